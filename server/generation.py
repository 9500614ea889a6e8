"""One API call's engine requests: submitted together, consumed as one stream, logged once.

A completion with several prompts, or any call with ``n > 1``, becomes one engine request
per prompt (each with ``n`` sequences); choice ``p * n + i`` is sequence ``i`` of prompt
``p``. A translation model's prompts are decoder prompts, each with its source
(``encoder_prompts``, which usage counts as the prompt tokens). `Generation` is an async
context manager: entering submits every prompt (or none, raising the APIError the client
should get); leaving aborts whatever is still running (the client went away, or the
handler failed), records the metrics and writes the request's log line.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
import torch
from aiohttp import web

from heron.core.async_engine import EngineStoppedError, QueueFullError, RequestDelta
from heron.core.outputs import NO_TOKEN_LEFT
from heron.core.logprobs import TokenLogprobs
from heron.core.sampling_params import SamplingParams
from heron.server.appkeys import ASYNC_ENGINE, CONFIG, METRICS, MODEL_NAME
from heron.server.errors import APIError
from heron.server.middleware import arrival_of, request_id_of, tenant_of
from heron.server.responses import PromptTokensDetails, Usage

log = structlog.get_logger("heron.server.requests")

_SEVERITY = ("stop", "length", "abort", "error")  # the request's reason: its worst choice's


@dataclass
class Choice:
    """Everything one sequence produced so far."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    last_token_s: float | None = None


