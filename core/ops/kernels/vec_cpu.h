// What the CPU kernels (*_cpu.cpp) share: vectors of 16 floats (GCC and Clang vector
// extensions: one AVX-512 register, two AVX2 ones) and bfloat16, a float32's upper half,
// converted as torch converts it (to nearest even, NaN to its quiet NaN 0x7fc0).
//
// `cpu_kernels` hashes this header into every library's name, so editing it rebuilds them.

#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16ui __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t bf16_t;
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v16hu __attribute__((vector_size(32), aligned(2), may_alias));

inline v16 load(const float *p) { return *reinterpret_cast<const v16u *>(p); }
inline void store(float *p, v16 x) { *reinterpret_cast<v16u *>(p) = x; }

inline float hsum(v16 x)
{
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float widen(float x) { return x; }
inline float widen(bf16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}
inline v16 load(const bf16_t *p)
{
    return (v16)(__builtin_convertvector(*reinterpret_cast<const v16hu *>(p), v16ui) << 16);
}

inline bf16_t to_bf16(float x)
{
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return x != x ? 0x7fc0 : (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
// x's bfloat16s in the upper halves, the lower halves zero
inline v16ui bf16_bits(v16 x)
{
    const v16ui bits = (v16ui)x;
    const v16ui rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const v16ui nan = (v16ui)(x != x);
    return (rounded & ~nan) | (0x7fc00000u & nan);
}
inline void store(bf16_t *p, v16 x)
{
    *reinterpret_cast<v16hu *>(p) = __builtin_convertvector(bf16_bits(x) >> 16, v16h);
}

inline void put(float *out, float x) { *out = x; }
inline void put(bf16_t *out, float x) { *out = to_bf16(x); }

}  // namespace
