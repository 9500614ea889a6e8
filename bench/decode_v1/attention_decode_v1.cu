// Baseline for bench/gpu_bench.py (section decode_sweep): heron's first decode kernel, two passes
// with logits in shared memory (commit bb19c4a), kept verbatim but for this header and the
// include path, so that one GPU run times the old and the new kernel side by side. Not used
// by heron itself.
// Decode attention (one query per sequence) over the paged KV cache, split-K style
// ("flash decoding"): each sequence's context is cut into partitions of `partition_size`
// keys, one CTA per (partition, kv head, sequence); a second kernel merges the partitions.
// Mirrors heron.core.ops.attention.paged_attention_ref for max_query_len == 1.
//
// Defines: HERON_DTYPE, HEAD_DIM, GROUP_SIZE (query heads per kv head), BLOCK_SIZE (tokens
// per KV block), PARTITION_MAX (upper bound of partition_size: sizes the logits buffer).
//
// Launch contract (graph-capturable: the grid depends only on num_seqs and a context bound):
//   paged_decode_kernel: grid (max_splits, num_kv_heads, num_seqs), block (128), no dynamic
//     shared memory, max_splits = ceil(max_seq_len / partition_size) for a bound
//     max_seq_len >= every seq_lens[b]. Partitions past a sequence's length exit at once.
//     With max_splits == 1 it writes `out` itself and the reduce kernel must not run;
//     otherwise it writes the normalised partial output, its max (log2 domain) and sum.
//   paged_decode_reduce_kernel: grid (num_q_heads, num_seqs), block (128).
//   A sequence with seq_len == 0 (a padded graph row) gets an all-zero output.
//
// Work split inside a CTA: a key row (HEAD_DIM elements) is read with 16-byte vectors by a
// group of LANES_PER_KEY lanes, so a warp covers KEYS_PER_WARP keys per step; the
// GROUP_SIZE query heads that share a kv head reuse every K/V load. Pass 1 writes the
// logits of the partition to shared memory, one warp per head turns them into
// probabilities, pass 2 accumulates P.V in registers, then lanes and warps are summed in a
// fixed order (deterministic).
#include "../../core/ops/kernels/common.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP_SIZE) || !defined(BLOCK_SIZE) || !defined(PARTITION_MAX)
#error "define HEAD_DIM, GROUP_SIZE, BLOCK_SIZE and PARTITION_MAX"
#endif

namespace decode {

constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int NVEC = HEAD_DIM / VEC;  // 16-byte vectors per key row
constexpr int LANES_PER_KEY = NVEC > 16 ? 32 : NVEC > 8 ? 16 : NVEC > 4 ? 8 : NVEC > 2 ? 4 : NVEC > 1 ? 2 : 1;
constexpr int VECS_PER_LANE = (NVEC + LANES_PER_KEY - 1) / LANES_PER_KEY;
constexpr int ELEMS = VECS_PER_LANE * VEC;  // elements of a key row held by one lane
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
constexpr int UNROLL = 4;  // keys per lane loaded before use: more bytes in flight
constexpr int KEYS_PER_STEP = NUM_WARPS * KEYS_PER_WARP * UNROLL;

static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must be a multiple of 16 bytes of elements");
static_assert(GROUP_SIZE >= 1, "GROUP_SIZE must be positive");

// Load, for key `t` of the partition (or zeros when t >= n), this lane's slice of the row.
__device__ __forceinline__ void load_row(uint4 (&raw)[VECS_PER_LANE], const scalar_t* __restrict__ cache,
                                         const int* __restrict__ bt, int start, int t, int n,
                                         long long stride_block, long long stride_token,
                                         long long head_off, int sub_lane) {
  if (t < n) {
    const int tok = start + t;
    const scalar_t* row = cache + (long long)bt[tok / BLOCK_SIZE] * stride_block +
                          (long long)(tok % BLOCK_SIZE) * stride_token + head_off;
#pragma unroll
    for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
      const int vi = vl * LANES_PER_KEY + sub_lane;
      raw[vl] = vi < NVEC ? load_raw16(row + vi * VEC) : make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
#pragma unroll
    for (int vl = 0; vl < VECS_PER_LANE; ++vl) raw[vl] = make_uint4(0u, 0u, 0u, 0u);
  }
}

}  // namespace decode

