"""PEFT LoRA adapters with random weights for tests (and the LoRA benchmark).

`build_adapter` never changes the base model it is given: PEFT wraps a deep copy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from heron.core.lora import LoraTarget

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP

# name -> build_adapter keywords: three ranks, three target sets, one rsLoRA
STANDARD = {
    "attn-r4": dict(r=4, alpha=8, targets=ATTENTION),
    "mlp-r8": dict(r=8, alpha=16, targets=MLP),
    "all-r16-rslora": dict(r=16, alpha=16, targets=ALL_LINEAR, rslora=True),
}


def build_adapter(base_model, directory: Path, r: int, alpha: float, targets, *,
                  rslora: bool = False, seed: int = 0, std: float = 0.1, **lora_config):
    """Save a PEFT LoRA adapter for ``base_model`` with random ``lora_A`` and ``lora_B``
    (PEFT starts B at zero, which would make the adapter a no-op) to ``directory``, and
    return the `PeftModel` (on a copy of the base). ``lora_config`` adds `LoraConfig`
    keywords (``rank_pattern``, ``use_dora``...)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=rslora, **lora_config)
    model = get_peft_model(copy.deepcopy(base_model), config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(directory)
    return model


def build_standard_adapters(base_model, directory: Path) -> dict[str, Path]:
    """The `STANDARD` adapters, each in ``directory / name``."""
    paths = {}
    for seed, (name, kw) in enumerate(STANDARD.items()):
        paths[name] = directory / name
        build_adapter(base_model, paths[name], seed=seed, **kw)
    return paths


def peft_oracle(base_model, adapter_dir: Path):
    """`PeftModel` for one saved adapter, on a copy of ``base_model``."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir).eval()


def llama_targets(config) -> tuple[LoraTarget, ...]:
    """The seven projections of a Llama-style transformers config, as LoRA targets."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    return tuple(LoraTarget(name, layers, i, o) for name, (i, o) in shapes.items())


def greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """A transformers (or PEFT) model's greedy tokens with its KV cache, never stopping."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(num_new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]),
                        past_key_values=out.past_key_values, use_cache=True)
    return tokens
