"""What the engine reports back per request, each step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from heron.core.logprobs import TokenLogprobs

# The error of a sequence whose request's own restrictions left no token to sample: the
# request's fault (the server answers 400), not the engine's
NO_TOKEN_LEFT = ("no token is left to sample: allowed_token_ids, bad_words and the "
                 "structured output together exclude every token")


@dataclass
class CompletionOutput:
    """One sequence of a request. ``text`` / ``token_ids`` are cumulative; ``new_text`` /
    ``new_token_ids`` are what this step added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    score: float | None = None  # beam search: the hypothesis' length-penalized score

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # logprob of each prompt token given the ones before it; None for the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # an embedding model's vector (float32, CPU), once the prompt is pooled; its one output
    # then ends "stop" without tokens
    embedding: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
