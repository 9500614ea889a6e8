"""The bert family (BERT, RoBERTa, XLM-RoBERTa, ModernBERT, DeBERTa, NomicBERT and GTE
encoders): embeddings and classifier probabilities against transformers' models of the same
checkpoints, on transformers' tokenization (with its token types for a pair of texts, where
the model takes them)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from heron.core.config import ConfigError
from tests.engine_utils import assert_no_leaks, make_engine
from tests.test_embeddings import PROMPTS, _save_sentence_transformers
from tests.tiny_models import ENCODER_COMMON, ENCODERS, build_tiny_encoder

EMBEDDERS = [kind for kind in ENCODERS if "-cls" not in kind]
CLASSIFIERS = [kind for kind in ENCODERS if "-cls" in kind]
QUERY = "Which animal jumps over the dog?"


@pytest.fixture(scope="module", params=EMBEDDERS)
def embedder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return build_tiny_encoder(request.param, path), path


@pytest.fixture(scope="module", params=CLASSIFIERS)
def classifier(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return build_tiny_encoder(request.param, path), path


def takes_token_types(model) -> bool:
    return getattr(model.config, "type_vocab_size", 0) > 1


def encode(model, tokenizer, *texts) -> dict:
    """transformers' inputs of ``texts`` for ``model``: token types where it takes them."""
    inputs = tokenizer(*texts, return_tensors="pt", return_token_type_ids=True)
    if not hasattr(model.config, "type_vocab_size"):
        del inputs["token_type_ids"]
    return inputs


def hidden_states(model, tokenizer, *texts) -> torch.Tensor:
    with torch.no_grad():
        return model(**encode(model, tokenizer, *texts)).last_hidden_state[0]


def probabilities(model, tokenizer, *texts) -> torch.Tensor:
    """transformers' logits (through the checkpoint's head) softmaxed, or a lone label's
    through a sigmoid."""
    with torch.no_grad():
        logits = model(**encode(model, tokenizer, *texts)).logits[0]
    return logits.sigmoid() if logits.numel() == 1 else logits.softmax(-1)


