// SiLU-and-mul on the CPU (heron_silu_and_mul): out = silu(gate) * up over a fused gate/up
// projection's rows, one pass.
//
// torch takes four ops for it (two slices, silu, mul); with a decode step's single row each
// costs more in dispatch than in arithmetic, and every layer of a gated MLP runs it.
//
// x [rows, 2 d], rows x_stride apart, gate first, elements contiguous; out [rows, d]
// contiguous. All float32, or all bfloat16 with ACT_BF16 defined, where silu(gate) rounds to
// bfloat16 before the product, which rounds again, as torch's two ops do.
// silu(g) = g * sigmoid(g), the sigmoid from t = exp(-|g|) <= 1: 1 / (1 + t) for g >= 0,
// t / (1 + t) below, so no exp overflows; relative error ~3e-7 against torch's float32.

#include <cmath>
#include <cstdint>

#include "act_cpu.h"
#include "packed_cpu.h"

namespace {

inline vec vsilu(vec g)
{
    const vec t = vexp(g < vec{} ? g : -g);
    const vec sigmoid = (g < vec{} ? t : vec{} + 1.0f) / (t + 1.0f);
    return g * sigmoid;
}

inline float silu(float g)
{
    const float t = std::exp(-std::fabs(g));
    return g * ((g < 0.0f ? t : 1.0f) / (t + 1.0f));
}

void row(const elem_t *gate, const elem_t *up, elem_t *out, int64_t d)
{
    const int64_t vd = d - d % VL;
    for (int64_t i = 0; i < vd; i += VL)
        vstore(out + i, round_act(vsilu(vload(gate + i))) * vload(up + i));
    for (int64_t i = vd; i < d; ++i)
        put(out + i, round_act(silu(widen(gate[i]))) * widen(up[i]));
}

}  // namespace

extern "C" void heron_silu_and_mul(const elem_t *x, int64_t x_stride, elem_t *out,
                                   int64_t rows, int64_t d)
{
    // a decode step's rows take a few microseconds on one thread: waking others costs more
    #pragma omp parallel for if (rows * d >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        row(x + r * x_stride, x + r * x_stride + d, out + r * d, d);
}

HERON_PACKED(heron_silu_and_mul)
