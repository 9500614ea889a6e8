// Rotary position embedding, neox / rotate-half layout; mirrors
// heron.core.ops.rotary.rotary_ref, and with a KV cache given, fuses the KV write after it
// (heron.core.ops.attention.rotary_write_kv_ref). Reads q, k and v through strides (they
// may be views of a fused qkv projection) and writes a fresh contiguous q; k goes to a fresh
// contiguous k_out or, with the cache, k and v go straight to their cache slots.
//
// Launch: grid (T, ceil(items / blockDim.x)), any block size, no dynamic shared memory;
// items = (Hq + Hkv) * (head_dim - rot_dim / 2), plus Hkv * head_dim with the cache. One
// thread per rotated pair (d, d + rot_dim / 2), per passed-through dim of a head, or per
// copied element of v, so a decode step's few tokens still spread over the GPU.
// cos_sin: [max_pos, rot_dim] float32, cos of each frequency then sin.
// Cache element (block, offset, head, d) lives at block*stride_block + offset*stride_token +
// head*stride_head + d; a negative slot (a padded row of a CUDA-graph batch) writes no K/V.
#include "common.cuh"

extern "C" __global__ void rotary_kernel(
    scalar_t* __restrict__ q_out,          // [T, Hq, D] contiguous
    scalar_t* __restrict__ k_out,          // [T, Hkv, D] contiguous; unused with the cache
    const scalar_t* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const scalar_t* __restrict__ k, long long k_stride_t, long long k_stride_h,
    const long long* __restrict__ positions,  // [T]
    const float* __restrict__ cos_sin,
    int num_q_heads, int num_kv_heads, int head_dim, int rot_dim,
    // The KV cache, or null k_cache: no KV write (v, v_cache and slot_mapping unused).
    scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
    long long stride_block, long long stride_token, long long stride_head, int block_size,
    const long long* __restrict__ slot_mapping,  // [T]
    const scalar_t* __restrict__ v, long long v_stride_t, long long v_stride_h) {
  const long long t = blockIdx.x;
  const int half = rot_dim / 2;
  const int per_head = head_dim - half;  // the pairs, then the dims past rot_dim
  const int idx = blockIdx.y * blockDim.x + threadIdx.x;
  const int rotary_items = (num_q_heads + num_kv_heads) * per_head;
  const bool to_cache = k_cache != nullptr;
  long long slot = 0, cache_base = 0;
  if (to_cache) {
    slot = slot_mapping[t];
    cache_base = (slot / block_size) * stride_block + (slot % block_size) * stride_token;
  }
  if (idx >= rotary_items) {  // v's copy into the cache
    const int j = idx - rotary_items;
    if (!to_cache || slot < 0 || j >= num_kv_heads * head_dim) return;
    const int h = j / head_dim, d = j % head_dim;
    v_cache[cache_base + h * stride_head + d] = v[t * v_stride_t + h * v_stride_h + d];
    return;
  }
  const int h = idx / per_head, i = idx % per_head;
  const bool is_q = h < num_q_heads;
  const int kv_head = h - num_q_heads;
  if (!is_q && to_cache && slot < 0) return;
  const scalar_t* src = is_q ? q + t * q_stride_t + h * q_stride_h
                             : k + t * k_stride_t + kv_head * k_stride_h;
  scalar_t* dst = is_q       ? q_out + (t * num_q_heads + h) * head_dim
                  : to_cache ? k_cache + cache_base + kv_head * stride_head
                             : k_out + (t * num_kv_heads + kv_head) * head_dim;
  if (i < half) {
    const float* cs = cos_sin + positions[t] * rot_dim;
    const float c = cs[i], s = cs[half + i];
    const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
    dst[i] = from_float<scalar_t>(x1 * c - x2 * s);
    dst[i + half] = from_float<scalar_t>(x2 * c + x1 * s);
  } else {  // partial rotary: the tail passes through
    const int d = rot_dim + (i - half);
    dst[d] = src[d];
  }
}
