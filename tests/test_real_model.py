"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in heron vs transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import LogitsRecorder, make_engine, relative_logit_error

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    return make_engine(default_gguf_path, **{"engine.max_num_batched_tokens": 16})


@pytest.fixture(scope="module")
def kept_engine(default_gguf_path):
    """Its Q4_1 projections and Q8_0 (tied) LM head kept quantized."""
    from heron.core.ops.quantized import QuantizedWeight
    engine = make_engine(default_gguf_path, **{"engine.max_num_batched_tokens": 16,
                                               "model.keep_quantized": True})
    model = engine.runner.model
    assert all(isinstance(w, QuantizedWeight) for w in (
        model.layers[0].attn.qkv, model.layers[0].attn.o, model.layers[-1].gate_up,
        model.layers[-1].down, model.lm_head))
    return engine


@pytest.fixture(scope="module")
def oracle(default_gguf_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("served", ["engine", "kept_engine"])
def test_chat_prompt_logits_and_greedy_tokens_match_transformers(served, oracle, request):
    engine = request.getfixturevalue(served)
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(QUESTION))
    recorder = LogitsRecorder(engine)  # prefill is chunked: 16 tokens per step
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                   ignore_eos=True, prompt_logprobs=0))[0]
    mine = torch.stack([recorder.rows[(out.request_id, p)] for p in range(len(prompt))])
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt])).logits[0]
        expected, step = [], oracle(torch.tensor([prompt]), use_cache=True)
        for _ in range(16):
            expected.append(int(step.logits[0, -1].argmax()))
            step = oracle(torch.tensor([[expected[-1]]]), past_key_values=step.past_key_values,
                          use_cache=True)
    assert relative_logit_error(mine, ref) <= 1e-5
    assert out.outputs[0].token_ids == expected


def test_a_kept_lm_head_s_rows_classify_as_transformers_logits_do(default_gguf_path, oracle):
    """``classifier_from_tokens`` on the GGUF file: the yes/no rows of its Q8_0 LM head, kept
    quantized, give yes's two-way probability at the prompt's last position."""
    engine = make_engine(default_gguf_path, **{"model.keep_quantized": True,
                                               "model.classifier_from_tokens": ["no", "yes"]})
    ids = [engine.tokenizer.token_to_id(t) for t in ("no", "yes")]
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Is {city} the capital of France? Answer yes or no."}])
        for city in ("Paris", "Rome")]
    for prompt, probs in zip(prompts, engine.embed(prompts)):
        with torch.no_grad():
            logits = oracle(torch.tensor([engine.tokenizer.encode(prompt)])).logits[0, -1, ids]
        assert probs.tolist() == pytest.approx([float(logits.softmax(-1)[1])], abs=1e-5)


def test_answers_paris(engine):
    prompt = engine.tokenizer.apply_chat_template(QUESTION)
    out = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on the model's own end-of-turn token
    assert engine.num_blocks_in_use == 0


def test_a_1000_token_shared_prefix_is_reused_with_the_same_greedy_output(default_gguf_path):
    facts = [f"Rule {i}: visitors to hall {i % 7} must sign the register before {i + 8} o'clock."
             for i in range(60)]
    system = {"role": "system", "content": " ".join(facts)}
    warm = make_engine(default_gguf_path, **{"engine.max_num_batched_tokens": 512})
    cold = make_engine(default_gguf_path, **{"engine.max_num_batched_tokens": 512,
                                             "prefix_cache.enabled": False})
    prompts = [warm.tokenizer.encode(warm.tokenizer.apply_chat_template(
        [system, {"role": "user", "content": q}]))
        for q in ("Which hall closes first?", "Summarise rule 12.")]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared >= 1000
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert warm.generate([prompts[0]], params)[0].num_cached_tokens == 0
    second = warm.generate([prompts[1]], params)[0]
    assert second.num_cached_tokens >= shared // 16 * 16
    reference = cold.generate([prompts[1]], params)[0]
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert warm.num_blocks_in_use == 0
