// RMSNorm on the CPU with the residual add fused (heron_rms_norm): one pass over each row.
//
// torch spends up to seven ops on it (add, pow, mean, add, rsqrt, two muls); with a decode
// step's few rows each costs more in dispatch than in arithmetic, and a layer runs two of them.
//
// x [rows, n], rows x_stride apart, elements contiguous; residual the same with res_stride,
// or null; weight [n]; out and residual_out [rows, n] contiguous (residual_out unused without
// residual). All float32, or all bfloat16 with ACT_BF16 defined. With a residual:
// s = x + residual goes to residual_out and is the row normalized. float32:
// out = (s * rsqrt(mean(s^2) + eps)) * weight, the order of torch's ops; bfloat16, as
// `rms_norm_ref` does it: s rounds to bfloat16, the norm is taken in float32 and rounds to
// bfloat16 before the product with the weight, which rounds again.

#include <cmath>
#include <cstdint>

#include "act_cpu.h"
#include "packed_cpu.h"

namespace {

void norm_row(const elem_t *x, const elem_t *residual, const elem_t *weight, elem_t *out,
              elem_t *residual_out, int64_t n, float eps)
{
    const int64_t vn = n - n % 16;  // whole vectors of 16, as on every machine: the same sums
    const elem_t *s = x;
    if (residual) {
        for (int64_t i = 0; i < vn; i += VL)
            vstore(residual_out + i, vload(x + i) + vload(residual + i));
        for (int64_t i = vn; i < n; ++i)
            put(residual_out + i, widen(x[i]) + widen(residual[i]));
        s = residual_out;
    }
    vec squares[16 / VL] = {};  // lane i of the sum of squares is element i of each 16
    for (int64_t i = 0; i < vn; i += 16)
        for (int c = 0; c < 16 / VL; ++c) {
            const vec v = vload(s + i + c * VL);
            squares[c] += v * v;
        }
    float sum = hsum16(squares);
    for (int64_t i = vn; i < n; ++i)
        sum += widen(s[i]) * widen(s[i]);
    const float r = 1.0f / std::sqrt(sum / (float)n + eps);
    for (int64_t i = 0; i < vn; i += VL)
        vstore(out + i, round_act(vload(s + i) * r) * vload(weight + i));
    for (int64_t i = vn; i < n; ++i)
        put(out + i, round_act(widen(s[i]) * r) * widen(weight[i]));
}

}  // namespace

extern "C" void heron_rms_norm(const elem_t *x, int64_t x_stride, const elem_t *residual,
                               int64_t res_stride, const elem_t *weight, elem_t *out,
                               elem_t *residual_out, int64_t rows, int64_t n, float eps)
{
    // a decode step's rows take a few microseconds on one thread: waking others costs more
    #pragma omp parallel for if (rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        norm_row(x + r * x_stride, residual ? residual + r * res_stride : nullptr, weight,
                 out + r * n, residual_out + r * n, n, eps);
}

HERON_PACKED(heron_rms_norm)
