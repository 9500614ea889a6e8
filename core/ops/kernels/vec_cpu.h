// What the CPU kernels (*_cpu.cpp) share: `vec`, a vector of one register's floats (GCC and
// Clang vector extensions; VEC_FLOATS: 16 with AVX-512, else 8), its loads, stores and sums,
// and bfloat16, a float32's upper half, converted as torch converts it (to nearest even, NaN
// to its quiet NaN 0x7fc0).
//
// One register's worth, not a fixed 16: where a register holds 8 floats (AVX2), GCC 12 keeps
// 16-float vectors on the stack in 16-byte pieces and lowers their comparisons to scalar code
// (a prompt's attention ran at a fourteenth of its speed). VECTOR_REGISTERS sizes a kernel's
// register blocks. VEC_FLOATS set by hand builds either width anywhere; the tests check both.
//
// `cpu_kernels` hashes this header into every library's name, so editing it rebuilds them.

#pragma once

#include <cstdint>
#include <cstring>

namespace {

#ifndef VEC_FLOATS
#ifdef __AVX512F__
#define VEC_FLOATS 16
#else
#define VEC_FLOATS 8
#endif
#endif
#if VEC_FLOATS != 8 && VEC_FLOATS != 16
#error "VEC_FLOATS must be 8 or 16"
#endif
constexpr int VL = VEC_FLOATS;
constexpr int VECTOR_REGISTERS = VL == 16 ? 32 : 16;

typedef float vec __attribute__((vector_size(VL * 4)));
typedef int32_t veci __attribute__((vector_size(VL * 4)));
typedef uint32_t vecu __attribute__((vector_size(VL * 4)));
typedef uint16_t vech __attribute__((vector_size(VL * 2)));
typedef float vec_u __attribute__((vector_size(VL * 4), aligned(4), may_alias));
typedef int32_t veci_u __attribute__((vector_size(VL * 4), aligned(4), may_alias));
typedef uint16_t vech_u __attribute__((vector_size(VL * 2), aligned(2), may_alias));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t bf16_t;

inline vec vload(const float *p) { return *reinterpret_cast<const vec_u *>(p); }
inline veci vload(const int32_t *p) { return *reinterpret_cast<const veci_u *>(p); }
inline vec vload(const bf16_t *p)
{
    return (vec)(__builtin_convertvector(*reinterpret_cast<const vech_u *>(p), vecu) << 16);
}
inline void vstore(float *p, vec x) { *reinterpret_cast<vec_u *>(p) = x; }

typedef float v8 __attribute__((vector_size(32)));
// The sum of a vector's lanes: halves added pairwise down to 4, then (0 + 2) + (1 + 3)
inline float sum8(v8 a)
{
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float vsum(vec x)
{
#if VEC_FLOATS == 16
    return sum8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
                + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#else
    return sum8(x);
#endif
}
// The sum of the 16 lanes 16 / VL vectors hold, in the same order whatever VL
inline float hsum16(const vec *x)
{
#if VEC_FLOATS == 16
    return vsum(x[0]);
#else
    return vsum(x[0] + x[1]);
#endif
}

inline float widen(float x) { return x; }
inline float widen(bf16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

inline bf16_t to_bf16(float x)
{
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return x != x ? 0x7fc0 : (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
// x's bfloat16s in the upper halves, the lower halves zero
inline vecu bf16_bits(vec x)
{
    const vecu bits = (vecu)x;
    const vecu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const vecu nan = (vecu)(x != x);
    return (rounded & ~nan) | (0x7fc00000u & nan);
}
inline void vstore(bf16_t *p, vec x)
{
    *reinterpret_cast<vech_u *>(p) = __builtin_convertvector(bf16_bits(x) >> 16, vech);
}

// exp for x <= 0 (attention: logits minus their max; SiLU: -|x|), relative error ~2e-7:
// x = k ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, 2^k through the
// exponent bits.
// Below -87 it returns exp(-87) ~ 2e-38 rather than 0, which no sum of weights can notice.
inline vec vexp(vec x)
{
    const vec lo = vec{} - 87.0f;
    x = x < lo ? lo : x;
    const vec shifter = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    vec k = (x * 1.44269504088896341f + shifter) - shifter;
    vec r = x - k * 0.693359375f + k * 2.12194440e-4f;
    vec p = vec{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    veci bits = (__builtin_convertvector(k, veci) + 127) << 23;
    return p * (vec)bits;  // a vector cast keeps the bits
}

inline void put(float *out, float x) { *out = x; }
inline void put(bf16_t *out, float x) { *out = to_bf16(x); }

}  // namespace