class Generation:
    """The engine requests of one API call; see the module docstring for the contract."""

    def __init__(self, request: web.Request, kind: str, prompts: list[list[int]],
                 params: SamplingParams, cache_salt: str | None = None, *,
                 adapter: str | None = None,
                 encoder_prompts: list[list[int]] | None = None, scoring: bool = False,
                 background: bool = False,
                 token_types: list[list[int]] | None = None) -> None:
        """``scoring``: the call only scores its prompts (a completion's ``max_tokens: 0``
        with ``echo``); the token the engine generates for it is not the caller's, in usage
        or metrics. ``background``: the call runs on after its HTTP request has been
        answered (a background response), so the client's connection does not stop it."""
        app = request.app
        self._request = request
        self.engine, self.metrics = app[ASYNC_ENGINE], app[METRICS]
        self.adapter = adapter  # a LoRA adapter's name; responses then name it as the model
        self.scoring = scoring
        self.model = adapter or app[MODEL_NAME]
        self.log_requests = app[CONFIG].logging.log_requests
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.request_id = request_id_of(request)
        self.kind, self.prompts, self.params = kind, prompts, params
        self.encoder_prompts = encoder_prompts
        self.token_types = token_types  # each prompt's, for a model that reads them
        self.tenant = tenant_of(request)
        self.namespace = _namespace(self.tenant, cache_salt or "")
        self.created = int(time.time())
        n = params.n
        self.choices = {(p, i): Choice(p * n + i, p) for p in range(len(prompts)) for i in range(n)}
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}
        self.embeddings: dict[int, torch.Tensor] = {}  # an embedding model's, by prompt
        self._cached_tokens: dict[int, int] = {}  # by prompt, known once it is scheduled
        self.arrival_s = arrival_of(request)
        self.first_token_s: float | None = None
        self.timeout_s = app[CONFIG].server.request_timeout_s
        self.is_timed_out = False
        self.background = background
        self.cancelled = False  # `cancel` stopped it
        self._queue: asyncio.Queue[tuple[int, RequestDelta]] = asyncio.Queue()
        self._live: set[str] = set()

    def _engine_id(self, prompt_index: int) -> str:
        return f"{self.id}-{prompt_index}"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Generation:
        try:
            # all at once: the prompts join one step, not a step each
            added = await asyncio.gather(*map(self._add, range(len(self.prompts))),
                                         return_exceptions=True)
            if (error := next((e for e in added if e is not None), None)) is not None:
                raise error
        except BaseException as e:
            self._abort_live()
            if (isinstance(e, ValueError) and self.adapter is not None
                    and self.adapter not in self.engine.adapters):  # unloaded meanwhile
                e = APIError(404, f"the LoRA adapter `{self.adapter}` was unloaded",
                             param="model", code="model_not_found")
            raise _admission_error(e, self.metrics) from None
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        return self

    async def _add(self, p: int) -> None:
        rid = self._engine_id(p)
        self._live.add(rid)
        await self.engine.add(rid, self.prompts[p], self.params,
                              lambda delta: self._queue.put_nowait((p, delta)),
                              tenant=self.namespace, adapter=self.adapter,
                              encoder_prompt=(None if self.encoder_prompts is None
                                              else self.encoder_prompts[p]),
                              token_type_ids=(None if self.token_types is None
                                              else self.token_types[p]))

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # the handler left before the engine finished, or the deadline stopped it
        aborted = bool(self._live) or self.is_timed_out
        self._abort_live()
        reason = "abort" if aborted else self.finish_reason or "abort"
        end = time.monotonic()
        usage = self.usage()
        self.metrics.requests_finished.labels(reason).inc()
        self.metrics.tenant_requests.labels(self.tenant, reason).inc()
        self.metrics.tenant_tokens.labels(self.tenant, "prompt").inc(usage.prompt_tokens)
        self.metrics.tenant_tokens.labels(self.tenant, "generated").inc(usage.completion_tokens)
        self.metrics.e2e.observe(end - self.arrival_s)
        if self.log_requests:  # never the prompt or the output: logs are shared by tenants
            log.info("request", id=self.id, request_id=self.request_id, model=self.model,
                     tenant=self.tenant or None, n=self.params.n,
                     prompt_tokens=usage.prompt_tokens,
                     completion_tokens=usage.completion_tokens,
                     cached_tokens=usage.prompt_tokens_details.cached_tokens,
                     ttft_s=None if self.first_token_s is None
                     else round(self.first_token_s - self.arrival_s, 4),
                     duration_s=round(end - self.arrival_s, 4), finish_reason=reason,
                     outcome="timeout" if self.is_timed_out
                     else _outcome(reason, aborted or exc_type is not None))

    def cancel(self) -> None:
        """Abort what still runs (its choices finish with "abort"); `cancelled` says so."""
        self.cancelled = True
        self._abort_live()

    def _abort_live(self) -> None:
        for rid in self._live:
            self.engine.abort(rid)
        self._live.clear()

    # -- consuming -------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Each engine delta, already absorbed into `choices`, until every prompt finished.

        Past ``server.request_timeout_s`` since arrival, aborts every engine request and
        raises a 408 `APIError` (code ``request_timeout``, which clients must not retry).
        Raises ConnectionResetError once the client has gone (not in the background): `serve`
        cancels the handler of a lost connection anyway, this also covers apps run without
        handler cancellation.
        """
        while self._live:
            p, delta = await self._next()
            transport = self._request.transport
            if not self.background and (transport is None or transport.is_closing()):
                raise ConnectionResetError("the client disconnected")
            self._absorb(p, delta)
            yield p, delta

    async def _next(self) -> tuple[int, RequestDelta]:
        if self.timeout_s is None:
            return await self._queue.get()
        deadline = self.arrival_s + self.timeout_s  # NOTE: asyncio's loop clock is monotonic
        try:
            # checked first too: get() from a queue that never empties never suspends
            if time.monotonic() < deadline:
                async with asyncio.timeout_at(deadline):
                    return await self._queue.get()
        except TimeoutError:
            pass
        self.is_timed_out = True
        self._abort_live()  # frees the engine's blocks before the next step
        # OpenAI's clients retry a 408 (twice by default): a request that outlasted the
        # limit would run up to three times over, on a server already too slow for it
        raise APIError(408, f"the request ran longer than {self.timeout_s:g} s "
                       "(server.request_timeout_s)", code="request_timeout",
                       headers={"x-should-retry": "false"})

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass

    def _absorb(self, p: int, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[p] = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embeddings[p] = delta.embedding
        self._cached_tokens[p] = delta.num_cached_tokens
        for sd in delta.seqs:
            choice = self.choices[(p, sd.index)]
            if sd.token_ids:
                if self.first_token_s is None:
                    self.first_token_s = delta.time_s
                    self.metrics.ttft.observe(delta.time_s - self.arrival_s)
                elif choice.last_token_s is not None:
                    self.metrics.inter_token.observe(delta.time_s - choice.last_token_s)
                choice.last_token_s = delta.time_s
                if not self.scoring:
                    self.metrics.generation_tokens.inc(len(sd.token_ids))
            choice.text += sd.text
            choice.token_ids += sd.token_ids
            choice.logprobs += sd.logprobs or ()
            if sd.finish_reason is not None and choice.finish_reason is None:
                choice.finish_reason, choice.stop_reason = sd.finish_reason, sd.stop_reason
                choice.error = sd.error
        if delta.finished:
            self._live.discard(self._engine_id(p))
            for (q, _), choice in self.choices.items():  # stopped without a word: aborted
                if q == p and choice.finish_reason is None:
                    choice.finish_reason = "abort"

    # -- results ---------------------------------------------------------------------------

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.finish_reason for c in self.choices.values() if c.finish_reason]
        return max(reasons, key=_SEVERITY.index) if reasons else None

    def failure(self) -> APIError | None:
        """The error to answer instead of choices, when a choice failed or was aborted."""
        for choice in self.choices.values():
            if choice.finish_reason == "error" and choice.error == NO_TOKEN_LEFT:
                return APIError(400, f"generation stopped: {NO_TOKEN_LEFT}", code="no_token_left")
            if choice.finish_reason == "error":
                return APIError(500, f"generation failed: {choice.error or 'internal error'}")
            if choice.finish_reason == "abort":
                return APIError(503, "the request was aborted: the server is shutting down",
                                code="aborted")
        return None

    @property
    def num_cached_tokens(self) -> int:
        """The prompts' tokens found in the prefix cache, so far as they were scheduled."""
        return sum(self._cached_tokens.values())

    @property
    def num_prompt_tokens(self) -> int:
        """The prompts' tokens; a translation's are its sources'."""
        return sum(map(len, self.encoder_prompts or self.prompts))

    def usage(self) -> Usage:
        prompt = self.num_prompt_tokens
        completion = (sum(len(c.token_ids) for c in self.choices.values())
                      if not self.scoring else 0)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=self.num_cached_tokens))


def _namespace(tenant: str, cache_salt: str) -> str:
    """Who may share cached KV: one namespace per (tenant, salt); tenant names have no
    ``|``, so the separator keeps the pair unambiguous."""
    return f"{tenant}|{cache_salt}" if tenant else cache_salt


def _outcome(reason: str, aborted: bool) -> str:
    if reason == "error":
        return "error"
    return "aborted" if aborted or reason == "abort" else "ok"


def _admission_error(e: BaseException, metrics) -> BaseException:
    if isinstance(e, QueueFullError):
        metrics.rejected.labels("429").inc()
        return APIError(429, f"the server is busy: {e} (server.{e.limit}); retry later",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineStoppedError):
        metrics.rejected.labels("503").inc()
        if e.draining:  # another replica, or this one restarted, can take it: as /health
            return APIError(503, str(e), code="shutting_down", headers={"Retry-After": "1"})
        return APIError(503, str(e), code="engine_stopped")
    if isinstance(e, ValueError):
        metrics.rejected.labels("400").inc()
        return APIError(400, str(e), param=getattr(e, "param", None))  # StructuredOutputError's
    return e
