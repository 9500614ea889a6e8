"""Tiny random-weight Mamba2 / hybrid models built from transformers configs (no downloads),
and transformers' own greedy loop over its hybrid cache as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.tiny_models import randomise_weights, save_tokenizer

COMMON = dict(vocab_size=320, hidden_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
IBM_MAMBA = dict(mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

# chunk size 8 everywhere: prompts and prefill chunks do not align with it
HYBRIDS = {
    "mamba2": (transformers.Mamba2ForCausalLM, transformers.Mamba2Config, dict(
        num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2,
        chunk_size=8)),
    "bamba": (transformers.BambaForCausalLM, transformers.BambaConfig, dict(
        **ATTENTION, **IBM_MAMBA, num_hidden_layers=3, intermediate_size=128,
        attn_layer_indices=[1])),
    "granitemoehybrid": (transformers.GraniteMoeHybridForCausalLM,
                         transformers.GraniteMoeHybridConfig, dict(
        **ATTENTION, **IBM_MAMBA, num_hidden_layers=3, intermediate_size=64,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=96,
        position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.7,
        attention_multiplier=0.2, logits_scaling=1.5)),
    "nemotron_h": (transformers.NemotronHForCausalLM, transformers.NemotronHConfig, dict(
        **ATTENTION, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        head_dim=16, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
        topk_group=1, routed_scaling_factor=1.5)),
    "falcon_h1": (transformers.FalconH1ForCausalLM, transformers.FalconH1Config, dict(
        **ATTENTION, **IBM_MAMBA, num_hidden_layers=2, intermediate_size=128, mamba_d_ssm=128,
        mamba_rms_norm=True, embedding_multiplier=1.5, lm_head_multiplier=0.8,
        key_multiplier=0.6, attention_in_multiplier=0.9, attention_out_multiplier=1.1,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], mlp_multipliers=[0.9, 1.1])),
}
# Granite-4.0-H "micro": no routed experts (the shared MLP alone) and no rope
HYBRIDS["granitemoehybrid-dense-nope"] = (*HYBRIDS["granitemoehybrid"][:2], {
    **HYBRIDS["granitemoehybrid"][2], "num_local_experts": 0, "position_embedding_type": None})
# NemotronH floors dt at time_step_min (1e-3) in transformers' prefill scan but not in its
# decode step: push half the heads' dt below the floor so both behaviours show in the logits;
# and its experts in a latent space
HYBRIDS["nemotron_h-latent-dt-floor"] = (*HYBRIDS["nemotron_h"][:2], {
    **HYBRIDS["nemotron_h"][2], "moe_latent_size": 32})

# Nemotron-H 8B's layout: no experts (its CUDA graphs capture), the dt floor shown as above
HYBRIDS["nemotron_h-dense-dt-floor"] = (*HYBRIDS["nemotron_h"][:2], {
    **HYBRIDS["nemotron_h"][2],
    "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]})


def _floor_dt(name: str, p: torch.Tensor) -> None:
    if name.endswith("dt_bias"):
        p[::2] = -9.0  # softplus(-9 + dt) ~ 1e-4 < the 1e-3 floor


# applied after the random init
TWEAKS = {"nemotron_h-latent-dt-floor": _floor_dt, "nemotron_h-dense-dt-floor": _floor_dt}


def build_hybrid(kind: str, directory: Path, seed: int = 0, std: float = 0.15, **overrides):
    """Save a tiny ``kind`` model whose weights are scaled so logits are O(1–10); return it.
    ``overrides`` replace entries of its transformers config.

    At std 0.3 transformers' own float32 logits are 1e-4 off a float64 run of the same
    weights (the scan amplifies rounding); at 0.15 they are within 1.5e-5, so a 1e-4 bound
    between two float32 implementations discriminates."""
    torch.manual_seed(seed)
    model_cls, config_cls, config = HYBRIDS[kind]
    model = model_cls(config_cls(**{**COMMON, **config, **overrides})).eval()
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # the plain per-expert loop
    randomise_weights(model, std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if kind in TWEAKS:
                TWEAKS[kind](name, p)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # NemotronH router bias
                b.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' forward with its hybrid cache, argmax each step, never stopping.

    Returns the tokens and the logits each was picked from (``[num_new, vocab]``: row ``k``
    is the logits at position ``len(prompt) - 1 + k``). The cache goes in as ``cache=`` and
    positions are explicit (Bamba needs them)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_new):
        logits.append(out.logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
        pos = len(prompt) + len(tokens) - 1
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True,
                    position_ids=torch.tensor([[pos]]))
    return tokens, torch.stack(logits)
