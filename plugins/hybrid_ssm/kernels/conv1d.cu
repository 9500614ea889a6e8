// Mamba2's depthwise causal conv1d + SiLU over windows held in state slots; mirrors
// heron.plugins.hybrid_ssm.ops.conv1d_decode_ref / conv1d_prefill_ref.
//
// A slot's window holds a sequence's last WIDTH - 1 inputs, oldest first (zeros before its
// first token). The conv sums in float32 and rounds to scalar_t once before the SiLU, as
// torch's conv does in the model dtype.
#include "common.cuh"

#ifndef MAX_CONV_WIDTH
#define MAX_CONV_WIDTH 8
#endif

__device__ __forceinline__ float silu_of(float v) {
  v = round_to_scalar(v);
  return v / (1.f + expf(-v));
}

// One token per sequence. Launch: grid (B, ceil(C / blockDim.x)), block (128).
// A row whose slot is negative (a padded graph row) writes zeros and no window.
extern "C" __global__ void conv1d_decode_kernel(
    scalar_t* __restrict__ out,                  // [B, C] contiguous
    const scalar_t* __restrict__ x, long long x_stride,  // row b's C inputs at b * x_stride
    scalar_t* __restrict__ conv_state, long long slot_stride,  // slot s: [C, width - 1]
                                                 // at s * slot_stride, updated in place
    const long long* __restrict__ slots,         // [B]
    const scalar_t* __restrict__ weight,         // [C, width]
    const scalar_t* __restrict__ bias,           // [C]; null: none
    int channels, int width) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const long long b = blockIdx.x, slot = slots[b];
  if (slot < 0) {
    out[b * (long long)channels + c] = from_float<scalar_t>(0.f);
    return;
  }
  scalar_t* window = conv_state + slot * slot_stride + (long long)c * (width - 1);
  const scalar_t* w = weight + (long long)c * width;
  const scalar_t xv = x[b * x_stride + c];
  float acc = bias != nullptr ? to_float(bias[c]) : 0.f;
  for (int k = 0; k < width - 1; ++k) acc += to_float(window[k]) * to_float(w[k]);
  acc += to_float(xv) * to_float(w[width - 1]);
  for (int k = 0; k + 1 < width - 1; ++k) window[k] = window[k + 1];
  if (width > 1) window[width - 2] = xv;
  out[b * (long long)channels + c] = from_float<scalar_t>(silu_of(acc));
}

// The tokens of each prefilling sequence in turn, PREFILL_TOKENS per block; the windows are
// read, not written (conv1d_window_kernel updates them after this kernel).
// seqs: [S, 3] (first row, end row, slot). Launch: grid (ceil(C / blockDim.x), S,
// ceil(longest / PREFILL_TOKENS)), block (128).
#define PREFILL_TOKENS 64
extern "C" __global__ void conv1d_prefill_kernel(
    scalar_t* __restrict__ out, long long out_stride,    // rows of the batch
    const scalar_t* __restrict__ x, long long x_stride,
    const scalar_t* __restrict__ conv_state, long long slot_stride,
    const long long* __restrict__ seqs,
    const scalar_t* __restrict__ weight, const scalar_t* __restrict__ bias,
    int channels, int width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const long long first = seqs[3 * blockIdx.y], end = seqs[3 * blockIdx.y + 1];
  const long long slot = seqs[3 * blockIdx.y + 2];
  const long long start = first + (long long)blockIdx.z * PREFILL_TOKENS;
  if (start >= end) return;
  const long long stop = min(end, start + PREFILL_TOKENS);
  const scalar_t* held = conv_state + slot * slot_stride + (long long)c * (width - 1);
  float w[MAX_CONV_WIDTH], window[MAX_CONV_WIDTH];  // window[k]: input at t - (width - 1) + k
  for (int k = 0; k < width; ++k) w[k] = to_float(weight[(long long)c * width + k]);
  for (int k = 0; k < width - 1; ++k) {
    const long long t = start - (width - 1) + k;
    window[k] = t >= first ? to_float(x[t * x_stride + c])
                           : to_float(held[width - 1 + (t - first)]);
  }
  const float b = bias != nullptr ? to_float(bias[c]) : 0.f;
  for (long long t = start; t < stop; ++t) {
    window[width - 1] = to_float(x[t * x_stride + c]);
    float acc = b;
    for (int k = 0; k < width; ++k) acc += window[k] * w[k];
    out[t * out_stride + c] = from_float<scalar_t>(silu_of(acc));
    for (int k = 0; k + 1 < width; ++k) window[k] = window[k + 1];
  }
}

// After conv1d_prefill_kernel: each prefilling sequence's window becomes its last width - 1
// inputs (some still from the old window when it ran fewer tokens than that).
// Launch: grid (ceil(C / blockDim.x), S), block (128).
extern "C" __global__ void conv1d_window_kernel(
    scalar_t* __restrict__ conv_state, long long slot_stride,
    const scalar_t* __restrict__ x, long long x_stride,
    const long long* __restrict__ seqs, int channels, int width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const long long first = seqs[3 * blockIdx.y], end = seqs[3 * blockIdx.y + 1];
  const long long n = end - first;
  scalar_t* window =
      conv_state + seqs[3 * blockIdx.y + 2] * slot_stride + (long long)c * (width - 1);
  // ascending: entry k reads entry k + n of the old window, not yet overwritten
  for (int k = 0; k < width - 1; ++k) {
    const long long t = n - (width - 1) + k;  // position in this step's tokens
    window[k] = t >= 0 ? x[(first + t) * x_stride + c] : window[k + n];
  }
}
