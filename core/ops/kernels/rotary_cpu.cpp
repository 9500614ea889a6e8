// Rotary embedding with the KV cache write on the CPU (heron_rotary_write_kv): one pass over
// a step's q, k and v in place of torch's dozen ops (gather the cos/sin rows, concatenate q
// and k, four products, two concatenations, two index copies), which on a decode step's few
// rows cost more in dispatch than in arithmetic.
//
// q [T, Hq, D], k and v [T, Hkv, D]: token rows q_stride / k_stride / v_stride apart (views
// of the fused qkv projection), heads D apart. positions [T], slot_mapping [T] int64;
// cos_sin [max_position, rot] float32 (cos of each of rot / 2 frequencies, then sin).
// q_out [T, Hq, D] contiguous, of q's type; k_cache, v_cache [num_slots, Hkv, D] contiguous.
// q, k, v, q_out and the caches float32; or the caches bfloat16 (CACHE_BF16 defined); or all
// bfloat16 (ACT_BF16 defined). A bfloat16 result rounds to nearest even, as torch's does.
//
// The first rot dims of each head rotate as halves (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin) in float32, the rest pass through: the rotated q goes to q_out, the
// rotated k and v to their token's slot. A negative slot (padding) stores nothing. Returns
// -1, having done nothing, if a position is past the table or a slot past the caches, else 0.

#include <cstdint>

#include "vec_cpu.h"
#include "packed_cpu.h"

// Each product rounds before the sum, as in torch's separate ops: the same bits as the torch
// path, not a fused multiply-add's
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

#ifdef ACT_BF16
#define CACHE_BF16 1
typedef bf16_t act_t;
#else
typedef float act_t;
#endif
#ifdef CACHE_BF16
typedef bf16_t cache_t;
#else
typedef float cache_t;
#endif

// The rotated head row `x` into `out` (q_out's or the cache's elements).
template <typename T>
inline void rotate(const act_t *x, const float *cos, const float *sin, int half, int dim, T *out)
{
    for (int i = 0; i < half; ++i) {
        const float x1 = widen(x[i]), x2 = widen(x[half + i]);
        put(out + i, x1 * cos[i] - x2 * sin[i]);
        put(out + half + i, x2 * cos[i] + x1 * sin[i]);
    }
    for (int i = 2 * half; i < dim; ++i)
        put(out + i, widen(x[i]));
}

}  // namespace

extern "C" int heron_rotary_write_kv(
    const act_t *q, int64_t q_stride, const act_t *k, int64_t k_stride, const act_t *v,
    int64_t v_stride, const int64_t *positions, const float *cos_sin, int64_t num_positions,
    int rot, const int64_t *slot_mapping, int64_t num_slots, int64_t num_tokens, int q_heads,
    int kv_heads, int dim, act_t *q_out, cache_t *k_cache, cache_t *v_cache)
{
    for (int64_t t = 0; t < num_tokens; ++t)  // nothing is read or written out of bounds
        if (positions[t] < 0 || positions[t] >= num_positions || slot_mapping[t] >= num_slots)
            return -1;
    const int half = rot / 2;
    #pragma omp parallel for if (num_tokens * (q_heads + kv_heads) * dim >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_sin + positions[t] * rot, *sin = cos + half;
        for (int h = 0; h < q_heads; ++h)
            rotate(q + t * q_stride + h * dim, cos, sin, half, dim,
                   q_out + (t * q_heads + h) * dim);
        const int64_t slot = slot_mapping[t];
        if (slot < 0)
            continue;
        cache_t *k_row = k_cache + slot * kv_heads * dim, *v_row = v_cache + slot * kv_heads * dim;
        for (int h = 0; h < kv_heads; ++h) {
            rotate(k + t * k_stride + h * dim, cos, sin, half, dim, k_row + h * dim);
            for (int i = 0; i < dim; ++i)
                put(v_row + h * dim + i, widen(v[t * v_stride + h * dim + i]));
        }
    }
    return 0;
}

HERON_PACKED(heron_rotary_write_kv)
