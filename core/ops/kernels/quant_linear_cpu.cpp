// Projections from GGUF-quantized weights on the CPU (heron_quant_linear):
// y [M, N] = x [M, K] @ dequantize(w)^T, the weight kept in its file's blocks.
//
// Reading a decode step's weights sets its speed: a Q4_1 weight is 0.625 bytes a value
// against float32's 4. Each task dequantizes a tile of NT weight rows into a small float32
// buffer (exactly gguf's values: d * q is exact in float32, so fused or not, d * q + m
// rounds once, as numpy's ops do) and multiplies it with a block of rows of x, so the
// result differs from a float32 matmul of the dequantized weight only in summation order.
// A single row of x (with AVX2) multiplies each block in registers instead.
//
// QTYPE, ggml's type numbers: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 20 IQ4_NL (blocks of
// 32 values), 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K, 23 IQ4_XS (blocks of 256: 8 sub-blocks of
// 32, each with its own scales; see sub_scales and sub_value). K is a multiple of the
// block. x rows are x_stride floats apart, y rows y_stride; w's rows are K / BLOCK_VALUES
// blocks, contiguous.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "vec_cpu.h"
#include "packed_cpu.h"

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

#if QTYPE == 2 || QTYPE == 3 || QTYPE == 6 || QTYPE == 7 || QTYPE == 8 || QTYPE == 20
#define K_QUANTS 0
constexpr int64_t BLOCK_VALUES = 32;
#elif (QTYPE >= 11 && QTYPE <= 14) || QTYPE == 23
#define K_QUANTS 1
constexpr int64_t BLOCK_VALUES = 256;
#else
#error "QTYPE must be 2, 3, 6, 7, 8 (Q4_0-Q8_0), 11-14 (Q3_K-Q6_K), 20 (IQ4_NL) or 23 (IQ4_XS)"
#endif
constexpr int SUBS = BLOCK_VALUES / 32;  // a block's sub-blocks of 32 values
constexpr int64_t BLOCK_BYTES = QTYPE == 2 ? 18 : QTYPE == 3 ? 20 : QTYPE == 6 ? 22
                              : QTYPE == 7 ? 24 : QTYPE == 8 ? 34 : QTYPE == 11 ? 110
                              : QTYPE == 12 ? 144 : QTYPE == 13 ? 176 : QTYPE == 14 ? 210
                              : QTYPE == 20 ? 18 : 136;
#define Q5 (QTYPE == 6 || QTYPE == 7)
#define IQ4 (QTYPE == 20 || QTYPE == 23)
// int8 values (Q3_K's are q - 4, Q6_K's q - 32, the IQ4 types' those of IQ4_VALUES)
constexpr bool SIGNED = QTYPE == 8 || QTYPE == 11 || QTYPE == 14 || IQ4;
// The IQ4 types' 16 values, which a nibble picks (ggml's kvalues_iq4nl)
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
#define TWO_SCALES (QTYPE == 11 || QTYPE == 14)  // one for each 16 values
constexpr bool HAS_MIN = QTYPE == 3 || QTYPE == 7;  // an fp16 m after d
// Q4_0 and Q5_0 store q + 8 and q + 16 (unsigned): their m is -8 d, -16 d
constexpr float ZERO = QTYPE == 2 ? 8.0f : QTYPE == 6 ? 16.0f : 0.0f;

// Value i of sub-block j is q_i * d[i / 16] + m: Q3_K and Q6_K scale each 16 values apart,
// the others all 32 alike. Q4_0's m = -8 d: then d * q + m is (q - 8) * d exactly. A
// K-quant's d is its block's fp16 d times the sub-block's scale and m its fp16 dmin times
// the sub-block's min, negated; both products are exact in float32, as gguf's numpy has
// them.
struct SubScales {
    float d[2], m;
};

