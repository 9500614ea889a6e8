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
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float hsum(v16 x)
{
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#ifdef ACT_BF16
typedef uint16_t elem_t;  // bfloat16: a float32's upper half
typedef uint32_t v16ui __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint16_t v16hv __attribute__((vector_size(32)));

// x's bfloat16 in the upper halves, the lower zero: rounded to nearest even, NaN to torch's
// quiet NaN, the bits of torch's conversion
inline v16ui bf16_bits(v16 x)
{
    const v16ui bits = (v16ui)x;
    const v16ui rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const v16ui nan = (v16ui)(x != x);
    return (rounded & ~nan) | (0x7fc00000u & nan);
}
inline v16 load(const elem_t *p)
{
    return (v16)(__builtin_convertvector(*reinterpret_cast<const v16h *>(p), v16ui) << 16);
}
inline void store(elem_t *p, v16 x)
{
    *reinterpret_cast<v16h *>(p) = __builtin_convertvector(bf16_bits(x) >> 16, v16hv);
}
inline v16 round_act(v16 x) { return (v16)bf16_bits(x); }  // as torch would store it
inline float widen(elem_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}
inline elem_t narrow(float x)
{
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return x != x ? 0x7fc0 : (elem_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float elem_t;
inline v16 load(const elem_t *p) { return *reinterpret_cast<const v16u *>(p); }
inline void store(elem_t *p, v16 x) { *reinterpret_cast<v16u *>(p) = x; }
inline float widen(elem_t x) { return x; }
inline elem_t narrow(float x) { return x; }
inline v16 round_act(v16 x) { return x; }
#endif

inline float round_act(float x) { return widen(narrow(x)); }

void norm_row(const elem_t *x, const elem_t *residual, const elem_t *weight, elem_t *out,
              elem_t *residual_out, int64_t n, float eps)
{
    const int64_t vn = n - n % 16;
    const elem_t *s = x;
    if (residual) {
        for (int64_t i = 0; i < vn; i += 16)
            store(residual_out + i, load(x + i) + load(residual + i));
        for (int64_t i = vn; i < n; ++i)
            residual_out[i] = narrow(widen(x[i]) + widen(residual[i]));
        s = residual_out;
    }
    v16 squares = {};
    for (int64_t i = 0; i < vn; i += 16) {
        const v16 v = load(s + i);
        squares += v * v;
    }
    float sum = hsum(squares);
    for (int64_t i = vn; i < n; ++i)
        sum += widen(s[i]) * widen(s[i]);
    const float r = 1.0f / std::sqrt(sum / (float)n + eps);
    for (int64_t i = 0; i < vn; i += 16)
        store(out + i, round_act(load(s + i) * r) * load(weight + i));
    for (int64_t i = vn; i < n; ++i)
        out[i] = narrow(round_act(widen(s[i]) * r) * widen(weight[i]));
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
