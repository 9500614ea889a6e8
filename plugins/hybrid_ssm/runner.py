"""The hybrid_ssm family's `ModelRunner`: declares paged KV for the attention layers and
two per-sequence states (conv window, SSM state) for the Mamba layers."""

from __future__ import annotations

import torch

from heron.core.batch import Batch
from heron.core.cache_spec import CacheSpec, CacheTensors, KVCacheSpec, StateSpec
from heron.core.family import ModelInfo, ModelRunner
from heron.plugins.hybrid_ssm.mixer import has_prompt_rows
from heron.plugins.hybrid_ssm.model import CONV_STATE, SSM_STATE, HybridModel


class HybridRunner(ModelRunner):
    supports_hidden_states = True

    def __init__(self, model: HybridModel, info: ModelInfo) -> None:
        self.model = model
        self.info = info
        self.cache: CacheTensors | None = None
        # MoE routing lists the experts a step hit on the host: not capturable
        moe = model.cfg.moe
        self.supports_cuda_graphs = not (moe is not None and moe.num_experts
                                         and "moe" in model.cfg.ffns)
        # NemotronH floors dt for prompt tokens only (as transformers does): a generated
        # token's state (and the KV after it) then differs from the same token's as a prompt
        self.generated_matches_prompt = not model.cfg.mamba.clamps_dt

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        a, m = cfg.attention, cfg.mamba
        num_attn, num_mamba = len(cfg.attention_layers), len(cfg.mamba_layers)
        # NOTE: a model without attention layers still declares (zero-byte) KV blocks: the
        # engine keeps its token bookkeeping in them
        kv = (KVCacheSpec(num_attn, a.num_kv_heads, a.head_dim) if num_attn
              else KVCacheSpec(0, 1, 1))
        return CacheSpec(kv=kv, states=(
            StateSpec(CONV_STATE, (num_mamba, m.conv_dim, m.conv_kernel - 1)),
            StateSpec(SSM_STATE, (num_mamba, m.num_heads, m.head_dim, m.state_size),
                      dtype=torch.float32),
        ))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache

    def can_replay(self, batch: Batch) -> bool:
        # a prompt row's dt is clamped, which a captured graph does not do
        return not (self.model.cfg.mamba.clamps_dt and has_prompt_rows(batch))

    def prefix_flops(self, num_tokens: int) -> float | None:
        """Matmul flops of a prefill: 2 per weight per token, plus causal attention scores."""
        cfg = self.model.cfg
        hidden, m = cfg.hidden_size, cfg.mamba
        mamba = hidden * (2 * m.d_inner + 2 * m.num_groups * m.state_size + m.num_heads) \
            + m.d_inner * hidden
        per_token = len(cfg.mamba_layers) * mamba
        if cfg.attention is not None and cfg.attention_layers:
            a = cfg.attention
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            per_token += len(cfg.attention_layers) * (hidden * (2 * q + 2 * kv)
                                                      + 2 * q * num_tokens / 2)
        for ffn in cfg.ffns:
            if ffn == "mlp":
                per_token += (3 if cfg.mlp_gated else 2) * hidden * cfg.intermediate_size
            elif ffn == "moe":  # router, top-k experts, shared expert
                e, mats = cfg.moe, (3 if cfg.moe.router == "softmax" else 2)
                per_token += hidden * (e.num_experts + mats * e.top_k * e.intermediate_size
                                       + mats * e.shared_intermediate_size)
        return 2.0 * per_token * num_tokens

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        if self.model.state_index and batch.state_slots is None:
            raise RuntimeError("the hybrid_ssm family needs the engine's state slots "
                               "(batch.state_slots) for its Mamba layers")
        return self.keeping_hidden_states(
            lambda hidden: self.model.forward(batch, self.cache, hidden,
                                              self.hidden_states_layers))
