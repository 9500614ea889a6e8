// RMSNorm on the CPU with the residual add fused (heron_rms_norm): one pass over each row.
//
// torch spends six ops on it (add, pow, mean, add, rsqrt, two muls); with a decode step's few
// rows each costs more in dispatch than in arithmetic, and a layer runs two of them.
//
// x [rows, n] float32, rows x_stride apart, elements contiguous; residual the same with
// res_stride, or null; weight [n]; out and residual_out [rows, n] contiguous (residual_out
// unused without residual). With a residual: s = x + residual goes to residual_out and is the
// row normalized. out = (s * rsqrt(mean(s^2) + eps)) * weight, the order of torch's ops.

#include <cmath>
#include <cstdint>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load(const float *p) { return *reinterpret_cast<const v16u *>(p); }
inline void store(float *p, v16 x) { *reinterpret_cast<v16u *>(p) = x; }

inline float hsum(v16 x)
{
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

void norm_row(const float *x, const float *residual, const float *weight, float *out,
              float *residual_out, int64_t n, float eps)
{
    const int64_t vn = n - n % 16;
    const float *s = x;
    if (residual) {
        for (int64_t i = 0; i < vn; i += 16)
            store(residual_out + i, load(x + i) + load(residual + i));
        for (int64_t i = vn; i < n; ++i)
            residual_out[i] = x[i] + residual[i];
        s = residual_out;
    }
    v16 squares = {};
    for (int64_t i = 0; i < vn; i += 16) {
        const v16 v = load(s + i);
        squares += v * v;
    }
    float sum = hsum(squares);
    for (int64_t i = vn; i < n; ++i)
        sum += s[i] * s[i];
    const float r = 1.0f / std::sqrt(sum / (float)n + eps);
    for (int64_t i = 0; i < vn; i += 16)
        store(out + i, load(s + i) * r * load(weight + i));
    for (int64_t i = vn; i < n; ++i)
        out[i] = s[i] * r * weight[i];
}

}  // namespace

extern "C" void heron_rms_norm(const float *x, int64_t x_stride, const float *residual,
                               int64_t res_stride, const float *weight, float *out,
                               float *residual_out, int64_t rows, int64_t n, float eps)
{
    // a decode step's rows take a few microseconds on one thread: waking others costs more
    #pragma omp parallel for if (rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        norm_row(x + r * x_stride, residual ? residual + r * res_stride : nullptr, weight,
                 out + r * n, residual_out + r * n, n, eps);
}
