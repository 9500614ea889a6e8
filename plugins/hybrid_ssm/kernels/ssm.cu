// Mamba2's SSM (SSD): the one-step state update of decode and the chunked scan of prefill;
// mirrors heron.plugins.hybrid_ssm.ops.ssm_decode_ref / ssd_prefill_ref.
//
// h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,  y_t = C_t h_t + D x_t, per head (P channels,
// state size N; heads h share group h / (H / G)'s B and C). States, dt, A, D and y are
// float32; x, B and C are rows of the conv output in the model dtype (row strides given).
#include "common.cuh"

// ---- decode: grid (B, H), block (128): warp w takes channels p = w, w + 4, ..., its lanes
// the state entries n. A row whose slot is negative (a padded graph row) writes zeros to y
// and leaves every state alone.
extern "C" __global__ void ssm_decode_kernel(
    float* __restrict__ y,                        // [B, H, P] contiguous
    float* __restrict__ state, long long slot_stride,  // slot s: [H, P, N] at
                                                  // s * slot_stride, updated in place
    const long long* __restrict__ slots,          // [B]
    const scalar_t* __restrict__ x, long long x_stride,   // row b: [H, P]
    const float* __restrict__ dt,                 // [B, H] contiguous
    const float* __restrict__ A, const float* __restrict__ D,  // [H]
    const scalar_t* __restrict__ Bm, const scalar_t* __restrict__ Cm,  // row b: [G, N]
    long long bc_stride, int num_heads, int head_dim, int num_groups, int state_size) {
  const long long b = blockIdx.x, slot = slots[b];
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  if (slot < 0) {  // the whole block: no barrier below
    for (int p = threadIdx.x; p < head_dim; p += blockDim.x)
      y[(b * num_heads + h) * head_dim + p] = 0.f;
    return;
  }
  const int g = h / (num_heads / num_groups);
  const float d = dt[b * num_heads + h];
  const float decay = expf(d * A[h]);
  const scalar_t* Bg = Bm + b * bc_stride + (long long)g * state_size;
  const scalar_t* Cg = Cm + b * bc_stride + (long long)g * state_size;
  float* s = state + slot * slot_stride + (long long)h * head_dim * state_size;
  for (int p = warp; p < head_dim; p += num_warps) {
    const float xv = to_float(x[b * x_stride + (long long)h * head_dim + p]);
    float* row = s + (long long)p * state_size;
    float acc = 0.f;
    for (int n = lane; n < state_size; n += 32) {
      const float v = row[n] * decay + d * to_float(Bg[n]) * xv;
      row[n] = v;
      acc += v * to_float(Cg[n]);
    }
    acc = group_sum<32>(acc);
    if (lane == 0) y[(b * num_heads + h) * head_dim + p] = acc + xv * D[h];
  }
}

// ---- prefill: the sequences' tokens in chunks of at most L (chunk boundaries count from
// each sequence's first row this step). chunks: [NC, 3] (sequence, first row, length);
// seqs: [S, 3] (first row, end row, slot); seq_chunks: [S + 1], sequence s's chunks are
// seq_chunks[s] .. seq_chunks[s + 1] - 1. Three kernels, launched in this order:
//   ssd_chunk_state_kernel: each chunk's cumulative decay (acum) and its state
//     contribution from zero;
//   ssd_state_passing_kernel: the recurrence over a sequence's chunks, leaving each chunk's
//     starting state in place of its contribution and the final state in the slot;
//   ssd_chunk_scan_kernel: y within each chunk plus its starting state read out.

