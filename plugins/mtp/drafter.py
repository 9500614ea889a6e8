"""Drafting with a multi-token-prediction (MTP) module on the target's hidden states.

The MTP module at position ``j`` reads the target's final hidden state ``h_j`` (or a middle
layer's, `MtpWeights.hidden_layer`) and the embedding of the token after it, ``t_{j+1}``,
runs one decoder layer (attending over its own earlier positions) and predicts ``t_{j+2}``.
After each step the engine hands the proposer the hidden states the target computed
(`observe`); at the next step `propose` runs the module over the positions verified since
(``j`` up to the last computed one, paired with the tokens the target emitted), which
yields the first draft, then chains the module on its own output ``k - 1`` times, the
previous draft as the next token.

Each sequence keeps the module's K/V for its verified positions in tensors of its own
(`_Cache`): one layer, so a few KB per token; the chained drafts' K/V are dropped again
after proposing. Positions the target did not compute (a prefix-cache hit, a sibling's
prompt before its fork copied the parent's cache) have no hidden state: the module takes
its K/V of them from the `PrefixStore` (filled by the sequences that ran those positions)
when it holds them all, and otherwise starts at the first position it has, which makes
drafts weaker there, never outputs different.

LoRA: the module runs without adapters; the hidden states it reads are the target's under
the request's adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core import Sequence
from heron.core.ops import linear, rms_norm
from heron.core.speculative import Proposer
from heron.plugins.mtp.prefix_store import Chain, PrefixStore
from heron.plugins.mtp.weights import DraftTarget, MtpWeights
from heron.plugins.transformer.model import gated_mlp, qkv_heads


@dataclass
class _Cache:
    """One sequence's MTP state: K/V ``[capacity, Hkv, D]`` of positions ``start ..
    start + length - 1``, then target hidden states of the next positions not yet run.
    ``chain``: the `PrefixStore` keys of its whole blocks when it starts at position 0."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    length: int = 0
    pending: torch.Tensor | None = None
    chain: Chain | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            grow = max(need, 2 * self.k.shape[0])
            self.k = torch.cat([self.k[:self.length], self.k.new_empty(grow - self.length,
                                                                      *self.k.shape[1:])])
            self.v = torch.cat([self.v[:self.length], self.v.new_empty(grow - self.length,
                                                                      *self.v.shape[1:])])
        self.k[self.length:need] = k
        self.v[self.length:need] = v
        self.length = need

    def copy(self) -> _Cache:
        return _Cache(self.k.clone(), self.v.clone(), self.start, self.length, self.pending,
                      None if self.chain is None else list(self.chain))


class MtpProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, weights: MtpWeights, target: DraftTarget,
                 confidence_threshold: float = 0.0, block_size: int = 16,
                 prefix_store_bytes: int = 0) -> None:
        """``block_size``: the engine's, so that prefix-cache hits end on the store's
        block boundaries; ``prefix_store_bytes`` 0 keeps no `PrefixStore`."""
        self.w, self.target = weights, target
        self.hidden_layers = (weights.hidden_layer,)
        self.confidence_threshold = confidence_threshold
        self.shape = target.shape
        self.caches: dict[int, _Cache] = {}
        self.store = PrefixStore(block_size, prefix_store_bytes) if prefix_store_bytes else None

    # -- what the target computed ---------------------------------------------------------

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        cache = self.caches.get(seq.seq_id)
        pending_start = cache.end if cache is not None else start
        have = 0 if cache is None or cache.pending is None else cache.pending.shape[0]
        if cache is None or not cache.start <= start <= pending_start + have:
            self.caches[seq.seq_id] = self._new_cache(seq, start, hidden)
            return
        if start < pending_start:  # positions it ran are being recomputed: run them again
            cache.length, cache.pending = start - cache.start, None
            if cache.chain is not None:
                del cache.chain[cache.length // self.store.block_size:]
            pending_start, have = start, 0
        kept = cache.pending[:start - pending_start] if have else hidden[:0]
        cache.pending = torch.cat([kept, hidden])

    def _new_cache(self, seq: Sequence, start: int, hidden: torch.Tensor) -> _Cache:
        if self.store is not None and start > 0:
            found = self.store.take(seq.token_ids, seq.namespace, start)
            if found is not None:
                k, v, chain = found
                return _Cache(k, v, 0, start, pending=hidden, chain=chain)
        s = self.shape
        empty = hidden.new_empty(64, s.num_kv_heads, s.head_dim)
        chain = [] if self.store is not None and start == 0 else None
        return _Cache(empty, empty.clone(), start, pending=hidden, chain=chain)

    def fork_sequence(self, parent: Sequence, child: Sequence) -> None:
        cache = self.caches.get(parent.seq_id)
        if cache is not None:
            self.caches[child.seq_id] = cache.copy()

    def free_sequence(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    # -- drafting -------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        ready, hidden, tokens, positions = [], [], [], []
        for i, seq in enumerate(seqs):
            cache = self.caches.get(seq.seq_id)
            computed = seq.num_computed_tokens
            if cache is None or cache.pending is None:
                continue
            n = computed - cache.end  # verified positions not yet run, their states held
            if n < 1 or n > cache.pending.shape[0]:
                continue
            ready.append((i, cache, n))
            hidden.append(cache.pending[:n])
            tokens += seq.token_ids[cache.end + 1:computed + 1]
            positions.append(torch.arange(cache.end, computed))
            cache.pending = None
        if not ready:
            return drafts
        device = hidden[0].device
        caches, sizes = [c for _, c, _ in ready], [n for _, _, n in ready]
        positions = torch.cat(positions).to(device)
        out = self._run(torch.cat(hidden), torch.tensor(tokens, device=device), positions,
                        caches, sizes)
        for (i, cache, _) in ready:  # verified positions: blocks others may start past
            if cache.chain is not None:
                self.store.put(cache.chain, seqs[i].token_ids, seqs[i].namespace, cache.k,
                               cache.v, cache.length)
        last = torch.tensor(sizes, device=device).cumsum(0) - 1
        state, token, prob = self._next(out.index_select(0, last))
        position = positions.index_select(0, last) + 1
        verified = [(c, c.length) for c in caches]
        chain = [1.0] * len(ready)  # the probability that every draft so far is accepted
        for step in range(k):
            going = []  # the chains that go on: their rows in this step's tensors
            for row, ((i, _, _), t, p) in enumerate(zip(ready, token.tolist(), prob.tolist())):
                chain[row] *= p
                if chain[row] >= self.confidence_threshold:
                    drafts[i].append(t)
                    going.append(row)
            if step + 1 == k or not going:
                break
            if len(going) < len(ready):
                rows = torch.tensor(going, device=device)
                state, token, position = (t.index_select(0, rows)
                                          for t in (state, token, position))
                ready, caches, chain = ([x[r] for r in going] for x in (ready, caches, chain))
            out = self._run(state, token, position, caches, [1] * len(caches))
            state, token, prob = self._next(out)
            position = position + 1
        for cache, length in verified:  # drafts' K/V: not the sequence's
            cache.length = length
        return drafts

    def _next(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state chained to the next position, the greedy draft token and its
        probability under the head, from the layer's output rows."""
        w, eps = self.w, self.target.eps
        normed, _ = rms_norm(out, w.out_norm, eps)
        prob, best = torch.softmax(linear(normed, w.head).float(), -1).max(-1)
        if w.draft_token_ids is not None:
            best = w.draft_token_ids.index_select(0, best)
        return (out if w.deepseek else normed), best, prob

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             caches: list[_Cache], sizes: list[int]) -> torch.Tensor:
        """The module's layer output (before its final norm) for rows pairing ``hidden`` with
        the embedding of ``tokens`` at ``positions``; ``sizes[i]`` rows for ``caches[i]``,
        whose K/V the rows append to and attend over."""
        w, s, eps = self.w, self.shape, self.target.eps
        e = F.embedding(tokens, w.embed)
        if w.deepseek:
            e = e.masked_fill((positions == 0)[:, None], 0.0)
        e, _ = rms_norm(e, w.embed_norm, eps)
        h, _ = rms_norm(hidden, w.hidden_norm, eps)
        x = linear(torch.cat([e, h], dim=-1), w.proj)
        layer = w.layer
        h, _ = rms_norm(x, layer.input_norm, eps)
        q, k, v = qkv_heads(h, layer.attn, s, positions, self.target.cos_sin)
        o = torch.empty_like(q)
        row = 0
        for cache, n in zip(caches, sizes):
            cache.append(k[row:row + n], v[row:row + n])
            keys = cache.k[:cache.length].transpose(0, 1)
            values = cache.v[:cache.length].transpose(0, 1)
            mask = None
            if n > 1:  # row j sees the cached positions and the new rows up to j
                mask = torch.ones(n, cache.length, dtype=torch.bool, device=q.device).tril(
                    cache.length - n)
            o[row:row + n] = F.scaled_dot_product_attention(
                q[row:row + n].transpose(0, 1), keys, values, attn_mask=mask, scale=s.scale,
                enable_gqa=True).transpose(0, 1)
            row += n
        x = x + linear(o.reshape(-1, s.q_size), layer.attn.o, layer.attn.o_bias)
        h, _ = rms_norm(x, layer.post_norm, eps)
        return x + gated_mlp(h, layer.gate_up, layer.down, layer.gate_up_bias,
                             layer.down_bias)
