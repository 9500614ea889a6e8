// Prefill / chunked-prefill / mixed-batch attention over the paged KV cache on tensor cores
// (mma.sync m16n8k16, float16 / bfloat16 in, float32 accumulation): FlashAttention-2's
// register-level scheme. Same contract as attention_prefill.cu (and
// heron.core.ops.attention.paged_attention_ref), which stays the kernel for float32 and for
// head dims this one does not take.
//
// Rows are (token, query head) pairs of one kv head, head fastest: row r of sequence b is
// token r / GROUP_SIZE, head kv_head * GROUP_SIZE + r % GROUP_SIZE, so the GQA group shares
// every K/V tile. Query j of a sequence with q_len queries and seq_len keys sees keys
// 0 .. seq_len - q_len + j.
//
// A CTA owns BLOCK_M rows, NUM_WARPS warps of WARP_ROWS = BLOCK_M / NUM_WARPS rows (one or
// two 16-row mma tiles each), and walks the keys in tiles of BLOCK_N:
//   S = Q K^T   mma; A = Q fragments (kept in registers when a warp has one 16-row tile and
//               HEAD_DIM <= 128, else re-read from shared memory by ldmatrix), B = K rows
//               from shared memory by ldmatrix (K row-major is B "col" directly);
//   online softmax on the S accumulators in registers (float32, base 2, scale folded in);
//   O += P V    mma; A = P packed to scalar_t in registers (an S accumulator pair of n-tiles
//               is exactly an A fragment), B = V by ldmatrix.trans;
// then O / l is staged through shared memory and written with 16-byte stores.
//
// K and V have one shared-memory buffer each, filled by cp.async (16 bytes per thread; a
// token's HEAD_DIM / 8 chunks go to consecutive threads): V of tile j loads while S of tile
// j is computed, K of tile j+1 while P V of tile j is. The cache offsets of tile j+1's
// tokens (block table lookups) are tabled in shared memory during tile j, so no load waits
// on a global block-table read. Shared-memory rows are padded by 16 bytes: the 8 row
// addresses of an ldmatrix hit distinct banks. A warp skips the key tiles that lie wholly
// past its rows' causal limit (it still takes part in the loads and barriers).
//
// Defines: HERON_DTYPE (1 or 2), HEAD_DIM (a multiple of 16), GROUP_SIZE, BLOCK_SIZE (tokens
// per KV block), BLOCK_M, BLOCK_N (a multiple of 16, <= NUM_WARPS * 32), NUM_WARPS
// (WARP_ROWS = BLOCK_M / NUM_WARPS must be 16 or 32).
// Launch: grid (ceil(max_query_len * GROUP_SIZE / BLOCK_M), num_kv_heads, num_seqs), block
// (NUM_WARPS * 32), dynamic shared memory prefill_mma_smem_bytes (plan.py) =
// 2 * (BLOCK_M + 2 * BLOCK_N) * (HEAD_DIM + 8) + 16 * BLOCK_N bytes (opt in above 48 KiB).
// Row tiles run last-first (the causal diagonal makes the last ones the longest); tiles
// past a sequence's rows exit at once.
#include "common.cuh"
#include "mma.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP_SIZE) || !defined(BLOCK_SIZE) || !defined(BLOCK_M) || \
    !defined(BLOCK_N) || !defined(NUM_WARPS)
#error "define HEAD_DIM, GROUP_SIZE, BLOCK_SIZE, BLOCK_M, BLOCK_N and NUM_WARPS"
#endif

