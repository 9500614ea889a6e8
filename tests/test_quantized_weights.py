"""GGUF weights kept quantized (`model.keep_quantized`): the CPU kernel against gguf's own
dequantization and a float64 matmul, the loader against its dequantizing self, and engines
with and without it."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from heron.core import cpu_kernels
from heron.core.ops import linear, pack_weight, quantized
from heron.core.ops.linear import unpack_weight
from heron.core.ops.quantized import (KeptWeight, QuantizedStack, QuantizedWeight,
                                      kernel_available, quantized_linear)
from heron.plugins.transformer.gguf_loader import load_gguf
from tests.kernel_utils import vector_widths
from tests.test_gguf import TINY, _random_blocks, _tiny_tensors, _write, tiny_meta

KEPT = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
        Q.IQ4_XS]

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None,
                                reason="no C++ compiler to build the quantized kernel")


def test_the_kernel_builds():
    assert all(kernel_available(int(q)) for q in KEPT)


def random_weight(qtype, rows, cols, seed=0) -> QuantizedWeight:
    """Random blocks: every nibble / int8 value and fp16 scales of every exponent (no inf,
    no NaN; subnormals included)."""
    raw = _random_blocks(np.random.default_rng(seed), rows, cols, qtype)
    return QuantizedWeight(torch.from_numpy(raw), int(qtype), cols)


def whole_blocks(qtype, width: int) -> int:
    """``width`` rounded up to whole blocks of ``qtype`` (32 values, a K-quant's 256)."""
    values = quantized.QUANT_TYPES[qtype].values
    return -(-width // values) * values


def gguf_values(w: QuantizedWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.blocks.numpy(), Q(w.qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
@pytest.mark.parametrize("path", ["tiles", "dequantized"])
def test_the_kernel_reads_gguf_values_exactly(qtype, path, monkeypatch):
    """One-hot rows pick single weights out: exact sums, so the product is the weight itself,
    bit for bit gguf's dequantization (scales, offsets, nibble order, signs), through the
    kernel's tiles, its one-row path and its dequantized weight (many rows)."""
    monkeypatch.setattr(quantized, "DEQUANTIZED_ROWS", 10**9 if path == "tiles" else 1)
    assert_reads_gguf_values(qtype)


def assert_reads_gguf_values(qtype):
    width = whole_blocks(qtype, 96)
    w = random_weight(qtype, 37, width)
    expected = gguf_values(w)
    assert torch.isfinite(expected).all() and (expected != 0).any()
    picked = quantized_linear(torch.eye(width), w)
    assert torch.equal(picked.T, expected)
    for j in range(0, width, 7):  # one row at a time: a decode step's path
        assert torch.equal(quantized_linear(torch.eye(width)[j:j + 1], w)[0], expected[:, j])
    assert torch.equal(w.dequantize(), expected)


@pytest.fixture
def without_avx2(monkeypatch):
    """The kernel built without AVX2 and FMA (its plain C++, for CPUs without them), whatever
    this machine's."""
    monkeypatch.setattr(cpu_kernels, "FLAGS",
                        (*cpu_kernels.FLAGS, "-mno-avx512f", "-mno-avx2", "-mno-fma"))
    monkeypatch.setattr(cpu_kernels, "_LIBRARIES", {})
    monkeypatch.setattr(quantized, "_kernel", functools.cache(quantized._kernel.__wrapped__))


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_the_kernel_without_avx2(qtype, without_avx2, monkeypatch):
    """The plain C++ reads gguf's values exactly (through its tiles) and multiplies int8
    rows as the AVX2 code does."""
    monkeypatch.setattr(quantized, "DEQUANTIZED_ROWS", 10**9)
    assert_reads_gguf_values(qtype)
    test_int8_activations_are_their_integer_products(qtype, 5, 13, 544, monkeypatch)


vector_width = vector_widths(quantized, "_kernel")


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,out,width", [
    (1, 1, 32), (1, 576, 576), (3, 5, 64), (4, 7, 96), (5, 13, 544), (63, 64, 160),
    (64, 3, 32), (65, 130, 256), (130, 47, 192)])
def test_the_kernel_is_a_float32_matmul(qtype, rows, out, width, vector_width):
    """Against a float64 matmul of gguf's values, within float32 summation error, on one
    thread and several (the larger shapes), over rows and columns that fill no whole tile;
    the input rows strided (a slice of wider rows). From `DEQUANTIZED_ROWS` rows on, the
    dequantized weight's product."""
    width = whole_blocks(qtype, width)
    w = random_weight(qtype, out, width, seed=rows * out)
    wide = torch.randn(rows, width + 40, generator=torch.Generator().manual_seed(out))
    x = wide[:, 20:20 + width]
    y = quantized_linear(x, w)
    values = gguf_values(w).double()
    expected = x.double() @ values.T
    bound = 1e-5 * (x.double().abs() @ values.abs().T) + 1e-30
    assert y.shape == (rows, out) and y.dtype == torch.float32
    assert ((y.double() - expected).abs() <= bound).all()


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 path's rounding of ``x``, in the kernel's float32 ops: per block of 32,
    d = max |x| / 127 and q = x * (1 / d) rounded, ties to even. Returns (q, d per value)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (blocks * inverse).round().reshape(x.shape), d.expand_as(blocks).reshape(x.shape)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,out,width", [(1, 1, 32), (1, 576, 576), (3, 5, 64),
                                            (4, 7, 96), (9, 130, 256), (16, 47, 192)])
