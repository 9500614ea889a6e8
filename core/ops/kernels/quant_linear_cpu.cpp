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
#include <cmath>
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
constexpr int64_t ROWS = 16;  // weight rows a task of the few-row paths takes

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
constexpr int64_t HEADER_BYTES = QTYPE == 3 ? 4 : 2;  // the fp16 d (and m) before the bytes
constexpr bool NIBBLES = QTYPE != 8, SIGNED = QTYPE == 8;

// block b's quantized bytes, and d and m of its values' d * q + m (Q4_0's m = -8 d: then
// d * q + m is (q - 8) * d exactly, which a float32 holds)
inline const uint8_t *params(const uint8_t *b, float &d, float &m)
{
    d = half_to_float(b);
    m = QTYPE == 3 ? half_to_float(b + 2) : QTYPE == 2 ? -8.0f * d : 0.0f;
    return b + HEADER_BYTES;
}

// value i of a block's quantized bytes q (8-bit ints; nibbles: 16 bytes whose low then high
// halves are the values)
inline int quantized_value(const uint8_t *q, int i)
{
    return NIBBLES ? (i < 16 ? q[i] & 0x0f : q[i - 16] >> 4)
                   : (SIGNED ? (int)(int8_t)q[i] : (int)q[i]);
}

// A block's 32 values from its bytes q as float32 d * q + m. d * q is exact in float32 (11 by 8
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
    for (int i = 0; i < 32; ++i)
        w[i] = (float)quantized_value(q, i) * d + m;
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

// -- int8 activations (heron_quant_linear_int8) --------------------------------------
// Each block of 32 values of a row of x is quantized as the weights are: a = max |x|,
// d = a / 127, q = x * (1 / d) rounded to the nearest int8 (ties to even), s = d * sum(q).
// A block's product is then dw * d * sum(qw * q) + c * s, c the weight block's m (Q4_1),
// -8 dw (Q4_0) or 0 (Q8_0): integer multiply-adds, 32 at a time, in place of converting
// each weight to float32. Not exact: x is rounded to 8 bits a value.

struct QuantizedRows {
    std::vector<int8_t> q;  // [M, K]
    std::vector<float> ds;  // [M, K / 32, 2]: each block's d and s, side by side
};

#ifdef BLOCK_IN_REGISTERS
inline float max8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int sum8i(__m256i v)
{
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_unpackhi_epi64(m, m));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 1)));
}

inline void quantize_block(const float *x, int8_t *q, float &d, float &s)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[k]));
    }
    d = max8(a) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i[4];
    for (int k = 0; k < 4; ++k)  // the default rounding: to nearest, ties to even
        i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
    s = d * (float)sum8i(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                          _mm256_add_epi32(i[2], i[3])));
    // packing works within 128-bit lanes: the dwords come out as rows 0 4 1 5 2 6 3 7
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                              _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(q), _mm256_permutevar8x32_epi32(
        packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// A weight block's 32 quantized values in order: unsigned nibbles, or Q8_0's int8
inline __m256i weight_bytes(const uint8_t *q)
{
    if (!NIBBLES)
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(q));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                            _mm256_set1_epi8(0x0f));
}

// sum(w * x) over a block, as 8 int32 partial sums converted to float
inline __m256 block_dot(__m256i w, __m256i x)
{
    // maddubs multiplies unsigned by signed bytes: int8 weights lend x their signs
    const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                        _mm256_sign_epi8(x, w))
                                 : _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
inline void quantize_block(const float *x, int8_t *q, float &d, float &s)
{
    float a = 0.0f;
    for (int i = 0; i < 32; ++i) a = std::max(a, std::fabs(x[i]));
    d = a / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
        q[i] = (int8_t)std::nearbyint(x[i] * id);  // the default rounding, as above
        sum += q[i];
    }
    s = d * (float)sum;
}
#endif

QuantizedRows quantize_rows(const float *x, int64_t x_stride, int64_t M, int64_t K)
{
    QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * K / 32 * 2)};
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / 32; ++b) {
            float *ds = r.ds.data() + (m * K / 32 + b) * 2;
            quantize_block(x + m * x_stride + b * 32, r.q.data() + m * K + b * 32, ds[0],
                           ds[1]);
        }
    return r;
}

