"""The asyncio driver of an `Engine`: steps run in a worker thread, results flow to queues.

Threading contract (the Engine is not thread-safe):
  - ``Engine.step`` runs in one dedicated worker thread, so the event loop (and ``/health``)
    stays responsive while the model computes;
  - everything else that touches the Engine (``add_request``, ``abort``) runs on the event
    loop thread inside the engine task, *between* steps, never while a step is in flight.
    Callers only enqueue commands; ``add`` awaits the engine task's verdict.
  - Adapter changes (``load_adapter`` / ``unload_adapter``) also run between steps, in the
    worker thread (loading reads files; the loop stays free), while the engine task waits
    for them as it waits for a step. Readers on the loop use the `adapters` snapshot.
  - An abort enqueued while a step runs takes effect before the next step starts.
  - `AsyncEngine.load` builds the Engine on that same worker thread. Torch's OpenMP keeps a
    pool of workers per thread that runs parallel regions, and once the pools hold more
    threads than there are cores, their workers sleep between regions instead of spinning:
    every region then waits for a wake-up (decode about 1.5x slower on 2 cores).

Each step's live `RequestOutput` views are copied into immutable `RequestDelta`s on the worker
thread, before the next step can change them, and handed to the loop in one callback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from heron.core.config import Config
from heron.core.engine import Engine
from heron.core.logprobs import TokenLogprobs
from heron.core.outputs import RequestOutput
from heron.core.sampling_params import SamplingParams
from heron.core.speculative import SpecStats

__all__ = ["AsyncEngine", "EngineStats", "EngineStoppedError", "QueueFullError", "RequestDelta",
           "SeqDelta"]

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests (or prompt tokens) are waiting; the caller should retry later (HTTP
    429). ``limit``: the name of the AsyncEngine setting that refused it."""

    def __init__(self, message: str, limit: str = "max_waiting_requests") -> None:
        super().__init__(message)
        self.limit = limit


class EngineStoppedError(RuntimeError):
    """The engine task is not running (shutting down or crashed; HTTP 503). ``draining``:
    it is shutting down on purpose."""

    def __init__(self, message: str, draining: bool = False) -> None:
        super().__init__(message)
        self.draining = draining


@dataclass(frozen=True, slots=True)
class SeqDelta:
    """What one sequence of a request gained in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """One request's progress in one step: only the sequences that changed.

    ``prompt_logprobs`` is sent once, in the first delta after the prompt is fully computed.
    ``finished`` is True in the request's last delta.
    """

    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    time_s: float = 0.0  # time.monotonic() when the step ended
    embedding: torch.Tensor | None = None  # an embedding model's vector, in the last delta


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot taken between steps (safe to read from any thread)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_in_use: int = 0
    num_kv_blocks_cached: int = 0
    num_requests_swapped: int = 0
    num_state_slots_in_use: int = 0
    num_state_snapshots: int = 0
    num_host_kv_blocks_in_use: int = 0
    num_adapters_in_use: int = 0
    num_prompt_tokens_waiting: int = 0  # of the requests counted in num_requests_waiting
    # cumulative counts
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    spec: SpecStats | None = None  # speculative decoding's counts; None when it is off


Sink = Callable[[RequestDelta], None]


@dataclass(slots=True)
class _Pending:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    accepted: asyncio.Future
    tenant: str
    adapter: str | None = None
    encoder_prompt: list[int] | None = None
    grammar: object = None  # an llguidance.LLMatcher: params.structured_outputs, compiled
    token_type_ids: list[int] | None = None


@dataclass(slots=True)
class _AdapterCommand:
    """An adapter change for the worker thread; ``done`` is settled once it ran."""

    run: Callable[[], object]
    done: asyncio.Future


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class _DeltaCopier:
    """Copies live outputs into deltas, remembering what each request was already sent.

    Used by the worker thread during a step and by the loop thread between steps, never both
    at once (the engine task serialises them).
    """

    def __init__(self) -> None:
        self._finished: dict[str, set[int]] = {}  # indices whose finish was sent
        self._sent_prompt_logprobs: set[str] = set()

    def copy(self, out: RequestOutput, now: float) -> RequestDelta:
        done = self._finished.setdefault(out.request_id, set())
        seqs = []
        for o in out.outputs:
            if o.index in done or (not o.new_token_ids and o.finish_reason is None):
                continue
            new = len(o.new_token_ids)
            logprobs = None if o.logprobs is None else (o.logprobs[-new:] if new else [])
            seqs.append(SeqDelta(o.index, o.new_text, list(o.new_token_ids), logprobs,
                                 o.finish_reason, o.stop_reason, o.error))
            if o.finish_reason is not None:
                done.add(o.index)
        prompt_logprobs = None
        if (out.prompt_logprobs is not None and out.request_id not in self._sent_prompt_logprobs
                and len(out.prompt_logprobs) == len(out.prompt_token_ids)):
            self._sent_prompt_logprobs.add(out.request_id)
            prompt_logprobs = list(out.prompt_logprobs)
        if out.finished:
            self.forget(out.request_id)
        return RequestDelta(out.request_id, seqs, out.finished, prompt_logprobs,
                            out.num_cached_tokens, now, out.embedding)

    def stopped(self, out: RequestOutput, reason: str, error: str | None) -> RequestDelta:
        """The last delta of a request stopped outside a step (abort, engine fault, shutdown).
        Text the stop flushed is dropped: nobody is waiting for an aborted request's tail."""
        done = self._finished.get(out.request_id, set())
        seqs = [SeqDelta(o.index, "", [], None if o.logprobs is None else [], reason, None, error)
                for o in out.outputs if o.index not in done]
        self.forget(out.request_id)
        return RequestDelta(out.request_id, seqs, True, None, out.num_cached_tokens,
                            time.monotonic())

    def forget(self, request_id: str) -> None:
        self._finished.pop(request_id, None)
        self._sent_prompt_logprobs.discard(request_id)


