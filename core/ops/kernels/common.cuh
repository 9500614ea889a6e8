// Shared by heron's kernels: the element type, float conversions, 16-byte vector loads and
// warp reductions.
//
// Header-free on purpose: NVRTC ships no cuda_fp16.h / cuda_bf16.h, and include paths differ
// between the CI compiler and the device's, so half types are raw 16-bit storage converted
// with PTX (cvt.rn.bf16.f32 needs sm_80+). Every kernel computes in float32.
//
// HERON_DTYPE selects scalar_t: 0 float32, 1 float16, 2 bfloat16.
// HERON_EMULATE (the CPU emulator in tests/gpu/emulator) swaps the PTX for plain C++.
// (No include guard: the loader inlines each header once per compiled text.)

#ifndef HERON_DTYPE
#error "HERON_DTYPE must be defined: 0 float32, 1 float16, 2 bfloat16"
#endif

struct heron_half { unsigned short bits; };
struct heron_bf16 { unsigned short bits; };

#ifndef HERON_EMULATE
__device__ __forceinline__ float heron_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short heron_f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ unsigned short heron_f32_to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(heron_half x) { return heron_f16_to_f32(x.bits); }
__device__ __forceinline__ float to_float(heron_bf16 x) {
  return __uint_as_float(((unsigned int)x.bits) << 16);  // exact: bf16 is float's top half
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ heron_half from_float<heron_half>(float x) {
  heron_half h;
  h.bits = heron_f32_to_f16(x);
  return h;
}
template <> __device__ __forceinline__ heron_bf16 from_float<heron_bf16>(float x) {
  heron_bf16 h;
  h.bits = heron_f32_to_bf16(x);
  return h;
}

#if HERON_DTYPE == 0
typedef float scalar_t;
#elif HERON_DTYPE == 1
typedef heron_half scalar_t;
#elif HERON_DTYPE == 2
typedef heron_bf16 scalar_t;
#else
#error "HERON_DTYPE must be 0, 1 or 2"
#endif

// Round-trip through scalar_t: what torch does between two ops in the model dtype.
__device__ __forceinline__ float round_to_scalar(float x) { return to_float(from_float<scalar_t>(x)); }

// ---- 16-byte vectors: VEC elements of scalar_t, unpacked to float.
// NOTE: the pointer must be 16-byte aligned; the Python side checks strides and bases.
constexpr int VEC = 16 / (int)sizeof(scalar_t);

__device__ __forceinline__ uint4 load_raw16(const scalar_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[VEC]) {
  const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#if HERON_DTYPE == 0
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
#elif HERON_DTYPE == 1
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // element 2i is the low half of word i (little endian)
    out[2 * i] = heron_f16_to_f32((unsigned short)(w[i] & 0xffffu));
    out[2 * i + 1] = heron_f16_to_f32((unsigned short)(w[i] >> 16));
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
#endif
}

__device__ __forceinline__ void load_vec(const scalar_t* p, float (&out)[VEC]) {
  unpack16(load_raw16(p), out);
}

// The VEC floats rounded to scalar_t and stored as one 16-byte write.
__device__ __forceinline__ void store_vec(scalar_t* p, const float (&in)[VEC]) {
  unsigned int w[4];
#if HERON_DTYPE == 0
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(in[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (unsigned int)from_float<scalar_t>(in[2 * i]).bits
           | ((unsigned int)from_float<scalar_t>(in[2 * i + 1]).bits << 16);
#endif
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// An item of W elements: one 16-byte vector (W == VEC) or one element (W == 1).
template <int W> __device__ __forceinline__ void load_item(const scalar_t* p, float (&out)[W]) {
  static_assert(W == 1 || W == VEC, "an item is one element or one 16-byte vector");
  if constexpr (W == 1) out[0] = to_float(*p);
  else load_vec(p, out);
}

template <int W> __device__ __forceinline__ void store_item(scalar_t* p, const float (&in)[W]) {
  static_assert(W == 1 || W == VEC, "an item is one element or one 16-byte vector");
  if constexpr (W == 1) *p = from_float<scalar_t>(in[0]);
  else store_vec(p, in);
}

// Dynamic shared memory (the emulator has no `extern __shared__`).
#ifndef HERON_EMULATE
#define HERON_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- Reductions over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
// NOTE: all 32 lanes of the warp must call these together (full-mask shuffles).
template <int WIDTH> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int WIDTH> __device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block, returned to every thread. blockDim.x must be a multiple of 32;
// call at most once per kernel (its shared scratch is not re-synchronised for reuse).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (int)(blockDim.x >> 5);
  v = group_sum<32>(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < num_warps ? partial[lane] : 0.f;
  return group_sum<32>(v);
}
