// Gated activation over a fused gate/up projection: out = silu(x[:, :I]) * x[:, I:].
// Mirrors heron.core.ops.activation.silu_and_mul_ref, including torch's rounding of
// silu's result to scalar_t before the product.
//
// Launch: grid (T, ceil(I / (blockDim.x * width))), block (any), no dynamic shared memory.
// HERON_ACT_VEC 1: x's rows, the output and I are 16-byte multiples, so each thread does one
// 16-byte vector of the gate and of the up half (width VEC); 0: one element (width 1).
#include "common.cuh"

#ifndef HERON_ACT_VEC
#error "HERON_ACT_VEC must be defined"
#endif

#if HERON_ACT_VEC
constexpr int WIDTH = VEC;
#else
constexpr int WIDTH = 1;
#endif

extern "C" __global__ void silu_and_mul_kernel(
    scalar_t* __restrict__ out,            // [T, I] contiguous
    const scalar_t* __restrict__ x,        // [T, 2I], rows x_stride apart, columns contiguous
    long long x_stride, int inter) {
  const int i = (blockIdx.y * blockDim.x + threadIdx.x) * WIDTH;
  if (i >= inter) return;
  const scalar_t* xr = x + blockIdx.x * x_stride;
  float gate[WIDTH], up[WIDTH];
  load_item<WIDTH>(xr + i, gate);
  load_item<WIDTH>(xr + inter + i, up);
#pragma unroll
  for (int e = 0; e < WIDTH; ++e) {
    const float silu = gate[e] / (1.f + expf(-gate[e]));  // torch's formula; expf, not __expf
    gate[e] = round_to_scalar(silu) * up[e];
  }
  store_item<WIDTH>(out + blockIdx.x * (long long)inter + i, gate);
}
