"""CUDA-graph replay of decode steps, for any family whose forward is graph-safe.

Decode steps (every sequence contributes one token) are captured once per (padded batch
size, context bound) and replayed with the step's inputs copied into static buffers.
Prefill and mixed steps run eagerly. A family's forward is graph-safe when, for a
decode-only batch, it does no host synchronisation and its launch shapes depend only on
the batch size and ``batch.attn.max_seq_len`` (the CUDA attention op's contract).
"""

from __future__ import annotations

from typing import Callable

import torch

from heron.core.batch import AttentionMetadata, Batch

MIN_CONTEXT_BOUND = 256


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and it, if not already)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Runs decode batches of up to ``max_num_seqs`` sequences through captured graphs.

    ``forward(batch) -> logits [len(batch.logits_indices), vocab]`` is the family's eager
    forward. Logits returned by `run` live in graph memory: valid until the next `run`.
    """

    def __init__(self, forward: Callable[[Batch], torch.Tensor], *, max_num_seqs: int,
                 max_context_len: int, block_size: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = batch_size_ladder(max_num_seqs)
        self.block_size = block_size
        self.max_blocks = -(-max_context_len // block_size)
        self.max_context_len = self.max_blocks * block_size
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, batch: Batch) -> bool:
        meta = batch.attn
        # NOTE: graphs are captured without adapters; a step with LoRA rows runs eagerly
        return (meta.is_decode_only and meta.num_seqs <= self.sizes[-1] and not batch.lora_groups
                and batch.logits_indices.shape[0] == meta.num_seqs
                and meta.max_seq_len <= self.max_context_len)

    def _bound(self, max_seq_len: int) -> int:
        bound = MIN_CONTEXT_BOUND
        while bound < max_seq_len:
            bound *= 2
        return min(bound, self.max_context_len)

    def run(self, batch: Batch) -> torch.Tensor:
        meta = batch.attn
        num = meta.num_seqs
        size = next(s for s in self.sizes if s >= num)
        bound = self._bound(meta.max_seq_len)
        self.input_ids[:num].copy_(batch.input_ids)
        self.positions[:num].copy_(batch.positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.block_tables[:num, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > num:  # padded rows write nothing and attend to nothing
            self.slot_mapping[num:size] = -1
            self.seq_lens[num:size] = 0
        key = (size, bound)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, bound)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:num]

    def _static_batch(self, size: int, bound: int) -> Batch:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            query_lens_list=[1] * size, seq_lens_list=[bound] * size, max_query_len=1,
            max_seq_len=bound, block_size=self.block_size)
        return Batch(seqs=[], input_ids=self.input_ids[:size], positions=self.positions[:size],
                     attn=attn, logits_indices=self.rows[:size])

    def _capture(self, size: int, bound: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(size, bound)
        # An eager run first: kernels compile and load on first launch, which capture forbids.
        # It recomputes this step's KV from the same inputs, so writing it twice is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(batch)
        return graph, logits
