"""CUDA-graph replay of decode steps, for any family whose forward is graph-safe.

Decode steps (every sequence contributes one token) are captured once per (padded batch
size, context bound, whether rows carry adapters) and replayed with the step's inputs
copied into static buffers. Prefill and mixed steps run eagerly. A family's forward is
graph-safe when, for a decode-only batch, it does no host synchronisation, reads none of
the batch's host-side fields (``seqs``, the ``*_list`` copies, ``lora_groups``) and its
launch shapes depend only on the batch size and ``batch.attn.max_seq_len`` (the CUDA
attention op's contract). Padding rows write no KV (slot -1), attend to nothing (length
0), own no state slot (-1) and no adapter (-1).
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


class StaticDecodeInputs:
    """The static input buffers graphs are captured on: `load` copies a decode batch in and
    pads it; `batch` is the static batch over them that a graph of that key runs.
    Device-agnostic, so CPU tests run a family's forward on exactly what a graph replays."""

    def __init__(self, *, max_num_seqs: int, max_context_len: int, block_size: int,
                 device: torch.device, cpu_kernels: bool = False) -> None:
        self.sizes = batch_size_ladder(max_num_seqs)
        self.block_size = block_size
        self.cpu_kernels = cpu_kernels  # the static batch's `AttentionMetadata.cpu_kernels`
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
        self.state_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        # what every row of a batch of padding reads
        self.no_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.no_lens = torch.zeros(n, dtype=torch.int32, device=device)

    def fits(self, batch: Batch) -> bool:
        meta = batch.attn
        return (meta.is_decode_only and meta.num_seqs <= self.sizes[-1]
                and batch.logits_indices.shape[0] == meta.num_seqs
                and meta.max_seq_len <= self.max_context_len)

    def load(self, batch: Batch) -> tuple[int, int, bool]:
        """Copy a batch that `fits` in; the key ``(size, bound, with_lora)`` of its graph."""
        meta = batch.attn
        num = meta.num_seqs
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(batch.input_ids)
        self.positions[:num].copy_(batch.positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.block_tables[:num, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if batch.state_slots is not None:
            self.state_slots[:num].copy_(batch.state_slots)
        with_lora = batch.lora_slots is not None
        if with_lora:
            self.lora_slots[:num].copy_(batch.lora_slots)
        if size > num:  # padded rows write nothing and attend to nothing
            for t in (self.slot_mapping, self.state_slots, self.lora_slots):
                t[num:size] = -1
            self.seq_lens[num:size] = 0
        return size, self._bound(meta.max_seq_len), with_lora

    def _bound(self, max_seq_len: int) -> int:
        bound = MIN_CONTEXT_BOUND
        while bound < max_seq_len:
            bound *= 2
        return min(bound, self.max_context_len)

    def batch(self, size: int, bound: int, with_lora: bool, padding: bool = False) -> Batch:
        """The static batch of a key; with ``padding`` every row is a padding row, which
        writes no KV, state or anything else a step keeps."""
        slots, seq_lens = ((self.no_slots, self.no_lens) if padding
                           else (self.slot_mapping, self.seq_lens))
        attn = AttentionMetadata(
            slot_mapping=slots[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=seq_lens[:size], block_tables=self.block_tables[:size],
            query_lens_list=[1] * size, seq_lens_list=[bound] * size, max_query_len=1,
            max_seq_len=bound, block_size=self.block_size, cpu_kernels=self.cpu_kernels,
            replayed=True)
        state_slots, lora_slots = ((self.no_slots, self.no_slots) if padding
                                   else (self.state_slots, self.lora_slots))
        return Batch(seqs=[], input_ids=self.input_ids[:size], positions=self.positions[:size],
                     attn=attn, logits_indices=self.rows[:size],
                     state_slots=state_slots[:size],
                     lora_slots=lora_slots[:size] if with_lora else None)


class DecodeGraphs:
    """Runs decode batches of up to ``max_num_seqs`` sequences through captured graphs.

    ``forward(batch) -> logits [len(batch.logits_indices), vocab]`` is the family's eager
    forward. Logits returned by `run` live in graph memory: valid until the next `run`.
    """

    def __init__(self, forward: Callable[[Batch], torch.Tensor], *, max_num_seqs: int,
                 max_context_len: int, block_size: int, device: torch.device) -> None:
        self.forward = forward
        self.inputs = StaticDecodeInputs(max_num_seqs=max_num_seqs,
                                         max_context_len=max_context_len,
                                         block_size=block_size, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, batch: Batch) -> bool:
        return self.inputs.fits(batch)

    def run(self, batch: Batch) -> torch.Tensor:
        key = self.inputs.load(batch)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:batch.attn.num_seqs]

    def _capture(self, key: tuple[int, int, bool]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # An eager run first: kernels compile and load on first launch, which capture forbids.
        # All padding, so that it keeps nothing: a state update applied twice is not the same
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(self.inputs.batch(*key, padding=True))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(self.inputs.batch(*key))
        return graph, logits