inline SubScales sub_scales(const uint8_t *b, [[maybe_unused]] int j)
{
#if !K_QUANTS
    const float d = half_to_float(b);
    return {{d, d}, HAS_MIN ? half_to_float(b + 2) : -ZERO * d};
#elif QTYPE == 12 || QTYPE == 13
    // 12 bytes of 6-bit scales and mins: sub-blocks 0-3 in the low bits of bytes 0-7,
    // 4-7 in the nibbles of bytes 8-11 with their top bits in those of bytes 0-7
    const uint8_t *s = b + 4;
    const int scale = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4;
    const int min = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    const float d = half_to_float(b) * (float)scale;
    return {{d, d}, -(half_to_float(b + 2) * (float)min)};
#elif QTYPE == 11
    // 12 bytes of 16 6-bit scales, stored + 32: scale k's low 4 bits in byte k (k < 8) or
    // the high half of byte k - 8, its top 2 bits in bits 2 (k / 4) of byte 8 + k % 4
    const uint8_t *s = b + 96;
    const float d = half_to_float(b + 108);
    float ds[2];
    for (int h = 0; h < 2; ++h) {
        const int k = 2 * j + h;
        const int low = k < 8 ? s[k] & 0x0f : s[k - 8] >> 4;
        ds[h] = d * (float)((low | (s[8 + k % 4] >> 2 * (k / 4) & 3) << 4) - 32);
    }
    return {{ds[0], ds[1]}, 0.0f};
#elif QTYPE == 23
    // sub-block j's 6-bit scale, stored + 32: 4 bits in a nibble of byte 4 + j / 2, 2 in
    // bits 2j of the 16-bit word at byte 2
    const int high = (b[2] | b[3] << 8) >> 2 * j & 3;
    const int scale = (b[4 + j / 2] >> 4 * (j % 2) & 0x0f) | high << 4;
    const float d = half_to_float(b) * (float)(scale - 32);
    return {{d, d}, 0.0f};
#else
    const int8_t *s = reinterpret_cast<const int8_t *>(b + 192);
    const float d = half_to_float(b + 208);
    return {{d * (float)s[2 * j], d * (float)s[2 * j + 1]}, 0.0f};
#endif
}

// Value i of sub-block j's quantized values, as an int. Q4_0, Q4_1: fp16 d (and m), then 16
// bytes whose low halves are values 0-15, high halves 16-31; Q5_0, Q5_1: the same with 4
// bytes before the 16 whose bit i is value i's fifth bit; Q8_0: fp16 d, 32 int8.
// Q4_K: fp16 d and dmin, the scales, 128 bytes: sub-blocks 2c and 2c + 1 are the low and
// high halves of bytes 32c to 32c + 31. Q5_K: the same after 32 bytes whose bit j is
// sub-block j's fifth bit. Q3_K: 32 bytes whose bit j is sub-block j's third bit, 64 bytes
// of low 2 bits (sub-block j at bit 2 (j % 4) of bytes 32 (j / 4) on), the scales, fp16 d;
// q - 4. Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d; q - 32
// (see gguf's dequantize_blocks). IQ4_NL: fp16 d, 16 bytes of nibbles as Q4_0's, each
// picking one of IQ4_VALUES; IQ4_XS: fp16 d, the scales, then each sub-block's 16 such bytes.
#define NIBBLES (QTYPE == 2 || QTYPE == 3 || Q5 || IQ4)
#if NIBBLES
// Q5's 4 bytes of fifth bits, after d (and m)
inline const uint8_t *fifth_bits(const uint8_t *b)
{
    return b + (HAS_MIN ? 4 : 2);
}

// Sub-block j's 16 bytes of nibbles
inline const uint8_t *nibbles(const uint8_t *b, [[maybe_unused]] int j)
{
    return QTYPE == 23 ? b + 8 + 16 * j : fifth_bits(b) + (Q5 ? 4 : 0);
}
#endif

inline int sub_value(const uint8_t *b, [[maybe_unused]] int j, int i)
{
#if NIBBLES
    const uint8_t *q = nibbles(b, j);
    const int nibble = i < 16 ? q[i] & 0x0f : q[i - 16] >> 4;
    return IQ4 ? IQ4_VALUES[nibble]
         : Q5  ? nibble | (fifth_bits(b)[i / 8] >> i % 8 & 1) << 4
               : nibble;
#elif QTYPE == 8
    return (int8_t)b[2 + i];
#elif QTYPE == 11
    return ((b[32 + 32 * (j / 4) + i] >> 2 * (j % 4) & 3) | (b[i] >> j & 1) << 2) - 4;
#elif QTYPE == 12 || QTYPE == 13
    const int low = b[(QTYPE == 12 ? 16 : 48) + 32 * (j / 2) + i] >> 4 * (j % 2) & 0x0f;
    return QTYPE == 12 ? low : low | (b[16 + i] >> j & 1) << 4;
#else
    const int h = j / 4, t = j % 4;
    const int low = b[64 * h + 32 * (t % 2) + i] >> 4 * (t / 2) & 0x0f;
    return (low | (b[128 + 32 * h + i] >> 2 * t & 3) << 4) - 32;
#endif
}

