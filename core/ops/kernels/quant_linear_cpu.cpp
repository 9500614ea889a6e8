// Projections from GGUF-quantized weights on the CPU (heron_quant_linear):
// y [M, N] = x [M, K] @ dequantize(w)^T, the weight kept in its file's blocks.
//
// Reading a decode step's weights sets its speed: a Q4_1 weight is 0.625 bytes a value
// against float32's 4. Each task dequantizes a tile of NT weight rows into a small float32
// buffer (exactly gguf's values: d * q is exact in float32, so fused or not, d * q + m
// rounds once, as numpy's two ops do) and multiplies it with a block of rows of x, so the
// result differs from a float32 matmul of the dequantized weight only in summation order.
// A single row of x (with AVX2) multiplies each block in registers instead.
//
// QTYPE: 2 Q4_0 (fp16 d, 16 bytes of nibbles: d * (q - 8)), 3 Q4_1 (fp16 d, fp16 m, nibbles:
// d * q + m), 8 Q8_0 (fp16 d, 32 int8: d * q); ggml's type numbers. A block holds 32 values:
// the nibbles' low halves are values 0-15, their high halves 16-31. K is a multiple of 32.
// x rows are x_stride floats apart, y rows y_stride; w's rows are K / 32 blocks, contiguous.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "vec_cpu.h"

namespace {

// The tile: MT rows of x by NT weight rows, MT * NT accumulators of one register (`vec`)
// and NT weight vectors, which fit AVX-512's 32 registers and AVX2's 16.
constexpr int64_t NT = VECTOR_REGISTERS == 32 ? 4 : 3, MT = 4;
constexpr int64_t MB = 64;  // x rows a task takes

inline float half_to_float(const uint8_t *p)
{
    _Float16 h;
    std::memcpy(&h, p, sizeof h);
    return (float)h;
}

#if QTYPE != 2 && QTYPE != 3 && QTYPE != 8
#error "QTYPE must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)"
#endif
// a block: fp16 d, then (Q4_1) fp16 m, then the quantized bytes
constexpr int64_t BLOCK_BYTES = QTYPE == 2 ? 18 : QTYPE == 3 ? 20 : 34;
constexpr bool NIBBLES = QTYPE != 8, SIGNED = QTYPE == 8;

// block b's quantized bytes, and d and m of its values' d * q + m (Q4_0's m = -8 d: then
// d * q + m is (q - 8) * d exactly, which a float32 holds)
inline const uint8_t *params(const uint8_t *b, float &d, float &m)
{
    d = half_to_float(b);
    m = QTYPE == 3 ? half_to_float(b + 2) : QTYPE == 2 ? -8.0f * d : 0.0f;
    return b + (QTYPE == 3 ? 4 : 2);
}

// A block's 32 values from its bytes q (8-bit ints; nibbles: 16 bytes whose low then high
// halves are the values) as float32 d * q + m. d * q is exact in float32 (11 by 8
// significant bits at most), so fused or not, d * q + m rounds once, as gguf's numpy does.
#if defined(__AVX2__) && defined(__FMA__)
#define BLOCK_IN_REGISTERS 1
// ... as four registers of 8 values, in order
inline void dequantize(const uint8_t *b, __m256 w[4])
{
    float d, m;
    const uint8_t *q = params(b, d, m);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    __m128i bytes[2];
    if (NIBBLES) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(q));
        const __m128i low = _mm_set1_epi8(0x0f);
        bytes[0] = _mm_and_si128(raw, low);
        bytes[1] = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    } else {
        bytes[0] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(q));
        bytes[1] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(q + 16));
    }
    for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) {
            const __m128i part = e ? _mm_srli_si128(bytes[h], 8) : bytes[h];
            const __m256 v = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(part)
                                                       : _mm256_cvtepu8_epi32(part));
            w[2 * h + e] = _mm256_fmadd_ps(v, vd, vm);
        }
}
inline void dequantize(const uint8_t *b, float *w)
{
    __m256 r[4];
    dequantize(b, r);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(w + 8 * k, r[k]);
}
#else
inline void dequantize(const uint8_t *b, float *w)
{
    float d, m;
    const uint8_t *q = params(b, d, m);
    for (int i = 0; i < 32; ++i) {
        const int v = NIBBLES ? (i < 16 ? q[i] & 0x0f : q[i - 16] >> 4)
                              : (SIGNED ? (int)(int8_t)q[i] : (int)q[i]);
        w[i] = (float)v * d + m;
    }
}
#endif