def test_int8_activations_are_their_integer_products(qtype, rows, out, width, monkeypatch):
    """``int8_activations`` up to the type's `int8_rows` (16 here for all): each block of x
    rounded to int8 with its scale (a block of zeros among them), then multiplied with
    gguf's values: a float64 product of those rounded rows, within float32 summation error;
    and within the rounding's ~0.5% of the exact product."""
    monkeypatch.setitem(quantized.QUANT_TYPES, qtype,
                        quantized.QUANT_TYPES[qtype]._replace(int8_rows=16))
    width = whole_blocks(qtype, width)
    w = random_weight(qtype, out, width, seed=rows + out)
    w.int8_activations = True
    wide = torch.randn(rows, width + 40, generator=torch.Generator().manual_seed(out))
    x = wide[:, 20:20 + width]
    x[0, :32] = 0.0
    q, d = int8_rows(x)
    assert q.abs().max() <= 127
    values = gguf_values(w).double()
    y = quantized_linear(x, w).double()
    rounded = (q * d).double()
    expected = rounded @ values.T
    bound = 1e-5 * (rounded.abs() @ values.abs().T) + 1e-30
    assert ((y - expected).abs() <= bound).all()
    exact = x.double() @ values.T
    assert (y - exact).norm() <= 0.02 * exact.norm()
    # past them, the float32 kernel's product
    more = torch.randn(quantized.QUANT_TYPES[qtype].int8_rows + 1, width,
                       generator=torch.Generator().manual_seed(1))
    plain = QuantizedWeight(w.blocks, w.qtype, w.in_features)
    assert torch.equal(quantized_linear(more, w), quantized_linear(more, plain))


def test_linear_takes_a_quantized_weight():
    """`linear` (bias, ReLU, 3-D rows) and `pack_weight` / `unpack_weight` with one; other
    dtypes multiply its dequantized values."""
    w = random_weight(Q.Q4_1, 24, 64)
    dense = gguf_values(w)
    assert pack_weight(w) is w and torch.equal(unpack_weight(w), dense)
    x = torch.randn(2, 3, 64)
    bias = torch.randn(24)
    got = linear(x, w, bias, relu=True)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, torch.relu(x @ dense.T + bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.bfloat16(), w).float(),
                               (x.bfloat16() @ dense.bfloat16().T).float())
    assert linear(torch.empty(0, 64), w).shape == (0, 24)


def test_a_quantized_weight_moves_and_fuses():
    a, b = random_weight(Q.Q8_0, 4, 64, 1), random_weight(Q.Q8_0, 6, 64, 2)
    fused = QuantizedWeight.cat([a, b])
    assert fused.shape == (10, 64) and torch.equal(fused.dequantize(),
                                                   torch.cat([gguf_values(a), gguf_values(b)]))
    assert QuantizedWeight.cat([a, random_weight(Q.Q8_0, 4, 96)]) is None
    b.int8_activations = True
    assert QuantizedWeight.cat([a, b]) is None
    a.int8_activations = True
    assert QuantizedWeight.cat([a, b]).int8_activations
    assert a.to(device="cpu", dtype=torch.float32) is a
    moved = a.to(device="cpu", dtype=torch.bfloat16)
    assert isinstance(moved, torch.Tensor) and torch.equal(moved, gguf_values(a).bfloat16())
    with pytest.raises(ValueError, match="do not hold rows of 96"):
        QuantizedWeight(a.blocks, int(Q.Q8_0), 96)
    with pytest.raises(ValueError, match="ggml type 10"):
        QuantizedWeight(a.blocks, int(Q.Q2_K), 64)
    with pytest.raises(ValueError, match="Q4_K blocks of shape"):  # 256 values a block
        QuantizedWeight(random_weight(Q.Q4_K, 4, 256).blocks, int(Q.Q4_K), 128)


