"""Embedding models: the engine's pooled vectors against transformers' hidden states.

The oracle is transformers' bare model (``AutoModel``) on the same weights and token ids:
its ``last_hidden_state`` (after the final norm) pooled the way sentence-transformers pools
(last token, mean of every token, or the first), then L2-normalized.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

from heron.core.config import ConfigError
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leaks, make_engine
from tests.tiny_models import BARE, COMMON, build_tiny

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention",
           "def add(a, b):\n    return a + b\n" * 3, "Caf\u00e9"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    build_tiny("qwen3", path, head_dim=32)
    return path


def oracle(path, ids: list[int], method: str, normalize: bool = True) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return F.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers_across_chunks(qwen3_dir, method):
    # a 16-token budget: the longer prompts compute over several steps, beside the others
    engine = make_engine(qwen3_dir, **{"model.task": "embed", "model.pooling": method,
                                       "engine.max_num_batched_tokens": 16})
    vectors = engine.embed(PROMPTS)
    assert max(len(engine.tokenizer.encode(p)) for p in PROMPTS) > 3 * 16
    for prompt, vector in zip(PROMPTS, vectors):
        expected = oracle(qwen3_dir, engine.tokenizer.encode(prompt), method)
        assert vector.dtype == torch.float32 and vector.shape == (COMMON["hidden_size"],)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    assert engine.pooler.num_partial == 0
    assert_no_leaks(engine)


def test_last_token_pooling_reuses_the_prefix_cache_and_mean_turns_it_off(qwen3_dir):
    engine = make_engine(qwen3_dir, **{"model.task": "embed"})
    first = engine.generate([PROMPTS[2]])[0]
    again = engine.generate([PROMPTS[2]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    torch.testing.assert_close(again.embedding, first.embedding, atol=1e-6, rtol=1e-6)
    assert_no_leaks(engine)
    # mean pooling reads every row, which a cache hit would skip
    assert make_engine(qwen3_dir, **{"model.task": "embed",
                                     "model.pooling": "mean"}).prefix_cache is None


def test_a_preempted_prompt_starts_its_pooling_over(qwen3_dir):
    # 10 blocks of 4 tokens, all of which the long prompt needs: an urgent one arriving
    # mid-way through its chunks takes some, and the long one computes again from its start
    engine = make_engine(qwen3_dir, **{"model.task": "embed", "model.pooling": "mean",
                                       "engine.block_size": 4, "engine.num_kv_blocks": 10,
                                       "engine.max_num_batched_tokens": 16,
                                       "engine.scheduling_policy": "priority"})
    long_ids = engine.tokenizer.encode(PROMPTS[2])[:40]
    urgent_ids = engine.tokenizer.encode(PROMPTS[0])[:20]
    engine.add_request("long", long_ids, SamplingParams(priority=1))
    engine.step()
    engine.add_request("urgent", urgent_ids, SamplingParams(priority=0))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.embedding for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    for rid, ids in (("long", long_ids), ("urgent", urgent_ids)):
        torch.testing.assert_close(done[rid], oracle(qwen3_dir, ids, "mean"),
                                   atol=1e-5, rtol=1e-5)
    assert engine.pooler.num_partial == 0
    assert_no_leaks(engine)


def test_abort_mid_prompt_frees_blocks_and_partial_sums(qwen3_dir):
    engine = make_engine(qwen3_dir, **{"model.task": "embed", "model.pooling": "mean",
                                       "engine.max_num_batched_tokens": 16})
    engine.add_request("long", PROMPTS[2])
    engine.step()
    assert engine.pooler.num_partial == 1 and engine.num_blocks_in_use > 0
    engine.abort("long")
    assert engine.pooler.num_partial == 0
    assert_no_leaks(engine)


def test_an_input_as_long_as_the_context_embeds_and_a_longer_one_is_refused(qwen3_dir):
    engine = make_engine(qwen3_dir, **{"model.task": "embed", "model.max_model_len": 32})
    ids = engine.tokenizer.encode(PROMPTS[2])[:32]
    torch.testing.assert_close(engine.embed([ids])[0], oracle(qwen3_dir, ids, "last"),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embeds at most 32"):
        engine.add_request("long", ids + [5])
    assert_no_leaks(engine)


def test_generation_fields_are_refused_and_a_generating_model_does_not_embed(qwen3_dir):
    engine = make_engine(qwen3_dir, **{"model.task": "embed"})
    for params, field in ((SamplingParams(n=2), "n"),
                          (SamplingParams(logprobs=2), "logprobs")):
        with pytest.raises(ValueError, match=f"generates nothing: {field}"):
            engine.add_request("x", "hello", params)
    with pytest.raises(ValueError, match="does not embed"):
        make_engine(qwen3_dir).embed(["hello"])
    with pytest.raises(ValueError, match="no speculative"):
        make_engine(qwen3_dir, **{"model.task": "embed", "speculative.method": "ngram"})


def _save_sentence_transformers(path, mode: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": COMMON["hidden_size"],
         **{f"pooling_mode_{m}": m == mode for m in modes}}))


def test_a_sentence_transformers_checkpoint_embeds_as_its_modules_say(tmp_path):
    build_tiny("llama", tmp_path)
    _save_sentence_transformers(tmp_path, "mean_tokens", normalize=False)
    engine = make_engine(tmp_path)  # model.task "auto"
    assert engine.pooler.pooling.method == "mean" and not engine.pooler.pooling.normalize
    ids = engine.tokenizer.encode(PROMPTS[0])
    torch.testing.assert_close(engine.embed([ids])[0],
                               oracle(tmp_path, ids, "mean", normalize=False),
                               atol=1e-5, rtol=1e-5)
    # [model] settings win over the modules
    engine = make_engine(tmp_path, **{"model.pooling": "last", "model.normalize": True})
    torch.testing.assert_close(engine.embed([ids])[0], oracle(tmp_path, ids, "last"),
                               atol=1e-5, rtol=1e-5)


def test_sentence_transformers_max_seq_length_bounds_inputs_unless_configured(tmp_path):
    """sentence-transformers cuts inputs at its ``max_seq_length``; heron refuses longer
    ones (a 400 over HTTP; `truncate_prompt_tokens` cuts) unless model.max_model_len says
    otherwise."""
    build_tiny("llama", tmp_path)
    _save_sentence_transformers(tmp_path, "mean_tokens", normalize=True)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 16, "do_lower_case": False}))
    engine = make_engine(tmp_path)
    assert engine.max_model_len == engine.limits.max_embedding_len == 16
    engine.embed([[5] * 16])
    with pytest.raises(ValueError, match="embeds at most 16"):
        engine.embed([[5] * 17])
    assert make_engine(tmp_path, **{"model.max_model_len": 40}).max_model_len == 40


def test_a_pooling_mode_heron_lacks_is_refused_at_start(tmp_path):
    build_tiny("llama", tmp_path)
    _save_sentence_transformers(tmp_path, "max_tokens", normalize=True)
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        make_engine(tmp_path)


@pytest.mark.parametrize("kind", sorted(BARE))
def test_a_bare_checkpoint_without_lm_head_embeds_and_cannot_generate(tmp_path, kind):
    build_tiny(kind, tmp_path)  # saved by the bare model: its tensors lack "model."
    assert "lm_head.weight" not in safetensors.torch.load_file(tmp_path / "model.safetensors")
    engine = make_engine(tmp_path, **{"engine.max_num_batched_tokens": 16})  # task "auto"
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for ids, vector in zip(prompts, engine.embed(prompts)):
        torch.testing.assert_close(vector, oracle(tmp_path, ids, "last"), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="without an LM head"):
        make_engine(tmp_path, **{"model.task": "generate"})


def test_a_hybrid_model_embeds_like_transformers(tmp_path):
    from tests.hybrid_models import build_hybrid
    build_hybrid("bamba", tmp_path)
    engine = make_engine(tmp_path, **{"model.task": "embed",
                                      "engine.max_num_batched_tokens": 16})
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for ids, vector in zip(prompts, engine.embed(prompts)):
        torch.testing.assert_close(vector, oracle(tmp_path, ids, "last"), atol=1e-4, rtol=1e-4)
    assert_no_leaks(engine)


def _add_to_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("normalize", [True, False])
def test_a_matryoshka_model_s_vectors_shorten_to_their_first_values(qwen3_dir, normalize):
    """sentence-transformers' ``truncate_dim`` and vLLM's ``dimensions``: the pooled
    vector's first values, normalized again when the model normalizes."""
    engine = make_engine(qwen3_dir, **{"model.task": "embed", "model.normalize": normalize,
                                       "model.matryoshka_dimensions": [16, 32]})
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for width in (16, 32, COMMON["hidden_size"]):
        vectors = engine.embed(prompts, dimensions=width)
        for ids, vector in zip(prompts, vectors):
            full = oracle(qwen3_dir, ids, "last", normalize=False)
            expected = F.normalize(full[:width], dim=-1) if normalize else full[:width]
            assert vector.shape == (width,)
            torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    for width, why in ((8, "may be shortened to 16, 32"),
                       (COMMON["hidden_size"] + 1, "embeddings have 64")):
        with pytest.raises(ValueError, match=why):
            engine.embed(prompts, dimensions=width)
    assert_no_leaks(engine)


def test_matryoshka_widths_come_from_the_checkpoint_unless_configured(tmp_path):
    build_tiny("qwen3", tmp_path, head_dim=32)
    settings = {"model.task": "embed"}
    with pytest.raises(ValueError, match="not trained to be shortened"):
        make_engine(tmp_path, **settings).embed(["a"], dimensions=16)
    _add_to_config(tmp_path, is_matryoshka=True)  # vLLM's fields: any width
    assert make_engine(tmp_path, **settings).pooler.pooling.matryoshka is True
    assert make_engine(tmp_path, **settings).embed(["a"], dimensions=7)[0].shape == (7,)
    _add_to_config(tmp_path, matryoshka_dimensions=[32, 16])
    assert make_engine(tmp_path, **settings).pooler.pooling.matryoshka == (16, 32)
    off = make_engine(tmp_path, **settings, **{"model.matryoshka_dimensions": False})
    with pytest.raises(ValueError, match="not trained to be shortened"):
        off.embed(["a"], dimensions=16)
    for bad in ([], [0, 16]):
        with pytest.raises(ConfigError, match="matryoshka_dimensions"):
            make_engine(tmp_path, **settings, **{"model.matryoshka_dimensions": bad})
