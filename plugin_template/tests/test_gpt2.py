"""The GPT-2 family against transformers: config, activation, logits and greedy tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import build_gpt2
from transformers.activations import NewGELUActivation

from heron.core import Engine, PluginManager, SamplingParams, load_config
from heron_gpt2.config import GPT2Config
from heron_gpt2.ops import GELU_KERNEL, gelu_tanh, gelu_tanh_ref

NUM_NEW = 32
PROMPT_LENS = (3, 21, 50)  # 21 and 50 are not multiples of the block size


def test_plugin_registers_the_family_and_its_kernel():
    pm = PluginManager()
    spec = pm.family_for(architecture="GPT2LMHeadModel")
    assert spec.name == "gpt2" and spec.loader == "heron_gpt2.loader:load"
    assert pm.plugins["gpt2"].kernel_files == [str(GELU_KERNEL)]


def test_config_reads_gpt2_fields_and_refuses_what_it_cannot_serve():
    cfg = GPT2Config.from_hf({"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                              "n_positions": 1024, "eos_token_id": 50256})
    assert (cfg.head_dim, cfg.inner_size, cfg.activation) == (64, 3072, "gelu_new")
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (50256,)
    with pytest.raises(ValueError, match="'swish' is not one of"):
        GPT2Config.from_hf({"n_embd": 8, "activation_function": "swish"})
    with pytest.raises(ValueError, match="cross-attention"):
        GPT2Config.from_hf({"n_embd": 8, "add_cross_attention": True})


def test_gelu_matches_transformers_gelu_new():
    x = torch.linspace(-8, 8, 10_001)
    # transformers' formula in float64: in float32, torch.tanh now and then takes a path
    # 1.7e-4 off near saturation (seen in about one run in ten), which F.gelu does not
    oracle = NewGELUActivation()(x.double())
    assert (gelu_tanh_ref(x).double() - oracle).abs().max() <= 1e-6
    assert torch.equal(gelu_tanh(x), gelu_tanh_ref(x))  # the CPU path is the reference


def engine_for(path, **overrides) -> Engine:
    return Engine(load_config(None, {"model.path": str(path), "model.device": "cpu",
                                     "model.dtype": "float32", "engine.block_size": 8,
                                     "engine.max_num_batched_tokens": 32, **overrides}))


def check_against_transformers(engine: Engine, model, prompts: list[list[int]]) -> None:
    """Greedy tokens equal transformers' generate; every prompt and generated token's
    log-probability equals transformers' within 1e-4."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    worst = 0.0
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                                 min_new_tokens=NUM_NEW, do_sample=False)[0]
            ref = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
        assert out.outputs[0].token_ids == ids[len(prompt):].tolist()
        mine = out.prompt_logprobs[1:] + out.outputs[0].logprobs
        for pos, lp in enumerate(mine):
            worst = max(worst, abs(lp.logprob - ref[pos, lp.token_id].item()),
                        abs(lp.top[0][1] - ref[pos].max().item()))
    assert worst <= 1e-4, f"max abs log-prob error {worst:.2e}"
    assert engine.num_blocks_in_use == 0


def prompts_of(lengths=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


def test_logits_and_greedy_tokens_match_transformers(gpt2):
    path, model = gpt2
    check_against_transformers(engine_for(path), model, prompts_of())


@pytest.mark.parametrize("config", [
    {"tie_word_embeddings": False},
    {"scale_attn_by_inverse_layer_idx": True, "n_inner": 96},
    {"activation_function": "gelu", "n_layer": 3},
], ids=["untied", "layer-scaled", "exact-gelu"])
def test_config_variants_match_transformers(tmp_path, config):
    model = build_gpt2(tmp_path, seed=3, **config)
    check_against_transformers(engine_for(tmp_path), model, prompts_of((9, 30)))


def test_kernel_compiles_with_heron_kernels_check():
    out = subprocess.run([sys.executable, "-m", "heron.server.cli", "kernels", "--check",
                          "--arch", "sm_90"], capture_output=True, text=True)
    if out.returncode == 2:
        pytest.skip("no CUDA compiler here (cupy + NVRTC, or nvcc)")
    line = next(ln for ln in out.stdout.splitlines() if ln.endswith(" compile error")
                or "gelu.cu" in ln)
    assert line.startswith("ok") and "gelu.cu  3 variant(s)" in line, out.stdout


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gelu_kernel_matches_reference_on_gpu(dtype, tol):
    x = (torch.randn(5, 3000, device="cuda") * 3).to(dtype)
    out = gelu_tanh(x)
    ref = gelu_tanh_ref(x.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() <= tol


@needs_cuda
def test_greedy_on_gpu_matches_cpu(gpt2):
    path, _ = gpt2
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in engine_for(path, **{"model.device": d})
               .generate(prompts_of(), params)] for d in ("cpu", "cuda")]
    assert tokens[0] == tokens[1]