class StepRecorder:
    """Wraps the runner's forward and keeps each step's (query lengths, context lengths)."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[list[int], list[int]]] = []
        forward = engine.runner.forward

        def recording(batch):
            self.steps.append((batch.attn.query_lens_list, batch.attn.seq_lens_list))
            return forward(batch)

        engine.runner.forward = recording


@pytest.mark.parametrize("method", ["auto", "mean", "last"])
def test_embeddings_match_transformers_with_inputs_packed_in_one_step(embedder, method):
    model, path = embedder
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine(path, **{"model.pooling": method})
    assert engine.pooler.pooling.method == ("cls" if method == "auto" else method)
    steps = StepRecorder(engine)
    vectors = engine.embed(PROMPTS)
    assert len(steps.steps) == 1 and len(steps.steps[0][0]) == len(PROMPTS)
    for prompt, vector in zip(PROMPTS, vectors):
        assert engine.tokenizer.encode(prompt) == tokenizer(prompt)["input_ids"]
        hidden = hidden_states(model, tokenizer, prompt)
        pooled = {"auto": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[method]
        assert vector.shape == (ENCODER_COMMON["hidden_size"],)
        torch.testing.assert_close(vector, F.normalize(pooled, dim=-1), atol=1e-5, rtol=1e-5)
    assert engine.prefix_cache is None
    assert_no_leaks(engine)


def test_inputs_compute_whole_and_one_past_the_step_budget_runs_alone(embedder):
    """With a step budget smaller than the longest prompts, chunked prefill stays off: every
    input computes whole (each step's query lengths equal their context lengths), and one
    longer than the budget runs alone in its step."""
    model, path = embedder
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine(path, **{"engine.max_num_batched_tokens": 16,
                                  "engine.chunked_prefill": True})
    assert any(len(engine.tokenizer.encode(p)) > 16 for p in PROMPTS)
    steps = StepRecorder(engine)
    for prompt, vector in zip(PROMPTS, engine.embed(PROMPTS)):
        expected = F.normalize(hidden_states(model, tokenizer, prompt)[0], dim=-1)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    assert all(query == context for query, context in steps.steps)
    assert all(len(query) == 1 for query, _ in steps.steps if sum(query) > 16)
    assert_no_leaks(engine)


def test_an_input_past_the_positions_is_refused(embedder):
    model, path = embedder
    engine = make_engine(path, **{"model.max_model_len": 200})
    # RoBERTa's positions start at pad + 1; ModernBERT's 8192 are past max_model_len
    positions = model.config.max_position_embeddings - (
        model.config.pad_token_id + 1 if "roberta" in model.config.model_type else 0)
    limit = min(positions, 200)
    assert engine.limits.max_embedding_len == limit in (128, 200)
    engine.embed([[5] * limit])
    with pytest.raises(ValueError, match=f"embeds at most {limit}"):
        engine.embed([[5] * (limit + 1)])
    assert_no_leaks(engine)


def test_a_sentence_transformers_encoder_pools_as_its_modules_say(tmp_path):
    model = build_tiny_encoder("bert", tmp_path)
    _save_sentence_transformers(tmp_path, "mean_tokens", normalize=False)
    engine = make_engine(tmp_path)
    assert engine.pooler.pooling.method == "mean" and not engine.pooler.pooling.normalize
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    torch.testing.assert_close(engine.embed([PROMPTS[0]])[0],
                               hidden_states(model, tokenizer, PROMPTS[0]).mean(0),
                               atol=1e-5, rtol=1e-5)


def test_classifier_probabilities_match_transformers(classifier):
    model, path = classifier
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine(path)
    labels = engine.pooler.pooling.labels
    assert labels == tuple(model.config.id2label[i] for i in range(model.config.num_labels))
    pooling = getattr(model.config, "classifier_pooling", "cls")  # ModernBERT's may be mean
    assert engine.pooler.pooling.method == pooling and not engine.pooler.pooling.normalize
    for prompt, probs in zip(PROMPTS, engine.embed(PROMPTS)):
        torch.testing.assert_close(probs, probabilities(model, tokenizer, prompt),
                                   atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_a_pair_is_typed_as_the_tokenizer_types_it(classifier):
    """A cross-encoder's pair (`Tokenizer.encode_pair`) with the token types transformers'
    tokenizer gives it: BERT's second text of type 1, which changes the score, even where a
    text holds the separator's own spelling; RoBERTa's tokenizer types every token 0, and
    ModernBERT takes no types."""
    model, path = classifier
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine(path)
    spelt = f"the fox {tokenizer.sep_token} jumps"
    texts = [*[(QUERY, doc) for doc in PROMPTS], (QUERY, spelt), (spelt, QUERY)]
    pairs = [engine.tokenizer.encode_pair(*pair) for pair in texts]
    expected = [tokenizer(*pair, return_token_type_ids=True) for pair in texts]
    assert [p[0] for p in pairs] == [e["input_ids"] for e in expected]
    assert [p[1] for p in pairs] == [e["token_type_ids"] for e in expected]
    types = [p[1] for p in pairs] if takes_token_types(model) else None
    got = engine.embed([p[0] for p in pairs], types)
    for pair, probs in zip(texts, got):
        torch.testing.assert_close(probs, probabilities(model, tokenizer, *pair),
                                   atol=1e-5, rtol=1e-5)
    assert (1 in pairs[0][1]) == ("roberta" not in model.config.model_type)  # the tokenizer
    if takes_token_types(model):  # the types matter: all zeros scores otherwise
        assert not torch.allclose(got[0], engine.embed([pairs[0][0]])[0], atol=1e-5)
    else:
        with pytest.raises(ValueError, match="reads no token types"):
            engine.embed([pairs[0][0]], [pairs[0][1]])
    assert_no_leaks(engine)


def test_token_types_are_checked(tmp_path):
    build_tiny_encoder("bert-cls", tmp_path)
    engine = make_engine(tmp_path)
    ids, types = engine.tokenizer.encode_pair(QUERY, PROMPTS[0])
    for bad, message in [(types[:-1], "token types for a prompt of"),
                         ([2] * len(ids), "outside 0..1")]:
        with pytest.raises(ValueError, match=message):
            engine.embed([ids], [bad])
    with pytest.raises(ValueError, match="1 token type lists for 2 prompts"):
        engine.embed([ids, ids], [types])
    # typed and untyped inputs in one step: each row reads its own request's types
    typed, untyped = engine.embed([ids], [types])[0], engine.embed([ids])[0]
    both = engine.embed([ids, ids], [types, None])
    torch.testing.assert_close(both, [typed, untyped], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(typed, untyped, atol=1e-5)
    assert_no_leaks(engine)


def test_a_checkpoint_with_prefixed_and_old_style_names_loads(tmp_path):
    """A ``BertModel`` whose tensors carry the ``bert.`` prefix and LayerNorm ``gamma`` /
    ``beta`` (older checkpoints) embeds as the same model saved the usual way."""
    model = build_tiny_encoder("bert", tmp_path)
    file = tmp_path / "model.safetensors"
    renamed = {"bert." + name.replace("LayerNorm.weight", "LayerNorm.gamma")
               .replace("LayerNorm.bias", "LayerNorm.beta"): t.contiguous()
               for name, t in model.state_dict().items()}
    safetensors.torch.save_file(renamed, file)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    torch.testing.assert_close(make_engine(tmp_path).embed([PROMPTS[1]])[0],
                               F.normalize(hidden_states(model, tokenizer, PROMPTS[1])[0], dim=-1),
                               atol=1e-5, rtol=1e-5)


def test_an_encoder_does_not_generate_and_unsupported_configs_are_named(tmp_path):
    build_tiny_encoder("bert", tmp_path)
    with pytest.raises(ConfigError, match="without an LM head"):
        make_engine(tmp_path, **{"model.task": "generate"})
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, message in [("position_embedding_type", "relative_key", "absolute"),
                                ("hidden_act", "quick_gelu", "hidden_act"),
                                ("is_decoder", True, "decoder")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            make_engine(tmp_path)


def test_unsupported_deberta_configs_are_named(tmp_path):
    build_tiny_encoder("deberta-v2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, message in [("conv_kernel_size", 3, "convolution"),
                                ("attention_head_size", 8, "attention_head_size"),
                                ("pooler_hidden_act", "quick_gelu", "pooler_hidden_act")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            make_engine(tmp_path)


# transformers' names -> the checkpoints' own (transformers' conversion mapping, read the
# other way): the projections each fuses (its own name: transformers' parts), then renames
OWN_NAMES = {
    "nomic-bert": ({"attn.Wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
                   {"embeddings.LayerNorm": "emb_ln", "layers.": "encoder.layers.",
                    "self_attn.o_proj": "attn.out_proj", "mlp.up_proj": "mlp.fc11",
                    "mlp.gate_proj": "mlp.fc12", "mlp.down_proj": "mlp.fc2",
                    "post_attention_layernorm": "norm1", "post_mlp_layernorm": "norm2"}),
    "gte": ({"attention.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.up_gate_proj": ("mlp.up_proj", "mlp.gate_proj")},
            {"layers.": "encoder.layer.", "self_attn.o_proj": "attention.o_proj",
             "post_attention_layernorm": "attn_ln", "post_mlp_layernorm": "mlp_ln"}),
}


def save_with_own_names(kind: str, model, path, config: dict) -> None:
    """``model`` (transformers') saved as the hub's checkpoints of ``kind`` are: their own
    tensor names, and ``config``."""
    fused, renames = OWN_NAMES[kind]
    state = dict(model.state_dict())
    for i in range(model.config.num_hidden_layers):
        for name, parts in fused.items():
            for kind_ in ("weight", "bias"):
                keys = [f"layers.{i}.{part}.{kind_}" for part in parts]
                if keys[0] in state:
                    state[f"layers.{i}.{name}.{kind_}"] = torch.cat([state.pop(k) for k in keys])
    own = {}
    for name, tensor in state.items():
        for new, old in renames.items():
            name = name.replace(new, old)
        own[name] = tensor.contiguous()
    safetensors.torch.save_file(own, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))


def save_as_nomic_checkpoint(model, path, context: int) -> None:
    """``model`` (a transformers NomicBertModel) as nomic-embed's checkpoints are saved: its
    own tensor names (q, k and v fused in ``Wqkv``) and config keys, ``context`` trained
    positions of 8192."""
    c = model.config
    save_with_own_names("nomic-bert", model, path, {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
        "vocab_size": c.vocab_size, "n_embd": c.hidden_size, "n_layer": c.num_hidden_layers,
        "n_head": c.num_attention_heads, "n_inner": c.intermediate_size,
        "layer_norm_epsilon": c.layer_norm_eps, "activation_function": "swiglu",
        "rotary_emb_base": c.rope_parameters["rope_theta"], "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None, "n_positions": 8192, "max_trained_positions": context,
        "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
        "prenorm": False, "causal": False, "use_rms_norm": False,
        "type_vocab_size": c.type_vocab_size})


def save_as_gte_checkpoint(model, path) -> None:
    """``model`` (a transformers GteModel) as GTE's hub checkpoints (``NewModel``, remote
    code) are saved: q, k and v fused, up and gate fused, their config keys."""
    c = model.config
    save_with_own_names("gte", model, path, {
        "architectures": ["NewModel"], "model_type": "new", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
        "hidden_act": "gelu", "layer_norm_eps": c.layer_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size, "pad_token_id": c.pad_token_id,
        "position_embedding_type": "rope", "rope_theta": c.rope_parameters["rope_theta"],
        "rope_scaling": None, "layer_norm_type": "layer_norm", "logn_attention_scale": False,
        "pack_qkv": True, "unpad_inputs": False})


@pytest.mark.parametrize("kind", ["nomic-bert", "gte"])
def test_a_hub_checkpoint_loads_with_its_own_names_and_config(kind, tmp_path):
    """nomic-embed-text's and GTE's checkpoints keep their remote code's names and config
    keys; the names are those transformers' conversion mapping renames (it loads them to the
    same model), and nomic's context is its trained positions."""
    model = build_tiny_encoder(kind, tmp_path / "hf")
    own = tmp_path / "own"
    own.mkdir()
    if kind == "gte":
        save_as_gte_checkpoint(model, own)
    else:
        save_as_nomic_checkpoint(model, own, context=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (own / name).write_text((tmp_path / "hf" / name).read_text())
    # transformers reads the names as its own model's (with its own config)
    (tmp_path / "check").mkdir()
    model.config.save_pretrained(tmp_path / "check")
    (tmp_path / "check" / "model.safetensors").write_bytes((own / "model.safetensors").read_bytes())
    reloaded = type(model).from_pretrained(tmp_path / "check").eval()
    ids = torch.tensor([[2, 40, 41, 42, 43, 3]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).last_hidden_state, model(ids).last_hidden_state)
    engine = make_engine(own)
    assert engine.max_model_len == (64 if kind == "nomic-bert" else 128)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for prompt, vector in zip(PROMPTS, engine.embed(PROMPTS)):
        torch.testing.assert_close(vector, F.normalize(hidden_states(model, tokenizer, prompt)[0],
                                                       dim=-1), atol=1e-5, rtol=1e-5)
    config = json.loads((own / "config.json").read_text())
    refused = ([("moe_every_n_layers", 2), ("rotary_emb_fraction", 0.5), ("prenorm", True),
                ("qkv_proj_bias", True), ("activation_function", "quick_gelu")]
               if kind == "nomic-bert" else
               [("rope_scaling", {"type": "ntk", "factor": 2.0}),
                ("layer_norm_type", "rms_norm"), ("logn_attention_scale", True),
                ("hidden_act", "quick_gelu")])
    for key, value in refused:
        (own / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=key):
            make_engine(own)


def test_async_scheduling_embeds_the_same(classifier):
    """With the next step planned while one runs (CUDA's default), each input still runs
    once, whole, and the results equal a synchronous engine's."""
    _, path = classifier
    inputs = PROMPTS * 3
    expected = make_engine(path).embed(inputs)
    engine = make_engine(path, **{"engine.async_scheduling": "on",
                                  "engine.max_num_batched_tokens": 80})
    steps = StepRecorder(engine)
    for got, want in zip(engine.embed(inputs), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert len(steps.steps) > 1 and sum(len(q) for q, _ in steps.steps) == len(inputs)
    assert_no_leaks(engine)


def test_a_checkpoint_with_only_vocab_txt_scores_pairs_as_transformers(tmp_path):
    """Older BERT checkpoints ship ``vocab.txt`` and no ``tokenizer.json``: heron builds the
    tokenizer through transformers' converter, pair template and token types included."""
    model = build_tiny_encoder("bert-cls", tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    (tmp_path / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    for doc in PROMPTS:
        ids, types = engine.tokenizer.encode_pair(QUERY, doc)
        assert ids == tokenizer(QUERY, doc)["input_ids"]
        torch.testing.assert_close(engine.embed([ids], [types])[0],
                                   probabilities(model, tokenizer, QUERY, doc),
                                   atol=1e-5, rtol=1e-5)


def test_a_modernbert_config_in_the_hub_s_older_form_reads_the_same(tmp_path):
    """ModernBERT checkpoints on the hub spell their layers and thetas as
    ``global_attn_every_n_layers``, ``global_rope_theta`` and ``local_rope_theta`` (which
    transformers 5 saves as ``layer_types`` and ``rope_parameters``): the same model."""
    model = build_tiny_encoder("modernbert", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    theta = {t: p["rope_theta"] for t, p in config.pop("rope_parameters").items()}
    assert config.pop("layer_types") == ["full_attention", "sliding_attention",
                                         "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps({
        **config, "global_attn_every_n_layers": 3, "global_rope_theta": theta["full_attention"],
        "local_rope_theta": theta["sliding_attention"]}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    torch.testing.assert_close(make_engine(tmp_path).embed([PROMPTS[2]])[0],
                               F.normalize(hidden_states(model, tokenizer, PROMPTS[2])[0], dim=-1),
                               atol=1e-5, rtol=1e-5)
    (tmp_path / "config.json").write_text(json.dumps({
        **config, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        make_engine(tmp_path)
