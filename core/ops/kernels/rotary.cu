// Rotary position embedding, neox / rotate-half layout; mirrors
// heron.core.ops.rotary.rotary_ref. Reads q and k through strides (they may be views of a
// fused qkv projection) and writes fresh contiguous outputs, copying the dims past rot_dim.
//
// Launch: grid (T), block (any multiple of 32), no dynamic shared memory.
// cos_sin: [max_pos, rot_dim] float32, cos of each frequency then sin.
#include "common.cuh"

extern "C" __global__ void rotary_kernel(
    scalar_t* __restrict__ q_out,          // [T, Hq, D] contiguous
    scalar_t* __restrict__ k_out,          // [T, Hkv, D] contiguous
    const scalar_t* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const scalar_t* __restrict__ k, long long k_stride_t, long long k_stride_h,
    const long long* __restrict__ positions,  // [T]
    const float* __restrict__ cos_sin,
    int num_q_heads, int num_kv_heads, int head_dim, int rot_dim) {
  const long long t = blockIdx.x;
  const float* cs = cos_sin + positions[t] * rot_dim;
  const int half = rot_dim / 2;
  const int total = (num_q_heads + num_kv_heads) * head_dim;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int h = idx / head_dim, d = idx % head_dim;
    const bool is_q = h < num_q_heads;
    const scalar_t* src = is_q ? q + t * q_stride_t + h * q_stride_h
                               : k + t * k_stride_t + (h - num_q_heads) * k_stride_h;
    scalar_t* dst = is_q ? q_out + (t * num_q_heads + h) * head_dim
                         : k_out + (t * num_kv_heads + (h - num_q_heads)) * head_dim;
    if (d < half) {         // first half: x1 * cos - x2 * sin
      dst[d] = from_float<scalar_t>(to_float(src[d]) * cs[d] - to_float(src[d + half]) * cs[half + d]);
    } else if (d < rot_dim) {  // second half: x2 * cos + x1 * sin
      const int f = d - half;
      dst[d] = from_float<scalar_t>(to_float(src[d]) * cs[f] + to_float(src[f]) * cs[half + f]);
    } else {                // partial rotary: the tail passes through
      dst[d] = src[d];
    }
  }
}
