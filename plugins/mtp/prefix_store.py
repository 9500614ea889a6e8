"""The MTP module's K/V of prompt prefixes it has run, for sequences that start past them.

A prefix-cache hit gives a sequence the target's KV of its first tokens but not the target's
hidden states there, which the module needs to compute its own K/V: without them it would
draft from the first position it sees, blind to the prompt before it (a shared system
prompt, the earlier turns of a conversation). `PrefixStore` keeps the module's K/V of each
block of ``block_size`` positions that a sequence ran from position 0, under a key chained
over the block's tokens and all before it, and the sequence's namespace (an adapter changes
the target's hidden states); a sequence that starts at a block boundary takes its prefix's
blocks from here when every one of them is stored.

The module's K/V at position ``j`` read ``h_j`` and the token after it, ``t_{j+1}``: a
block's key covers the token after the block too. Least recently used blocks go first once
the store holds ``capacity_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

Chain = list[Hashable]  # a sequence's block keys, block 0 first


class PrefixStore:
    def __init__(self, block_size: int, capacity_bytes: int) -> None:
        self.block_size, self.capacity_bytes = block_size, capacity_bytes
        self.num_bytes = 0
        self.blocks: OrderedDict[Hashable, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def _extend_chain(self, chain: Chain, tokens: list[int], namespace: Hashable,
                      num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(chain), num_blocks):
            before = chain[-1] if chain else (namespace, tokens[0])
            chain.append((hash(before), tuple(tokens[i * bs + 1:(i + 1) * bs + 1])))

    def take(self, tokens: list[int], namespace: Hashable,
             num_positions: int) -> tuple[torch.Tensor, torch.Tensor, Chain] | None:
        """The K/V ``[num_positions, Hkv, D]`` of positions ``0 .. num_positions - 1`` of a
        sequence of ``tokens`` (which must reach ``num_positions``) and their chain, when
        ``num_positions`` is a whole number of blocks, all stored; else None."""
        num_blocks, rest = divmod(num_positions, self.block_size)
        if rest or not num_blocks:
            return None
        chain: Chain = []
        self._extend_chain(chain, tokens, namespace, num_blocks)
        found = [self.blocks.get(key) for key in chain]
        if any(f is None for f in found):
            return None
        for key in chain:
            self.blocks.move_to_end(key)
        return torch.cat([k for k, _ in found]), torch.cat([v for _, v in found]), chain

    def put(self, chain: Chain, tokens: list[int], namespace: Hashable, k: torch.Tensor,
            v: torch.Tensor, num_positions: int) -> None:
        """Store the blocks that ``k, v`` (rows = positions from 0) complete among the first
        ``num_positions``, and extend the sequence's ``chain`` over them. ``tokens`` must
        reach ``num_positions``."""
        start, bs = len(chain), self.block_size
        self._extend_chain(chain, tokens, namespace, num_positions // bs)
        for i in range(start, len(chain)):
            key = chain[i]
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            block = (k[i * bs:(i + 1) * bs].clone(), v[i * bs:(i + 1) * bs].clone())
            self.blocks[key] = block
            self.num_bytes += sum(t.nbytes for t in block)
            while self.num_bytes > self.capacity_bytes:
                self.num_bytes -= sum(t.nbytes for t in self.blocks.popitem(last=False)[1])
