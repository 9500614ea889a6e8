"""The model-family contract: what a plugin's loaded model must provide the engine.

A family plugin registers a `FamilySpec` (see `hookspecs.heron_register_families`); the
engine calls its loader once, then talks to the returned `ModelRunner` with plain method
calls every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from heron.core.batch import Batch, EncoderChunk
from heron.core.cache_spec import CacheSpec, CacheTensors
from heron.core.lora import LoraTarget
from heron.core.pooling import Pooling, ScoreHead
from heron.core.sequence import Sequence


@dataclass(frozen=True)
class FamilySpec:
    """A model family as registered by a plugin.

    ``loader`` is a ``"module:callable"`` string, imported only when a model of this family
    is loaded (so registering never imports torch-heavy code or touches CUDA). The callable
    takes ``(path: str, model_config: ModelConfig, device: torch.device, dtype: torch.dtype)``
    and returns a `LoadedModel`.
    ``architectures`` are HF ``config.json`` architecture names, ``gguf_architectures`` the
    ``general.architecture`` values of GGUF files this family serves.
    """

    name: str
    loader: str
    architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()


@dataclass
class ModelInfo:
    """Facts about a loaded model the engine and server need."""

    name: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    extra: dict[str, Any] = field(default_factory=dict)
    hidden_size: int = 0  # width of the final hidden states (what an embedding has)

    @classmethod
    def of_checkpoint(cls, name: str, vocab_size: int, max_context_len: int,
                      config_eos: tuple[int, ...], tokenizer, dtype: torch.dtype,
                      device: torch.device) -> ModelInfo:
        """Stop tokens: the tokenizer's end-of-sequence ids first, then the config's."""
        eos = tokenizer.eos_token_ids if tokenizer is not None and tokenizer.eos_token_ids else ()
        return cls(name=name, vocab_size=vocab_size, max_context_len=max_context_len,
                   eos_token_ids=tuple(dict.fromkeys((*eos, *config_eos))), dtype=dtype,
                   device=device)


class ModelRunner(ABC):
    """A loaded model of one family, driven by the engine.

    Lifecycle: `cache_spec` → the engine allocates → `bind_cache` → then per step
    `alloc_sequence` (first time a sequence is scheduled), `forward`, and `free_sequence`
    (when a sequence finishes, aborts or is preempted).

    The KV of a sequence may come from elsewhere: a prefix-cache hit, a sibling it forked
    from (``n > 1``), or host memory after a swap. A family that declares per-sequence
    states (``CacheSpec.states``) gets none of these, since the engine cannot rebuild a
    state from KV blocks: its sequences always compute from their first token.
    """

    info: ModelInfo
    #: True when `forward` is graph-safe for decode batches (see `heron.core.cuda_graphs`);
    #: the engine then replays captured CUDA graphs for decode steps.
    supports_cuda_graphs: bool = False
    #: True when `forward` is also safe to record and replay on the CPU (see
    #: `heron.core.cpu_graphs`): graph-safe, no host reads of tensor values, and kernel
    #: pointers only to tensors made in the step or that outlive it.
    supports_cpu_graphs: bool = False
    #: False when a generated token's KV or state is computed differently from the same
    #: token's in a prompt (so what decode wrote differs from a recompute of that text): the
    #: prefix cache then keeps only the prompt tokens of each sequence.
    generated_matches_prompt: bool = True
    #: True for an encoder-decoder: every request then carries an encoder prompt
    #: (``Sequence.encoder_token_ids``, at most `max_encoder_len` tokens) and ``token_ids``
    #: are the decoder's; the prefix cache is off (it does not key KV by the source).
    is_encoder_decoder: bool = False
    max_encoder_len: int = 0
    #: An encoder-decoder's encoder runs as this many stages (its layers, say), each over a
    #: whole source; the scheduler charges a stage ``len(source) / encoder_stages`` tokens
    #: of a step's budget, so a long source's encoder spreads over several steps.
    encoder_stages: int = 1
    #: True when no step writes a sequence's states once it decodes (an encoder-decoder's
    #: cross-attention K/V): beams forked from it then read its slot, shared, instead of a
    #: copy made by `fork_state`, and several rows of a batch may name one slot.
    forks_share_states: bool = False
    #: Set by the engine when its speculative proposer drafts from hidden states; a family
    #: that supports this then leaves, after each `forward`, the hidden states of every row
    #: of the batch in `hidden_states`: those of `hidden_states_layers` (the proposer's
    #: `heron.core.speculative.Proposer.hidden_layers`; None: the final ones, after the last
    #: norm, what the LM head reads), side by side.
    keep_hidden_states: bool = False
    #: True for a family whose `forward` honours `keep_hidden_states` (the engine refuses
    #: to serve embeddings, or drafts from hidden states, with any other).
    supports_hidden_states: bool = False
    hidden_states_layers: tuple[int | None, ...] = (None,)
    hidden_states: torch.Tensor | None = None
    #: A sequence-classification model's score head: the pooled final hidden state in, the
    #: labels' logits out (`heron.core.pooling`).
    classifier: ScoreHead | None = None
    #: The token an embedding or a classification pools (`heron.core.pooling.Pooling`)
    #: unless ``[model] pooling`` or a sentence-transformers module names one: a decoder's
    #: last token, which has read them all; an encoder's first (BERT's ``[CLS]``).
    default_pooling: str = "last"
    #: True for an encoder whose every token attends to every other of its input (BERT):
    #: each input then computes whole in one step, never in chunks (nothing before its last
    #: token is final until then), and the prefix cache is off.
    attends_whole_prompt: bool = False
    #: How many token types the model reads (BERT's segment embeddings: 2, the second text
    #: of a cross-encoder's pair being type 1); 0: none. Requests may then carry each prompt
    #: token's type (``Sequence.token_type_ids``, all 0 when they do not).
    num_token_types: int = 0

    def keeping_hidden_states(self, forward) -> torch.Tensor:
        """``forward(hidden_out)`` of a model that appends to the list ``hidden_out`` (None:
        not needed) the hidden states of `hidden_states_layers`, in order; with
        `keep_hidden_states` they are kept in `hidden_states`. For families that support
        drafting from hidden states."""
        if not self.keep_hidden_states:
            return forward(None)
        hidden: list[torch.Tensor] = []
        logits = forward(hidden)
        self.hidden_states = hidden[0] if len(hidden) == 1 else torch.cat(hidden, -1)
        return logits

    @abstractmethod
    def cache_spec(self) -> CacheSpec:
        """Declare the cache memory this model needs; called once, before `bind_cache`."""

    @abstractmethod
    def bind_cache(self, cache: CacheTensors) -> None:
        """Receive the engine-allocated cache tensors. Called once before the first step."""

    def alloc_sequence(self, seq: Sequence) -> Any:
        """Return this family's per-sequence state (stored in ``seq.family_state``), or None.

        Called when a sequence is scheduled without one: on admission (which may start after
        a prefix-cache hit, with ``num_computed_tokens > 0``), after a preemption, after a
        fork.
        """
        return None

    def free_sequence(self, seq: Sequence) -> None:
        """Release what `alloc_sequence` set up. Must not raise.

        Called once for every `alloc_sequence` that returned something other than None.
        """

    def fork_state(self, cache: CacheTensors, parent_slot: int, child_slot: int) -> None:
        """Make ``child_slot`` hold ``parent_slot``'s state (a beam forked from a sequence
        that has computed its tokens; not called when `forks_share_states`). The default
        copies every state tensor's slot; a family that knows how much of a slot is in use
        may copy less."""
        for t in cache.states.values():
            t[child_slot].copy_(t[parent_slot])

    def can_replay(self, batch: Batch) -> bool:
        """Whether decode-only ``batch`` may run through a captured graph (a family with
        `supports_cuda_graphs`): False for a batch whose forward takes a path the graph's
        does not."""
        return True

    def lora_targets(self) -> tuple[LoraTarget, ...]:
        """The projections LoRA adapters may change; () when the family takes no adapters.
        A family that lists targets applies ``CacheTensors.lora`` to ``batch.lora_groups``
        (see `heron.core.ops.lora`)."""
        return ()

    def prefix_flops(self, num_tokens: int) -> float | None:
        """Approximate compute of a prefill of ``num_tokens`` tokens (``flop_aware``
        eviction of state snapshots weighs it); None when the family does not say."""
        return None

    def encode(self, chunks: list[EncoderChunk]) -> None:
        """Run encoder stages (encoder-decoders only), before the step's `forward`. A chunk
        ending at `encoder_stages` must leave in its slot whatever the decoder reads of the
        source; one ending earlier keeps its progress in its slot for the next step's. A
        sequence's decoder rows are never scheduled before its last stage has run."""
        raise NotImplementedError(f"{type(self).__name__} has no encoder")

    @abstractmethod
    def forward(self, batch: Batch) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(batch.logits_indices), vocab_size]``.

        Must write the KV of every token in the batch at ``batch.attn.slot_mapping``.
        Must not mutate sequences; the engine advances them after sampling. Token ids come
        from ``batch.input_ids``: with async scheduling a sequence's last token may still be
        a placeholder on the host (`heron.core.inflight`).
        """


@dataclass
class LoadedModel:
    runner: ModelRunner
    tokenizer: Any  # heron.core.tokenizer.Tokenizer, or None for a model without one
    # how an embedding model pools (set by `heron.core.model_loader`); None: it generates
    pooling: Pooling | None = None