// grid (NC, H), block (256); dynamic shared memory: 2 * L floats.
extern "C" __global__ void ssd_chunk_state_kernel(
    float* __restrict__ chunk_states,             // [NC, H, P, N]
    float* __restrict__ acum,                     // [NC, H, L]
    const long long* __restrict__ chunks,
    const scalar_t* __restrict__ x, long long x_stride, const float* __restrict__ dt,
    const float* __restrict__ A, const scalar_t* __restrict__ Bm, long long bc_stride,
    int num_heads, int head_dim, int num_groups, int state_size, int chunk_size) {
  HERON_DYNAMIC_SMEM(float, smem);
  float* cum = smem;                  // [L]
  float* weight = smem + chunk_size;  // [L]: exp(cum[last] - cum[l]) * dt[l]
  const int c = blockIdx.x, h = blockIdx.y;
  const long long row0 = chunks[3 * c + 1];
  const int len = (int)chunks[3 * c + 2];
  const int g = h / (num_heads / num_groups);
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int l = 0; l < len; ++l) {
      total += dt[(row0 + l) * num_heads + h] * A[h];
      cum[l] = total;
    }
  }
  __syncthreads();
  float* acum_out = acum + ((long long)c * num_heads + h) * chunk_size;
  for (int l = threadIdx.x; l < len; l += blockDim.x) {
    acum_out[l] = cum[l];
    weight[l] = expf(cum[len - 1] - cum[l]) * dt[(row0 + l) * num_heads + h];
  }
  __syncthreads();
  float* out = chunk_states + ((long long)c * num_heads + h) * head_dim * state_size;
  for (int i = threadIdx.x; i < head_dim * state_size; i += blockDim.x) {
    const int p = i / state_size, n = i % state_size;
    const scalar_t* xs = x + row0 * x_stride + (long long)h * head_dim + p;
    const scalar_t* bs = Bm + row0 * bc_stride + (long long)g * state_size + n;
    float acc = 0.f;
    for (int l = 0; l < len; ++l)
      acc += weight[l] * to_float(xs[l * x_stride]) * to_float(bs[l * bc_stride]);
    out[i] = acc;
  }
}

// grid (S, H), block (256).
extern "C" __global__ void ssd_state_passing_kernel(
    float* __restrict__ chunk_states,             // in: contributions; out: starting states
    float* __restrict__ state, long long slot_stride,  // as in ssm_decode_kernel
    const float* __restrict__ acum, const long long* __restrict__ chunks,
    const long long* __restrict__ seqs, const long long* __restrict__ seq_chunks,
    int num_heads, int head_dim, int state_size, int chunk_size) {
  const int s = blockIdx.x, h = blockIdx.y;
  const long long size = (long long)head_dim * state_size;
  float* held = state + seqs[3 * s + 2] * slot_stride + h * size;
  const long long c0 = seq_chunks[s], c1 = seq_chunks[s + 1];
  for (long long i = threadIdx.x; i < size; i += blockDim.x) {
    float v = held[i];
    for (long long c = c0; c < c1; ++c) {
      float* slot = chunk_states + (c * num_heads + h) * size + i;
      const float contribution = *slot;
      *slot = v;
      const int len = (int)chunks[3 * c + 2];
      v = expf(acum[(c * num_heads + h) * chunk_size + len - 1]) * v + contribution;
    }
    held[i] = v;
  }
}