def test_weights_of_several_types_fuse_as_a_stack():
    """q and k of one type beside v of another (a Q4_K_M layer): one part a run of a type,
    multiplied part by part into the fused weight's columns."""
    q, k, v = (random_weight(t, rows, 512, rows) for t, rows in
               ((Q.Q4_K, 8), (Q.Q4_K, 4), (Q.Q6_K, 4)))
    fused = QuantizedWeight.cat([q, k, v])
    assert isinstance(fused, QuantizedStack) and fused.shape == (16, 512)
    assert [(p.qtype, p.shape[0]) for p in fused.parts] == [(Q.Q4_K, 12), (Q.Q6_K, 4)]
    values = torch.cat([gguf_values(q), gguf_values(k), gguf_values(v)])
    assert torch.equal(fused.dequantize(), values) and torch.equal(unpack_weight(fused), values)
    assert fused.to(device="cpu") is fused and pack_weight(fused) is fused
    assert torch.equal(fused.to(dtype=torch.bfloat16), values.bfloat16())
    bias = torch.randn(16)
    for rows in (1, 3, quantized.DEQUANTIZED_ROWS):  # the register, tile and GEMM paths
        x = torch.randn(rows, 512)
        expected = x.double() @ values.double().T + bias.double()
        bound = 1e-5 * (x.double().abs() @ values.double().abs().T) + 1e-6
        assert ((linear(x, fused, bias).double() - expected).abs() <= bound).all()
    v.int8_activations = True
    assert QuantizedWeight.cat([q, k, v]) is None


# -- loading ----------------------------------------------------------------------------------

# where each block's fp16 d (and dmin) lies
K_SCALE = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _k_blocks(rng, rows, cols, qtype):
    """Random ``qtype`` blocks whose fp16 d (and dmin) are 1e-4: values of at most ~0.1, as a
    trained 256-wide projection's (gguf-py cannot quantize K-quants)."""
    raw = _random_blocks(rng, rows, cols, qtype)
    blocks = raw.reshape(rows, -1, quantized.QUANT_TYPES[qtype].bytes)
    for offset in K_SCALE[qtype]:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return raw


def _tiny_gguf(tmp_path, arch, types="mixed"):
    """A tiny ``arch`` GGUF: ``mixed``, test_gguf's mix of types per projection; ``fused``,
    Q4_1 or Q8_0 for all of a layer's, so q/k/v and gate/up fuse quantized; ``k``, as a
    Q4_K_M file: Q4_K (layer 0) or Q5_K (layer 1) where rows are whole 256-value blocks,
    ffn_down Q5_0 (llama.cpp's stand-in for Q4_K there), attn_v, the embeddings and LM head
    Q6_K."""
    rng = np.random.default_rng(4)
    tensors = _tiny_tensors(arch, rng, with_output=arch != "qwen3")
    for name, (array, qtype) in list(tensors.items()):
        if array.ndim != 2:
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if layer is not None:
            # scaled as trained weights are, so activations stay in range layer to layer
            array = array / np.sqrt(array.shape[1])
            if types == "fused":
                qtype = (Q.Q4_1, Q.Q8_0)[layer % 2]
        if types == "k":
            qtype = (Q.Q6_K if layer is None or ".attn_v." in name
                     else Q.Q5_0 if array.shape[1] % 256 else (Q.Q4_K, Q.Q5_K)[layer])
            if qtype != Q.Q5_0:
                array = _k_blocks(rng, *array.shape, qtype)
        tensors[name] = (array, qtype)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write(path, arch, tensors, meta=tiny_meta(arch))
    return path, {name: qtype for name, (_, qtype) in tensors.items()}


