"""End-to-end on a GPU: each family's greedy output on CUDA equals the same family on CPU.

fp32 on both sides (TF32 off), so the only differences are summation order. Decode steps
on CUDA replay captured graphs (families that capture them); a second engine with graphs
off must agree too.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import LogitsRecorder, assert_no_leaks, make_engine, run_to_end
from tests.tiny_models import build_tiny

pytestmark = pytest.mark.gpu

PROMPT_LENS = (5, 37, 64, 100)
FAMILIES = ("granite", "llama", "llama3-rope", "mistral", "olmo2", "olmo3", "phi3", "qwen2",
            "qwen3", "qwen3-yarn", "smollm3")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, path, head_dim=32)  # the CUDA prefill kernel wants a multiple of 32
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return path, prompts


def run(path, prompts, device, **overrides):
    engine = make_engine(path, **{"model.device": device, "engine.block_size": 16,
                                  "engine.max_num_batched_tokens": 48, **overrides})
    recorder = LogitsRecorder(engine)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    assert engine.num_blocks_in_use == 0
    return engine, recorder, [o.outputs[0].token_ids for o in outs], outs


def prompt_logits_gap(cpu_rec, cpu_outs, gpu_rec, gpu_outs, prompts) -> float:
    """The largest absolute difference between the two runs' logits at any prompt position."""
    return max((cpu_rec.rows[(c.request_id, pos)] - gpu_rec.rows[(g.request_id, pos)].cpu())
               .abs().max().item()
               for c, g, prompt in zip(cpu_outs, gpu_outs, prompts) for pos in range(len(prompt)))