// A sub-block's 32 values from a block b as float32 q * d + m. q * d is exact in float32
// (24 significant bits at most), so fused or not, q * d + m rounds once, as gguf's numpy does.
#if defined(__AVX2__) && defined(__FMA__)
#define BLOCK_IN_REGISTERS 1
// Sub-block j's quantized values as bytes: values 0-15, then 16-31 (see sub_value)
inline void sub_bytes(const uint8_t *b, [[maybe_unused]] int j, __m128i bytes[2])
{
    auto load = [](const uint8_t *p) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    };
    [[maybe_unused]] const __m128i nibble = _mm_set1_epi8(0x0f);  // all but Q8_0
#if NIBBLES
    const __m128i raw = load(nibbles(b, j));
    bytes[0] = _mm_and_si128(raw, nibble);
    bytes[1] = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    if (IQ4) {  // each nibble picks its value
        const __m128i values = load(reinterpret_cast<const uint8_t *>(IQ4_VALUES));
        bytes[0] = _mm_shuffle_epi8(values, bytes[0]);
        bytes[1] = _mm_shuffle_epi8(values, bytes[1]);
    } else if (Q5) {
        // the fifth bits: byte k of each half takes bit k of its 16 (a byte of them
        // copied to 8 lanes, each lane testing its own bit)
        uint32_t high;
        std::memcpy(&high, fifth_bits(b), 4);
        const __m128i bit = _mm_set1_epi64x(0x8040201008040201);
        const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for (int e = 0; e < 2; ++e) {
            const __m128i h = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(high >> 16 * e)), spread);
            const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(h, bit), bit);
            bytes[e] = _mm_or_si128(bytes[e], _mm_and_si128(set, _mm_set1_epi8(16)));
        }
    }
#elif QTYPE == 8
    bytes[0] = load(b + 2);
    bytes[1] = load(b + 18);
#elif QTYPE == 12 || QTYPE == 13
    // 16-bit shifts: the bits a byte takes from its neighbour fall outside the mask
    const uint8_t *q = b + (QTYPE == 12 ? 16 : 48) + 32 * (j / 2);
    for (int e = 0; e < 2; ++e) {
        bytes[e] = _mm_and_si128(_mm_srl_epi16(load(q + 16 * e), _mm_cvtsi32_si128(4 * (j % 2))),
                                 nibble);
        if (QTYPE == 13) {
            const __m128i fifth = _mm_and_si128(
                _mm_srl_epi16(load(b + 16 + 16 * e), _mm_cvtsi32_si128(j)), _mm_set1_epi8(1));
            bytes[e] = _mm_or_si128(bytes[e], _mm_slli_epi16(fifth, 4));
        }
    }
#elif QTYPE == 11
    for (int e = 0; e < 2; ++e) {
        const __m128i low = _mm_and_si128(
            _mm_srl_epi16(load(b + 32 + 32 * (j / 4) + 16 * e), _mm_cvtsi32_si128(2 * (j % 4))),
            _mm_set1_epi8(3));
        const __m128i third = _mm_and_si128(
            _mm_srl_epi16(load(b + 16 * e), _mm_cvtsi32_si128(j)), _mm_set1_epi8(1));
        bytes[e] = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(third, 2)), _mm_set1_epi8(4));
    }
