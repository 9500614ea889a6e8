"""What one request may ask of the engine: the model's context, the KV pool, and (without
chunked prefill) one step's token budget. Each check raises a ValueError that says which
limit a request is past and by how much."""

from __future__ import annotations

from dataclasses import dataclass

from heron.core.config import EngineConfig


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    num_kv_blocks: int
    engine: EngineConfig

    @property
    def kv_capacity(self) -> int:
        """The most tokens one sequence's KV can take: the whole pool."""
        return self.num_kv_blocks * self.engine.block_size

    @property
    def max_embedding_len(self) -> int:
        """The most tokens an embedding model takes in one input: its context, or the KV
        pool where that is smaller. (An input past the step budget without chunked prefill
        runs alone in a step: `heron.core.scheduler`.)"""
        return min(self.max_model_len, self.kv_capacity)

    def check_generation(self, n: int, max_tokens: int | None) -> None:
        """A prompt of ``n`` tokens that may grow by ``max_tokens`` (None: to the context)."""
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this model's context is "
                             f"{self.max_model_len} tokens, leaving no room to generate")
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the model's context of {self.max_model_len} tokens")
        total = n + (max_tokens or self.max_model_len - n)
        if total > self.kv_capacity:
            raise ValueError(f"a sequence of {total} tokens needs more KV blocks than the pool "
                             f"holds ({self.num_kv_blocks} of {self.engine.block_size} tokens)")
        budget = self.engine.max_num_batched_tokens
        if not self.engine.chunked_prefill and total > budget:
            raise ValueError(f"without chunked prefill, prompt + max_tokens ({total} tokens) "
                             f"must fit engine.max_num_batched_tokens ({budget})")

    def check_embedding(self, n: int) -> None:
        """An embedding model's input of ``n`` tokens."""
        if n > self.max_embedding_len:
            raise ValueError(f"the input has {n} tokens; this model embeds at most "
                             f"{self.max_embedding_len}")