// y[i][j] = x[i] . wt[j] for i < mt, j < nt; wt rows are K floats apart
template <int mt>
void tile(const float *x, int64_t x_stride, const float *wt, int64_t K, float *y,
          int64_t y_stride, int64_t nt)
{
    vec acc[mt][NT] = {};
    for (int64_t k = 0; k < K; k += VL) {
        vec w[NT];
        for (int j = 0; j < NT; ++j)
            w[j] = vload(wt + j * K + k);
        for (int i = 0; i < mt; ++i) {
            const vec xv = vload(x + i * x_stride + k);
            for (int j = 0; j < NT; ++j)
                acc[i][j] += xv * w[j];
        }
    }
    for (int i = 0; i < mt; ++i)
        for (int j = 0; j < nt; ++j)
            y[i * y_stride + j] = vsum(acc[i][j]);
}

#ifdef BLOCK_IN_REGISTERS
// One row of x by weight rows [n0, n1): a block dequantized into registers and multiplied
// there, with no buffer to write and read back (a decode step's single row)
void row(const float *x, const uint8_t *w, int64_t row_bytes, int64_t K, float *y, int64_t n0,
         int64_t n1)
{
    for (int64_t n = n0; n < n1; ++n) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        const uint8_t *wr = w + n * row_bytes;
        for (int64_t b = 0; b < K / 32; ++b) {
            __m256 v[4];
            dequantize(wr + b * BLOCK_BYTES, v);
            for (int k = 0; k < 4; ++k)
                acc[k] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(x + b * 32 + 8 * k), acc[k]);
        }
        y[n] = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                  _mm256_add_ps(acc[2], acc[3])));
    }
}
#endif

}  // namespace

extern "C" void heron_quant_linear(const float *x, int64_t x_stride, const uint8_t *w,
                                   float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K)
{
    const int64_t row_bytes = K / 32 * BLOCK_BYTES;
#ifdef BLOCK_IN_REGISTERS
    if (M == 1) {
        constexpr int64_t ROWS = 16;  // weight rows a task takes
        #pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
        for (int64_t n0 = 0; n0 < N; n0 += ROWS)
            row(x, w, row_bytes, K, y, n0, n0 + ROWS < N ? n0 + ROWS : N);
        return;
    }
#endif
    const int64_t groups = (N + NT - 1) / NT, mblocks = (M + MB - 1) / MB;
    // one row through a narrow weight is microseconds of work: waking threads costs more
    #pragma omp parallel if (M * N * K >= (1 << 18))
    {
        std::vector<float> buf(NT * K, 0.0f);
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < groups * mblocks; ++task) {
            const int64_t n0 = task % groups * NT, m0 = task / groups * MB;
            const int64_t nt = std::min(NT, N - n0), m_end = std::min(M, m0 + MB);
            for (int64_t j = 0; j < nt; ++j)
                for (int64_t b = 0; b < K / 32; ++b)
                    dequantize(w + (n0 + j) * row_bytes + b * BLOCK_BYTES,
                               buf.data() + j * K + b * 32);
            int64_t m = m0;
            for (; m + MT <= m_end; m += MT)
                tile<MT>(x + m * x_stride, x_stride, buf.data(), K, y + m * y_stride + n0,
                         y_stride, nt);
            const float *xm = x + m * x_stride;
            float *ym = y + m * y_stride + n0;
            switch (m_end - m) {
            case 3: tile<3>(xm, x_stride, buf.data(), K, ym, y_stride, nt); break;
            case 2: tile<2>(xm, x_stride, buf.data(), K, ym, y_stride, nt); break;
            case 1: tile<1>(xm, x_stride, buf.data(), K, ym, y_stride, nt); break;
            }
        }
    }
}

// out [N, K] = dequantize(w): for many rows of x, a float32 GEMM of the whole weight beats
// the tiles above (which keep no block of x in the first-level cache)
extern "C" void heron_dequantize(const uint8_t *w, float *out, int64_t N, int64_t K)
{
    const int64_t row_bytes = K / 32 * BLOCK_BYTES;
    #pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < K / 32; ++b)
            dequantize(w + n * row_bytes + b * BLOCK_BYTES, out + n * K + b * 32);
}
