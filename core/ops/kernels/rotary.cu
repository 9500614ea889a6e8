// Rotary position embedding, neox / rotate-half layout; mirrors
// heron.core.ops.rotary.rotary_ref. Reads q and k through strides (they may be views of a
// fused qkv projection) and writes fresh contiguous outputs, copying the dims past rot_dim.
//
// Launch: grid (T, ceil((Hq + Hkv) * (head_dim - rot_dim / 2) / blockDim.x)), any block size,
// no dynamic shared memory. One thread per rotated pair (d, d + rot_dim / 2) or per
// passed-through dim of a head, so a decode step's few tokens still spread over the GPU.
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
  const int half = rot_dim / 2;
  const int per_head = head_dim - half;  // the pairs, then the dims past rot_dim
  const int idx = blockIdx.y * blockDim.x + threadIdx.x;
  if (idx >= (num_q_heads + num_kv_heads) * per_head) return;
  const int h = idx / per_head, i = idx % per_head;
  const bool is_q = h < num_q_heads;
  const scalar_t* src = is_q ? q + t * q_stride_t + h * q_stride_h
                             : k + t * k_stride_t + (h - num_q_heads) * k_stride_h;
  scalar_t* dst = is_q ? q_out + (t * num_q_heads + h) * head_dim
                       : k_out + (t * num_kv_heads + (h - num_q_heads)) * head_dim;
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
