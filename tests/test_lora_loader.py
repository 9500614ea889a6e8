"""The PEFT adapter loader (plugins/lora) against PEFT's own modules; every bad adapter is
refused with an `AdapterError` naming it and the problem."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from heron.core.lora import AdapterError, LoraTarget
from heron.core.plugins import PluginManager
from tests.lora_models import (ALL_LINEAR, ATTENTION, STANDARD, build_adapter, llama_targets)
from tests.tiny_models import build_tiny

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = build_tiny("llama", tmp_path_factory.mktemp("base"))
    return model, llama_targets(model.config)


@pytest.fixture(scope="module")
def standard(base, tmp_path_factory):
    """name -> (adapter dir, its PeftModel)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, build_adapter(base[0], root / name, seed=i, **kw))
            for i, (name, kw) in enumerate(STANDARD.items())}


@pytest.fixture(scope="module")
def load():
    return PluginManager(load_entry_points=False).adapter_loaders["peft"]


def lora_modules(peft_model):
    """``(target, layer, module)`` for every PEFT LoRA layer."""
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            yield name.rsplit(".", 1)[-1], layer, module


@pytest.mark.parametrize("name", sorted(STANDARD))
def test_weights_and_scaling_match_peft(base, standard, load, name):
    path, peft_model = standard[name]
    kw = STANDARD[name]
    weights = load(name, str(path), base[1], 16)
    assert (weights.name, weights.path, weights.rank) == (name, str(path), kw["r"])
    assert sorted(weights.layers) == sorted(kw["targets"])
    seen = 0
    for target, layer, module in lora_modules(peft_model):
        a, b = weights.layers[target][layer]
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous()
        assert torch.equal(a, module.lora_A["default"].weight)
        assert torch.equal(b, module.lora_B["default"].weight)
        assert weights.scaling == pytest.approx(module.scaling["default"], rel=1e-12)
        seen += 1
    assert seen == 2 * len(kw["targets"])


def test_rank_and_alpha_patterns_pad_and_fold_scaling(base, load, tmp_path):
    peft_model = build_adapter(base[0], tmp_path, r=4, alpha=8, targets=ALL_LINEAR,
                               rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.up_proj": 2},
                               alpha_pattern={"down_proj": 3})
    weights = load("patterned", str(tmp_path), base[1], 8)
    assert weights.rank == 8 and weights.scaling == 1.0
    for target, layer, module in lora_modules(peft_model):
        a, b = weights.layers[target][layer]
        assert a.shape[0] == b.shape[1] == 8
        delta = weights.scaling * b @ a
        torch.testing.assert_close(delta, module.get_delta_weight("default"), rtol=1e-6, atol=1e-7)
    with pytest.raises(AdapterError, match=r"'patterned'.*rank 8 of .*q_proj exceeds .*max_rank 4"):
        load("patterned", str(tmp_path), base[1], 4)


def test_layers_left_alone_are_none(base, load, tmp_path):
    build_adapter(base[0], tmp_path, r=2, alpha=2, targets=("v_proj",), layers_to_transform=[1])
    weights = load("late", str(tmp_path), base[1], 16)
    assert list(weights.layers) == ["v_proj"]
    assert weights.layers["v_proj"][0] is None and weights.layers["v_proj"][1] is not None


def test_regex_target_modules(base, load, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base[0]), LoraConfig(
        r=2, lora_alpha=4, target_modules=r".*\.layers\.0\.self_attn\.(q|v)_proj"))
    model.save_pretrained(tmp_path)
    weights = load("regex", str(tmp_path), base[1], 16)
    assert sorted(weights.layers) == ["q_proj", "v_proj"]
    assert weights.layers["q_proj"][1] is None and weights.layers["q_proj"][0] is not None


def test_half_precision_adapters_load_as_float32(base, standard, load, tmp_path):
    path = tmp_path / "half"
    shutil.copytree(standard["attn-r4"][0], path)
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              path / "adapter_model.safetensors")
    a, b = load("half", str(path), base[1], 16).layers["q_proj"][0]
    assert a.dtype == b.dtype == torch.float32


# -- bad adapters -------------------------------------------------------------------------

def edit_config(path, **changes):
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors = load_file(path / "adapter_model.safetensors")
    save_file(edit(tensors), path / "adapter_model.safetensors")


def rename(old, new):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def shrink_targets(targets, **changes):
    return tuple(LoraTarget(**{**vars(t), **changes}) for t in targets)