extern "C" __global__ void __launch_bounds__(decode::NUM_THREADS) paged_decode_kernel(
    scalar_t* __restrict__ out,           // [B, Hq, D] contiguous (max_splits == 1)
    float* __restrict__ part_out,         // [B, Hq, max_splits, D] (max_splits > 1)
    float* __restrict__ part_max,         // [B, Hq, max_splits]
    float* __restrict__ part_sum,         // [B, Hq, max_splits]
    const scalar_t* __restrict__ q,       // [B, Hq, D] contiguous
    const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
    long long stride_block, long long stride_token, long long stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,     // [B]
    int num_q_heads, int partition_size,
    float scale_log2) {                   // softmax scale * log2(e): logits in the exp2 domain
  using namespace decode;
  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int max_splits = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int sub = lane / LANES_PER_KEY, sub_lane = lane % LANES_PER_KEY;
  const long long head0 = (long long)seq * num_q_heads + (long long)kv_head * GROUP_SIZE;

  const int seq_len = seq_lens[seq];
  const int start = split * partition_size;
  if (start >= seq_len) {  // block-uniform exit, before any barrier
    if (max_splits == 1) {  // only when seq_len == 0: the row still must be written
      for (int i = tid; i < GROUP_SIZE * HEAD_DIM; i += NUM_THREADS)
        out[head0 * HEAD_DIM + i] = from_float<scalar_t>(0.f);
    }
    return;
  }
  const int n = min(partition_size, seq_len - start);

  __shared__ float logits[GROUP_SIZE * PARTITION_MAX];
  __shared__ float red[GROUP_SIZE * HEAD_DIM];
  __shared__ float s_max[GROUP_SIZE], s_sum[GROUP_SIZE];

  const int* bt = block_tables + (long long)seq * block_tables_stride;
  const long long head_off = (long long)kv_head * stride_head;

  // This lane's slice of every query head of the group, pre-scaled.
  float qf[GROUP_SIZE][ELEMS];
#pragma unroll
  for (int g = 0; g < GROUP_SIZE; ++g) {
#pragma unroll
    for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
      const int vi = vl * LANES_PER_KEY + sub_lane;
      float tmp[VEC];
      if (vi < NVEC) {
        load_vec(q + (head0 + g) * HEAD_DIM + vi * VEC, tmp);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) tmp[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][vl * VEC + e] = tmp[e] * scale_log2;
    }
  }

  // Pass 1: logits. The loop bound is warp-uniform so every lane reaches the shuffles.
  for (int base = warp * KEYS_PER_WARP * UNROLL; base < n; base += KEYS_PER_STEP) {
    uint4 raw[UNROLL][VECS_PER_LANE];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      load_row(raw[u], k_cache, bt, start, base + u * KEYS_PER_WARP + sub, n, stride_block,
               stride_token, head_off, sub_lane);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float dot[GROUP_SIZE];
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) dot[g] = 0.f;
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        float kf[VEC];
        unpack16(raw[u][vl], kf);
#pragma unroll
        for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] += qf[g][vl * VEC + e] * kf[e];
      }
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) dot[g] = group_sum<LANES_PER_KEY>(dot[g]);
      const int t = base + u * KEYS_PER_WARP + sub;
      if (t < n && sub_lane == 0) {
#pragma unroll
        for (int g = 0; g < GROUP_SIZE; ++g) logits[g * PARTITION_MAX + t] = dot[g];
      }
    }
  }
  __syncthreads();

  // Softmax numerators in place, one warp per query head.
  for (int g = warp; g < GROUP_SIZE; g += NUM_WARPS) {
    float* lg = logits + g * PARTITION_MAX;
    float mx = neg_inf();
    for (int t = lane; t < n; t += 32) mx = fmaxf(mx, lg[t]);
    mx = group_max<32>(mx);
    float sum = 0.f;
    for (int t = lane; t < n; t += 32) {
      const float p = exp2f(lg[t] - mx);
      lg[t] = p;
      sum += p;
    }
    sum = group_sum<32>(sum);
    if (lane == 0) {
      s_max[g] = mx;
      s_sum[g] = sum;
    }
  }
  __syncthreads();

  // Pass 2: P.V into registers.
  float acc[GROUP_SIZE][ELEMS];
