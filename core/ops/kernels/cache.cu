// KV write: store this step's k, v rows into their paged cache slots; mirrors
// heron.core.ops.attention.write_kv_ref. A negative slot means "no slot" (a padded row of a
// CUDA-graph batch) and is skipped.
//
// Launch: grid (T), block (any multiple of 32), no dynamic shared memory.
// Cache element (block, offset, head, d) lives at block*stride_block + offset*stride_token +
// head*stride_head + d (strides in elements; the last dim is contiguous).
#include "common.cuh"

extern "C" __global__ void write_kv_kernel(
    scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
    long long stride_block, long long stride_token, long long stride_head,
    const scalar_t* __restrict__ k, long long k_stride_t, long long k_stride_h,
    const scalar_t* __restrict__ v, long long v_stride_t, long long v_stride_h,
    const long long* __restrict__ slot_mapping,  // [T]
    int num_kv_heads, int head_dim, int block_size) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long base = (slot / block_size) * stride_block + (slot % block_size) * stride_token;
  for (int idx = threadIdx.x; idx < num_kv_heads * head_dim; idx += blockDim.x) {
    const int h = idx / head_dim, d = idx % head_dim;
    const long long dst = base + h * stride_head + d;
    k_cache[dst] = k[t * k_stride_t + h * k_stride_h + d];
    v_cache[dst] = v[t * v_stride_t + h * v_stride_h + d];
  }
}