#else
    const int h = j / 4, t = j % 4;
    for (int e = 0; e < 2; ++e) {
        const __m128i low = _mm_and_si128(
            _mm_srl_epi16(load(b + 64 * h + 32 * (t % 2) + 16 * e), _mm_cvtsi32_si128(4 * (t / 2))),
            nibble);
        const __m128i high = _mm_and_si128(
            _mm_srl_epi16(load(b + 128 + 32 * h + 16 * e), _mm_cvtsi32_si128(2 * t)),
            _mm_set1_epi8(3));
        bytes[e] = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
    }
#endif
}

// ... as four registers of 8 values, in order
inline void dequantize(const uint8_t *b, int j, __m256 w[4])
{
    const SubScales s = sub_scales(b, j);
    __m128i bytes[2];
    sub_bytes(b, j, bytes);
    const __m256 vm = _mm256_set1_ps(s.m);
    for (int h = 0; h < 2; ++h) {
        const __m256 vd = _mm256_set1_ps(s.d[h]);
        for (int e = 0; e < 2; ++e) {
            const __m128i part = e ? _mm_srli_si128(bytes[h], 8) : bytes[h];
            const __m256 v = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(part)
                                                       : _mm256_cvtepu8_epi32(part));
            w[2 * h + e] = _mm256_fmadd_ps(v, vd, vm);
        }
    }
}
// ... a whole block's values
inline void dequantize(const uint8_t *b, float *w)
{
#pragma GCC unroll 8  // see row
    for (int j = 0; j < SUBS; ++j) {
        __m256 r[4];
        dequantize(b, j, r);
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(w + 32 * j + 8 * k, r[k]);
    }
}
#else
inline void dequantize(const uint8_t *b, float *w)
{
    for (int j = 0; j < SUBS; ++j) {
        const SubScales s = sub_scales(b, j);
        for (int i = 0; i < 32; ++i)
            w[32 * j + i] = (float)sub_value(b, j, i) * s.d[i / 16] + s.m;
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
// One row of x by weight rows [n0, n1): a sub-block dequantized into registers and
// multiplied there, with no buffer to write and read back (a decode step's single row)
void row(const float *x, const uint8_t *w, int64_t row_bytes, int64_t K, float *y, int64_t n0,
         int64_t n1)
{
    for (int64_t n = n0; n < n1; ++n) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        const uint8_t *wr = w + n * row_bytes;
        for (int64_t b = 0; b < K / BLOCK_VALUES; ++b)
#pragma GCC unroll 8  // so that j is a constant: K-quants' scales and bits unpack at fixed places
            for (int j = 0; j < SUBS; ++j) {
                __m256 v[4];
                dequantize(wr + b * BLOCK_BYTES, j, v);
                const float *xb = x + b * BLOCK_VALUES + 32 * j;
                for (int k = 0; k < 4; ++k)
                    acc[k] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xb + 8 * k), acc[k]);
            }
        y[n] = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                  _mm256_add_ps(acc[2], acc[3])));
    }
}
#endif

// -- int8 activations (heron_quant_linear_int8) --------------------------------------
// Each block of 32 values of a row of x is quantized as the weights are: a = max |x|,
// d = a / 127, q = x * (1 / d) rounded to the nearest int8 (ties to even), s = d * sum(q).
// A block's product is then dw * d * sum(qw * q) + c * s, c the weight block's m (Q4_1,
// Q5_1, Q4_K, Q5_K), -8 dw (Q4_0), -16 dw (Q5_0) or 0 (Q8_0, Q3_K, Q6_K): integer
// multiply-adds, 32 at a time, in place of converting each weight to float32. Not exact: x
// is rounded to 8 bits a value.

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

