"""heron's transformer family vs transformers on tiny random models: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import LogitsRecorder, assert_greedy_logits_match, make_engine
from tests.tiny_models import FAMILIES, build_tiny

PROMPT_LENS = (5, 37, 64, 100)  # 37 and 100 do not divide the block size
NUM_NEW = 32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_tiny(request.param, path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        ref_tokens = [greedy(model, p) for p in prompts]
        # every row heron computes logits for: the prompt's, then each decode step's
        ref_logits = [model(torch.tensor([p + t[:-1]])).logits[0]
                      for p, t in zip(prompts, ref_tokens)]
    return path, prompts, ref_logits, ref_tokens


def greedy(model, prompt: list[int]) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, never stopping."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(NUM_NEW):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


def run(path, prompts, **engine_overrides):
    engine = make_engine(path, **engine_overrides)
    recorder = LogitsRecorder(engine)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    assert engine.num_blocks_in_use == 0
    return engine, recorder, outs


SCENARIOS = {
    # chunked prefill smaller than the prompts, mixed lengths in one batch
    "chunked": {"engine.block_size": 16, "engine.max_num_batched_tokens": 32},
    "whole-prompt": {"engine.block_size": 8, "engine.max_num_batched_tokens": 512,
                     "engine.chunked_prefill": False},
    # too few blocks for all four sequences: preemption by recompute mid-generation
    "preempt": {"engine.block_size": 16, "engine.max_num_batched_tokens": 64,
                "engine.num_kv_blocks": 14},
    # decode attention by the torch ops rather than the compiled CPU kernel
    "torch-decode": {"engine.block_size": 16, "engine.max_num_batched_tokens": 32,
                     "engine.cpu_kernels": False},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_logits_and_greedy_match_transformers(tiny, scenario):
    path, prompts, ref_logits, ref_tokens = tiny
    engine, recorder, outs = run(path, prompts, **SCENARIOS[scenario])
    if scenario == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert engine.cpu_kernels == (scenario != "torch-decode")
    worst = 0.0
    for out, ref in zip(outs, ref_logits):
        mine = torch.stack([recorder.rows[(out.request_id, pos)] for pos in range(len(ref))])
        worst = max(worst, (mine - ref).abs().max().item())
    assert worst <= 1e-4, f"max abs logit error {worst:.2e}"
    assert max(r.abs().max().item() for r in ref_logits) > 1.0  # logits are not flat
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kind,window", [
    ("mistral", {"sliding_window": 48}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1})])
def test_a_sliding_window_caps_the_context_where_attention_agrees(tmp_path, kind, window):
    """heron attends to the whole context, so a model whose layers attend through a window
    (Mistral v0.1's 4096 tokens) serves contexts up to the window, where the two agree:
    logits match transformers' (its model, window and all) to the window's last position,
    and a longer context is refused rather than served with other attention."""
    model = build_tiny(kind, tmp_path, **window)
    engine = make_engine(tmp_path, **{"model.max_model_len": 256})
    assert engine.max_model_len == 48
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_greedy_logits_match(engine, model, prompt, max_tokens=8)
    with pytest.raises(ValueError, match="context of 48 tokens"):
        engine.generate([prompt], SamplingParams(max_tokens=9))


def test_a_yarn_context_is_its_original_context_times_its_factor(tmp_path):
    """YaRN stretches the original context by its factor, as vLLM reads it: Qwen's
    long-context recipe adds the scaling and leaves ``max_position_embeddings`` short."""
    build_tiny("qwen3", tmp_path, head_dim=32, max_position_embeddings=160, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 128})
    assert make_engine(tmp_path, **{"engine.num_kv_blocks": 128}).max_model_len == 1024