@pytest.mark.parametrize("types", ["mixed", "k"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_loader_keeps_what_it_can_multiply(tmp_path, arch, types):
    """Projections of the kept types and the LM head (the embeddings' blocks when tied) stay
    quantized, with the dequantizing load's values (llama's permuted q/k rows included);
    everything else is the dequantizing load's tensor."""
    path, types = _tiny_gguf(tmp_path, arch, types)
    _, dense, _ = load_gguf(path)
    _, kept, _ = load_gguf(path, keep_quantized=True)
    tied = arch == "qwen3"
    assert set(kept) == set(dense) | ({"lm_head.weight"} if tied else set())
    quantized = {name for name, t in kept.items() if isinstance(t, QuantizedWeight)}
    expected = {name for name, t in types.items() if t in KEPT and name.startswith("blk.")}
    assert len(quantized) == len(expected) + 1 > 1  # the LM head too
    for name, t in kept.items():
        if isinstance(t, QuantizedWeight):
            reference = dense["model.embed_tokens.weight" if name not in dense else name]
            assert torch.equal(t.dequantize(), reference), name
        else:
            assert torch.equal(t, dense[name]), name
    assert not isinstance(kept["model.embed_tokens.weight"], QuantizedWeight)


@pytest.mark.parametrize("types", ["mixed", "fused", "k"])
def test_an_engine_with_kept_weights(tmp_path, types):
    """A tiny llama GGUF served greedily both ways (chunked prefills beside decodes): the
    runner holds quantized weights, fused where the types agree, and its logits are the
    dequantized model's to float32 rounding, its tokens the same."""
    from heron.core.sampling_params import SamplingParams
    from tests.engine_utils import LogitsRecorder, assert_no_leaks, make_engine

    path, _ = _tiny_gguf(tmp_path, "llama", types)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TINY["vocab"], (n,), generator=g).tolist() for n in (5, 40, 12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(keep):
        engine = make_engine(path, **{"model.keep_quantized": keep,
                                      "engine.max_num_batched_tokens": 16})
        layer = engine.runner.model.layers[0]
        weights = [layer.attn.qkv, layer.attn.o, layer.gate_up, layer.down,
                   engine.runner.model.lm_head]
        recorder = LogitsRecorder(engine)
        outs = engine.generate(prompts, params)
        assert_no_leaks(engine)
        return weights, [o.outputs[0].token_ids for o in outs], recorder.rows

    weights, tokens, rows = run(True)
    kinds = [isinstance(w, KeptWeight) for w in weights]
    # mixed: layer 0 has Q8_0 q, Q4_1 k, F16 v, BF16 o, F32 gate, Q8_0 up, Q4_1 down
    assert kinds == ([False, False, False, True, True] if types == "mixed" else [True] * 5)
    assert isinstance(weights[0], QuantizedStack) == (types == "k")  # Q4_K q, k; Q6_K v
    dense_weights, ref_tokens, ref_rows = run(False)
    assert not any(isinstance(w, KeptWeight) for w in dense_weights)
    assert tokens == ref_tokens and rows.keys() == ref_rows.keys()
    for key, row in rows.items():
        torch.testing.assert_close(row, ref_rows[key], rtol=0, atol=1e-5 * row.abs().max())
    # "int8": the same weights, small batches' rows rounded to int8: near, not equal
    int8_weights, _, int8_rows = run("int8")
    assert [w.int8_activations for w in int8_weights if isinstance(w, KeptWeight)] == [
        True] * sum(kinds)
    firsts = {rid: min(p for r, p in int8_rows if r == rid) for rid, _ in int8_rows}
    errors = [((int8_rows[rid, p] - ref_rows[rid, p]).abs().max()
               / ref_rows[rid, p].abs().max()).item() for rid, p in firsts.items()]
    assert 0 < max(errors) <= 0.05  # each prompt's last row (later ones may follow others)


def test_not_kept_in_bfloat16(tmp_path):
    """Where rows are not float32 the loader dequantizes everything, as without the key."""
    from tests.engine_utils import make_engine

    path, _ = _tiny_gguf(tmp_path, "llama", "fused")
    engine = make_engine(path, **{"model.keep_quantized": True, "model.dtype": "bfloat16"})
    layer = engine.runner.model.layers[0]
    assert layer.attn.qkv.dtype == torch.bfloat16
    assert not isinstance(layer.attn.qkv, QuantizedWeight)