// grid (NC, H, ceil(L / SCAN_ROWS)), block (256); dynamic shared memory:
// SCAN_ROWS * N + SCAN_ROWS * N + SCAN_ROWS * P + SCAN_ROWS * SCAN_ROWS + L floats.
#define SCAN_ROWS 16
#define SCAN_MAX_OUT 16  // SCAN_ROWS * P / blockDim.x: P <= 256
extern "C" __global__ void ssd_chunk_scan_kernel(
    float* __restrict__ y,                        // [T, H, P] contiguous
    const float* __restrict__ chunk_states,       // starting states [NC, H, P, N]
    const float* __restrict__ acum, const long long* __restrict__ chunks,
    const scalar_t* __restrict__ x, long long x_stride, const float* __restrict__ dt,
    const float* __restrict__ D, const scalar_t* __restrict__ Bm,
    const scalar_t* __restrict__ Cm, long long bc_stride,
    int num_heads, int head_dim, int num_groups, int state_size, int chunk_size) {
  HERON_DYNAMIC_SMEM(float, smem);
  const int N = state_size, P = head_dim;
  float* c_rows = smem;                   // [SCAN_ROWS, N]: C of this block's rows
  float* b_rows = c_rows + SCAN_ROWS * N; // [SCAN_ROWS, N]: B of the source rows
  float* x_rows = b_rows + SCAN_ROWS * N; // [SCAN_ROWS, P]: dt * x of the source rows
  float* scores = x_rows + SCAN_ROWS * P; // [SCAN_ROWS, SCAN_ROWS]
  float* cum = scores + SCAN_ROWS * SCAN_ROWS;  // [L]
  const int c = blockIdx.x, h = blockIdx.y;
  const long long row0 = chunks[3 * c + 1];
  const int len = (int)chunks[3 * c + 2];
  const int l0 = blockIdx.z * SCAN_ROWS;
  if (l0 >= len) return;
  const int rows = min(SCAN_ROWS, len - l0);
  const int g = h / (num_heads / num_groups);
  const long long bc_head = (long long)g * N, x_head = (long long)h * P;
  const float* cum_in = acum + ((long long)c * num_heads + h) * chunk_size;
  for (int l = threadIdx.x; l < l0 + rows; l += blockDim.x) cum[l] = cum_in[l];
  for (int i = threadIdx.x; i < SCAN_ROWS * N; i += blockDim.x) {
    const int r = i / N, n = i % N;
    c_rows[i] = r < rows ? to_float(Cm[(row0 + l0 + r) * bc_stride + bc_head + n]) : 0.f;
  }
  __syncthreads();

  // this thread's outputs: (r, p) = divmod(threadIdx.x + j * blockDim.x, P)
  float acc[SCAN_MAX_OUT];
  const int num_out = (SCAN_ROWS * P + blockDim.x - 1) / blockDim.x;
  const float* start = chunk_states + ((long long)c * num_heads + h) * P * N;
  for (int j = 0; j < num_out; ++j) {
    const int i = threadIdx.x + j * blockDim.x, r = i / P, p = i % P;
    acc[j] = 0.f;
    if (i >= SCAN_ROWS * P || r >= rows) continue;
    float dot = 0.f;  // the chunk's starting state read out at row l0 + r
    for (int n = 0; n < N; ++n) dot += c_rows[r * N + n] * start[(long long)p * N + n];
    acc[j] = expf(cum[l0 + r]) * dot;
  }

  // within the chunk: source rows s <= l, SCAN_ROWS at a time
  for (int s0 = 0; s0 < l0 + rows; s0 += SCAN_ROWS) {
    const int sources = min(SCAN_ROWS, len - s0);
    for (int i = threadIdx.x; i < SCAN_ROWS * N; i += blockDim.x) {
      const int r = i / N, n = i % N;
      b_rows[i] = r < sources ? to_float(Bm[(row0 + s0 + r) * bc_stride + bc_head + n]) : 0.f;
    }
    for (int i = threadIdx.x; i < SCAN_ROWS * P; i += blockDim.x) {
      const int r = i / P, p = i % P;
      const long long t = row0 + s0 + r;
      x_rows[i] = r < sources
          ? dt[t * num_heads + h] * to_float(x[t * x_stride + x_head + p]) : 0.f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < SCAN_ROWS * SCAN_ROWS; i += blockDim.x) {
      const int r = i / SCAN_ROWS, q = i % SCAN_ROWS;
      const int l = l0 + r, s = s0 + q;
      float v = 0.f;
      if (r < rows && q < sources && s <= l) {
        for (int n = 0; n < N; ++n) v += c_rows[r * N + n] * b_rows[q * N + n];
        v *= expf(cum[l] - cum[s]);
      }
      scores[i] = v;
    }
    __syncthreads();
    for (int j = 0; j < num_out; ++j) {
      const int i = threadIdx.x + j * blockDim.x, r = i / P, p = i % P;
      if (i >= SCAN_ROWS * P || r >= rows) continue;
      float sum = 0.f;
      for (int q = 0; q < SCAN_ROWS; ++q) sum += scores[r * SCAN_ROWS + q] * x_rows[q * P + p];
      acc[j] += sum;
    }
    __syncthreads();
  }

  for (int j = 0; j < num_out; ++j) {
    const int i = threadIdx.x + j * blockDim.x, r = i / P, p = i % P;
    if (i >= SCAN_ROWS * P || r >= rows) continue;
    const long long t = row0 + l0 + r;
    y[(t * num_heads + h) * P + p] = acc[j] + D[h] * to_float(x[t * x_stride + x_head + p]);
  }
}
