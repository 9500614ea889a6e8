"""Decode steps recorded once and replayed on the CPU (`heron.core.cpu_graphs`).

Engines replaying steps against the same engines stepping eagerly and against transformers'
greedy generation: tokens equal, logprobs within float32 rounding, padding rows and
contexts past the first bound exercised; kept-quantized GGUF weights (a fused q/k/v of two types, joined by
a torch op inside the record); and the recorder on its own: what it keeps, what it refuses,
and a kernel's failure stopping a replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.core import cpu_graphs, cpu_kernels
from heron.core.ops.activation import silu_and_mul
from heron.core.ops.attention import rotary_write_kv
from heron.core.ops.norm import rms_norm
from heron.core.ops.rotary import rope_cos_sin_cache
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.hybrid_models import build_hybrid
from tests.lora_models import build_standard_adapters
from tests.test_quantized_weights import _tiny_gguf
from tests.test_gguf import TINY
from tests.tiny_models import build_tiny

# five sequences (a batch of 8 with padding, then fewer as they finish); the long one
# crosses the first context bound (256): the torch ops' steps record a second graph
PROMPT_LENS = (3, 17, 9, 250, 12)


def _requests(vocab: int, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True,
                             logprobs=3) for i in range(len(lens))]
    # one sampled request: the replay's logits feed the seeded sampler as eager logits do
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True,
                               logprobs=3)
    return prompts, params


def _generate(path, graphs: bool, prompts, params, adapters=(), **overrides):
    engine = make_engine(path, **{"engine.cpu_graphs": graphs, "engine.block_size": 8,
                                  "engine.max_num_seqs": 8, **overrides})
    assert (engine.graphs is not None) == graphs
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p,
                           adapter=adapters[i % len(adapters)] if adapters else None)
    outs = run_to_end(engine)
    assert_no_leaks(engine)
    return engine, [outs[f"r{i}"].outputs[0] for i in range(len(prompts))]


def _assert_same(outs, ref_outs, atol=1e-5):
    for out, ref in zip(outs, ref_outs):
        assert out.token_ids == ref.token_ids
        for lp, ref_lp in zip(out.logprobs, ref.logprobs):
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
            assert lp.logprob == pytest.approx(ref_lp.logprob, abs=atol)


@pytest.mark.parametrize("kind, kernels", [("llama", True), ("qwen3", True),
                                           ("llama", False)])
def test_replayed_steps_match_eager_and_transformers(kind, kernels, tmp_path):
    """``kernels`` False: attention by torch ops (SDPA, and reshapes that copy)."""
    model = build_tiny(kind, tmp_path)
    prompts, params = _requests(model.config.vocab_size)
    settings = {"engine.cpu_kernels": kernels}
    engine, outs = _generate(tmp_path, True, prompts, params, **settings)
    _, eager = _generate(tmp_path, False, prompts, params, **settings)
    _assert_same(outs, eager)
    graphs = engine.graphs
    assert graphs.replays > 10
    assert None not in graphs.graphs.values(), "a step was not recorded"
    sizes, bounds = {k[0] for k in graphs.graphs}, {k[1] for k in graphs.graphs}
    # the compiled attention's records serve any context; the torch ops' one bound each
    assert bounds == ({model.config.max_position_embeddings} if kernels else {256, 512})
    assert 8 in sizes and len(sizes) > 2, graphs.graphs.keys()
    for prompt, p, out in zip(prompts, params, outs):
        if p.temperature:
            continue
        ids = torch.tensor([prompt])
        with torch.no_grad():  # greedy, past EOS as ``ignore_eos``
            for _ in range(p.max_tokens):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert out.token_ids == ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("keep", [True, "int8"])
def test_kept_quantized_weights_replay(keep, tmp_path):
    """Q4_K/Q5_K/Q6_K/Q5_0 weights, q/k/v a stack of two types (their products joined by a
    torch op between the kernels of the record)."""
    path, _ = _tiny_gguf(tmp_path, "llama", "k")
    prompts, params = _requests(TINY["vocab"], lens=(3, 17, 9, 12))
    engine, outs = _generate(path, True, prompts, params, **{"model.keep_quantized": keep})
    _, eager = _generate(path, False, prompts, params, **{"model.keep_quantized": keep})
    _assert_same(outs, eager)
    assert engine.graphs.replays > 10 and None not in engine.graphs.graphs.values()


def test_steps_with_adapters_run_eagerly(tmp_path):
    """An adapter's rows take the eager forward (its scales are read on the host); steps
    of base-model rows alone replay."""
    model = build_tiny("llama", tmp_path / "base")
    adapters = build_standard_adapters(model, tmp_path)
    names = [None, list(adapters)[0], None]
    prompts, params = _requests(model.config.vocab_size, lens=(5, 9, 30))
    settings = {"lora.adapters": {n: str(p) for n, p in adapters.items()}}
    engine, outs = _generate(tmp_path / "base", True, prompts, params, names, **settings)
    _, eager = _generate(tmp_path / "base", False, prompts, params, names, **settings)
    _assert_same(outs, eager)
    assert all(not key[2] for key in engine.graphs.graphs)  # no record with adapter rows
    assert engine.graphs.replays > 0  # the last request's steps, alone


def test_a_family_that_does_not_support_them_steps_eagerly(tmp_path):
    build_hybrid("mamba2", tmp_path)
    assert make_engine(tmp_path).graphs is None


# -- the recorder on its own ---------------------------------------------------------------

def _layer_tail(x, residual, w_norm, w_up):
    """A norm with the residual add (a kernel), a matmul (torch), SiLU-and-mul (a kernel)."""
    h, summed = rms_norm(x, w_norm, 1e-6, residual)
    return silu_and_mul(h @ w_up) + summed.sum(-1, keepdim=True)


def test_a_record_replays_on_new_values():
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    w_norm, w_up = torch.randn(32, generator=g), torch.randn(32, 64, generator=g)
    logits, graph = cpu_graphs.record(lambda _: _layer_tail(x, residual, w_norm, w_up), None)
    torch.testing.assert_close(logits, _layer_tail(x, residual, w_norm, w_up))
    assert graph is not None
    assert [type(r).__name__ for r in graph.runs] == [
        "_KernelRun", "_TorchCall", "_KernelRun", "_TorchCall", "_TorchCall"]
    for _ in range(3):
        x.copy_(torch.randn(3, 32, generator=g))
        residual.copy_(torch.randn(3, 32, generator=g))
        assert graph.replay()
        torch.testing.assert_close(graph.output, _layer_tail(x, residual, w_norm, w_up),
                                   rtol=0, atol=0)


def test_a_view_that_copies_is_repeated():
    x = torch.randn(4, 6)
    out, graph = cpu_graphs.record(lambda _: x.t().reshape(-1) * 2, None)  # reshape copies
    x.copy_(torch.randn(4, 6))
    assert graph.replay()
    torch.testing.assert_close(graph.output, x.t().reshape(-1) * 2, rtol=0, atol=0)


@pytest.mark.parametrize("unrepeatable", [
    lambda x: x * x.sum().item(),              # a value read on the host
    lambda x: x * 2 if (x > 9).any() else x,   # a branch on one (bool: is_nonzero, untagged)
    lambda x: x * torch.equal(x, x.abs()),     # a bool out of two tensors
    lambda x: x + torch.rand(x.shape),         # random numbers
    lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None], dropout_p=0.5)[0],
    lambda x: x[x > 0].sum(0, keepdim=True),   # a shape that depends on values
])
def test_what_a_replay_could_not_repeat_is_not_kept(unrepeatable, caplog):
    x = torch.randn(4, 8)
    with caplog.at_level("INFO", logger="heron.core.cpu_graphs"):
        out, graph = cpu_graphs.record(lambda _: unrepeatable(x), None)
    assert graph is None and out.shape == unrepeatable(x).shape
    assert "not recorded (torch op" in caplog.text


def test_a_kernel_without_a_packed_entry_is_not_kept():
    lib = cpu_kernels.load("norm_cpu.cpp")
    bare = cpu_kernels.Kernel(lib.heron_rms_norm.function, None)
    x, out = torch.randn(1, 16), torch.empty(1, 16)
    weight = torch.ones(16)

    def forward(_):
        bare(x.data_ptr(), 16, None, 0, weight.data_ptr(), out.data_ptr(), None, 1, 16,
             1e-6)
        return out

    assert cpu_graphs.record(forward, None)[1] is None
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-6)[0])


def test_a_failing_kernel_stops_the_replay():
    """The rotary kernel refuses a slot past the cache: a replay reports it (the engine
    then runs the step eagerly, whose torch ops raise a clear error)."""
    heads, kv_heads, dim = 4, 2, 16
    q, k, v = (torch.randn(2, h, dim) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = torch.zeros(2, 8, kv_heads, dim), torch.zeros(2, 8, kv_heads, dim)
    positions, slots = torch.tensor([3, 4]), torch.tensor([5, 9])
    cos_sin = rope_cos_sin_cache(dim, 64, 10000.0, None)
    _, graph = cpu_graphs.record(lambda _: rotary_write_kv(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots), None)
    assert graph is not None and graph.replay()
    slots[1] = 16  # past the 16 slots of the cache
    assert not graph.replay()

