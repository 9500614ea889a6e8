// Gated activation over a fused gate/up projection: out = silu(x[:, :I]) * x[:, I:].
// Mirrors heron.core.ops.activation.silu_and_mul_ref, including torch's rounding of
// silu's result to scalar_t before the product.
//
// Launch: grid (T, ceil(I / blockDim.x)), block (any), no dynamic shared memory.
#include "common.cuh"

extern "C" __global__ void silu_and_mul_kernel(
    scalar_t* __restrict__ out,            // [T, I] contiguous
    const scalar_t* __restrict__ x,        // [T, 2I], rows x_stride apart, columns contiguous
    long long x_stride, int inter) {
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const long long row = blockIdx.x;
  const float gate = to_float(x[row * x_stride + i]);
  const float up = to_float(x[row * x_stride + inter + i]);
  const float silu = gate / (1.f + expf(-gate));  // torch's formula; expf, not __expf
  out[row * inter + i] = from_float<scalar_t>(round_to_scalar(silu) * up);
}
