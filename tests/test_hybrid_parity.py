"""heron's hybrid_ssm family vs transformers' pure-torch path on tiny random models: logits
at every prompt and generated position and greedy tokens, under chunked prefill, whole
prompts and preemption."""

from __future__ import annotations

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import LogitsRecorder, make_engine
from tests.hybrid_models import HYBRIDS, build_hybrid, hf_greedy

PROMPT_LENS = (5, 37, 64, 100)  # none a multiple of the SSD chunk size (8) but 64
NUM_NEW = 32

SCENARIOS = {
    # 13-token steps: chunks cut the prompts off the SSD chunk grid, and prefill chunks share
    # steps with other sequences' decode tokens
    "chunked": {"engine.block_size": 16, "engine.max_num_batched_tokens": 13},
    "whole-prompt": {"engine.block_size": 8, "engine.max_num_batched_tokens": 512,
                     "engine.chunked_prefill": False},
    # too few blocks for all four sequences: preemption by recompute mid-generation
    "preempt": {"engine.block_size": 16, "engine.max_num_batched_tokens": 64,
                "engine.num_kv_blocks": 14},
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_hybrid(request.param, path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        ref_logits = [model(torch.tensor([p])).logits[0] for p in prompts]
    greedy = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    # rows for positions 0 .. len(prompt) + NUM_NEW - 2: the prompt, then each decode step
    ref_logits = [torch.cat([full[:-1], steps]) for full, (_, steps) in zip(ref_logits, greedy)]
    return request.param, path, prompts, ref_logits, [tokens for tokens, _ in greedy]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_logits_and_greedy_match_transformers(tiny, scenario):
    kind, path, prompts, ref_logits, ref_tokens = tiny
    engine = make_engine(path, **SCENARIOS[scenario])
    assert engine.runner.model.cfg.architecture == HYBRIDS[kind][0].__name__
    recorder = LogitsRecorder(engine)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    assert engine.num_blocks_in_use == 0 and engine.states.slots.num_used == 0
    if scenario == "preempt":
        assert engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    worst = 0.0
    for out, ref in zip(outs, ref_logits):
        mine = torch.stack([recorder.rows[(out.request_id, pos)] for pos in range(len(ref))])
        worst = max(worst, (mine - ref).abs().max().item())
    assert worst <= 1e-4, f"{kind}: max abs logit error {worst:.2e}"
    assert max(r.abs().max().item() for r in ref_logits) > 1.0  # logits are not flat
