// RMSNorm with an optional fused residual add; mirrors heron.core.ops.norm.rms_norm_ref.
//
// Launch: grid (T), block (a multiple of 32, <= 1024), no dynamic shared memory.
// HERON_NORM_VEC 1: every row, the weight and the outputs are 16-byte aligned and hidden is a
// multiple of VEC, so each item is one 16-byte vector; 0: an item is one element.
// HERON_NORM_ITEMS: items per thread, ITEMS * blockDim.x * width >= hidden. A thread keeps
// its items in registers between the sum of squares and the scaling, so a row is read once.
//
// Rounding follows torch in the model dtype: x + residual is rounded to scalar_t (and is the
// new residual), x * rsqrt(mean(x^2) + eps) is rounded to scalar_t, then multiplied by the
// weight and rounded again. Sums are float32.
#include "common.cuh"

#if !defined(HERON_NORM_VEC) || !defined(HERON_NORM_ITEMS)
#error "HERON_NORM_VEC and HERON_NORM_ITEMS must be defined"
#endif

#if HERON_NORM_VEC
constexpr int WIDTH = VEC;
#else
constexpr int WIDTH = 1;
#endif

extern "C" __global__ void __launch_bounds__(1024) rms_norm_kernel(
    scalar_t* __restrict__ out,                 // [T, H] contiguous
    scalar_t* __restrict__ residual_out,        // [T, H] contiguous; unused without residual
    const scalar_t* __restrict__ x, long long x_stride,
    const scalar_t* __restrict__ residual,      // null: no residual
    long long residual_stride,
    const scalar_t* __restrict__ weight,        // [H]
    int hidden, float eps) {
  const long long row = blockIdx.x;
  const scalar_t* xr = x + row * x_stride;
  const scalar_t* rr = residual + row * residual_stride;
  scalar_t* outr = out + row * (long long)hidden;
  scalar_t* resr = residual_out + row * (long long)hidden;
  const bool has_residual = residual != nullptr;
  const int num_items = hidden / WIDTH;

  float v[HERON_NORM_ITEMS][WIDTH];
  float sum_sq = 0.f;
#pragma unroll
  for (int it = 0; it < HERON_NORM_ITEMS; ++it) {
    const int j = threadIdx.x + it * (int)blockDim.x;
    if (j >= num_items) continue;
    load_item<WIDTH>(xr + j * WIDTH, v[it]);
    if (has_residual) {
      float r[WIDTH];
      load_item<WIDTH>(rr + j * WIDTH, r);
#pragma unroll
      for (int e = 0; e < WIDTH; ++e) v[it][e] = round_to_scalar(v[it][e] + r[e]);
      store_item<WIDTH>(resr + j * WIDTH, v[it]);
    }
#pragma unroll
    for (int e = 0; e < WIDTH; ++e) sum_sq += v[it][e] * v[it][e];
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);

#pragma unroll
  for (int it = 0; it < HERON_NORM_ITEMS; ++it) {
    const int j = threadIdx.x + it * (int)blockDim.x;
    if (j >= num_items) continue;
    float w[WIDTH];
    load_item<WIDTH>(weight + j * WIDTH, w);
#pragma unroll
    for (int e = 0; e < WIDTH; ++e) v[it][e] = round_to_scalar(v[it][e] * inv_rms) * w[e];
    store_item<WIDTH>(outr + j * WIDTH, v[it]);
  }
}