namespace prefill_mma {

constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int WARP_ROWS = BLOCK_M / NUM_WARPS;
constexpr int WM = WARP_ROWS / 16;       // 16-row mma tiles per warp
constexpr int NN = BLOCK_N / 8;          // n-tiles of S
constexpr int KD = HEAD_DIM / 16;        // k-steps of S = Q K^T
constexpr int ND = HEAD_DIM / 8;         // n-tiles of O
constexpr int KN = BLOCK_N / 16;         // k-steps of O += P V
constexpr int LD = HEAD_DIM + 8;         // shared-memory row, in elements (16-byte pad)
constexpr int CHUNKS = HEAD_DIM / 8;     // 16-byte chunks per row
constexpr bool Q_IN_REGS = WM == 1 && HEAD_DIM <= 128;
constexpr int KD_UNROLL = Q_IN_REGS ? KD : 2;
static_assert(BLOCK_N <= NUM_THREADS, "token-offset table filled by one pass of threads");

static_assert(sizeof(scalar_t) == 2, "float16 / bfloat16 only");
static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(WARP_ROWS * NUM_WARPS == BLOCK_M && (WARP_ROWS == 16 || WARP_ROWS == 32),
              "each warp owns 16 or 32 rows");

// `ROWS` rows of 16-byte chunks, spread over the CTA: calls f(row, chunk) for each.
template <int ROWS, class F>
__device__ __forceinline__ void for_chunks(F f) {
  constexpr int TOTAL = ROWS * CHUNKS;
  constexpr int ITERS = (TOTAL + NUM_THREADS - 1) / NUM_THREADS;
  if (NUM_THREADS % CHUNKS == 0) {  // a thread keeps its chunk; rows step by a constant
    constexpr int STEP = NUM_THREADS / CHUNKS;
    const int r0 = (int)threadIdx.x / CHUNKS, c = (int)threadIdx.x % CHUNKS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
      if (TOTAL % NUM_THREADS == 0 || r0 + it * STEP < ROWS) f(r0 + it * STEP, c);
  } else {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int i = (int)threadIdx.x + it * NUM_THREADS;
      if (TOTAL % NUM_THREADS == 0 || i < TOTAL) f(i / CHUNKS, i % CHUNKS);
    }
  }
}

// K or V tokens n0 .. n0 + BLOCK_N of the sequence into the tile at dst (cp.async, not yet
// committed). tok_off[r] is the cache offset of token n0 + r's row of this kv head (see
// fill_token_offsets); rows past kv_end are zero-filled without reading the cache.
__device__ __forceinline__ void load_kv_tile(tc::sptr dst, const scalar_t* __restrict__ cache,
                                             const long long* __restrict__ tok_off, int n0,
                                             int kv_end) {
  for_chunks<BLOCK_N>([&](int r, int c) {
    tc::cp_async16(dst + (r * LD + c * 8) * 2, cache + tok_off[r] + c * 8, n0 + r < kv_end);
  });
}

}  // namespace prefill_mma

