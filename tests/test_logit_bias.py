"""OpenAI's ``logit_bias``: transformers' ``SequenceBiasLogitsProcessor`` (one-token
sequences) is the oracle, in the sampler and in greedy generation with a repetition penalty
(transformers applies the bias first, as vLLM does)."""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from heron.core.sampler import Sampler
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence
from tests.engine_utils import assert_no_leaks, make_engine
from tests.tiny_models import build_tiny

HAS_CUDA = torch.cuda.is_available()
EOS = (2,)
NUM_NEW = 16


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def device(request) -> str:
    return request.param


def oracle(bias: dict[int, float]) -> SequenceBiasLogitsProcessor:
    return SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})


def test_sampler_adds_the_bias_and_reports_raw_logprobs(device):
    torch.manual_seed(3)
    raw = torch.randn(4, 50) * 2
    top = raw.topk(2).indices.tolist()
    lift = [(raw[i].max() - raw[i, t] + 0.5).item() for i, t in ((0, top[0][1]), (3, 13))]
    biases = [{top[0][1]: lift[0], 11: -3.5}, {}, {top[2][0]: -100.0, 0: 0.25},
              {EOS[0]: 100.0, 13: lift[1]}]
    # the last row's EOS is banned by min_tokens: a bias cannot lift a ban
    params = [SamplingParams(temperature=0.0, logit_bias=b, logprobs=1, min_tokens=2 * (i == 3))
              for i, b in enumerate(biases)]
    seqs = [Sequence(i, f"r{i}", [1, 3], p, arrival=i) for i, p in enumerate(params)]
    out = Sampler(EOS).sample(raw.to(device, copy=True), seqs)  # edits it in place
    raw_logprobs = torch.log_softmax(raw, dim=-1)
    for i, bias in enumerate(biases):
        expected = raw[i:i + 1].clone()
        if bias:
            expected = oracle(bias)(torch.tensor([[1, 3]]), expected)
        if i == 3:
            expected[0, EOS[0]] = float("-inf")
        assert out.token_ids[i] == expected.argmax().item(), i
        assert out.logprobs[i].logprob == pytest.approx(
            raw_logprobs[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.token_ids[0] == top[0][1] and out.token_ids[1] == top[1][0]
    assert out.token_ids[2] != top[2][0] and out.token_ids[3] == 13


def test_forced_token_with_sampling(device):
    seq = Sequence(0, "r", [1], SamplingParams(temperature=1.0, seed=5,
                                               logit_bias={17: 100.0}), arrival=0)
    seq.generator = torch.Generator(device=device).manual_seed(5)
    logits = torch.randn(8, 50)
    for row in logits:  # a -100 or +100 bias is a ban or a force in practice
        assert Sampler(EOS).sample(row[None].to(device), [seq]).token_ids == [17]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = build_tiny("llama", path, std=0.15)
    return path, model


def hf_greedy(model, prompt: list[int], processors: LogitsProcessorList) -> list[int]:
    """transformers' forward with its KV cache; ``processors`` on each step's logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(NUM_NEW):
            token = processors(ids, out.logits[:, -1].float()).argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
    return ids[0, len(prompt):].tolist()


def test_greedy_generation_matches_transformers(tiny):
    path, model = tiny
    prompts = [[5, 9, 33, 71, 12], [100, 4, 4, 18], [7, 250, 3, 3, 60, 61, 8]]
    penalty = 1.3
    plain = [hf_greedy(model, p, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)]))
             for p in prompts]
    # ban what each prompt generates first and fourth, favour a prompt token
    biases = [{out[0]: -6.0, out[3]: -4.0, prompt[1]: 2.5} for prompt, out in zip(prompts, plain)]
    biases[2] = {}  # a request without bias in the same batch
    expected = [hf_greedy(model, p, LogitsProcessorList(
        ([oracle(b)] if b else []) + [RepetitionPenaltyLogitsProcessor(penalty)]))
        for p, b in zip(prompts, biases)]
    assert expected[0] != plain[0] and expected[1] != plain[1]
    engine = make_engine(path, **{"engine.block_size": 8})
    outs = engine.generate(prompts, [SamplingParams(
        max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=penalty,
        logit_bias=b) for b in biases])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(engine)


def test_out_of_vocabulary_ids_and_beams_are_refused(tiny):
    path, _ = tiny
    engine = make_engine(path)
    vocab = engine.runner.info.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias .* for token {vocab} .*0\.\.{vocab - 1}"):
        engine.add_request("r", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="logit_bias is not supported with beam search"):
        engine.add_request("b", [5, 6], SamplingParams(num_beams=2, logit_bias={3: 1.0}))
    assert engine.num_requests == 0
