"""GGUF loading, checked against transformers' own GGUF loader.

The real default model (llama architecture, Q4_1/Q8_0/F32 tensors, permuted q/k) is loaded
once by heron and once by transformers and every tensor compared. Small synthetic files,
written with `gguf.GGUFWriter`, cover the other quantization types and the qwen2 / qwen3
architectures (whose q/k are stored unpermuted). Files written from tiny checkpoints the way
llama.cpp's converter writes them (`write_decoder_gguf`: SmolLM3, a Qwen3-Reranker) are
checked against transformers' model of the checkpoint; beside the converter itself, on the
same checkpoints, those writers gave the same keys and values (but ``general.*``) and
bit-identical tensors.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
from gguf import GGMLQuantizationType as Q

from heron.plugins.transformer.gguf_loader import _ARCHS, dequantize_tensor, load_gguf


@pytest.fixture(scope="module")
def heron_default(default_gguf_path):
    return load_gguf(default_gguf_path)


def transformers_gguf_state(path, config):
    """(config dict, parameter names, state dict) as transformers' GGUF loader reads ``path``.

    This is the function `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs,
    called directly: from_pretrained insists on `accelerate` for GGUF files, which heron does
    not otherwise need, and parses the 50k-token metadata twice (~15 s). The meta-device
    skeleton (built from heron's ``config``) only supplies parameter names; transformers
    parses the file itself for everything else, and the callers check that its config
    agrees with heron's on every field the skeleton's names depend on.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "rope_parameters")}
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    names = set(skeleton.state_dict())
    assert set(parsed["tensors"]) <= names
    return parsed["config"], names, parsed["tensors"]


@pytest.fixture(scope="module")
def hf_default_state(default_gguf_path, heron_default):
    return transformers_gguf_state(default_gguf_path, heron_default[0])


def test_default_config(heron_default):
    config, _, tokenizer = heron_default
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert tokenizer is not None and tokenizer.eos_token_ids == (2,)


def test_default_config_agrees_with_transformers(heron_default, hf_default_state):
    config, _, _ = heron_default
    hf_config, _, _ = hf_default_state
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id"):
        assert config[key] == hf_config[key], key


def test_default_tensors_equal_transformers(heron_default, hf_default_state):
    _, state, _ = heron_default
    _, hf_names, hf_state = hf_default_state
    # tied: transformers' model has lm_head.weight (the embedding, shared); heron leaves it out
    assert set(state) == set(hf_state) == hf_names - {"lm_head.weight"}
    for name, tensor in state.items():
        expected = hf_state[name]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        assert tensor.is_contiguous() and not tensor.is_inference()
        assert torch.equal(tensor, expected) or (tensor - expected).abs().max().item() <= 1e-6, name
    tensor = state["model.layers.0.self_attn.q_proj.weight"]
    tensor.add_(0)  # writable: not a view of the read-only memmap


# -- synthetic files -----------------------------------------------------------------------------
def _write(path, arch, tensors, *, meta=None):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        getattr(writer, {int: "add_uint32", float: "add_float32", str: "add_string"}[type(value)])(key, value)
    for name, (array, qtype) in tensors.items():
        if array.dtype == np.uint8:  # blocks already
            writer.add_tensor(name, array, raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0, Q.MXFP4]
# gguf-py cannot quantize K-quants, so those blocks get random bytes with sane f16 scales.
RANDOM_BLOCKS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


def _random_blocks(rng, rows, cols, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # every f16 field in these blocks sits at a 2-byte offset; clamp their exponent bits so
    # no scale is inf/NaN (bit 14 off keeps |x| < 2)
    raw[..., 1::2] &= 0b10111111
    return raw.reshape(rows, cols // block * size)


def test_dequantize_every_type(tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    originals = {f"t.{q.name}": rng.standard_normal((rows, cols)).astype(np.float32) for q in QUANTIZABLE}
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    raws = {}
    for q in QUANTIZABLE:
        raws[q] = gguf.quants.quantize(originals[f"t.{q.name}"], q)
        writer.add_tensor(f"t.{q.name}", raws[q], raw_dtype=q)
    for q in RANDOM_BLOCKS:
        raws[q] = _random_blocks(rng, rows, cols, q)
        writer.add_tensor(f"t.{q.name}", raws[q], raw_dtype=q)
    writer.add_tensor("t.vector", originals["t.F32"][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    for q in QUANTIZABLE + RANDOM_BLOCKS:
        out = dequantize_tensor(tensors[f"t.{q.name}"])
        assert out.shape == (rows, cols) and out.dtype == np.float32 and out.flags.writeable, q.name
        reference = gguf.quants.dequantize(raws[q], q).astype(np.float32)
        np.testing.assert_array_equal(out, reference, err_msg=q.name)
        assert np.isfinite(out).all() and np.abs(out).max() > 0, q.name
        if q in QUANTIZABLE and q not in (Q.TQ1_0, Q.TQ2_0):  # ternary types are lossy by design
            error = np.abs(out - originals[f"t.{q.name}"]).mean()
            assert error < 0.15, (q.name, error)
    vector = dequantize_tensor(tensors["t.vector"])
    assert vector.shape == (cols,) and np.array_equal(vector, originals["t.F32"][0])


def test_unsupported_quant_type_names_tensor(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    writer = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 64 // block * size), np.uint8),
                      raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(tmp_path / "q81.gguf").tensors[0]
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q8_1"):
        dequantize_tensor(tensor)


TINY = dict(hidden=256, heads=2, kv_heads=1, head_dim=128, ffn=128, vocab=64, layers=2)


def _tiny_tensors(arch, rng, with_output):
    h, d, ffn, vocab = TINY["hidden"], TINY["head_dim"], TINY["ffn"], TINY["vocab"]
    q_rows, kv_rows = TINY["heads"] * d, TINY["kv_heads"] * d
    weight_types = [Q.Q8_0, Q.Q4_1, Q.F16, Q.BF16, Q.F32]
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, h)), Q.Q8_0),
               "output_norm.weight": (rng.standard_normal(h), Q.F32)}
    if with_output:
        tensors["output.weight"] = (rng.standard_normal((vocab, h)), Q.Q4_0)
    for i in range(TINY["layers"]):
        shapes = {"attn_q": (q_rows, h), "attn_k": (kv_rows, h), "attn_v": (kv_rows, h),
                  "attn_output": (h, q_rows), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
        for j, (name, shape) in enumerate(shapes.items()):
            tensors[f"blk.{i}.{name}.weight"] = (rng.standard_normal(shape), weight_types[(i + j) % 5])
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = (rng.standard_normal(h), Q.F32)
        if arch == "qwen2":
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                tensors[f"blk.{i}.{name}.bias"] = (rng.standard_normal(rows), Q.F32)
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                tensors[f"blk.{i}.{name}.weight"] = (rng.standard_normal(d), Q.F32)
    return {k: (v.astype(np.float32), q) for k, (v, q) in tensors.items()}


def tiny_meta(arch):
    """The TINY shape as ``arch``'s GGUF metadata."""
    return {f"{arch}.{k}": v for k, v in {
        "context_length": 512, "block_count": TINY["layers"], "embedding_length": TINY["hidden"],
        "feed_forward_length": TINY["ffn"], "attention.head_count": TINY["heads"],
        "attention.head_count_kv": TINY["kv_heads"], "attention.key_length": TINY["head_dim"],
        "rope.dimension_count": TINY["head_dim"], "rope.freq_base": 5000.0,
        "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": TINY["vocab"]}.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_equal_transformers(tmp_path, arch):
    rng = np.random.default_rng(1)
    meta = tiny_meta(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write(path, arch, _tiny_tensors(arch, rng, with_output=arch != "qwen3"), meta=meta)

    config, state, tokenizer = load_gguf(path)
    assert tokenizer is None  # no tokenizer metadata: served by token ids
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert config["tie_word_embeddings"] is (arch == "qwen3")
    assert config["head_dim"] == TINY["head_dim"] and config["rope_theta"] == 5000.0
    hf_config, hf_names, hf_state = transformers_gguf_state(path, config)
    for key in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert config[key] == hf_config[key], key
    assert set(state) == set(hf_state) == hf_names - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    for name, tensor in state.items():
        assert tensor.shape == hf_state[name].shape, name
        assert torch.equal(tensor, hf_state[name]), name


def test_llama_qk_unpermute_is_exact_inverse(tmp_path):
    """llama.cpp's `permute` applied to HF rows, written, then loaded, gives the HF rows."""
    rng = np.random.default_rng(2)
    tensors = _tiny_tensors("llama", rng, with_output=True)
    hf_q = rng.standard_normal((TINY["heads"] * TINY["head_dim"], TINY["hidden"])).astype(np.float32)

    def permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors["blk.0.attn_q.weight"] = (permute(hf_q, TINY["heads"]), Q.F32)
    meta = {"llama.block_count": TINY["layers"], "llama.embedding_length": TINY["hidden"],
            "llama.feed_forward_length": TINY["ffn"], "llama.attention.head_count": TINY["heads"],
            "llama.attention.head_count_kv": TINY["kv_heads"], "llama.attention.key_length": TINY["head_dim"]}
    _write(tmp_path / "p.gguf", "llama", tensors, meta=meta)
    _, state, _ = load_gguf(tmp_path / "p.gguf")
    assert np.array_equal(state["model.layers.0.self_attn.q_proj.weight"].numpy(), hf_q)


def test_unknown_architecture_and_tensor(tmp_path):
    _write(tmp_path / "a.gguf", "mamba", {"token_embd.weight": (np.zeros((4, 32), np.float32), Q.F32)})
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        load_gguf(tmp_path / "a.gguf")
    meta = {"llama.embedding_length": 32, "llama.attention.head_count": 2}
    _write(tmp_path / "b.gguf", "llama", {"token_embd.weight": (np.zeros((4, 32), np.float32), Q.F32),
                                          "blk.0.ffn_gate_exps.weight": (np.zeros((4, 32), np.float32), Q.F32)},
           meta=meta)
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        load_gguf(tmp_path / "b.gguf")


def test_a_file_with_a_pooling_type_embeds_as_transformers_pools(tmp_path):
    """An embedding model's file (llama.cpp writes ``pooling_type``: Qwen3-Embedding's,
    last token) embeds under model.task "auto", pooled as the file says."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.engine_utils import assert_no_leaks, make_engine
    path = tmp_path / "tiny-qwen3-embedding.gguf"
    _write(path, "qwen3", _tiny_tensors("qwen3", np.random.default_rng(3), with_output=False),
           meta={**tiny_meta("qwen3"), "qwen3.pooling_type": int(gguf.PoolingType.LAST)})
    engine = make_engine(path)
    assert engine.pooler.pooling.method == "last" and engine.pooler.pooling.normalize
    config, _, _ = load_gguf(path)
    hf_config, _, hf_state = transformers_gguf_state(path, config)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **fields)).eval()
    model.load_state_dict(hf_state, strict=False)
    prompts = [[5, 9, 13, 2, 40], list(range(1, 30)), [7]]
    for ids, vector in zip(prompts, engine.embed(prompts)):
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(vector, F.normalize(hidden, dim=-1), atol=1e-4, rtol=1e-4)
    assert_no_leaks(engine)


# what llama.cpp's converter writes as a Qwen3-Reranker's `tokenizer.chat_template.rerank`
LLAMA_CPP_RERANK = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def write_decoder_gguf(hf_dir, path, arch: str, named=None, drop=(), meta=None) -> None:
    """``hf_dir``'s causal LM as llama.cpp's converter writes one of ``arch`` (``"qwen3"``,
    ``"smollm3"``...): its metadata keys, the byte-level BPE vocabulary with gguf-py's
    special tokens and merges, its tensors under gguf-py's names, q and k rows permuted
    for Llama's kind (``LlamaModel.permute``); ``drop``: tensors left out, ``named``: more
    under their GGUF names, ``meta(writer)``: more keys."""
    from tests.test_bert_gguf import _bpe_vocab, _finish
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if _ARCHS[arch][2]:  # Llama's kind (`LlamaModel.set_gguf_parameters`)
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    if meta is not None:
        meta(writer)
    _bpe_vocab(writer, hf_dir, config["vocab_size"])
    state = safetensors.torch.load_file(hf_dir / "model.safetensors")
    for name in drop:
        del state[name]
    if _ARCHS[arch][2]:  # stored permuted
        def permute(w, n):
            return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
                w.shape)
        for name in state:
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                state[name] = permute(state[name], heads if "q_proj" in name else kv_heads)
    _finish(writer, hf_dir, config, state, gguf.MODEL_ARCH[arch.upper()], merges=True,
            named=named)


def write_qwen3_reranker_gguf(hf_dir, path, yes: int, no: int) -> None:
    """``hf_dir``'s Qwen3ForCausalLM as llama.cpp's converter writes a Qwen3-Reranker:
    pooling rank, labels yes and no, the LM head's ``yes`` and ``no`` rows as ``cls.output``
    and no LM head, and the rerank template beside the chat template."""
    def meta(writer):
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": LLAMA_CPP_RERANK}])

    head = safetensors.torch.load_file(hf_dir / "model.safetensors")["lm_head.weight"]
    write_decoder_gguf(hf_dir, path, "qwen3", meta=meta, drop=["lm_head.weight"],
                       named={"cls.output.weight": torch.stack([head[yes], head[no]])})


def test_a_qwen3_reranker_file_ranks_as_llama_server_scores_it(tmp_path):
    """llama.cpp's Qwen3-Reranker files rank out of the box: /rerank fills the file's rerank
    template in with each pair and scores it by the first of the two rows' softmax, as
    llama-server does; the oracle is transformers' causal LM on the filled-in prompt, the
    probability of "yes" against "no" at its last token."""
    from transformers import AutoTokenizer

    from tests.test_server_classify import QUERY
    from tests.test_server_embeddings import PROMPTS, post, serve
    from tests.tiny_models import add_chat_markers, build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("qwen3", hf_dir, head_dim=32)
    add_chat_markers(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    yes, no = tokenizer.convert_tokens_to_ids(["a", "b"])  # any two rows
    path = tmp_path / "tiny-qwen3-reranker.gguf"
    write_qwen3_reranker_gguf(hf_dir, path, yes, no)
    expected = []
    for document in PROMPTS:
        ids = tokenizer(LLAMA_CPP_RERANK.replace("{query}", QUERY).replace(
            "{document}", document))["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [yes, no]]
        expected.append((len(ids), float(logits.softmax(-1)[0])))
    with serve(path) as server:
        assert server.async_engine.engine.pooler.pooling.labels == ("yes",)
        status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS})
        assert status == 200, reply
        for r in reply["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]][1], abs=1e-5)
        assert [r["index"] for r in reply["results"]] == sorted(
            range(len(PROMPTS)), key=lambda i: -expected[i][1])
        assert reply["usage"]["prompt_tokens"] == sum(n for n, _ in expected)


def test_a_smollm3_file_skips_rotary_every_fourth_layer(tmp_path):
    """llama.cpp's SmolLM3 files name no NoPE layers: every fourth goes without rotary, as
    transformers' default; heron's logits from the file match transformers' model of the
    checkpoint it was written from, at every position."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("smollm3", hf_dir, num_hidden_layers=4, no_rope_layers=None)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = tmp_path / "tiny-smollm3.gguf"
    write_decoder_gguf(hf_dir, path, "smollm3")
    assert_greedy_logits_match(make_engine(path), model, list(range(5, 45)))


def test_a_yarn_file_rotates_as_transformers(tmp_path):
    """A file whose rope is YaRN-scaled (Qwen's long-context recipe, as the converter writes
    it: type, factor, original context) matches transformers' model of its checkpoint past
    the original context."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import YARN_ROPE, build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("qwen3", hf_dir, head_dim=32, rope_parameters=YARN_ROPE,
                       max_position_embeddings=256)

    def meta(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(YARN_ROPE["factor"])
        writer.add_rope_scaling_orig_ctx_len(YARN_ROPE["original_max_position_embeddings"])

    path = tmp_path / "tiny-qwen3-yarn.gguf"
    write_decoder_gguf(hf_dir, path, "qwen3", meta=meta)
    assert_greedy_logits_match(make_engine(path), model, list(range(5, 105)))


def test_a_phi3_file_with_fused_projections_matches_transformers(tmp_path):
    """llama.cpp's Phi-3 files keep q/k/v (``attn_qkv``) and gate/up (``ffn_up``) fused and
    name the rotated dims (``rope.dimension_count``, half a head here); heron's logits from
    one match transformers' model of its checkpoint. A LongRoPE file is refused by name."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("phi3", hf_dir)

    def meta(writer):  # as `Phi3MiniModel.set_gguf_parameters` adds them
        writer.add_rope_scaling_orig_ctx_len(model.config.original_max_position_embeddings)
        writer.add_rope_dimension_count(8)
        writer.add_sliding_window(0)

    path = tmp_path / "tiny-phi3.gguf"
    write_decoder_gguf(hf_dir, path, "phi3", meta=meta)
    assert_greedy_logits_match(make_engine(path), model, list(range(5, 45)))
    longrope = tmp_path / "longrope.gguf"
    factors = torch.ones(4)
    write_decoder_gguf(hf_dir, longrope, "phi3", meta=meta,
                       named={"rope_factors_long.weight": factors,
                              "rope_factors_short.weight": factors})
    with pytest.raises(ValueError, match="LongRoPE"):
        load_gguf(longrope)


def test_a_granite_file_carries_its_multipliers(tmp_path):
    """llama.cpp's Granite files keep the multipliers as ``embedding_scale``,
    ``residual_scale``, ``attention.scale`` and ``logit_scale``; heron's logits from one
    match transformers' model of its checkpoint."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("granite", hf_dir)
    c = model.config

    def meta(writer):  # as `GraniteModel.set_gguf_parameters` adds them
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)

    path = tmp_path / "tiny-granite.gguf"
    write_decoder_gguf(hf_dir, path, "granite", meta=meta)
    assert_greedy_logits_match(make_engine(path), model, list(range(5, 45)))


def test_an_olmo2_file_norms_after_its_sublayers(tmp_path):
    """llama.cpp's OLMo 2 files: norms on the attention's and MLP's outputs
    (``post_attention_norm``, ``post_ffw_norm``) and q/k norms over all heads; heron's
    logits from one match transformers' model of its checkpoint."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("olmo2", hf_dir)
    path = tmp_path / "tiny-olmo2.gguf"
    write_decoder_gguf(hf_dir, path, "olmo2")
    assert_greedy_logits_match(make_engine(path), model, list(range(5, 45)))


def test_an_olmo3_file_rotates_its_windowed_layers_plainly(tmp_path):
    """The converter writes OLMo 3 as ``olmo2`` with a window, its pattern, the full layers'
    YaRN and the windowed layers' base; as llama.cpp runs it, those rotate unscaled.
    heron serves such a file up to its window, its logits transformers' there."""
    from tests.engine_utils import assert_greedy_logits_match, make_engine
    from tests.tiny_models import OLMO3, YARN_ROPE, build_tiny
    hf_dir = tmp_path / "hf"
    model = build_tiny("olmo3", hf_dir, sliding_window=64)

    def meta(writer):  # as `Olmo2Model.set_gguf_parameters` and the base rope keys add them
        writer.add_rope_freq_base_swa(OLMO3["rope_parameters"]["sliding_attention"]["rope_theta"])
        writer.add_sliding_window(64)
        writer.add_sliding_window_pattern([True, False])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(YARN_ROPE["factor"])
        writer.add_rope_scaling_orig_ctx_len(YARN_ROPE["original_max_position_embeddings"])

    path = tmp_path / "tiny-olmo3.gguf"
    write_decoder_gguf(hf_dir, path, "olmo2", meta=meta)
    engine = make_engine(path)
    assert engine.max_model_len == 64
    assert_greedy_logits_match(engine, model, list(range(5, 55)))