def test_greedy_on_cuda_matches_cpu(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, prompts = tiny
    _, cpu_rec, cpu_tokens, cpu_outs = run(path, prompts, "cpu")
    engine, gpu_rec, gpu_tokens, gpu_outs = run(path, prompts, "cuda")
    assert engine.graphs is not None and engine.graphs.graphs, "decode did not use CUDA graphs"
    assert gpu_tokens == cpu_tokens
    worst = prompt_logits_gap(cpu_rec, cpu_outs, gpu_rec, gpu_outs, prompts)
    assert worst <= 1e-3, f"CPU vs CUDA prompt logits differ by {worst:.2e}"
    _, _, eager_tokens, _ = run(path, prompts, "cuda", **{"engine.cuda_graphs": False})
    assert eager_tokens == cpu_tokens


def test_bf16_on_cuda_stays_close_to_fp32(tiny):
    path, prompts = tiny
    _, rec32, _, outs32 = run(path, prompts[:2], "cuda")
    _, rec16, _, outs16 = run(path, prompts[:2], "cuda", **{"model.dtype": "bfloat16"})
    a = torch.stack([rec32.rows[(outs32[1].request_id, p)] for p in range(len(prompts[1]))])
    b = torch.stack([rec16.rows[(outs16[1].request_id, p)] for p in range(len(prompts[1]))])
    rel = ((a - b).norm() / a.norm()).item()
    assert rel <= 5e-2, f"bf16 vs fp32 relative logits error {rel:.2e}"


def test_preemption_and_abort_on_cuda_free_everything(tiny):
    path, prompts = tiny
    engine = make_engine(path, **{"model.device": "cuda", "engine.block_size": 16,
                                  "engine.max_num_batched_tokens": 64,
                                  "engine.num_kv_blocks": 14})
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                   ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    _, _, cpu_tokens, _ = run(path, prompts, "cpu")
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens
    engine.add_request("a", prompts[3], SamplingParams(max_tokens=20, seed=1))
    engine.step()
    engine.abort("a")
    assert engine.num_blocks_in_use == 0


def test_tensor_core_attention_matches_cuda_cores_in_the_engine(tmp_path):
    """bf16, head_dim 64: the engine with the tensor-core prefill and decode kernels ("auto")
    gives the logits of the CUDA-core ones ("fma") wherever both runs saw the same tokens
    (prompts chunked over the cached prefix, then decode steps)."""
    from heron.core.ops.cuda import attention, plan

    build_tiny("llama", tmp_path, head_dim=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with plan.decode_config(kernel="auto"):
        assert plan.plan_decode(4, 2, 160, 132, 2, 64, 2).mma, "auto must pick tensor cores here"
    runs = {}
    for kernel in ("fma", "auto"):
        attention.PREFILL_KERNEL = kernel
        try:
            with plan.decode_config(kernel=kernel):
                # eager decode steps: the recorder sees their logits rows
                _, rec, tokens, outs = run(tmp_path, prompts, "cuda", **{
                    "model.dtype": "bfloat16", "engine.cuda_graphs": False})
        finally:
            attention.PREFILL_KERNEL = None
        runs[kernel] = rec, tokens, outs
    (rec_f, tok_f, outs_f), (rec_m, tok_m, outs_m) = runs["fma"], runs["auto"]
    a, b = [], []
    for prompt, tf, tm, of, om in zip(prompts, tok_f, tok_m, outs_f, outs_m):
        same = next((k for k, (x, y) in enumerate(zip(tf, tm)) if x != y), len(tf))
        for pos in range(min(len(prompt) + same, len(prompt) + len(tf) - 1)):
            a.append(rec_f.rows[(of.request_id, pos)].float())
            b.append(rec_m.rows[(om.request_id, pos)].float())
    a, b = torch.stack(a), torch.stack(b)
    assert len(a) > sum(PROMPT_LENS), "no decode step was compared"
    rel = ((a - b).norm() / a.norm()).item()
    assert rel <= 2e-2, f"tensor-core vs CUDA-core attention: relative logits error {rel:.2e}"


@pytest.mark.parametrize("kind", ["bamba", "nemotron_h", "nemotron_h-dense-dt-floor",
                                  "falcon_h1", "mamba2"])
def test_hybrid_greedy_on_cuda_matches_cpu(kind, tmp_path):
    """The hybrid family with its Mamba2 kernels (conv, scan, state update, gated norm) on
    CUDA against the torch ops on CPU, prefills chunked across steps among decodes; decode
    steps replay captured graphs (not with routed experts), and graphs off agree too."""
    from tests.hybrid_models import build_hybrid
    torch.backends.cuda.matmul.allow_tf32 = False
    # head_dim 32, as the float32 prefill kernel wants
    build_hybrid(kind, tmp_path, num_attention_heads=2, num_key_value_heads=1,
                 **({"head_dim": 32} if kind.startswith("nemotron_h") else {}))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 37, 64, 100)]
    _, cpu_rec, cpu_tokens, cpu_outs = run(tmp_path, prompts, "cpu")
    engine, gpu_rec, gpu_tokens, gpu_outs = run(tmp_path, prompts, "cuda")
    assert engine.states.slots.num_used == 0
    assert gpu_tokens == cpu_tokens
    worst = prompt_logits_gap(cpu_rec, cpu_outs, gpu_rec, gpu_outs, prompts)
    assert worst <= 1e-3, f"CPU vs CUDA prompt logits differ by {worst:.2e}"
    assert engine.runner.supports_cuda_graphs == (kind != "nemotron_h")
    if engine.runner.supports_cuda_graphs:
        assert engine.graphs.graphs, "decode did not use CUDA graphs"
        _, _, eager_tokens, _ = run(tmp_path, prompts, "cuda", **{"engine.cuda_graphs": False})
        assert eager_tokens == cpu_tokens


def test_lora_on_cuda_matches_cpu(tmp_path):
    """Two adapters and the base model in one batch: CUDA (the per-row LoRA kernels, decode
    steps replayed by graphs captured with adapter rows) equals CPU."""
    from tests.lora_models import build_standard_adapters
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_tiny("llama", tmp_path / "base", head_dim=32)
    adapters = build_standard_adapters(model, tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 40, 19)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for device in ("cpu", "cuda"):
        engine = make_engine(tmp_path / "base", **{
            "model.device": device, "lora.adapters": {n: str(p) for n, p in adapters.items()}})
        for i, (prompt, adapter) in enumerate(zip(prompts, [*list(adapters)[:2], None])):
            engine.add_request(f"r{i}", prompt, params, adapter=adapter)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        assert engine.num_blocks_in_use == 0
        if device == "cuda":
            assert any(with_lora for *_, with_lora in engine.graphs.graphs), \
                "no graph was captured with adapter rows"
        results[device] = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert results["cuda"] == results["cpu"]


