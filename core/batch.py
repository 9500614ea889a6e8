"""The flat batch handed to a model family each step."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from heron.core.workspace import Workspace

if TYPE_CHECKING:  # annotations only: keeps the ops importable without the engine's deps
    from heron.core.sequence import Sequence


# Sequences read a shared prefix in a call of their own only when it is at least this many
# keys long: below it, the extra call and the merge cost more than reading the keys once
# saves (measured on the CPU for 2-32 sequences: 80 shared keys lose, 160 break even or win)
MIN_SHARED_KEYS = 128


@dataclass
class SharedPrefixPlan:
    """Decode attention split where sequences share their first blocks (the prefix cache
    gives requests with one system prompt, or the ``n`` samples of a prompt, the same
    blocks): each group's queries attend to the keys of its shared blocks in one call, every
    sequence to its own keys after them, and the two parts merge by their log-sum-exps."""

    # (member indices [m], or None for every sequence; slots of the shared keys [P])
    groups: list[tuple[torch.Tensor | None, torch.Tensor]]
    suffix_slots: torch.Tensor  # [B, Ls] int64: each sequence's keys past its group's prefix
    suffix_bias: torch.Tensor   # [B, 1, 1, Ls] float32: 0 at those keys, -inf at padding


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes paged KV.

    Sequence ``i`` owns flat rows ``query_start_loc[i] : query_start_loc[i + 1]``; its
    queries sit at the last ``query_len`` positions of a context of ``seq_lens[i]`` tokens
    (the earlier ones are already in the cache). ``slot_mapping[t]`` is the flat cache slot
    (``block_id * block_size + offset``) that row ``t`` writes its K/V to.
    ``block_tables`` is padded with zeros past each sequence's blocks.
    The ``*_list`` copies live on the host so CPU code never syncs on a device tensor.
    """

    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks] int32
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    workspace: Workspace | None = None  # scratch the CPU ops reuse; None: fresh tensors
    cpu_kernels: bool = False  # CPU attention by the compiled kernels where they apply
    # a graph's static batch: replays change its tensors' values, so no host code reads them
    replayed: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @cached_property
    def padded_slots(self) -> torch.Tensor:
        """``[B, max_seq_len]`` int64 flat cache slots: key ``j`` of sequence ``i`` sits at slot
        ``[i, j]`` (past a sequence's length the slot is some other one's, for its reader to
        mask), for attention over contexts padded to one length. Computed once per step,
        shared by every layer."""
        dev, bs = self.seq_lens.device, self.block_size
        keys = torch.arange(self.max_seq_len, device=dev)
        blocks = self.block_tables[:, :-(-self.max_seq_len // bs)].long()
        return blocks[:, keys // bs] * bs + keys % bs

    @cached_property
    def whole_blocks_and_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B * n] int64 block ids, [B, 1, 1, n * block_size] bool key mask)``, ``n`` the
        most blocks a sequence has: each sequence's first ``n`` blocks (zero-padded) in
        order, and which of their keys are its own, for attention over whole blocks.
        Computed once per step."""
        num_blocks = -(-self.max_seq_len // self.block_size)
        keys = torch.arange(num_blocks * self.block_size, device=self.seq_lens.device)
        return (self.block_tables[:, :num_blocks].reshape(-1).long(),
                (keys[None, :] < self.seq_lens[:, None])[:, None, None, :])

    @cached_property
    def single_query_part(self) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """For a step where some sequences have one query and others more (decode rows
        beside a prompt chunk): ``(their flat rows [n] int64, a decode-only
        AttentionMetadata of just them)``; None where none or all have one query."""
        ones = [i for i, n in enumerate(self.query_lens_list) if n == 1]
        if not ones or len(ones) == self.num_seqs:
            return None
        dev = self.seq_lens.device
        which = torch.tensor(ones, device=dev)
        rows = self.query_start_loc[which].long()
        seq_lens = [self.seq_lens_list[i] for i in ones]
        return rows, AttentionMetadata(
            slot_mapping=self.slot_mapping[rows],
            query_start_loc=torch.arange(len(ones) + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens[which], block_tables=self.block_tables[which],
            query_lens_list=[1] * len(ones), seq_lens_list=seq_lens, max_query_len=1,
            max_seq_len=max(seq_lens), block_size=self.block_size, workspace=self.workspace,
            cpu_kernels=self.cpu_kernels)

    @cached_property
    def prompt_query_lens(self) -> torch.Tensor:
        """``[B]`` int32 host tensor: each sequence's query count, 0 for the one-query
        sequences `single_query_part` takes (the rows a prompt kernel leaves to it)."""
        skip = self.single_query_part is not None
        return torch.tensor([0 if skip and n == 1 else n for n in self.query_lens_list],
                            dtype=torch.int32)

    @cached_property
    def shared_prefix_plan(self) -> SharedPrefixPlan | None:
        """For a decode step: the split of `SharedPrefixPlan`, or None where no sequences
        share `MIN_SHARED_KEYS` keys. Computed once per step."""
        if not self.is_decode_only or self.replayed:
            return None
        # the tensors, not the host lists, which a graph's static batch sets to its bound
        bs, lens = self.block_size, self.seq_lens.tolist()
        tables = self.block_tables.cpu()
        by_first = defaultdict(list)  # a block id names its whole prefix: group by the first
        for i, first in enumerate(tables[:, 0].tolist()):
            if lens[i] > bs:  # a shared block must lie wholly before the query
                by_first[first].append(i)
        prefix = [0] * len(lens)  # keys each sequence reads in its group's call
        groups = []  # (members, shared keys)
        for members in by_first.values():
            if len(members) < 2:
                continue
            limit = min((lens[i] - 1) // bs for i in members)
            rows = tables[members, :limit]
            same = (rows == rows[0]).all(0).int().cumprod(0)  # leading blocks all members share
            shared = int(same.sum()) * bs
            if shared < MIN_SHARED_KEYS:
                continue
            for i in members:
                prefix[i] = shared
            groups.append((members, shared))
        if not groups:
            return None
        dev = self.seq_lens.device
        slots = self.padded_slots
        starts = torch.tensor(prefix, device=dev)
        suffix_lens = self.seq_lens - starts
        keys = torch.arange(int(suffix_lens.max()), device=dev)
        at = (starts[:, None] + keys).clamp_(max=self.max_seq_len - 1)
        padding = keys[None, :] >= suffix_lens[:, None]
        return SharedPrefixPlan(
            groups=[(None if len(m) == len(lens) else torch.tensor(m, device=dev),
                     slots[m[0], :shared]) for m, shared in groups],
            suffix_slots=slots.gather(1, at),
            suffix_bias=torch.zeros(padding.shape, device=dev).masked_fill_(
                padding, float("-inf"))[:, None, None, :])

    @cached_property
    def padded_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T] int64 place, [B, 1, max_query_len, max_seq_len] bool causal mask)`` for
        attention with every sequence's queries padded to ``max_query_len``: flat row ``t``
        is query ``place[t] % max_query_len`` of sequence ``place[t] // max_query_len``.
        A padding query sees what its sequence's last one sees. Computed once per step."""
        dev, width = self.seq_lens.device, self.max_query_len
        place = torch.cat([torch.arange(n) + i * width
                           for i, n in enumerate(self.query_lens_list)]).to(dev)
        query_lens = torch.tensor(self.query_lens_list, device=dev)
        rows = torch.minimum(torch.arange(width, device=dev)[None, :], query_lens[:, None] - 1)
        last_key = (self.seq_lens - query_lens)[:, None] + rows  # [B, width]
        keys = torch.arange(self.max_seq_len, device=dev)
        return place, (keys[None, None, :] <= last_key[:, :, None])[:, None]


@dataclass
class EncoderChunk:
    """Encoder stages ``[start, end)`` of one sequence, run this step before the decoder
    batch; ``slot`` is the sequence's state slot, where its encoder's output goes."""

    seq: "Sequence"
    slot: int
    start: int
    end: int


@dataclass
class Batch:
    """One engine step's work, as a flat token batch.

    ``logits_indices`` lists the flat rows whose logits the engine needs (the last row of
    every sequence that samples this step and the rows of its speculative drafts, plus
    every prompt row of sequences that asked for prompt logprobs). A family's ``forward``
    returns logits for exactly those rows, in that order.
    """

    seqs: list["Sequence"]
    input_ids: torch.Tensor         # [T] int64
    positions: torch.Tensor         # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor    # [R] int64
    # families with per-sequence states: the slot of each sequence (device and host copies)
    state_slots: torch.Tensor | None = None  # [B] int64
    state_slots_list: list[int] | None = None
    # LoRA: (adapter slot, first row, end row) per run of rows using one adapter; the
    # engine orders sequences by adapter, so that is one segment per adapter
    lora_groups: list[tuple[int, int, int]] = field(default_factory=list)
    # the same per row: [T] int64 adapter slot, -1 for none; None when no row has one. A
    # captured graph's batch has this alone (no host-side groups)
    lora_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