// A weight sub-block's 32 quantized values in order: unsigned, or int8 (`SIGNED`)
inline __m256i weight_bytes(const uint8_t *b, int j)
{
    __m128i bytes[2];
    sub_bytes(b, j, bytes);
    return _mm256_set_m128i(bytes[1], bytes[0]);
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

#if defined(BLOCK_IN_REGISTERS) && !K_QUANTS
// A weight block's d and c (see above) as the first two lanes of a vector, converted from
// fp16 in one instruction (Q4_1's and Q5_1's pair; Q8_0's d beside a zero; Q4_0's and Q5_0's
// d, then times -ZERO)
inline __m128 weight_scales(const uint8_t *b)
{
    uint32_t bits = 0;
    std::memcpy(&bits, b, HAS_MIN ? 4 : 2);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    return ZERO != 0.0f ? _mm_mul_ps(_mm_moveldup_ps(v), _mm_setr_ps(1.0f, -ZERO, 0.0f, 0.0f))
                        : v;
}
#endif

// y[i][n] for rows i < mt of r from row0 on, weight rows [n0, n1); x's block b meets
// sub-block j = b % SUBS of the row's weight block b / SUBS
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
        for (int64_t b0 = 0; b0 < blocks; b0 += SUBS) {
            const uint8_t *wb = wr + b0 / SUBS * BLOCK_BYTES;
#pragma GCC unroll 8  // see row
            for (int j = 0; j < SUBS; ++j) {
                const int64_t b = b0 + j;
                const __m256i wq = weight_bytes(wb, j);
#if TWO_SCALES
                // a block's dot has values 0-15 in lanes 0-3, 16-31 in 4-7: two scales
                const SubScales s = sub_scales(wb, j);
                const __m256 dw = _mm256_setr_m128(_mm_set1_ps(s.d[0]), _mm_set1_ps(s.d[1]));
                const __m128 dc = _mm_setr_ps(1.0f, 0.0f, 0.0f, 0.0f);
#elif K_QUANTS
                const SubScales s = sub_scales(wb, j);
                const __m128 dc = _mm_setr_ps(s.d[0], s.m, 0.0f, 0.0f);
#else
                const __m128 dc = weight_scales(wb);
#endif
                for (int i = 0; i < mt; ++i) {
                    const __m256i xq = _mm256_loadu_si256(
                        reinterpret_cast<const __m256i *>(q + i * K + b * 32));
                    // {dw * d, c * s}: the block's scale and its offset term in one multiply
                    // (Q3_K's and Q6_K's dw come after, per half)
                    const __m128 scale = _mm_mul_ps(dc, _mm_castpd_ps(_mm_load_sd(
                        reinterpret_cast<const double *>(ds + (i * blocks + b) * 2))));
#if TWO_SCALES
                    const __m256 block_scale = _mm256_mul_ps(dw, _mm256_broadcastss_ps(scale));
#else
                    const __m256 block_scale = _mm256_broadcastss_ps(scale);
#endif
                    acc[i] = _mm256_fmadd_ps(block_dot(wq, xq), block_scale, acc[i]);
                    c_sum[i] = _mm_add_ps(c_sum[i], scale);
                }
            }
        }
        for (int i = 0; i < mt; ++i)
            y[i * y_stride + n] = sum8(acc[i]) + _mm_cvtss_f32(_mm_movehdup_ps(c_sum[i]));
#else
        float acc[mt] = {}, c_sum[mt] = {};
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *wb = wr + b / SUBS * BLOCK_BYTES;
            const int j = b % SUBS;
            const SubScales s = sub_scales(wb, j);
            for (int i = 0; i < mt; ++i) {
                int dot[2] = {0, 0};
                for (int k = 0; k < 32; ++k)
                    dot[k / 16] += sub_value(wb, j, k) * q[i * K + b * 32 + k];
                const float *dsb = ds + (i * blocks + b) * 2;
                acc[i] += dsb[0] * (s.d[0] * (float)dot[0] + s.d[1] * (float)dot[1]);
                c_sum[i] += s.m * dsb[1];
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
    const int64_t row_bytes = K / BLOCK_VALUES * BLOCK_BYTES;
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
    const int64_t row_bytes = K / BLOCK_VALUES * BLOCK_BYTES;
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
                for (int64_t b = 0; b < K / BLOCK_VALUES; ++b)
                    dequantize(w + (n0 + j) * row_bytes + b * BLOCK_BYTES,
                               buf.data() + j * K + b * BLOCK_VALUES);
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
    const int64_t row_bytes = K / BLOCK_VALUES * BLOCK_BYTES;
    #pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < K / BLOCK_VALUES; ++b)
            dequantize(w + n * row_bytes + b * BLOCK_BYTES, out + n * K + b * BLOCK_VALUES);
}

HERON_PACKED(heron_quant_linear_int8)
HERON_PACKED(heron_quant_linear)
HERON_PACKED(heron_dequantize)
