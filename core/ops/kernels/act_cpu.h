// The activations' element type of the kernels that take float32 or, with ACT_BF16
// defined, bfloat16 rows (norm_cpu.cpp, activation_cpu.cpp): `elem_t`, and `round_act`,
// which rounds a float32 result as torch stores one of that type.

#pragma once

#include "vec_cpu.h"

namespace {

#ifdef ACT_BF16
typedef bf16_t elem_t;
inline vec round_act(vec x) { return (vec)bf16_bits(x); }
inline float round_act(float x) { return widen(to_bf16(x)); }
#else
typedef float elem_t;
inline vec round_act(vec x) { return x; }
inline float round_act(float x) { return x; }
#endif

}  // namespace