extern "C" __global__ void __launch_bounds__(prefill_mma::NUM_THREADS) paged_prefill_mma_kernel(
    scalar_t* __restrict__ out,           // [T, Hq, D] contiguous
    const scalar_t* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
    long long stride_block, long long stride_token, long long stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,         // [B]
    const int* __restrict__ query_start_loc,  // [B + 1]
    int num_q_heads,
    float scale_log2) {                       // softmax scale * log2(e)
  using namespace prefill_mma;
  const int kv_head = blockIdx.y, seq = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * GROUP_SIZE;
  const int m0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BLOCK_M;  // last tiles first
  if (m0 >= num_rows) return;  // block-uniform exit, before any barrier
  const int context = seq_lens[seq] - q_len;  // keys cached before this chunk
  // Keys this tile needs: up to the last valid row's own position.
  const int kv_end = context + (min(m0 + BLOCK_M, num_rows) - 1) / GROUP_SIZE + 1;
  const int num_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

  HERON_DYNAMIC_SMEM(uint4, smem16);
  unsigned short* q_s = reinterpret_cast<unsigned short*>(smem16);  // BLOCK_M x LD
  // then K and V tiles (BLOCK_N x LD each), then two tables of BLOCK_N token offsets
  long long* off_s = reinterpret_cast<long long*>(q_s + (BLOCK_M + 2 * BLOCK_N) * LD);
  // Their shared-window addresses; instruction operands are these plus byte offsets.
  const tc::sptr q_a = tc::to_sptr(q_s), k_a = q_a + BLOCK_M * LD * 2, v_a = k_a + BLOCK_N * LD * 2;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;  // mma groupID / threadID_in_group
  const int* bt = block_tables + (long long)seq * block_tables_stride;
  const long long head_off = (long long)kv_head * stride_head;

  // Cache offsets (block * stride_block + slot * stride_token + head offset) of the tokens of
  // key tile t live in off_s[(t & 1) * BLOCK_N ...] (the head offset alone past kv_end: a
  // valid address, never read). Filled one tile ahead with a barrier before their use, so
  // the K / V loads never wait on a global block-table read.
  auto fill_token_offsets = [&](int t) {
    const int tok = t * BLOCK_N + tid;
    if (tid < BLOCK_N) {
      off_s[(t & 1) * BLOCK_N + tid] =
          head_off + (tok < kv_end ? (long long)bt[tok / BLOCK_SIZE] * stride_block +
                                         (long long)(tok % BLOCK_SIZE) * stride_token
                                   : 0ll);
    }
  };
  fill_token_offsets(0);
  __syncthreads();

  // Q tile (rows past num_rows are zeros: computed, never stored) and K tile 0.
  for_chunks<BLOCK_M>([&](int r, int c) {
    const int row = m0 + r;
    const bool valid = row < num_rows;
    const long long tok = q_start + row / GROUP_SIZE;
    const long long head = (long long)kv_head * GROUP_SIZE + row % GROUP_SIZE;
    tc::cp_async16(q_a + (r * LD + c * 8) * 2,
                   valid ? q + tok * q_stride_t + head * q_stride_h + c * 8 : q, valid);
  });
  load_kv_tile(k_a, k_cache, off_s, 0, kv_end);
  tc::cp_async_commit();

  // This warp's rows: CTA rows w0 .. w0 + WARP_ROWS. Keys past warp_last are masked for all
  // of them (the warp skips such tiles); keys <= warp_first are visible to all of them.
  const int w0 = warp * WARP_ROWS;
  const int warp_first = context + (m0 + w0) / GROUP_SIZE;
  const int warp_last = m0 + w0 < num_rows
      ? context + (min(m0 + w0 + WARP_ROWS, num_rows) - 1) / GROUP_SIZE : -1;
  int pos[WM][2];  // absolute position (= last visible key) of rows g and g + 8 of each m-tile
  float m_i[WM][2], l_i[WM][2], o[WM][ND][4];
#pragma unroll
  for (int m = 0; m < WM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pos[m][h] = context + (m0 + w0 + m * 16 + g + 8 * h) / GROUP_SIZE;
      m_i[m][h] = neg_inf();
      l_i[m][h] = 0.f;  // this lane's share of the row sum; the 4 shares are added at the end
    }
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[m][n][e] = 0.f;
  }
  // This lane's ldmatrix row addresses at offset 0 (see mma.cuh for the layouts): A from Q
  // (matrices: rows 0-7 / 8-15 x k 0-7, then x k 8-15), B from K (keys 0-7 x d 0-7 / 8-15,
  // then keys 8-15), B from V by .trans (keys 0-7 / 8-15 x d 0-7, then x d 8-15).
  const tc::sptr qa = q_a + ((w0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2;
  const tc::sptr ka = k_a + (((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2;
  const tc::sptr va = v_a + (((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2;

  tc::cp_async_wait_all();
  __syncthreads();  // Q and K tile 0 in shared memory

  unsigned qf[Q_IN_REGS ? KD : 1][4];
  if (Q_IN_REGS) {
#pragma unroll
    for (int kd = 0; kd < (Q_IN_REGS ? KD : 1); ++kd)
      tc::ldmatrix_x4(qf[kd], qa + kd * 32);
  }

  for (int it = 0; it < num_tiles; ++it) {
    const int n0 = it * BLOCK_N;
    if (it > 0) {
      tc::cp_async_wait_all();
      __syncthreads();  // K tile `it` landed; every warp is done with V tile it - 1
    }
    load_kv_tile(v_a, v_cache, off_s + (it & 1) * BLOCK_N, n0, kv_end);
    tc::cp_async_commit();
    if (it + 1 < num_tiles) fill_token_offsets(it + 1);  // read after the next barrier

    const bool active = n0 <= warp_last;  // warp-uniform
    float s[WM][NN][4];
    if (active) {
#pragma unroll
      for (int m = 0; m < WM; ++m)
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[m][n][e] = 0.f;
      // Unrolled fully when Q sits in registers (qf needs constant indices); else by 2, which
      // keeps ptxas from hoisting every K fragment load (registers are what bound WM = 2).
#pragma unroll KD_UNROLL
      for (int kd = 0; kd < KD; ++kd) {
        unsigned a[WM][4];
#pragma unroll
        for (int m = 0; m < WM; ++m) {
          if (Q_IN_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[m][e] = qf[Q_IN_REGS ? kd : 0][e];
          } else {
            tc::ldmatrix_x4(a[m], qa + (m * 16 * LD + kd * 16) * 2);
          }
        }
#pragma unroll
        for (int n = 0; n < NN; n += 2) {
          unsigned b[4];  // b0 b1 of n-tile n, b0 b1 of n-tile n + 1
          tc::ldmatrix_x4(b, ka + (n * 8 * LD + kd * 16) * 2);
#pragma unroll
          for (int m = 0; m < WM; ++m) {
            tc::mma_m16n8k16(s[m][n], a[m], b[0], b[1]);
            tc::mma_m16n8k16(s[m][n + 1], a[m], b[2], b[3]);
          }
        }
      }

      // Causal mask (only tiles reaching past the warp's first row), then online softmax.
      const bool masked = n0 + BLOCK_N - 1 > warp_first;
#pragma unroll
      for (int m = 0; m < WM; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = neg_inf();
#pragma unroll
          for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[m][n][2 * h + e];
              if (masked && n0 + n * 8 + 2 * t4 + e > pos[m][h]) x = neg_inf();
              mx = fmaxf(mx, x);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_i[m][h], mx * scale_log2);
          // A row that has seen only masked keys keeps m = -inf; subtract 0 then, not -inf.
          const float m_ref = m_new == neg_inf() ? 0.f : m_new;
          const float corr = tc::exp2_approx(m_i[m][h] - m_ref);
          m_i[m][h] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[m][n][2 * h + e];
              x = tc::exp2_approx(fmaf(x, scale_log2, -m_ref));
              sum += x;
            }
          l_i[m][h] = l_i[m][h] * corr + sum;
#pragma unroll
          for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) o[m][n][2 * h + e] *= corr;
        }
      }
    }

    tc::cp_async_wait_all();
    __syncthreads();  // V tile `it` landed; every warp is done with K tile `it`
    if (it + 1 < num_tiles) {
      load_kv_tile(k_a, k_cache, off_s + ((it + 1) & 1) * BLOCK_N, n0 + BLOCK_N, kv_end);
      tc::cp_async_commit();
    }

    if (active) {
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) {
        unsigned p[WM][4];  // P rows x keys kk*16 .. +16 as an A fragment
#pragma unroll
        for (int m = 0; m < WM; ++m) {
          p[m][0] = tc::pack2(s[m][2 * kk][0], s[m][2 * kk][1]);
          p[m][1] = tc::pack2(s[m][2 * kk][2], s[m][2 * kk][3]);
          p[m][2] = tc::pack2(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
          p[m][3] = tc::pack2(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          unsigned b[4];  // b0 b1 of d-tile n, b0 b1 of d-tile n + 1
          tc::ldmatrix_x4_trans(b, va + (kk * 16 * LD + n * 8) * 2);
#pragma unroll
          for (int m = 0; m < WM; ++m) {
            tc::mma_m16n8k16(o[m][n], p[m], b[0], b[1]);
            tc::mma_m16n8k16(o[m][n + 1], p[m], b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: O / l to scalar_t, staged in the Q tile's shared memory, 16-byte stores.
  __syncthreads();  // every warp is done reading q_s
#pragma unroll
  for (int m = 0; m < WM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_i[m][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = 1.f / l;  // inf for rows past num_rows (l = 0): never stored
      unsigned* row = reinterpret_cast<unsigned*>(q_s + (w0 + m * 16 + g + 8 * h) * LD);
#pragma unroll
      for (int n = 0; n < ND; ++n)
        row[n * 4 + t4] = tc::pack2(o[m][n][2 * h] * inv, o[m][n][2 * h + 1] * inv);
    }
  }
  __syncthreads();
  const int m0_out = tc::opaque(m0);  // recompute the Q loads' row indexing, don't keep it
  for_chunks<BLOCK_M>([&](int r, int c) {
    const int row = m0_out + r;
    if (row < num_rows) {
      const long long tok = q_start + row / GROUP_SIZE;
      const long long head = (long long)kv_head * GROUP_SIZE + row % GROUP_SIZE;
      *reinterpret_cast<uint4*>(out + (tok * num_q_heads + head) * HEAD_DIM + c * 8) =
          *reinterpret_cast<const uint4*>(q_s + r * LD + c * 8);
    }
  });
}