#pragma unroll
  for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
  for (int base = warp * KEYS_PER_WARP * UNROLL; base < n; base += KEYS_PER_STEP) {
    uint4 raw[UNROLL][VECS_PER_LANE];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      load_row(raw[u], v_cache, bt, start, base + u * KEYS_PER_WARP + sub, n, stride_block,
               stride_token, head_off, sub_lane);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * KEYS_PER_WARP + sub;
      if (t >= n) continue;
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        float vf[VEC];
        unpack16(raw[u][vl], vf);
#pragma unroll
        for (int g = 0; g < GROUP_SIZE; ++g) {
          const float p = logits[g * PARTITION_MAX + t];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][vl * VEC + e] += p * vf[e];
        }
      }
    }
  }

  // Sum the KEYS_PER_WARP lane groups of each warp (lanes with equal sub_lane)...
#pragma unroll
  for (int o = LANES_PER_KEY; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  // ...then the warps, last to first, into `red`.
#pragma unroll
  for (int w = NUM_WARPS - 1; w >= 0; --w) {
    if (warp == w && sub == 0) {
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
        for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
          const int vi = vl * LANES_PER_KEY + sub_lane;
          if (vi < NVEC) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const int idx = g * HEAD_DIM + vi * VEC + e;
              red[idx] = (w == NUM_WARPS - 1 ? 0.f : red[idx]) + acc[g][vl * VEC + e];
            }
          }
        }
    }
    __syncthreads();
  }

  for (int i = tid; i < GROUP_SIZE * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    const float val = red[i] / s_sum[g];
    if (max_splits == 1) {
      out[(head0 + g) * HEAD_DIM + d] = from_float<scalar_t>(val);
    } else {
      part_out[((head0 + g) * max_splits + split) * HEAD_DIM + d] = val;
    }
  }
  if (max_splits > 1 && tid < GROUP_SIZE) {
    part_max[(head0 + tid) * max_splits + split] = s_max[tid];
    part_sum[(head0 + tid) * max_splits + split] = s_sum[tid];
  }
}

// Merge the partitions of each (sequence, query head): weights sum_s * 2^(max_s - M).
extern "C" __global__ void __launch_bounds__(128) paged_decode_reduce_kernel(
    scalar_t* __restrict__ out,              // [B, Hq, D] contiguous
    const float* __restrict__ part_out,      // [B, Hq, max_splits, D]
    const float* __restrict__ part_max,      // [B, Hq, max_splits]
    const float* __restrict__ part_sum,      // [B, Hq, max_splits]
    const int* __restrict__ seq_lens,        // [B]
    int num_q_heads, int max_splits, int partition_size) {
  const long long row = (long long)blockIdx.y * num_q_heads + blockIdx.x;
  const int seq_len = seq_lens[blockIdx.y];
  const int num_splits = min((seq_len + partition_size - 1) / partition_size, max_splits);
  scalar_t* dst = out + row * HEAD_DIM;
  if (num_splits <= 0) {
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) dst[d] = from_float<scalar_t>(0.f);
    return;
  }
  const float* pm = part_max + row * max_splits;
  const float* ps = part_sum + row * max_splits;
  float m = neg_inf();
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, pm[s]);
  float denom = 0.f;
  for (int s = 0; s < num_splits; ++s) denom += ps[s] * exp2f(pm[s] - m);
  const float inv = 1.f / denom;
  const float* po = part_out + row * max_splits * HEAD_DIM;
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < num_splits; ++s) acc += po[s * HEAD_DIM + d] * (ps[s] * exp2f(pm[s] - m));
    dst[d] = from_float<scalar_t>(acc * inv);
  }
}