class AsyncEngine:
    """Runs ``engine`` from an asyncio loop: `start` the engine task, `stop` it at shutdown.

    ``add`` raises `QueueFullError` when ``max_waiting_requests`` requests are already
    waiting, or when the prompt would take the prompt tokens waiting past
    ``max_waiting_tokens`` (a prompt is always let in when none waits, so that one larger
    than the limit is not refused forever); the Engine's ValueError for a request it cannot
    serve, and `EngineStoppedError` when the engine task is not running. Every accepted
    request gets deltas through its sink until one with ``finished`` (also on abort, engine
    fault and shutdown). ``adapters``: the loaded LoRA adapters (name -> path), a snapshot
    replaced after every adapter change. ``executor``: the one-thread executor that steps the
    engine (`load` passes the one that built it); a new one by default.
    """

    def __init__(self, engine: Engine, *, max_waiting_requests: int = 256,
                 max_waiting_tokens: int = 262144,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.stats = EngineStats(num_kv_blocks_total=engine.num_kv_blocks)
        self._pending: dict[str, _Pending] = {}
        self._aborts: set[str] = set()
        self._adapter_commands: list[_AdapterCommand] = []
        self.adapters = self._read_adapters()
        self._sinks: dict[str, Sink] = {}
        self._copier = _DeltaCopier()
        self._wake = asyncio.Event()
        self._stopping = False
        self.draining = False
        self._task: asyncio.Task | None = None
        self._inflight: asyncio.Future | None = None
        self._executor = executor or _engine_thread()

    @classmethod
    async def load(cls, config: Config, **kw) -> AsyncEngine:
        """A driver of a new Engine for ``config``, built on the worker thread that will step
        it (see the module's threading contract). The loop stays free while it loads."""
        executor = _engine_thread()
        try:
            engine = await asyncio.get_running_loop().run_in_executor(executor, Engine, config)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor=executor, **kw)

    @property
    def is_running(self) -> bool:
        """True while the engine task runs and takes new requests (not while draining)."""
        return (self._task is not None and not self._task.done() and not self._stopping
                and not self.draining)

    @property
    def num_requests(self) -> int:
        """Requests accepted or queued and not yet finished."""
        return len(self._sinks) + len(self._pending)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heron-engine")

    async def drain(self, timeout_s: float) -> None:
        """Take no new requests (`add` raises `EngineStoppedError`), and wait up to
        ``timeout_s`` for those already accepted to finish. `stop` aborts what is left."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Finish the step in flight, abort every request (their sinks get a last delta)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- commands (event loop thread) ------------------------------------------------------

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  sink: Sink, *, tenant: str = "", adapter: str | None = None,
                  encoder_prompt: list[int] | None = None,
                  token_type_ids: list[int] | None = None) -> None:
        """Queue a request; returns once the engine accepted it (deltas then go to ``sink``).
        ``adapter``: the name of a loaded LoRA adapter to apply, or None for the base model;
        ``encoder_prompt``: an encoder-decoder model's source, ``token_type_ids``: the
        prompt tokens' types (`Engine.add_request`)."""
        grammar = None
        if params.structured_outputs is not None:
            # milliseconds to seconds (a large schema, a new tokenizer): in a thread of its
            # own, not on the loop between steps
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.compile_grammar, params)
        if not self.is_running:
            raise EngineStoppedError("the server is shutting down" if self.draining
                                     else "the engine is not running", self.draining)
        if request_id in self._pending or request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.stats.num_requests_waiting + len(self._pending) >= self.max_waiting_requests:
            raise QueueFullError(f"{self.max_waiting_requests} requests are already waiting")
        # NOTE: the scheduler's part is the last snapshot (stats), like the count above:
        # reading the scheduler here could race the step in flight
        waiting = self.stats.num_prompt_tokens_waiting + sum(
            len(p.prompt_ids) + len(p.encoder_prompt or ()) for p in self._pending.values())
        mine = len(prompt_ids) + len(encoder_prompt or ())
        if waiting and waiting + mine > self.max_waiting_tokens:
            raise QueueFullError(f"{waiting} prompt tokens are already waiting, this prompt has "
                                 f"{mine}", limit="max_waiting_tokens")
        accepted = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(request_id, prompt_ids, params, sink, accepted,
                                             tenant, adapter, encoder_prompt, grammar,
                                             token_type_ids)
        self._wake.set()
        await accepted

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter at ``path`` as ``name``, between steps. Raises the Engine's
        `heron.core.lora.AdapterError` for a bad adapter."""
        await self._adapter_command(lambda: self.engine.add_adapter(name, path))

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``, between steps. It does not wait for the requests using
        it: the Engine's `heron.core.lora.AdapterBusyError` while any is running or waiting,
        KeyError for an unknown name."""
        await self._adapter_command(lambda: self.engine.remove_adapter(name))

    async def _adapter_command(self, run: Callable[[], object]) -> None:
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._adapter_commands.append(_AdapterCommand(run, done))
        self._wake.set()
        await done

    def abort(self, request_id: str) -> None:
        """Stop a request before the next step; unknown or finished ids are ignored."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.accepted.cancel()
        elif request_id in self._sinks:
            self._aborts.add(request_id)
            self._wake.set()

    # -- the engine task -------------------------------------------------------------------

    async def _run(self) -> None:
        """Apply commands, step in the worker thread, dispatch; until `stop`."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._apply_commands()
                if self._adapter_commands:  # rare; a stream of them must not starve the steps
                    await self._run_adapter_commands(loop)
                    self._apply_commands()  # what arrived meanwhile, before the next step
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not (self._pending or self._aborts or self._adapter_commands
                            or self._stopping):
                        await self._wake.wait()
                    continue
                # NOTE: no await between here and the step's end may touch the engine.
                self._inflight = loop.run_in_executor(self._executor, self._step)
                try:
                    deltas, stats = await self._inflight
                except Exception:  # a bug below the family: fail what is in flight, go on
                    log.exception("engine step failed")
                    self._stop_all("error", "internal error in the engine step")
                    continue
                self.stats = stats
                for delta in deltas:
                    self._deliver(delta)
        finally:
            for p in self._pending.values():
                if not p.accepted.done():
                    p.accepted.set_exception(EngineStoppedError("the engine stopped"))
            self._pending.clear()
            for c in self._adapter_commands:
                if not c.done.done():
                    c.done.set_exception(EngineStoppedError("the engine stopped"))
            self._adapter_commands.clear()
            if self._inflight is None or self._inflight.done():
                self._stop_all("abort", None)
            else:  # cancelled mid-step: the worker still owns the engine, leave it alone
                for request_id in list(self._sinks):
                    self._sinks.pop(request_id)(RequestDelta(request_id, [], True))

    def _apply_commands(self) -> None:
        for request_id in self._aborts:
            self._stop(request_id, "abort", None)
        self._aborts.clear()
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if p.accepted.done():  # its caller was cancelled while waiting: nobody to serve
                continue
            try:
                self.engine.add_request(p.request_id, p.prompt_ids, p.params, tenant=p.tenant,
                                        adapter=p.adapter, encoder_prompt=p.encoder_prompt,
                                        grammar=p.grammar, token_type_ids=p.token_type_ids)
            except Exception as e:  # the Engine's ValueError reaches the caller as is
                p.accepted.set_exception(e)
                continue
            self._sinks[p.request_id] = p.sink
            p.accepted.set_result(None)
        self.stats = self._read_stats()

    async def _run_adapter_commands(self, loop: asyncio.AbstractEventLoop) -> None:
        """The adapter changes queued now, in turn, in the worker thread. A command stays
        queued until settled, so that `_run`'s ``finally`` fails it if the task is cancelled."""
        for _ in range(len(self._adapter_commands)):
            c = self._adapter_commands[0]
            if not c.done.done():  # else its caller was cancelled while waiting
                # NOTE: no await between here and the command's end may touch the engine
                self._inflight = loop.run_in_executor(self._executor, c.run)
                try:
                    await self._inflight
                except Exception as e:  # the Engine's AdapterError / KeyError reach the caller
                    _settle(c.done, e)
                else:
                    _settle(c.done, None)
                self.adapters = self._read_adapters()
            self._adapter_commands.pop(0)

    def _read_adapters(self) -> dict[str, str]:
        """Loaded adapters, name -> source path (a new dict after every change)."""
        return {name: weights.path for name, weights in self.engine.adapters.items()}

    def _step(self) -> tuple[list[RequestDelta], EngineStats]:
        """Worker thread: one step, its outputs copied out before the next step."""
        outputs = self.engine.step()
        now = time.monotonic()
        deltas = (self._copier.copy(out, now) for out in outputs)
        # a prefill chunk that produced nothing yet is news to nobody
        return ([d for d in deltas if d.seqs or d.finished or d.prompt_logprobs is not None],
                self._read_stats())

    def _read_stats(self) -> EngineStats:
        engine = self.engine
        sched = engine.scheduler
        running = {s.request_id for s in sched.running}
        swapped = {s.request_id for s in sched.swapped} - running
        waiting_tokens = {s.request_id: s.num_prompt_tokens + len(s.encoder_token_ids)
                          for s in sched.waiting
                          if s.request_id not in running and s.request_id not in swapped}
        cache, spec = engine.prefix_cache, engine.spec_stats
        return EngineStats(
            num_requests_running=len(running), num_requests_waiting=len(waiting_tokens),
            num_kv_blocks_total=engine.num_kv_blocks,
            num_kv_blocks_in_use=engine.num_blocks_in_use,
            num_kv_blocks_cached=cache.num_cached_blocks if cache is not None else 0,
            num_requests_swapped=len(swapped),
            num_state_slots_in_use=engine.num_state_slots_in_use,
            num_state_snapshots=engine.num_state_snapshots,
            num_host_kv_blocks_in_use=engine.num_host_blocks_in_use,
            num_adapters_in_use=engine.num_adapters_in_use,
            num_prompt_tokens_waiting=sum(waiting_tokens.values()),
            num_preemptions=sched.num_preemptions,
            prefix_cache_queried_tokens=sched.prefix_queried_tokens,
            prefix_cache_hit_tokens=sched.prefix_hit_tokens,
            spec=spec.copy() if engine.proposer is not None else None)

    def _stop(self, request_id: str, reason: str, error: str | None) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(self._copier.stopped(out, reason, error))
        else:
            self._copier.forget(request_id)
            self._sinks.pop(request_id, None)

    def _stop_all(self, reason: str, error: str | None) -> None:
        for request_id in list(self._sinks):
            self._stop(request_id, reason, error)
        self.stats = self._read_stats()

    def _deliver(self, delta: RequestDelta) -> None:
        sink = self._sinks.get(delta.request_id)
        if sink is None:
            return
        if delta.finished:
            del self._sinks[delta.request_id]
        try:
            sink(delta)
        except Exception:  # one consumer's fault must not stop the engine
            log.exception("delivering to request %s failed", delta.request_id)


def _engine_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="heron-engine")
