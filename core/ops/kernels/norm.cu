// RMSNorm with an optional fused residual add; mirrors heron.core.ops.norm.rms_norm_ref.
//
// Launch: grid (T), block (a multiple of 32, <= 1024), no dynamic shared memory.
// Rounding follows torch in the model dtype: x + residual is rounded to scalar_t (and is the
// new residual), x * rsqrt(mean(x^2) + eps) is rounded to scalar_t, then multiplied by the
// weight and rounded again. Sums are float32.
#include "common.cuh"

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
  scalar_t* outr = out + row * (long long)hidden;
  scalar_t* resr = residual_out + row * (long long)hidden;
  const bool has_residual = residual != nullptr;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(xr[i]);
    if (has_residual) {
      const scalar_t s = from_float<scalar_t>(v + to_float(residual[row * residual_stride + i]));
      resr[i] = s;
      v = to_float(s);
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);

  // Second pass re-reads this thread's own elements (L1/L2 hits; the residual it wrote).
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = has_residual ? to_float(resr[i]) : to_float(xr[i]);
    outr[i] = from_float<scalar_t>(round_to_scalar(v * inv_rms) * to_float(weight[i]));
  }
}
