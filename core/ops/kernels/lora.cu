// Multi-LoRA over a batch whose rows use different adapters (or none), BGMV-style: each row
// reads its own adapter slot's A and B. Mirrors heron.core.ops.lora.add_lora (its segments
// given per row: row_slots, -1 for none, and row_scales).
//
// shrink: v[r] = scale[r] * (x[r] @ A[slot].T), rounded to scalar_t before the scale as the
// torch matmul in the model dtype is; expand: out[r] += v[r] @ B[slot]. Sums are float32.
#include "common.cuh"

// Launch: grid (T, ceil(R / 4)), block (128): warp w of block y computes rank 4 y + w.
extern "C" __global__ void lora_shrink_kernel(
    float* __restrict__ v,                         // [T, R] contiguous
    const scalar_t* __restrict__ x, long long x_stride,  // row r's in_features at r * x_stride
    const scalar_t* __restrict__ a,                // [slots, R, in_features] contiguous
    const long long* __restrict__ row_slots,       // [T]
    const float* __restrict__ row_scales,          // [T]
    int rank, int in_features) {
  const long long r = blockIdx.x;
  const long long slot = row_slots[r];
  const int j = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (slot < 0 || j >= rank) return;  // whole warps
  const scalar_t* xr = x + r * x_stride;
  const scalar_t* ar = a + (slot * rank + j) * (long long)in_features;
  float acc = 0.f;
  for (int i = lane; i < in_features; i += 32) acc += to_float(xr[i]) * to_float(ar[i]);
  acc = group_sum<32>(acc);
  if (lane == 0) v[r * rank + j] = round_to_scalar(acc) * row_scales[r];
}

// Launch: grid (T, ceil(out_features / blockDim.x)), block (128).
extern "C" __global__ void lora_expand_kernel(
    scalar_t* __restrict__ out, long long out_stride,  // a column slice of a projection
    const float* __restrict__ v,                   // [T, R] from lora_shrink_kernel
    const scalar_t* __restrict__ b,                // [slots, R, out_features] contiguous
    const long long* __restrict__ row_slots,
    int rank, int out_features) {
  const long long r = blockIdx.x;
  const long long slot = row_slots[r];
  const int o = blockIdx.y * blockDim.x + threadIdx.x;
  if (slot < 0 || o >= out_features) return;
  const scalar_t* br = b + slot * rank * (long long)out_features + o;
  float acc = 0.f;
  for (int j = 0; j < rank; ++j) acc += v[r * rank + j] * to_float(br[(long long)j * out_features]);
  scalar_t* dst = out + r * out_stride + o;
  *dst = from_float<scalar_t>(to_float(*dst) + round_to_scalar(acc));
}
