// Prefill / chunked-prefill / mixed-batch attention over the paged KV cache, flash-attention
// style: a CTA owns BLOCK_M query rows and walks the keys in tiles of BLOCK_N with an online
// softmax, accumulating in float32. Mirrors heron.core.ops.attention.paged_attention_ref.
//
// Rows are (token, query head) pairs of one kv head, head fastest: row r of sequence b is
// token r / GROUP_SIZE, head kv_head * GROUP_SIZE + r % GROUP_SIZE. Packing the GQA group
// into rows lets the group share every K/V tile (and gives a decode row of a mixed batch
// GROUP_SIZE useful rows instead of one). Query j of a sequence with q_len queries and
// seq_len keys sees keys 0 .. seq_len - q_len + j (the cached prefix plus its causal part).
//
// Defines: HERON_DTYPE, HEAD_DIM (a multiple of 32), GROUP_SIZE, BLOCK_SIZE (tokens per KV
// block), BLOCK_M (a multiple of 16), BLOCK_N (a multiple of 8).
// Launch: grid (ceil(max_query_len * GROUP_SIZE / BLOCK_M), num_kv_heads, num_seqs),
// block (128), dynamic shared memory prefill_smem_bytes(...) below (set the kernel's
// max dynamic shared memory attribute when it exceeds 48 KiB). Tiles past a sequence's
// rows exit at once.
//
// Thread layout: 16 x 8 threads; thread (ty, tx) owns S rows ty*RM .. +RM and S columns
// tx + 8j, and O rows ty*RM .. +RM, columns c*32 + tx*4 .. +4. A row's 8 threads are
// consecutive lanes, so row max/sum are 3 shuffles.
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP_SIZE) || !defined(BLOCK_SIZE) || !defined(BLOCK_M) || !defined(BLOCK_N)
#error "define HEAD_DIM, GROUP_SIZE, BLOCK_SIZE, BLOCK_M and BLOCK_N"
#endif

