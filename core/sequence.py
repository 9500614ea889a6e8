"""The engine's per-sequence record: engine fields only, plus one opaque plugin state."""

from __future__ import annotations

import enum
from typing import Any

from heron.core.prefix_cache import Namespace
from heron.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its KV in host memory
    FINISHED = "finished"


class Sequence:
    """One generation stream of a request (a request with ``n > 1`` owns several).

    ``token_ids`` holds the prompt followed by the generated tokens. ``num_computed_tokens``
    counts the leading tokens whose KV is written in the blocks of ``block_table``; the
    scheduler moves it forward, preemption by recompute resets it to zero; a prefix-cache
    hit starts it at the number of tokens reused. ``namespace`` scopes the cache lookups and
    inserts of this sequence. ``num_cached_tokens`` is None until the sequence is first
    admitted, then the number of prompt tokens that admission reused from the cache.
    ``host_block_table`` holds its KV while it is swapped out. ``state_slot`` indexes the
    family's per-sequence state tensors (families that declare states) while it runs.
    ``encoder_token_ids`` is an encoder-decoder model's source (the decoder's input is
    ``token_ids``); ``encoder_stages_done`` counts the stages of its encoder that have run
    (the scheduler spreads a long source's over steps; recompute resets it to zero).
    ``token_type_ids`` are the prompt tokens' types for a model that reads them
    (``ModelRunner.num_token_types``), () for all 0.
    ``draft_token_ids`` are tokens a proposer drafted to follow ``token_ids`` this step
    (`heron.core.speculative`): scheduled after them, never part of them.
    ``grammar`` is the matcher of its structured output (`heron.core.grammar`), if any;
    ``thinking`` is True while the output is in a reasoning model's thinking, which the
    grammar leaves free, and ``num_thinking_tokens`` counts the tokens in it, its start
    and end aside (`heron.core.thinking`).
    ``family_state`` is whatever the model family's ``alloc_sequence`` returned; the engine
    never looks inside it.
    """

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_table", "status", "params", "arrival", "family_state", "generator",
        "namespace", "num_cached_tokens", "host_block_table", "state_slot", "lora_slot",
        "encoder_token_ids", "encoder_stages_done", "token_type_ids", "draft_token_ids",
        "grammar", "thinking", "num_thinking_tokens",
    )

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, arrival: int,
                 namespace: Namespace = Namespace(),
                 encoder_token_ids: tuple[int, ...] = (),
                 token_type_ids: tuple[int, ...] = ()) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.arrival = arrival
        self.family_state: Any = None
        self.generator: Any = None  # torch.Generator for seeded sampling, set by the engine
        self.namespace = namespace
        self.num_cached_tokens: int | None = None
        self.host_block_table: list[int] = []
        self.state_slot: int | None = None  # the engine's state slot while it runs
        self.lora_slot: int | None = None  # its adapter's slot while it runs (namespace.adapter)
        self.encoder_token_ids = encoder_token_ids  # an encoder-decoder's source; () otherwise
        self.encoder_stages_done = 0
        self.token_type_ids = token_type_ids
        self.draft_token_ids: list[int] = []  # this step's speculative drafts, to verify
        self.grammar: Any = None  # an llguidance.LLMatcher: what the output may be next
        gate = params.reasoning
        self.thinking = gate is not None and gate.open
        self.num_thinking_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, req={self.request_id!r}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