def nllb_outputs(path, tok, device):
    """Greedy and 4-beam translations of four sources of different lengths into two target
    languages, all in one engine: ``{request id: [token ids of each output]}``."""
    from tests.nllb_models import corpus
    engine = make_engine(path, **{"model.device": device})
    assert engine.graphs is None  # its cross-attention reads source lengths on the host
    words = " ".join(corpus(5, seed=1)).split()
    tok.src_lang = "eng_Latn"
    start = engine.runner.model.cfg.decoder_start_token_id
    for n, lang in ((3, "fra_Latn"), (8, "deu_Latn"), (20, "fra_Latn"), (12, "deu_Latn")):
        for beams in (1, 4):
            engine.add_request(f"{n}-{beams}", [start, tok.convert_tokens_to_ids(lang)],
                               SamplingParams(max_tokens=19, temperature=0.0, num_beams=beams),
                               encoder_prompt=tok(" ".join(words[:n])).input_ids)
    outs = run_to_end(engine)
    assert_no_leaks(engine)
    return {rid: [o.token_ids for o in out.outputs] for rid, out in outs.items()}


def test_nllb_translations_on_cuda_match_cpu(tmp_path):
    """The nllb family (encoder stages, cross-attention K/V in slots, beams sharing them) on
    CUDA, its decoder's self-attention through the paged kernels, against CPU."""
    from tests.nllb_models import build_translator
    torch.backends.cuda.matmul.allow_tf32 = False
    # head_dim 32, as the prefill kernel wants; at d_model 128 an EOS boost of 2 ends
    # translations at several lengths
    tok, _ = build_translator(tmp_path, d_model=128, eos_boost=2.0)
    cpu = nllb_outputs(tmp_path, tok, "cpu")
    assert len(cpu) == 8 and len({len(t[0]) for t in cpu.values()}) > 1  # lengths differ
    assert nllb_outputs(tmp_path, tok, "cuda") == cpu


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta-cls", "modernbert", "deberta-v2-cls",
                                  "nomic-bert", "gte"])
def test_encoder_embeddings_on_cuda_match_cpu(kind, tmp_path):
    """The bert family (whole inputs packed into one bidirectional SDPA call) on CUDA, async
    scheduling on by default there, against CPU: an embedding model's vectors, a
    cross-encoder's scores."""
    from tests.test_embeddings import PROMPTS
    from tests.tiny_models import build_tiny_encoder
    torch.backends.cuda.matmul.allow_tf32 = False
    build_tiny_encoder(kind, tmp_path)
    cpu = make_engine(tmp_path).embed(PROMPTS * 4)
    engine = make_engine(tmp_path, **{"model.device": "cuda", "model.dtype": "float32",
                                      "engine.max_num_batched_tokens": 80})
    for got, want in zip(engine.embed(PROMPTS * 4), cpu):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_async_scheduling_on_cuda_changes_no_output(tmp_path):
    """On CUDA the step in flight really overlaps the host's work: its inputs cross in
    pinned memory, its sampled tokens are read on the device by the next step and copied
    to the host behind it. Every sampling feature gives the same outputs with async
    scheduling on and off, decode steps replayed as graphs."""
    from tests.test_async_scheduling import run_both, sampling_wave
    build_tiny("llama", tmp_path, head_dim=32, std=0.15)
    _, (sync, async_) = run_both(tmp_path, [sampling_wave(make_engine(tmp_path))],
                                 **{"model.device": "cuda"})
    assert async_.async_scheduling and not sync.async_scheduling
    assert async_.graphs is not None and async_.graphs.graphs


def test_column_major_weights_give_the_same_tokens(tiny, monkeypatch):
    """CUDA weights laid out column-major (cuBLAS's "NN" GEMMs) serve the tokens and prompt
    logits of the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, prompts = tiny
    _, cpu_rec, cpu_tokens, cpu_outs = run(path, prompts, "cpu")
    # the module itself: the package's `linear` is the function
    monkeypatch.setattr(importlib.import_module("heron.core.ops.linear"), "CUDA_WEIGHT_LAYOUT",
                        "column")
    engine, gpu_rec, gpu_tokens, gpu_outs = run(path, prompts, "cuda")
    qkv = engine.runner.model.layers[0].attn.qkv
    assert qkv.stride() == (1, qkv.shape[0]), "the weights were not laid out column-major"
    assert gpu_tokens == cpu_tokens
    worst = prompt_logits_gap(cpu_rec, cpu_outs, gpu_rec, gpu_outs, prompts)
    assert worst <= 1e-3, f"CPU vs CUDA prompt logits differ by {worst:.2e}"
