"""The engine: owns memory and the schedule, and runs one step at a time.

``step()`` reads as the design: schedule a batch, let the family run it, sample, update
the sequences, emit outputs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec
import torch

from heron.core.adapters import Adapters
from heron.core.batch import EncoderChunk
from heron.core.batch_builder import BatchBuilder
from heron.core.beam_search import BeamSearch, step_searches
from heron.core.beams import BeamGroup
from heron.core.block_pool import BlockPool
from heron.core.config import Config
from heron.core.device import resolve_device, to_device
from heron.core.grammar import Grammars
from heron.core.inflight import InflightStep, placeholder
from heron.core.limits import Limits
from heron.core.kv_cache import (allocate_cache, allocate_host_kv, copy_block_rows, copy_blocks,
                                 num_kv_blocks_for, num_swap_blocks_for)
from heron.core.lora import AdapterError, AdapterWeights
from heron.core.ops.attention import compiled_attention_applies
from heron.core.model_loader import load_model
from heron.core.outputs import NO_TOKEN_LEFT, RequestOutput
from heron.core.plugins import PluginManager
from heron.core.pooling import Pooler, Pooling, embedding_params
from heron.core.prefix_cache import Namespace, PrefixCache
from heron.core.request import RequestState, SeqOutput
from heron.core.logprobs import prompt_logprobs
from heron.core.sampler import Sampler
from heron.core.sampling_params import SamplingParams
from heron.core.scheduler import Scheduler, SchedulerOutput
from heron.core.sequence import Sequence, SequenceStatus
from heron.core.speculative import LookupFirst, Proposer, SpecStats
from heron.core.state_pool import StatePool, snapshot_bytes

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching inference over one model.

    Not thread-safe: one caller drives ``add_request`` / ``abort`` / ``step``.
    RequestOutputs returned by ``step`` are live views, valid until the next ``step``.
    """

    def __init__(self, config: Config, plugins: PluginManager | None = None) -> None:
        self.config = config
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        self.plugins = plugins or PluginManager()
        self.device, self.dtype = resolve_device(config.model)
        loaded = load_model(config.model, self.plugins, self.device, self.dtype)
        self.runner, self.tokenizer = loaded.runner, loaded.tokenizer
        info = self.runner.info
        self.pooler = self._build_pooler(loaded.pooling)
        checkpoint_len = loaded.pooling.max_len if loaded.pooling is not None else None
        self.max_model_len = min(config.model.max_model_len or checkpoint_len
                                 or info.max_context_len, info.max_context_len)
        if (config.model.max_model_len or 0) > info.max_context_len:
            log.warning("model.max_model_len %d is past what %s takes (%d tokens): using %d",
                        config.model.max_model_len, info.name, info.max_context_len,
                        info.max_context_len)
        spec = self.runner.cache_spec()
        engine = config.engine
        if self.runner.attends_whole_prompt:  # no row of an input is final before its last
            engine = msgspec.structs.replace(engine, chunked_prefill=False)
        self.num_kv_blocks = num_kv_blocks_for(spec, engine, self.dtype, self.max_model_len)
        self.limits = limits = Limits(self.max_model_len, self.num_kv_blocks, engine)
        if spec.kv is not None and limits.kv_capacity < self.max_model_len:
            log.warning("the KV cache holds %d tokens (engine.num_kv_blocks %d x "
                        "engine.block_size %d), fewer than max_model_len %d: a request that "
                        "could grow longer is refused", limits.kv_capacity, self.num_kv_blocks,
                        engine.block_size, self.max_model_len)
        try:
            self.cache = allocate_cache(spec, engine, self.num_kv_blocks, engine.max_num_seqs,
                                        self.dtype, self.device)
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors included
            size = (spec.kv.bytes_per_block(engine.block_size, self.dtype) * self.num_kv_blocks
                    if spec.kv is not None else 0)
            raise RuntimeError(
                f"the KV cache of {self.num_kv_blocks} blocks ({size / 2**30:.1f} GiB) cannot be "
                f"allocated on {self.device}: lower engine.kv_cache_memory_gb or set "
                f"engine.num_kv_blocks ({e})") from e
        self.runner.bind_cache(self.cache)
        # builds the kernels now, so the first step does not wait for the compiler
        self.cpu_kernels = (engine.cpu_kernels and self.device.type == "cpu"
                            and spec.kv is not None and spec.kv.num_layers > 0
                            and compiled_attention_applies(self.dtype, spec.kv.head_dim))
        self.block_pool = BlockPool(self.num_kv_blocks)
        # NOTE: per-sequence states (SSM) are not in the KV blocks: a prefix hit must restore
        # a state snapshot too, and swapping or forking KV alone would be wrong, so
        # families with states get snapshots and neither of the others
        stateless = not spec.states
        cache_cfg = config.prefix_cache
        # an encoder-decoder's decoder KV depends on its source, which the cache does not
        # key, and a bidirectional encoder's rows of a prefix on what follows it
        runner = self.runner
        caching = (cache_cfg.enabled and not runner.is_encoder_decoder
                   and not runner.attends_whole_prompt
                   and not (self.pooler is not None and self.pooler.pooling.reads_every_row))
        self.states = None
        if not stateless:
            num_snapshots = 0
            if caching:
                num_snapshots = cache_cfg.num_snapshots or int(
                    cache_cfg.snapshot_memory_gb * 2**30) // snapshot_bytes(spec, self.dtype)
            self.states = StatePool(self.cache, spec, engine.max_num_seqs, num_snapshots)
        self.prefix_cache = None
        if caching:
            self.prefix_cache = PrefixCache(
                self.block_pool, engine.block_size, cache_cfg.eviction,
                snapshots=self.states.snapshot_pool if self.states else None,
                flops_of=self.runner.prefix_flops, flop_weight=cache_cfg.flop_weight)
            if self.states is not None:
                self.states.prefix_cache = self.prefix_cache
        self.host_kv, host_pool = None, None
        if engine.preemption == "swap" and stateless:
            num_swap = num_swap_blocks_for(spec, engine, self.dtype)
            self.host_kv = allocate_host_kv(self.cache.kv, num_swap)
            host_pool = BlockPool(num_swap)
        self._share_prompt = stateless
        lora_cfg = config.lora
        self.lora: Adapters | None = None
        if lora_cfg.adapters or lora_cfg.allow_runtime_updates:
            targets = self.runner.lora_targets()
            if not targets:
                raise ValueError(f"model {info.name!r}: its family takes no LoRA adapters")
            self.lora = Adapters(lora_cfg, targets, self.cache,
                                 self.plugins.adapter_loaders.get("peft"), self.dtype,
                                 self.device)
        self.adapter_pool = self.lora.pool if self.lora is not None else None
        self.scheduler = Scheduler(engine, self.block_pool, self.prefix_cache, host_pool,
                                   cache_cfg.snapshot_admission,
                                   cache_generated=self.runner.generated_matches_prompt,
                                   adapter_pool=self.adapter_pool,
                                   encoder_stages=(self.runner.encoder_stages
                                                   if self.runner.is_encoder_decoder else 0))
        self.sampler = Sampler(info.eos_token_ids)
        self.grammars = (Grammars(self.tokenizer.backend, info.vocab_size, info.eos_token_ids)
                         if self.tokenizer is not None else None)
        self.batch_builder = BatchBuilder(
            engine.block_size, self.device, logits=self.pooler is None,
            cpu_kernels=self.cpu_kernels)
        self.graphs = None
        if (self.device.type == "cuda" and engine.cuda_graphs and self.pooler is None
                and self.runner.supports_cuda_graphs):
            from heron.core.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.runner.forward, max_num_seqs=engine.max_num_seqs,
                                       max_context_len=self.max_model_len,
                                       block_size=engine.block_size, device=self.device)
        elif (self.device.type == "cpu" and engine.cpu_graphs and self.pooler is None
                and self.runner.supports_cpu_graphs):
            from heron.core.cpu_graphs import CpuDecodeGraphs
            self.graphs = CpuDecodeGraphs(self.runner.forward, max_num_seqs=engine.max_num_seqs,
                                          max_context_len=self.max_model_len,
                                          block_size=engine.block_size,
                                          cpu_kernels=self.cpu_kernels)
        self.proposer: Proposer | None = None
        self.async_scheduling = engine.async_scheduling == "on" or (
            engine.async_scheduling == "auto" and self.device.type == "cuda")
        self._inflight: InflightStep | None = None
        proposer = self._build_proposer()
        if proposer is not None:
            if engine.async_scheduling == "on":
                raise ValueError("engine.async_scheduling = \"on\" does not work with "
                                 "speculative decoding: drafts need each step's tokens on "
                                 "the host before the next step")
            self.set_proposer(proposer)
        self.spec_stats = SpecStats()
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._outputs: dict[int, SeqOutput] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        for name, path in lora_cfg.adapters.items():
            try:
                self.add_adapter(name, path)
            except AdapterError as e:  # one bad adapter must not take the server down
                log.error("adapter not loaded: %s", e)

    def _build_pooler(self, pooling: Pooling | None) -> Pooler | None:
        """An embedding model's pooler: its forwards then keep every row's final hidden
        states and compute no logits."""
        if pooling is None:
            return None
        runner, name = self.runner, self.runner.info.name
        if runner.is_encoder_decoder or not runner.supports_hidden_states:
            raise ValueError(f"model {name!r}: its family does not serve embeddings")
        if self.config.speculative.method:
            raise ValueError(f"model {name!r} serves embeddings: it takes no speculative "
                             "decoding ([speculative] method)")
        runner.keep_hidden_states, runner.hidden_states_layers = True, (None,)
        return Pooler(pooling, runner.classifier)

    def _build_proposer(self) -> Proposer | None:
        spec = self.config.speculative
        if spec.prompt_lookup and spec.method in ("", "ngram"):
            log.warning("[speculative] prompt_lookup does nothing with method %r: it puts "
                        "prompt lookup before another method (mtp)", spec.method)
        if not spec.method:
            return None
        build = self.plugins.proposers.get(spec.method)
        if build is None:
            raise ValueError(f"unknown speculative method {spec.method!r}; registered: "
                             f"{sorted(self.plugins.proposers)}")
        if self.runner.is_encoder_decoder:
            raise ValueError(f"speculative decoding is not available for model "
                             f"{self.runner.info.name!r}: an encoder-decoder")
        proposer = build(self.config, self.runner)
        if spec.prompt_lookup and spec.method != "ngram":
            lookup = self.plugins.proposers.get("ngram")
            if lookup is None:
                raise ValueError("[speculative] prompt_lookup needs the 'ngram' proposer, "
                                 "which no plugin registered")
            proposer = LookupFirst(lookup(self.config, self.runner), proposer,
                                   ("ngram", spec.method))
        return proposer

    def set_proposer(self, proposer: Proposer) -> None:
        """Draft with ``proposer`` from the next step on (one built from the config is set
        at start-up). Turns async scheduling off: drafts need each step's tokens on the
        host. Not while a step's tokens are in flight."""
        if self._inflight is not None:
            raise RuntimeError("set_proposer while a step's tokens are in flight")
        if proposer.needs_hidden_states and not self.runner.supports_hidden_states:
            raise ValueError(f"model {self.runner.info.name!r}: its family keeps no hidden "
                             "states to draft from")
        self.async_scheduling = False
        if proposer.needs_hidden_states:
            self.runner.keep_hidden_states = True
            self.runner.hidden_states_layers = proposer.hidden_layers
            self.graphs = None  # replays would not leave the hidden states
        self.proposer = proposer

    # -- adapters ------------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, AdapterWeights]:
        """The loaded LoRA adapters, by name."""
        return self.lora.by_name if self.lora is not None else {}

    def add_adapter(self, name: str, path: str) -> AdapterWeights:
        """Load a LoRA adapter (validated against the model) under ``name``. Raises
        AdapterError naming the adapter and the problem."""
        if self.lora is None:
            raise AdapterError(f"adapter {name!r}: LoRA is off (set [lora] adapters or "
                               "allow_runtime_updates)")
        return self.lora.add(name, path)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter. KeyError when unknown; AdapterBusyError while requests that
        use it are running or waiting (it does not wait for them)."""
        if self.lora is None or name not in self.adapters:
            raise KeyError(name)
        key = self.lora.key(name)
        self.lora.remove(name, sum(1 for s in self._requests.values()
                                   if s.seqs[0].namespace.adapter == key))

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, tenant: str = "",
                    adapter: str | None = None,
                    encoder_prompt: str | list[int] | None = None,
                    grammar: LLMatcher | None = None,
                    token_type_ids: list[int] | None = None) -> None:
        """Queue a request. Raises ValueError for a prompt or params the engine cannot serve.

        An encoder-decoder model (``runner.is_encoder_decoder``) needs ``encoder_prompt``
        (the source: text or token ids) beside the decoder ``prompt``; other models refuse
        one. ``params.num_beams > 1`` runs a beam search (`heron.core.beams`): the outputs
        are its ``n`` best hypotheses, reported once it is done.

        Requests share prefix-cache blocks only with requests of the same ``tenant`` and
        ``adapter`` (a loaded LoRA adapter's name; None: the base model). With ``n > 1`` the
        first sequence computes the prompt and the others fork from it.

        ``token_type_ids``: each prompt token's type, for a model that reads types
        (``runner.num_token_types``; a cross-encoder's pair: `Tokenizer.encode_pair`); None
        types every token 0.

        ``grammar``: ``params.structured_outputs`` compiled by `compile_grammar` (which takes
        milliseconds, at times more, so callers with a step loop to keep going compile
        elsewhere); compiled here when None.

        An embedding model (`pooler`) pools the prompt's hidden states into
        ``RequestOutput.embedding`` and generates nothing: of ``params`` only ``priority``
        applies, and asking for more sequences, beams, logprobs or a grammar is a ValueError.
        """
        params = params or SamplingParams()
        if self.pooler is not None:
            params = embedding_params(params)
        params.validate(self.runner.info.vocab_size,
                        priorities=self.config.engine.scheduling_policy == "priority")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter_key = ""
        if adapter is not None:
            if self.lora is None:
                raise ValueError(f"unknown adapter {adapter!r}: LoRA is off")
            adapter_key = self.lora.key(adapter)
        prompt_ids = self._encode(prompt)
        if self.pooler is not None:
            self.limits.check_embedding(len(prompt_ids))
        else:
            self.limits.check_generation(len(prompt_ids), params.max_tokens)
        encoder_ids = self._encoder_prompt(encoder_prompt)
        types = self._token_types(token_type_ids, len(prompt_ids))
        if grammar is None:
            grammar = self.compile_grammar(params)
        arrival = next(self._arrivals)
        seqs, outputs = [], []
        namespace = Namespace(adapter=adapter_key, tenant=tenant)
        for index in range(params.n if params.num_beams == 1 else 1):
            seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params, arrival,
                           namespace, encoder_ids, types)
            if params.seed is not None:
                seq.generator = torch.Generator(self.device).manual_seed(params.seed + index)
            if grammar is not None:
                seq.grammar = grammar if index == 0 else grammar.deep_copy()
            seqs.append(seq)
            if params.num_beams == 1:  # beam outputs are the search's (`BeamGroup`)
                outputs.append(SeqOutput(seq, index, self.tokenizer,
                                         self.runner.info.eos_token_ids, self.max_model_len))
        state = RequestState(request_id, prompt_ids, params, seqs, outputs)
        if params.num_beams > 1:
            state.beam = self._beam_group(seqs[0], params)
        self._requests[request_id] = state
        for seq in seqs:
            self._by_seq[seq.seq_id] = state
        for seq, out in zip(seqs, outputs):
            self._outputs[seq.seq_id] = out
        if self._share_prompt:
            state.unforked = seqs[1:]
            seqs = seqs[:1]
        for seq in seqs:
            self.scheduler.add(seq)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.runner.info.vocab_size
            bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _beam_group(self, root: Sequence, params: SamplingParams) -> BeamGroup:
        """Beam search for ``root``'s request. For an encoder-decoder the decoder prompt's
        tokens after the start token (NLLB's target language) count as generated, forced
        tokens, as transformers' ``forced_bos_token_id`` does."""
        if params.num_beams > self.config.engine.max_num_seqs:
            raise ValueError(f"num_beams ({params.num_beams}) exceeds engine.max_num_seqs "
                             f"({self.config.engine.max_num_seqs})")
        forced = root.token_ids[1:] if self.runner.is_encoder_decoder else []
        if len(forced) > 1:
            raise ValueError("beam search takes at most one token after the decoder start")
        max_tokens = params.max_tokens or self.max_model_len - root.num_prompt_tokens
        eos = () if params.ignore_eos else self.runner.info.eos_token_ids
        search = BeamSearch(params.num_beams, max_tokens + len(forced), eos,
                            params.length_penalty, params.early_stopping, params.n,
                            params.min_tokens + len(forced), forced[0] if forced else None)
        group = BeamGroup(search, root, len(forced), params.n)
        if forced:  # the forced step: every beam is the prompt, which holds the token
            search.step(torch.zeros(1, self.runner.info.vocab_size))
            group.beams = [root] * params.num_beams
        return group

    def compile_grammar(self, params: SamplingParams) -> LLMatcher | None:
        """A matcher in the start state of ``params``' structured output (None without one);
        ValueError for one this model cannot serve. Safe to call from any thread."""
        spec = params.structured_outputs
        if spec is None:
            return None
        spec.validate()
        if self.grammars is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        if self.runner.is_encoder_decoder:
            raise ValueError(f"structured_outputs is not available for model "
                             f"{self.runner.info.name!r}: an encoder-decoder")
        return self.grammars.compile(spec)

    def _token_types(self, types: list[int] | None, num_tokens: int) -> tuple[int, ...]:
        if types is None:
            return ()
        kinds = self.runner.num_token_types
        if not kinds:
            raise ValueError("this model reads no token types")
        if len(types) != num_tokens:
            raise ValueError(f"{len(types)} token types for a prompt of {num_tokens} tokens")
        if (bad := next((t for t in types if not (isinstance(t, int) and 0 <= t < kinds)),
                        None)) is not None:
            raise ValueError(f"token type {bad!r} is outside 0..{kinds - 1}")
        return tuple(types)

    def _encoder_prompt(self, prompt: str | list[int] | None) -> tuple[int, ...]:
        runner = self.runner
        if not runner.is_encoder_decoder:
            if prompt is not None:
                raise ValueError("this model has no encoder: it takes no encoder prompt")
            return ()
        if prompt is None:
            raise ValueError("this model is an encoder-decoder: send an encoder prompt")
        ids = self._encode(prompt)
        if len(ids) > runner.max_encoder_len:
            raise ValueError(f"the encoder prompt has {len(ids)} tokens; this model encodes "
                             f"at most {runner.max_encoder_len}")
        return tuple(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free everything it holds. Unknown ids are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        state.finish("abort")
        self._retire(state)
        return state.snapshot()

    def has_unfinished(self) -> bool:
        inflight = self._inflight
        return self.scheduler.has_unfinished() or inflight is not None and any(
            seq.status is not SequenceStatus.FINISHED for seq in inflight.seqs)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_blocks_in_use(self) -> int:
        """KV blocks live sequences reference (cached blocks nobody uses are not counted)."""
        return self.block_pool.num_used_blocks - self.block_pool.num_evictable_blocks

    @property
    def num_state_slots_in_use(self) -> int:
        """Per-sequence state slots (SSM layers) held by live sequences."""
        return self.states.slots.num_used if self.states is not None else 0

    @property
    def num_host_blocks_in_use(self) -> int:
        """Host KV blocks holding swapped-out sequences (preemption by swap)."""
        host = self.scheduler.host_pool
        return host.num_used_blocks if host is not None else 0

    @property
    def num_state_snapshots(self) -> int:
        """State snapshots (SSM) held for the prefix cache or pending on live sequences."""
        pool = self.states.snapshot_pool if self.states is not None else None
        return pool.num_used if pool is not None else 0

    @property
    def num_adapters_in_use(self) -> int:
        """LoRA adapters live requests hold a reference to."""
        return self.adapter_pool.num_referenced if self.adapter_pool is not None else 0

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step. With async scheduling, the outputs are mostly the previous step's
        tokens, which land while this step runs (`heron.core.inflight`)."""
        if self.proposer is not None:
            self._propose()
        inflight, self._inflight = self._inflight, None
        # a sequence whose token in flight is its last by length needs no more steps
        sched = self.scheduler.schedule(hold={s.seq_id for s in inflight.seqs
                                              if self._ends_by_length(s)} if inflight else ())
        self._prepare(sched)
        # requests whose tokens land in this step: those in flight, and this step's own
        touched = self._states_of(inflight.seqs if inflight else ())
        pl_seqs: set[int] = set()
        # sequences that only run encoder stages this step have no rows and no output yet
        decoding = [item for item in sched.scheduled if item.num_tokens]
        for item in decoding:
            state = self._by_seq[item.seq.seq_id]
            touched[state.request_id] = state
            if state.needs_prompt_logprobs:
                pl_seqs.add(item.seq.seq_id)
        batch = None
        if decoding:
            batch = self.batch_builder.build(decoding, pl_seqs,
                                             inflight.sample.token_ids if inflight else None)
        for state in touched.values():
            for out in state.outputs:
                out.begin_step()
        encoding = [item for item in sched.scheduled if item.encoder_stages]
        logits = None
        try:  # the family's code: a fault here fails only this step's requests
            for item in sched.scheduled:
                if item.seq.family_state is None:
                    item.seq.family_state = self.runner.alloc_sequence(item.seq)
            if encoding:
                self._run_encoder(encoding)
            if batch is not None:
                if (self.graphs is not None and self.graphs.can_run(batch)
                        and self.runner.can_replay(batch)):
                    logits = self.graphs.run(batch)
                else:
                    logits = self.runner.forward(batch)
                if self.proposer is not None and self.proposer.needs_hidden_states:
                    self._observe(decoding)
        except Exception as e:
            log.exception("model step failed")
            self._resolve(inflight)  # sampled before the fault
            failed = self._states_of(item.seq for item in sched.scheduled)
            for state in failed.values():
                state.finish("error", error=f"model step failed: {e}")
            return self._report(touched | failed, failed)
        for item in decoding:
            item.seq.num_computed_tokens += item.num_tokens
        self._resolve(inflight)  # on the host, while the device runs this step
        if self.pooler is not None and decoding:
            self._pool(decoding)
        elif logits is not None:
            self._postprocess(decoding, pl_seqs, logits)
        self._cache_new_blocks(decoding)
        self._checkpoint_states(decoding)
        return self._report(touched)

    def _states_of(self, seqs) -> dict[str, RequestState]:
        """The live requests of ``seqs``, by request id."""
        states = (self._by_seq.get(seq.seq_id) for seq in seqs)
        return {state.request_id: state for state in states if state is not None}

    def _report(self, touched: dict[str, RequestState],
                failed: Collection[str] = ()) -> list[RequestOutput]:
        """The outputs of the requests a step touched; those that finished retire (the
        blocks of those whose step ``failed`` are not cached)."""
        outputs = []
        for state in touched.values():
            if state.finished:
                self._retire(state, cache=state.request_id not in failed)
            outputs.append(state.snapshot())
        return outputs

    def _prepare(self, sched: SchedulerOutput) -> None:
        """Carry out the memory moves a schedule asks for before its batch runs: swaps,
        state slots and snapshots, adapter slots."""
        if self.adapter_pool is not None:  # each adapter's rows one segment (ops.lora)
            sched.scheduled.sort(key=lambda item: -1 if item.seq.lora_slot is None
                                 else item.seq.lora_slot)
        for seq in sched.preempted:
            self._free_family_state(seq)
            if self.states is not None:
                self.states.release(seq, commit=False)
        if self.host_kv is not None:
            copy_blocks(self.cache.kv, self.host_kv, sched.swap_out)
            copy_blocks(self.host_kv, self.cache.kv, sched.swap_in)
        if self.states is not None:
            for item in sched.scheduled:
                self.states.acquire(item.seq)
        for seq, snapshot in sched.restores:
            self.states.restore(seq, snapshot)
        for key, slot in sched.adapter_loads:
            self.lora.load_slot(key, slot)
        if self.states is not None and self.proposer is not None:
            for item in sched.scheduled:
                if item.seq.draft_token_ids:
                    self.states.save_before_drafts(item.seq)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether ``seq``'s last token (one in flight) takes it to ``max_tokens`` or the
        context's end, as `SeqOutput.append` will find."""
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens >= max_tokens)
                or len(seq) >= self.max_model_len)

    def _resolve(self, step: InflightStep | None) -> None:
        """A step's sampled tokens land on the host: each replaces its sequence's
        placeholder and goes to its output, which may end."""
        if step is None:
            return
        result = step.sample.result()
        for i, seq in enumerate(step.seqs):
            if seq.status is SequenceStatus.FINISHED:  # aborted, or failed, since
                continue
            seq.token_ids.pop()  # the placeholder
            if not self._emit(seq, result, i):
                self._finish_seq(seq)

    def _propose(self) -> None:
        """Drafts for the running sequences that decode this step, within their limits (the
        token the target adds after the drafts must still fit max_tokens and the context).
        Not before a sequence's first token: that one's row also serves its unforked
        siblings (``n > 1``). None while more sequences run than
        ``disable_by_batch_size``."""
        spec, running = self.config.speculative, self.scheduler.running
        if 0 < spec.disable_by_batch_size < len(running):
            return
        k = spec.num_speculative_tokens
        seqs = [s for s in running if s.num_uncomputed_tokens == 1
                and s.num_output_tokens and s.params.speculative and s.params.num_beams == 1]
        if not seqs:
            return
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, k)):
            room = min(k, self.max_model_len - len(seq) - 1)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            seq.draft_token_ids = list(drafts[:max(0, room)])

    def _observe(self, decoding) -> None:
        """Each sequence's rows of the final hidden states, to the proposer."""
        hidden, row = self.runner.hidden_states, 0
        for item in decoding:
            seq = item.seq
            if seq.params.speculative and seq.params.num_beams == 1:
                self.proposer.observe(seq, seq.num_computed_tokens,
                                      hidden[row:row + item.num_tokens])
            row += item.num_tokens

    def _run_encoder(self, encoding) -> None:
        chunks = []
        for item in encoding:
            seq = item.seq
            start = seq.encoder_stages_done
            chunks.append(EncoderChunk(seq, seq.state_slot, start, start + item.encoder_stages))
        self.runner.encode(chunks)
        for chunk in chunks:
            chunk.seq.encoder_stages_done = chunk.end

    def _postprocess(self, scheduled, pl_seqs: set[int], logits: torch.Tensor) -> None:
        """Sample, step beam searches, verify drafts, record prompt logprobs: everything a
        step's logits give, for ``scheduled``, whose ``num_computed_tokens`` already count
        this step. Sampled tokens land at once, or with async scheduling in the next step
        (`_inflight`)."""
        row = 0
        sample_rows, sample_seqs = [], []
        beams: dict[str, RequestState] = {}
        forks: list[RequestState] = []
        drafted: list[tuple[Sequence, int]] = []  # (sequence, its first row)
        for item in scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                row += 1  # its token in flight ended it: a running sequence's decode row
                continue
            start = seq.num_computed_tokens - item.num_tokens
            if seq.seq_id in pl_seqs:
                num = max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens - 1) - start)
                self._add_prompt_logprobs(seq, logits[row:row + num], start)
                row += num
            if seq.draft_token_ids:  # scheduled whole: its last token and every draft
                drafted.append((seq, row))
                row += 1 + len(seq.draft_token_ids)
                continue
            if seq.num_computed_tokens == len(seq.token_ids):
                state = self._by_seq[seq.seq_id]
                if state.beam is not None:
                    state.beam.rows[seq.seq_id] = row
                    beams[state.request_id] = state
                    row += 1
                    continue
                if state.unforked and seq is state.seqs[0]:
                    forks.append(state)  # siblings sample their first token from this row
                    sample_rows += [row] * len(state.unforked)
                    sample_seqs += state.unforked
                sample_rows.append(row)
                sample_seqs.append(seq)
                row += 1
        if beams:
            self._step_beams(list(beams.values()), logits)
        if drafted:
            self._verify(drafted, logits)
        if not sample_seqs:
            return
        if sample_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(sample_rows, torch.long, logits.device))
        sample = self.sampler.launch(logits, sample_seqs)
        for state in forks:
            self._fork_siblings(state)
        for i, seq in enumerate(sample_seqs):
            seq.token_ids.append(placeholder(i))
        self._inflight = InflightStep(sample_seqs, sample)
        # NOTE: only running sequences wait for their tokens (a sibling that found no seat
        # to fork into waits to be computed with it); see `_postprocess`'s finished rows
        if not self.async_scheduling or any(s.status is SequenceStatus.WAITING
                                            for s in sample_seqs):
            self._resolve(self._inflight)
            self._inflight = None

    def _pool(self, scheduled) -> None:
        """Each sequence's rows of the final hidden states, to the pooler; a sequence whose
        prompt is all in ends with its embedding."""
        hidden, row = self.runner.hidden_states, 0
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens - item.num_tokens
            vector = self.pooler.feed(seq.seq_id, hidden[row:row + item.num_tokens], start,
                                      seq.num_prompt_tokens)
            row += item.num_tokens
            if vector is not None:
                state = self._by_seq[seq.seq_id]
                state.embedding = vector
                state.outputs[0].finish("stop")

    def _emit(self, seq: Sequence, result, i: int) -> bool:
        """Append row ``i`` of a sampler result to ``seq``; False when ``seq`` is done."""
        out = self._outputs[seq.seq_id]
        if i in result.failed_rows:
            out.finish("error", error="the model produced non-finite logits")
        elif i in result.no_token_rows:
            out.finish("error", error=NO_TOKEN_LEFT)
        else:
            token = result.token_ids[i]
            seq.token_ids.append(token)
            out.append(token, result.logprobs[i] if result.logprobs else None)
        return out.out.finish_reason is None

    def _verify(self, drafted: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        """Walk each sequence's drafts in order (see `heron.core.speculative`): the sampler
        picks the target's token at each position; a draft equal to it is accepted and the
        walk goes on, the first that differs is replaced by it and ends the walk, and after
        the last draft the target's next token is a bonus. Then roll back the KV of what
        was rejected."""
        drafts = {seq.seq_id: seq.draft_token_ids for seq, _ in drafted}
        for seq, _ in drafted:
            seq.draft_token_ids = []
        active, position = drafted, 0
        while active:
            seqs = [seq for seq, _ in active]
            result = self.sampler.sample(logits[[row + position for _, row in active]], seqs)
            walking = []
            for i, (seq, row) in enumerate(active):
                draft = drafts[seq.seq_id]
                live = self._emit(seq, result, i)
                matched = position < len(draft) and result.token_ids[i] == draft[position]
                if live and matched:
                    walking.append((seq, row))
                    continue
                accepted = position + matched
                self.spec_stats.record(len(draft), accepted, self.proposer.draft_source(seq))
                if accepted < len(draft) and self.states is not None:
                    # a state went through the rejected drafts too and cannot step back:
                    # restore it, and the next step computes the accepted tokens again
                    self.states.restore_before_drafts(seq)
                    seq.num_computed_tokens -= len(draft) + 1
                else:  # the rejected drafts' KV is stale; later writes overwrite it
                    seq.num_computed_tokens -= len(draft) - accepted
                self.scheduler.rollback(seq)
                if not live:
                    self._finish_seq(seq)
            active, position = walking, position + 1

    def _step_beams(self, states: list[RequestState], logits: torch.Tensor) -> None:
        """Step the beam searches of ``states`` on their rows of ``logits``, together, and
        fork, extend and drop their beams' sequences as they say."""
        ready = []
        for state in states:
            group = state.beam
            if group.ready():
                ready.append(state)
                continue
            for seq in group.live:  # a beam is behind: the others compute their token again
                if seq.seq_id in group.rows:
                    seq.num_computed_tokens -= 1
            group.rows.clear()
        try:
            steps = step_searches([s.beam.search for s in ready], logits,
                                  [s.beam.beam_rows() for s in ready])
        except Exception:  # a failed step changed no search: find the faulty ones alone
            log.exception("beam search step failed")
            ready, steps = self._step_searches_alone(ready, logits)
        copies: list[tuple[int, int, int]] = []  # forked beams' partial blocks, copied at once
        for state, pairs in zip(ready, steps):
            state.beam.rows.clear()
            self._follow_beams(state, pairs, copies)
        copy_block_rows(self.cache.kv, copies)

    def _step_searches_alone(self, states: list[RequestState], logits: torch.Tensor
                             ) -> tuple[list[RequestState], list[list[tuple[int, int]]]]:
        """Step each search of ``states`` by itself; one that fails finishes its request
        with an error (its sequences retire when the step reports it), the rest go on.
        Returns the states that stepped and their pairs."""
        stepped, steps = [], []
        for state in states:
            try:
                steps += step_searches([state.beam.search], logits, [state.beam.beam_rows()])
                stepped.append(state)
            except Exception as e:
                state.beam.rows.clear()
                state.finish("error", error=f"beam search step failed: {e}")
        return stepped, steps

    def _follow_beams(self, state: RequestState, pairs: list[tuple[int, int]],
                      copies: list[tuple[int, int, int]]) -> None:
        """Make ``state``'s sequences the search's next beams, ``pairs`` of (parent row,
        token); the KV blocks its forks must copy (copy on write) go to ``copies``."""
        group = state.beam
        if group.search.done:
            group.fill_outputs(self.tokenizer, group.search.eos_token_ids,
                               state.params.skip_special_tokens)
            return
        parents, targets, appends = group.beams, {}, []
        used = {id(parents[p]) for p, _ in pairs}
        for seq in group.live:  # first, so that the forks below find seats, blocks, slots
            if id(seq) not in used:
                self._finish_seq(seq)
                self._by_seq.pop(seq.seq_id, None)
        for parent_row, token in pairs:
            parent = parents[parent_row]
            if (parent.seq_id, token) not in targets:
                # a parent's first continuation keeps its sequence, the others fork it
                # (before any token is appended to it)
                taken = any(s is parent for s, _ in appends)
                seq = self._fork_beam(state, parent, copies) if taken else parent
                targets[parent.seq_id, token] = seq
                appends.append((seq, token))
        for seq, token in appends:
            seq.token_ids.append(token)
        group.beams = [targets[parents[p].seq_id, t] for p, t in pairs]
        state.seqs = group.live

    def _fork_beam(self, state: RequestState, parent: Sequence,
                   copies: list[tuple[int, int, int]]) -> Sequence:
        child = Sequence(next(self._seq_ids), parent.request_id, parent.prompt_token_ids,
                         parent.params, parent.arrival, parent.namespace,
                         parent.encoder_token_ids)
        child.token_ids = list(parent.token_ids)
        copy = self.scheduler.fork(parent, child)
        if copy is not None:
            copies.append(copy)
        if self.states is not None and child.status is SequenceStatus.RUNNING:
            self.states.fork(parent, child, None if self.runner.forks_share_states else
                             lambda src, dst: self.runner.fork_state(self.cache, src, dst))
        self._by_seq[child.seq_id] = state
        return child

    def _fork_siblings(self, state: RequestState) -> None:
        """The first sequence computed the prompt: its siblings take its KV (copy on write)."""
        parent = state.seqs[0]
        self.scheduler.cache_computed(parent)  # shared blocks must be cached ones (paths)
        copies = [c for child in state.unforked
                  if (c := self.scheduler.fork(parent, child)) is not None]
        if self.proposer is not None:
            for child in state.unforked:
                self.proposer.fork_sequence(parent, child)
        copy_block_rows(self.cache.kv, copies)
        state.unforked = []

    def _cache_new_blocks(self, scheduled) -> None:
        """Offer the blocks this step filled to the prefix cache, so that requests arriving
        while these still run can share them."""
        bs = self.config.engine.block_size
        for item in scheduled:
            seq = item.seq
            done = seq.num_computed_tokens
            if (seq.status is SequenceStatus.RUNNING
                    and done // bs > (done - item.num_tokens) // bs):
                self.scheduler.cache_computed(seq)

    def _checkpoint_states(self, scheduled) -> None:
        """Snapshot the states the scheduler planned (or decode reached) for the prefix cache."""
        if self.states is None or self.prefix_cache is None:
            return
        for item in scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING and (
                    kind := self.scheduler.checkpoint_due(seq)) is not None:
                # a boundary was crossed: `_cache_new_blocks` cached the node it goes to
                self.states.checkpoint(seq, kind)

    def _add_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        state = self._by_seq[seq.seq_id]
        if seq is not state.seqs[0] or logits.shape[0] == 0:
            return  # sibling sequences share the prompt; record it once
        done = len(state.prompt_logprobs) - 1  # positions already covered
        targets = state.prompt_token_ids[start + 1:start + 1 + logits.shape[0]]
        entries = prompt_logprobs(logits, torch.tensor(targets), state.params.prompt_logprobs)
        skip = max(0, done - start)
        state.prompt_logprobs += entries[skip:]

    def _finish_seq(self, seq: Sequence, *, cache: bool = True) -> None:
        """Free a sequence's blocks and family state as soon as its output is final."""
        if seq.token_ids[-1] < 0:  # a placeholder (aborted while its token was in flight)
            seq.token_ids.pop()
        states = self.states
        if (states is not None and cache and seq.state_slot is not None
                and self.scheduler.checkpoint_due(seq) is not None):
            states.checkpoint(seq, "pending")  # the last boundary it reached: cached below
        self.scheduler.finish(seq, cache=cache)
        if states is not None:
            states.release(seq, commit=cache)
        if self.pooler is not None:
            self.pooler.forget(seq.seq_id)
        self._free_family_state(seq)

    def _retire(self, state: RequestState, *, cache: bool = True) -> None:
        for seq in state.seqs:
            self._finish_seq(seq, cache=cache)
            self._by_seq.pop(seq.seq_id, None)
            self._outputs.pop(seq.seq_id, None)
        self._requests.pop(state.request_id, None)

    def _free_family_state(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.free_sequence(seq)
        if seq.family_state is not None:
            self.runner.free_sequence(seq)
            seq.family_state = None

    # -- offline use ---------------------------------------------------------------------

    def embed(self, prompts: list[str] | list[list[int]],
              token_type_ids: list[list[int] | None] | None = None,
              dimensions: int | None = None) -> list[torch.Tensor]:
        """An embedding model's vectors of ``prompts`` (float32, on the CPU), in order; a
        classifier's label probabilities. ``token_type_ids``: each prompt's token types
        (None: all 0), for a model that reads them (a cross-encoder's pairs:
        `Tokenizer.encode_pair`). ``dimensions``: shorten the vectors to their first values
        (`Pooling.shorten`), for a model that allows it (ValueError otherwise)."""
        if self.pooler is None:
            raise ValueError(f"model {self.runner.info.name!r} generates text; it does not "
                             "embed (model.task)")
        if token_type_ids is not None and len(token_type_ids) != len(prompts):
            raise ValueError(f"{len(token_type_ids)} token type lists for {len(prompts)} "
                             "prompts")
        pooling = self.pooler.pooling
        if dimensions is not None:
            pooling.check_dimensions(dimensions, self.runner.info.hidden_size)
        outputs = self._run_all(prompts, [None] * len(prompts),
                                token_type_ids or [None] * len(prompts))
        failed = next((o.outputs[0] for o in outputs if o.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"embedding failed: {failed.error or failed.finish_reason}")
        return [pooling.shorten(o.embedding, dimensions) for o in outputs]

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; results in prompt order. A prompt refused (a
        ValueError) runs none of them."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        return self._run_all(prompts, params_list, [None] * len(prompts))

    def _run_all(self, prompts: list[str] | list[list[int]],
                 params: list[SamplingParams | None],
                 token_types: list[list[int] | None]) -> list[RequestOutput]:
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        for i, (rid, prompt, p, types) in enumerate(zip(ids, prompts, params, token_types)):
            try:
                self.add_request(rid, prompt, p, token_type_ids=types)
            except ValueError:
                for added in ids[:i]:
                    self.abort(added)
                raise
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
            if not self.has_unfinished() and len(results) < len(ids):
                raise RuntimeError("engine idle with unfinished requests")
        return [results[rid] for rid in ids]