#ifdef BLOCK_IN_REGISTERS
// A weight block's d and c (see above) as the first two lanes of a vector, converted from
// fp16 in one instruction (Q4_1's pair; Q8_0's d beside a zero; Q4_0's d, then times -8)
inline __m128 weight_scales(const uint8_t *b)
{
    uint32_t bits = 0;
    std::memcpy(&bits, b, HEADER_BYTES);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    return QTYPE == 2 ? _mm_mul_ps(_mm_moveldup_ps(v), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f))
                      : v;
}
#endif

// y[i][n] for rows i < mt of r from row0 on, weight rows [n0, n1)
template <int mt>
void rows_int8(const QuantizedRows &r, int64_t row0, const uint8_t *w, int64_t row_bytes,
               int64_t K, float *y, int64_t y_stride, int64_t n0, int64_t n1)
{
    const int64_t blocks = K / 32;
    const int8_t *q = r.q.data() + row0 * K;
    const float *ds = r.ds.data() + row0 * blocks * 2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = w + n * row_bytes;
#ifdef BLOCK_IN_REGISTERS
        __m256 acc[mt];
        __m128 c_sum[mt];  // lane 1: the sum of c * s
        for (int i = 0; i < mt; ++i) acc[i] = _mm256_setzero_ps(), c_sum[i] = _mm_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *wb = wr + b * BLOCK_BYTES;
            const __m128 dc = weight_scales(wb);
            const __m256i wq = weight_bytes(wb + HEADER_BYTES);
            for (int i = 0; i < mt; ++i) {
                const __m256i xq = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i *>(q + i * K + b * 32));
                // {dw * d, c * s}: the block's scale and its offset term in one multiply
                const __m128 scale = _mm_mul_ps(dc, _mm_castpd_ps(_mm_load_sd(
                    reinterpret_cast<const double *>(ds + (i * blocks + b) * 2))));
                acc[i] = _mm256_fmadd_ps(block_dot(wq, xq), _mm256_broadcastss_ps(scale),
                                         acc[i]);
                c_sum[i] = _mm_add_ps(c_sum[i], scale);
            }
        }
        for (int i = 0; i < mt; ++i)
            y[i * y_stride + n] = sum8(acc[i]) + _mm_cvtss_f32(_mm_movehdup_ps(c_sum[i]));
#else
        float acc[mt] = {}, c_sum[mt] = {};
        for (int64_t b = 0; b < blocks; ++b) {
            float dw, c;
            const uint8_t *wq = params(wr + b * BLOCK_BYTES, dw, c);
            for (int i = 0; i < mt; ++i) {
                int dot = 0;
                for (int k = 0; k < 32; ++k)
                    dot += quantized_value(wq, k) * q[i * K + b * 32 + k];
                const float *dsb = ds + (i * blocks + b) * 2;
                acc[i] += dw * dsb[0] * (float)dot;
                c_sum[i] += c * dsb[1];
            }
        }
        for (int i = 0; i < mt; ++i) y[i * y_stride + n] = acc[i] + c_sum[i];
#endif
    }
}

}  // namespace

// y [M, N] = x [M, K] @ dequantize(w)^T with x's blocks quantized to int8 (see above)
extern "C" void heron_quant_linear_int8(const float *x, int64_t x_stride, const uint8_t *w,
                                        float *y, int64_t y_stride, int64_t M, int64_t N,
                                        int64_t K)
{
    const int64_t row_bytes = K / 32 * BLOCK_BYTES;
    const QuantizedRows r = quantize_rows(x, x_stride, M, K);
    #pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
        const int64_t n1 = std::min(N, n0 + ROWS);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4)
            rows_int8<4>(r, m, w, row_bytes, K, y + m * y_stride, y_stride, n0, n1);
        switch (M - m) {
        case 3: rows_int8<3>(r, m, w, row_bytes, K, y + m * y_stride, y_stride, n0, n1); break;
        case 2: rows_int8<2>(r, m, w, row_bytes, K, y + m * y_stride, y_stride, n0, n1); break;
        case 1: rows_int8<1>(r, m, w, row_bytes, K, y + m * y_stride, y_stride, n0, n1); break;
        }
    }
}

extern "C" void heron_quant_linear(const float *x, int64_t x_stride, const uint8_t *w,
                                   float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K)
{
    const int64_t row_bytes = K / 32 * BLOCK_BYTES;
#ifdef BLOCK_IN_REGISTERS
    if (M == 1) {
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