namespace prefill {

constexpr int NUM_THREADS = 128;
constexpr int TN = 8;                    // threads per row
constexpr int TM = NUM_THREADS / TN;     // 16 row groups
constexpr int RM = BLOCK_M / TM;         // rows per thread
constexpr int RN = BLOCK_N / TN;         // S columns per thread
constexpr int DCH = HEAD_DIM / 32;       // float4 chunks of O per row per thread
constexpr int DP = HEAD_DIM + 4;         // padded smem row: 8 rows x float4 hit 32 banks
constexpr int PP = BLOCK_N + 4;
constexpr int NVEC = HEAD_DIM / VEC;

static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32");
static_assert(BLOCK_M % TM == 0 && BLOCK_N % TN == 0 && BLOCK_N % 4 == 0, "bad tile");
// Shared memory in floats: Q tile, one K-or-V tile, P tile (see plan.py: prefill_smem_bytes).
constexpr int SMEM_FLOATS = BLOCK_M * DP + BLOCK_N * DP + BLOCK_M * PP;

// K or V rows n0 .. n0 + BLOCK_N of the sequence into smem as float; zeros past kv_end.
__device__ __forceinline__ void load_kv_tile(float* __restrict__ dst, const scalar_t* __restrict__ cache,
                                             const int* __restrict__ bt, int n0, int kv_end,
                                             long long stride_block, long long stride_token,
                                             long long head_off) {
  for (int i = threadIdx.x; i < BLOCK_N * NVEC; i += NUM_THREADS) {
    const int r = i / NVEC, vi = i % NVEC, tok = n0 + r;
    float f[VEC];
    if (tok < kv_end) {
      load_vec(cache + (long long)bt[tok / BLOCK_SIZE] * stride_block +
                   (long long)(tok % BLOCK_SIZE) * stride_token + head_off + vi * VEC, f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[r * DP + vi * VEC + e] = f[e];
  }
}

}  // namespace prefill

extern "C" __global__ void __launch_bounds__(prefill::NUM_THREADS) paged_prefill_kernel(
    scalar_t* __restrict__ out,           // [T, Hq, D] contiguous
    const scalar_t* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
    long long stride_block, long long stride_token, long long stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,         // [B]
    const int* __restrict__ query_start_loc,  // [B + 1]
    int num_q_heads,
    float scale_log2) {                       // softmax scale * log2(e)
  using namespace prefill;
  const int kv_head = blockIdx.y, seq = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * GROUP_SIZE;
  const int m0 = blockIdx.x * BLOCK_M;
  if (m0 >= num_rows) return;  // block-uniform exit, before any barrier
  const int seq_len = seq_lens[seq];
  const int context = seq_len - q_len;  // keys cached before this chunk
  // Keys this tile needs: up to the last valid row's own position.
  const int kv_end = context + (min(m0 + BLOCK_M, num_rows) - 1) / GROUP_SIZE + 1;

  HERON_DYNAMIC_SMEM(float4, smem4);
  float* q_s = reinterpret_cast<float*>(smem4);
  float* kv_s = q_s + BLOCK_M * DP;
  float* p_s = kv_s + BLOCK_N * DP;

  const int tid = threadIdx.x, tx = tid % TN, ty = tid / TN;
  const int* bt = block_tables + (long long)seq * block_tables_stride;
  const long long head_off = (long long)kv_head * stride_head;

  // Q tile, pre-scaled; rows past num_rows are zeros (computed, never stored).
  for (int i = tid; i < BLOCK_M * NVEC; i += NUM_THREADS) {
    const int r = i / NVEC, vi = i % NVEC, row = m0 + r;
    float f[VEC];
    if (row < num_rows) {
      const long long tok = q_start + row / GROUP_SIZE;
      const long long head = (long long)kv_head * GROUP_SIZE + row % GROUP_SIZE;
      load_vec(q + tok * q_stride_t + head * q_stride_h + vi * VEC, f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) q_s[r * DP + vi * VEC + e] = f[e] * scale_log2;
  }

  int row_pos[RM];  // absolute position of each owned row: its last visible key
  float m_i[RM], l_i[RM], o[RM][DCH][4];
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    row_pos[i] = context + (m0 + ty * RM + i) / GROUP_SIZE;
    m_i[i] = neg_inf();
    l_i[i] = 0.f;  // this thread's share of the row sum; the 8 shares are added at the end
#pragma unroll
    for (int c = 0; c < DCH; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][c][e] = 0.f;
  }

  for (int n0 = 0; n0 < kv_end; n0 += BLOCK_N) {
    __syncthreads();  // Q tile written / previous P.V done with kv_s and p_s
    load_kv_tile(kv_s, k_cache, bt, n0, kv_end, stride_block, stride_token, head_off);
    __syncthreads();

    float s[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) s[i][j] = 0.f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 4) {
      float4 a[RM];
#pragma unroll
      for (int i = 0; i < RM; ++i) a[i] = *reinterpret_cast<const float4*>(q_s + (ty * RM + i) * DP + d);
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const float4 b = *reinterpret_cast<const float4*>(kv_s + (tx + TN * j) * DP + d);
#pragma unroll
        for (int i = 0; i < RM; ++i) s[i][j] += a[i].x * b.x + a[i].y * b.y + a[i].z * b.z + a[i].w * b.w;
      }
    }

    // Causal mask, online softmax; P to smem for the P.V product.
#pragma unroll
    for (int i = 0; i < RM; ++i) {
      float tile_max = neg_inf();
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const int tok = n0 + tx + TN * j;
        if (tok > row_pos[i] || tok >= kv_end) s[i][j] = neg_inf();
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      tile_max = group_max<TN>(tile_max);
      const float m_new = fmaxf(m_i[i], tile_max);
      // A row that has seen only masked keys keeps m = -inf; subtract 0 then, not -inf.
      const float m_ref = m_new == neg_inf() ? 0.f : m_new;
      const float corr = exp2f(m_i[i] - m_ref);
      m_i[i] = m_new;
      l_i[i] *= corr;
#pragma unroll
      for (int c = 0; c < DCH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][c][e] *= corr;
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const float p = exp2f(s[i][j] - m_ref);
        l_i[i] += p;
        p_s[(ty * RM + i) * PP + tx + TN * j] = p;
      }
    }
    __syncthreads();  // P complete; every thread is done reading K
    load_kv_tile(kv_s, v_cache, bt, n0, kv_end, stride_block, stride_token, head_off);
    __syncthreads();

#pragma unroll 2
    for (int n = 0; n < BLOCK_N; n += 4) {
      float4 p4[RM];
#pragma unroll
      for (int i = 0; i < RM; ++i) p4[i] = *reinterpret_cast<const float4*>(p_s + (ty * RM + i) * PP + n);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
#pragma unroll
        for (int c = 0; c < DCH; ++c) {
          const float4 v = *reinterpret_cast<const float4*>(kv_s + (n + nn) * DP + c * 32 + tx * 4);
#pragma unroll
          for (int i = 0; i < RM; ++i) {
            const float p = nn == 0 ? p4[i].x : nn == 1 ? p4[i].y : nn == 2 ? p4[i].z : p4[i].w;
            o[i][c][0] += p * v.x;
            o[i][c][1] += p * v.y;
            o[i][c][2] += p * v.z;
            o[i][c][3] += p * v.w;
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const float l = group_sum<TN>(l_i[i]);
    const int row = m0 + ty * RM + i;
    if (row >= num_rows) continue;
    const long long tok = q_start + row / GROUP_SIZE;
    const long long head = (long long)kv_head * GROUP_SIZE + row % GROUP_SIZE;
    scalar_t* dst = out + (tok * num_q_heads + head) * HEAD_DIM;
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < DCH; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[c * 32 + tx * 4 + e] = from_float<scalar_t>(o[i][c][e] * inv);
  }
}
