"""Turns the scheduler's decisions into the flat `Batch` a family runs."""

from __future__ import annotations

import torch

from heron.core.batch import AttentionMetadata, Batch
from heron.core.device import to_device
from heron.core.inflight import fill_placeholders
from heron.core.scheduler import ScheduledSeq
from heron.core.workspace import Workspace


class BatchBuilder:
    """Builds host tensors for one step and moves them to the model's device in one go."""

    def __init__(self, block_size: int, device: torch.device, logits: bool = True,
                 cpu_kernels: bool = False) -> None:
        """``logits`` False: batches name no rows for logits (an embedding model's).
        ``cpu_kernels``: the batches' attention may use the compiled CPU kernels."""
        self.block_size = block_size
        self.device = device
        self.logits = logits
        self.cpu_kernels = cpu_kernels
        self.workspace = Workspace()  # every batch's attention reuses it

    def build(self, scheduled: list[ScheduledSeq], prompt_logprob_seqs: set[int],
              sampled: torch.Tensor | None = None) -> Batch:
        """``prompt_logprob_seqs``: seq ids whose prompt rows in this chunk need logits too.
        ``sampled``: the tokens of the step in flight (async scheduling), on the device, which
        the sequences' placeholders stand for (`heron.core.inflight`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            drafts = seq.draft_token_ids  # speculative: verified after the sequence's tokens
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            input_ids += tokens[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(n)
            seq_lens.append(end)
            if seq.seq_id in prompt_logprob_seqs:
                # rows predicting prompt tokens start..end-1 → the next prompt token
                last = min(end, seq.num_prompt_tokens - 1)
                logits_rows += range(row0, row0 + max(0, last - start))
            if end == len(tokens) and self.logits:  # its last token's row, and one per draft
                logits_rows += range(row0 + n - 1 - len(drafts), row0 + n)
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        tables = torch.tensor([item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
                               for item in scheduled], dtype=torch.int32)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        lora_segments: list[tuple[int, int, int]] = []
        row = 0
        for item in scheduled:
            slot, end = item.seq.lora_slot, row + item.num_tokens
            if slot is not None:
                if lora_segments and lora_segments[-1][0] == slot and lora_segments[-1][2] == row:
                    lora_segments[-1] = (slot, lora_segments[-1][1], end)
                else:
                    lora_segments.append((slot, row, end))
            row = end
        slot_list = [item.seq.state_slot for item in scheduled]
        if None in slot_list:
            slot_list = None
        attn = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            query_start_loc=to_device(qsl, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(tables, torch.int32, dev),
            query_lens_list=query_lens, seq_lens_list=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs,
            workspace=self.workspace, cpu_kernels=self.cpu_kernels)
        ids = to_device(input_ids, torch.int64, dev)
        if sampled is not None and min(input_ids) < 0:
            ids = fill_placeholders(ids, sampled)
        return Batch(
            seqs=[item.seq for item in scheduled],
            input_ids=ids,
            positions=to_device(positions, torch.int64, dev),
            attn=attn,
            logits_indices=to_device(logits_rows, torch.int64, dev),
            state_slots=None if slot_list is None else to_device(slot_list, torch.int64, dev),
            state_slots_list=slot_list,
            lora_groups=lora_segments,
            lora_slots=_row_slots(lora_segments, len(input_ids), dev) if lora_segments else None)


def _row_slots(segments: list[tuple[int, int, int]], num_rows: int,
               device: torch.device) -> torch.Tensor:
    """``segments`` per row: each row's adapter slot, -1 for none."""
    slots = torch.full((num_rows,), -1, dtype=torch.int64)
    for slot, r0, r1 in segments:
        slots[r0:r1] = slot
    return to_device(slots, torch.int64, device)