# case -> (how to break a copy of the rank-4 attention adapter, targets edit, error pattern)
BAD = {
    "no-directory": (lambda p: shutil.rmtree(p), None, r"is not a directory"),
    "no-config": (lambda p: (p / "adapter_config.json").unlink(), None,
                  r"adapter_config.json does not exist"),
    "no-weights": (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
                   None, r"adapter_model.safetensors does not exist \(adapter_model.bin is not"),
    "bad-json": (lambda p: (p / "adapter_config.json").write_text("{not json"), None,
                 r"cannot read .*adapter_config.json"),
    "json-list": (lambda p: (p / "adapter_config.json").write_text("[1]"), None,
                  r"is not a JSON object"),
    "bad-weights-file": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"junk" * 4),
                         None, r"cannot read .*adapter_model.safetensors"),
    "no-rank": (lambda p: edit_config(p, r=None), None, r"r must be a positive integer"),
    "rank-above-max": (lambda p: edit_config(p, r=32, lora_alpha=64), None,
                       r"rank 32 of .* exceeds lora.max_rank 16"),
    "rank-mismatch": (lambda p: edit_config(p, r=5), None,
                      r"lora_A.weight has shape \[4, 64\], expected \[5, 64\]"),
    "unknown-module-in-config": (lambda p: edit_config(p, target_modules=["q_proj", "c_attn"]),
                                 None, r"targets module 'c_attn', which the base model does "
                                       r"not offer \(it offers down_proj, gate_proj"),
    "unknown-module-in-weights": (lambda p: edit_tensors(p, rename(".k_proj.", ".qkv_proj.")),
                                  None, r"targets module 'qkv_proj', which the base"),
    "target-not-offered-by-base": (None, lambda ts: tuple(t for t in ts if t.name != "v_proj"),
                                   r"targets module 'v_proj', which the base model does not"),
    "in-features-mismatch": (None, lambda ts: shrink_targets(ts, in_features=48),
                             r"has shape \[4, 64\], expected \[4, 48\]"),
    "out-features-mismatch": (None, lambda ts: shrink_targets(ts, out_features=48),
                              r"lora_B.weight has shape \[\d+, 4\], expected \[48, 4\]"),
    "layer-out-of-range": (None, lambda ts: shrink_targets(ts, num_layers=1),
                           r"is for layer 1, but the base model has 1 layers"),
    "missing-lora-b": (lambda p: edit_tensors(p, lambda t: {k: v for k, v in t.items()
                                                             if "0.self_attn.o_proj.lora_B" not in k}),
                       None, r"o_proj of layer 0 has no lora_B weight"),
    "no-tensors": (lambda p: edit_tensors(p, lambda t: {"other": torch.zeros(1)}), None,
                   r"unexpected tensor other"),
    "empty-weights": (lambda p: edit_tensors(p, lambda t: {}), None, r"holds no LoRA weights"),
    "not-in-a-layer": (lambda p: edit_tensors(p, rename("model.layers.0.self_attn.q_proj",
                                                        "model.q_proj")), None,
                       r"tensor base_model.model.model.q_proj.lora_A.weight is not in a numbered"),
    "bad-rank-pattern": (lambda p: edit_config(p, rank_pattern={"q_proj": "eight"}), None,
                         r"rank_pattern\['q_proj'\] must be a positive integer, not 'eight'"),
    "bad-pattern-regex": (lambda p: edit_config(p, alpha_pattern={"q_proj(": 2}), None,
                          r"alpha_pattern key 'q_proj\(' is not a regular expression"),
    "dora": (lambda p: edit_config(p, use_dora=True), None, r"DoRA \(use_dora\) is not supported"),
    "dora-tensor": (lambda p: edit_tensors(p, lambda t: {**t, "base_model.model.model.layers.0."
                                                         "self_attn.q_proj.lora_magnitude_vector":
                                                         torch.ones(64)}), None,
                    r"DoRA magnitude; DoRA is not supported"),
    "bias": (lambda p: edit_config(p, bias="lora_only"), None,
             r"bias='lora_only' is not supported"),
    "lora-bias": (lambda p: edit_config(p, lora_bias=True), None, r"LoRA biases"),
    "modules-to-save": (lambda p: edit_config(p, modules_to_save=["lm_head"]), None,
                        r"modules_to_save .* is not supported"),
    "lm-head-target": (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]), None,
                       r"targets 'lm_head': embedding and lm_head adapters are not supported"),
    "embedding-tensor": (lambda p: edit_tensors(p, lambda t: {**t, "base_model.model.model."
                                                              "embed_tokens.lora_embedding_A":
                                                              torch.ones(4, 320)}), None,
                         r"adapts an embedding; embedding adapters are not supported"),
    "not-lora": (lambda p: edit_config(p, peft_type="IA3"), None,
                 r"peft_type 'IA3' is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_with_its_name_and_problem(base, standard, load, tmp_path, case):
    breaks, edit_targets, pattern = BAD[case]
    path = tmp_path / "adapter"
    shutil.copytree(standard["attn-r4"][0], path)
    if breaks is not None:
        breaks(path)
    targets = edit_targets(base[1]) if edit_targets else base[1]
    with pytest.raises(AdapterError, match=rf"^adapter 'broken-{case}': .*{pattern}"):
        load(f"broken-{case}", str(path), targets, 16)


def test_real_peft_embedding_and_dora_adapters_are_refused(base, load, tmp_path):
    build_adapter(base[0], tmp_path / "emb", r=4, alpha=4, targets=("embed_tokens", "q_proj"))
    with pytest.raises(AdapterError, match="'emb': targets 'embed_tokens': embedding"):
        load("emb", str(tmp_path / "emb"), base[1], 16)
    build_adapter(base[0], tmp_path / "dora", r=4, alpha=4, targets=ATTENTION, use_dora=True)
    with pytest.raises(AdapterError, match="'dora': DoRA"):
        load("dora", str(tmp_path / "dora"), base[1], 16)
