// GELU, tanh approximation, elementwise: out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// Mirrors heron_gpt2.ops.gelu_tanh_ref; computes in float32 whatever the element type.
//
// "common.cuh" is heron's (the loader finds it in heron's kernel folder): it defines
// scalar_t from HERON_DTYPE and the to_float / from_float conversions.
//
// Launch: grid (any), block (any), no dynamic shared memory; a grid-stride loop covers n.
#include "common.cuh"

extern "C" __global__ void gelu_tanh_kernel(
    scalar_t* __restrict__ out,        // [n] contiguous
    const scalar_t* __restrict__ x,    // [n] contiguous
    long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = to_float(x[i]);
    const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2/pi)
    out[i] = from_float<scalar_t>(0.5f * v * (1.f + tanhf(inner)));
  }
}
