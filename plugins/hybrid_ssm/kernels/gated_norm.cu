// Mamba2's output gate and grouped RMSNorm; mirrors
// heron.plugins.hybrid_ssm.mamba2.gated_rms_norm (float32 math and output).
//
// norm_before_gate 0: norm(y * silu(z)) * weight; 1: norm(y) * weight * silu(z); weight
// null: y * silu(z) alone. Each group of group_size channels is normalised on its own.
// Launch: grid (T, d_inner / group_size), block (a multiple of 32, <= 1024).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024) gated_rms_norm_kernel(
    float* __restrict__ out,                      // [T, d_inner] contiguous
    const float* __restrict__ y,                  // [T, d_inner] contiguous
    const scalar_t* __restrict__ z, long long z_stride,
    const scalar_t* __restrict__ weight,          // [d_inner]; null: no norm
    int d_inner, int group_size, int norm_before_gate, float eps) {
  const long long t = blockIdx.x;
  const int base = blockIdx.y * group_size;
  const float* yr = y + t * d_inner + base;
  const scalar_t* zr = z + t * z_stride + base;
  float* outr = out + t * d_inner + base;
  if (weight == nullptr) {
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
      const float g = to_float(zr[i]);
      outr[i] = yr[i] * (g / (1.f + expf(-g)));
    }
    return;
  }
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
    float v = yr[i];
    if (!norm_before_gate) {
      const float g = to_float(zr[i]);
      v *= g / (1.f + expf(-g));
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)group_size + eps);
  for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
    const float g = to_float(zr[i]), gate = g / (1.f + expf(-g));
    float v = yr[i];
    if (!norm_before_gate) v *= gate;
    v = to_float(weight[base + i]) * (v * inv_rms);
    outr[i] = norm_before_gate ? v * gate : v;
  }
}
