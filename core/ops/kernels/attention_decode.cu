// Decode attention (one query per sequence) over the paged KV cache, split-K style
// ("flash decoding"): each sequence's context is cut into partitions of `partition_size`
// keys, one CTA per (partition, kv head, sequence); a second kernel merges the partitions.
// Mirrors heron.core.ops.attention.paged_attention_ref for max_query_len == 1.
//
// Defines: HERON_DTYPE, HEAD_DIM, GROUP_SIZE (query heads per kv head), BLOCK_SIZE (tokens
// per KV block). Tuning knobs (plan parameters: heron.core.ops.cuda.plan.DecodeConfig; every
// combination computes the same function):
//   DECODE_MMA       1: tensor cores (mma.sync m16n8k16) for Q.K and P.V; needs float16 /
//                    bfloat16, HEAD_DIM % 64 == 0 and GROUP_SIZE <= 16. 0: CUDA cores (any).
//   DECODE_WARPS     warps per CTA (default 4)
//   DECODE_UNROLL    rows in flight: keys each lane group loads before using any (CUDA-core
//                    path), or 16-key chunks per warp step (tensor-core path). Default 4 / 2.
//   DECODE_KEY_LANES CUDA-core path: lanes sharing one key row, a power of two <= 32; 0 = the
//                    fewest that cover HEAD_DIM with one 16-byte vector each (default 0)
//   DECODE_PREFETCH  1: issue the next step's loads before computing this step (default 0)
//   DECODE_MIN_BLOCKS  CTAs per SM the compiler must fit in registers (__launch_bounds__'s
//                    second argument; default 1 = no register cap)
//
// Launch contract (graph-capturable: the grid depends only on num_seqs and a context bound):
//   paged_decode_kernel: grid (max_splits, num_kv_heads, num_seqs), block (32 * DECODE_WARPS),
//     no dynamic shared memory, max_splits = ceil(max_seq_len / partition_size) for a bound
//     max_seq_len >= every seq_lens[b]; any partition_size >= 1 works (no compile-time bound).
//     Partitions past a sequence's length exit at once.
//     With max_splits == 1 it writes `out` itself and the reduce kernel must not run;
//     otherwise it writes the normalised partial output, its max (log2 domain) and sum.
//   paged_decode_reduce_kernel: grid (ceil(num_q_heads * HEAD_DIM / 4 / 128), num_seqs),
//     block (128); it merges only the partitions that the sequence's length reaches.
//   A sequence with seq_len == 0 (a padded graph row) gets an all-zero output.
//
// One pass over K and V with an online softmax: every warp walks its own keys of the
// partition keeping a running max, sum and P.V accumulator in registers for the GROUP_SIZE
// query heads that share the kv head (each K/V byte is loaded once and used GROUP_SIZE times);
// no logits go through shared memory, so the partition size is a run-time choice. At the end
// the warps merge through shared memory in a fixed order (deterministic).
//   CUDA-core path: a key row is read with 16-byte vectors by LANES_PER_KEY lanes; a lane
//     group loads the K and V rows of UNROLL keys, then reduces the dot products by shuffles.
//   Tensor-core path: a warp takes 16 keys per chunk. S^T = Q K^T with A = Q (16 rows =
//     query heads, zero past GROUP_SIZE) and B = K^T; the accumulator layout of S is the A
//     layout of P, so P.V needs no shuffles. The head dimension is permuted consistently on
//     both operands (a dot product does not care), which lets every lane load K, V and Q
//     with whole 16-byte vectors straight from global memory into mma fragments.
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP_SIZE) || !defined(BLOCK_SIZE)
#error "define HEAD_DIM, GROUP_SIZE and BLOCK_SIZE"
#endif
#ifndef DECODE_MMA
#define DECODE_MMA 0
#endif
#ifndef DECODE_WARPS
#define DECODE_WARPS 4
#endif
#ifndef DECODE_UNROLL
#define DECODE_UNROLL (DECODE_MMA ? 2 : 4)
#endif
#ifndef DECODE_KEY_LANES
#define DECODE_KEY_LANES 0
#endif
#ifndef DECODE_PREFETCH
#define DECODE_PREFETCH 0
#endif
#ifndef DECODE_MIN_BLOCKS
#define DECODE_MIN_BLOCKS 1
#endif

#if DECODE_MMA
#include "mma.cuh"
#endif

namespace decode {

constexpr int NUM_WARPS = DECODE_WARPS;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int UNROLL = DECODE_UNROLL;
// Cross-warp merge: the accumulators of up to WARPS_PER_ROUND warps go through shared memory
// at once (at most RED_BYTES), so large GROUP_SIZE x HEAD_DIM rows still fit 48 KiB. Rows are
// padded by 4 floats against bank conflicts of the tensor-core path's stores.
constexpr int ROW_FLOATS = GROUP_SIZE * HEAD_DIM;
constexpr int RED_STRIDE = HEAD_DIM + 4;
constexpr int RED_FLOATS = GROUP_SIZE * RED_STRIDE;
constexpr int RED_BYTES = 32 * 1024;
constexpr int WARPS_PER_ROUND_FIT = RED_BYTES / (4 * RED_FLOATS) > 0 ? RED_BYTES / (4 * RED_FLOATS) : 1;
constexpr int WARPS_PER_ROUND = NUM_WARPS < WARPS_PER_ROUND_FIT ? NUM_WARPS : WARPS_PER_ROUND_FIT;
constexpr int OUT_PER_THREAD = (ROW_FLOATS + NUM_THREADS - 1) / NUM_THREADS;

static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must be a multiple of 16 bytes of elements");
static_assert(GROUP_SIZE >= 1, "GROUP_SIZE must be positive");
static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 32, "DECODE_WARPS must be in 1..32");
static_assert(UNROLL >= 1, "DECODE_UNROLL must be positive");
static_assert(4 * RED_FLOATS <= RED_BYTES, "GROUP_SIZE x HEAD_DIM too large for the merge buffer");

// 2^x; 0 for x = -inf (ex2.approx.ftz: a few ulp, plenty for softmax weights).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef HERON_EMULATE
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// A running max for exp2(x - m): -inf (nothing seen yet) becomes 0, so that -inf - -inf
// never makes a NaN (exp2(-inf - 0) = 0).
__device__ __forceinline__ float safe_max(float m) { return m == neg_inf() ? 0.f : m; }

__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {  // i: a compile-time constant
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace decode

#if !DECODE_MMA
// ------------------------------------------------------------------ CUDA-core path
namespace decode_fma {
using namespace decode;

constexpr int NVEC = HEAD_DIM / VEC;  // 16-byte vectors per key row
constexpr int AUTO_LANES = NVEC > 16 ? 32 : NVEC > 8 ? 16 : NVEC > 4 ? 8 : NVEC > 2 ? 4 : NVEC > 1 ? 2 : 1;
constexpr int LANES_PER_KEY = DECODE_KEY_LANES > 0 ? DECODE_KEY_LANES : AUTO_LANES;
constexpr int VECS_PER_LANE = (NVEC + LANES_PER_KEY - 1) / LANES_PER_KEY;
constexpr int ELEMS = VECS_PER_LANE * VEC;  // elements of a key row held by one lane
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
static_assert(LANES_PER_KEY >= 1 && LANES_PER_KEY <= 32 && (LANES_PER_KEY & (LANES_PER_KEY - 1)) == 0,
              "DECODE_KEY_LANES must be 0 or a power of two <= 32");

struct Path {
  static constexpr int WARP_KEYS = KEYS_PER_WARP * UNROLL;  // keys one warp covers per step

  // The K and V rows of the UNROLL keys this lane group handles in one step (its slices).
  struct Rows {
    uint4 k[UNROLL][VECS_PER_LANE];
    uint4 v[UNROLL][VECS_PER_LANE];
  };

  int sub, sub_lane;
  float qf[GROUP_SIZE][ELEMS];  // this lane's slice of every query head, pre-scaled
  float m[GROUP_SIZE], l[GROUP_SIZE], acc[GROUP_SIZE][ELEMS];  // this lane group's state

  __device__ __forceinline__ void setup(int lane) {
    sub = lane / LANES_PER_KEY;
    sub_lane = lane % LANES_PER_KEY;
  }

  // Keys base + u * KEYS_PER_WARP + sub of the partition. Branch-free: a key past n loads
  // key n - 1 again (an owned row, already on its way: no extra DRAM traffic, never an
  // unowned slot) and `consume` gives it probability 0. All block-table entries are read
  // before the first row load, so their latencies overlap. Requires n >= 1.
  __device__ __forceinline__ void load(Rows& r, const scalar_t* __restrict__ k_cache,
                                       const scalar_t* __restrict__ v_cache,
                                       const int* __restrict__ bt, int start, int base, int n,
                                       long long stride_block, long long stride_token,
                                       long long head_off) const {
    int tok[UNROLL], blk[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      tok[u] = start + min(base + u * KEYS_PER_WARP + sub, n - 1);
      blk[u] = bt[tok[u] / BLOCK_SIZE];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long off = (long long)blk[u] * stride_block +
                            (long long)(tok[u] % BLOCK_SIZE) * stride_token + head_off;
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        const int vi = vl * LANES_PER_KEY + sub_lane;
        if (NVEC % LANES_PER_KEY == 0 || vi < NVEC) {
          r.k[u][vl] = load_raw16(k_cache + off + vi * VEC);
          r.v[u][vl] = load_raw16(v_cache + off + vi * VEC);
        } else {  // idle lanes of a row that is not a multiple of LANES_PER_KEY vectors
          r.k[u][vl] = r.v[u][vl] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }

  // q_rows: the GROUP_SIZE query rows of this (sequence, kv head), contiguous.
  __device__ __forceinline__ void init(const scalar_t* __restrict__ q_rows, float scale_log2) {
#pragma unroll
    for (int g = 0; g < GROUP_SIZE; ++g) {
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        const int vi = vl * LANES_PER_KEY + sub_lane;
        float tmp[VEC];
        if (vi < NVEC) {
          load_vec(q_rows + g * HEAD_DIM + vi * VEC, tmp);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) tmp[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[g][vl * VEC + e] = tmp[e] * scale_log2;
      }
      m[g] = neg_inf();
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
    }
  }

  // Fold the UNROLL keys of `r` into the state. All lanes of the warp must call it together.
  __device__ __forceinline__ void consume(const Rows& r, int base, int n) {
    float s[UNROLL][GROUP_SIZE];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) s[u][g] = 0.f;
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        float kf[VEC];
        unpack16(r.k[u][vl], kf);
#pragma unroll
        for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[u][g] += qf[g][vl * VEC + e] * kf[e];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool valid = base + u * KEYS_PER_WARP + sub < n;
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) {
        s[u][g] = group_sum<LANES_PER_KEY>(s[u][g]);
        if (!valid) s[u][g] = neg_inf();
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP_SIZE; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
      const float ms = safe_max(mx);
      const float alpha = fast_exp2(m[g] - ms);
      m[g] = mx;
      float sum = l[g] * alpha;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u][g] = fast_exp2(s[u][g] - ms);  // now the probability numerator p (0 when masked)
        sum += s[u][g];
      }
      l[g] = sum;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        float vf[VEC];
        unpack16(r.v[u][vl], vf);  // a masked key's row is an owned (finite) one: p = 0 cancels it
#pragma unroll
        for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][vl * VEC + e] += s[u][g] * vf[e];
      }
    }
  }

  // Merge the KEYS_PER_WARP lane groups of the warp (lanes with equal sub_lane).
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int o = LANES_PER_KEY; o < 32; o <<= 1) {
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) {
        const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
        const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
        const float mx = fmaxf(m[g], mo);
        const float ms = safe_max(mx);
        const float a = fast_exp2(m[g] - ms), b = fast_exp2(mo - ms);
        m[g] = mx;
        l[g] = l[g] * a + lo * b;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e)
          acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * b;
      }
    }
  }

  __device__ __forceinline__ void write_stats(float (*s_m)[GROUP_SIZE], float (*s_l)[GROUP_SIZE],
                                              int warp, int lane) const {
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < GROUP_SIZE; ++g) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
    }
  }

  // The warp's [GROUP_SIZE, HEAD_DIM] accumulator into dst (rows RED_STRIDE apart).
  __device__ __forceinline__ void write_acc(float* dst) const {
    if (sub != 0) return;
#pragma unroll
    for (int g = 0; g < GROUP_SIZE; ++g)
#pragma unroll
      for (int vl = 0; vl < VECS_PER_LANE; ++vl) {
        const int vi = vl * LANES_PER_KEY + sub_lane;
        if (vi < NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dst[g * RED_STRIDE + vi * VEC + e] = acc[g][vl * VEC + e];
        }
      }
  }
};

}  // namespace decode_fma
using DecodePath = decode_fma::Path;

#else
// ------------------------------------------------------------------ tensor-core path
namespace decode_mma {
using namespace decode;

constexpr int CHUNKS = UNROLL;        // 16-key chunks per warp step
constexpr int KVEC = HEAD_DIM / 32;   // K vectors (16 bytes) per lane per key: 32-dim slices
constexpr int VVEC = HEAD_DIM / 64;   // V vectors per lane per key: 64-dim slices
constexpr int KSTEPS = HEAD_DIM / 16;
constexpr int NTILES = HEAD_DIM / 8;
constexpr int ROWS = GROUP_SIZE > 8 ? 2 : 1;  // A row halves in use: heads g, and g + 8

static_assert(HERON_DTYPE == 1 || HERON_DTYPE == 2, "DECODE_MMA needs float16 or bfloat16");
static_assert(HEAD_DIM % 64 == 0, "DECODE_MMA needs HEAD_DIM % 64 == 0");
static_assert(GROUP_SIZE <= 16, "DECODE_MMA needs GROUP_SIZE <= 16");

// Two 16-bit halves from two words: the low halves (key x, key y) or the high halves.
__device__ __forceinline__ unsigned lo_halves(unsigned x, unsigned y) { return (x & 0xffffu) | (y << 16); }
__device__ __forceinline__ unsigned hi_halves(unsigned x, unsigned y) { return (x >> 16) | (y & 0xffff0000u); }

// Lane l = 4 * g + t (g = l / 4, t = l % 4). Within a 16-key chunk:
//   K: lane (g, t) loads keys g and 8 + g (the columns of S's two 8-key tiles), dims
//      32 c + 8 t .. + 7 for every 32-dim slice c. In k-step 2c + j its B registers are the
//      words 2j, 2j + 1 of slice c: logical k 2t, 2t+1 <-> dims 32c + 8t + 4j + {0, 1} and
//      logical k 2t+8, 2t+9 <-> dims 32c + 8t + 4j + {2, 3}. Q's A registers use the same map.
//   S tile n (keys 8n .. 8n+7): c0, c1 = S[head g][keys 8n + 2t, +1] (c2, c3: head g + 8),
//      which is P's A layout for the P.V product over the chunk's 16 keys.
//   V: lane (g, t) loads keys 2t, 2t+1, 2t+8, 2t+9, dims 64 h + 8 g .. + 7 (h: 64-dim slices);
//      the B register of output tile 8 h + i pairs the two keys' element i (column g of the
//      tile <-> dim 64 h + 8 g + i), so accumulator c0, c1 of tile 8 h + i hold the dims
//      64 h + 8 (2t) + i and 64 h + 8 (2t + 1) + i.
struct Path {
  static constexpr int WARP_KEYS = 16 * CHUNKS;

  struct Rows {
    uint4 k[CHUNKS][2][KVEC];  // keys g, 8 + g
    uint4 v[CHUNKS][4][VVEC];  // keys 2t, 2t+1, 2t+8, 2t+9
  };

  int g, t;
  float scale;
  unsigned qa[KSTEPS][4];  // Q as the A operand, rows = heads
  float m[ROWS], l[ROWS];  // per head row (g, g + 8); l is this lane's partial sum
  float acc[NTILES][4];  // c2, c3 (heads g + 8) stay 0 when ROWS == 1: A's rows are 0

  __device__ __forceinline__ void setup(int lane) {
    g = lane >> 2;
    t = lane & 3;
  }

  // Branch-free like the CUDA-core path: keys past n load key n - 1 (owned, finite) again.
  __device__ __forceinline__ void load(Rows& r, const scalar_t* __restrict__ k_cache,
                                       const scalar_t* __restrict__ v_cache,
                                       const int* __restrict__ bt, int start, int base, int n,
                                       long long stride_block, long long stride_token,
                                       long long head_off) const {
    int tok[CHUNKS][6], blk[CHUNKS][6];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        const int key = j == 0 ? g : j == 1 ? 8 + g : 2 * t + ((j - 2) & 1) + ((j - 2) >> 1) * 8;
        tok[c][j] = start + min(base + c * 16 + key, n - 1);
        blk[c][j] = bt[tok[c][j] / BLOCK_SIZE];
      }
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        const long long off = (long long)blk[c][j] * stride_block +
                              (long long)(tok[c][j] % BLOCK_SIZE) * stride_token + head_off;
        if (j < 2) {
#pragma unroll
          for (int s = 0; s < KVEC; ++s) r.k[c][j][s] = load_raw16(k_cache + off + 32 * s + 8 * t);
        } else {
#pragma unroll
          for (int h = 0; h < VVEC; ++h) r.v[c][j - 2][h] = load_raw16(v_cache + off + 64 * h + 8 * g);
        }
      }
    }
  }

  __device__ __forceinline__ void init(const scalar_t* __restrict__ q_rows, float scale_log2) {
    scale = scale_log2;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int s = 0; s < KVEC; ++s) {
      const uint4 q0 = g < GROUP_SIZE ? load_raw16(q_rows + g * HEAD_DIM + 32 * s + 8 * t) : zero;
      uint4 q1 = zero;
      if (ROWS == 2 && g + 8 < GROUP_SIZE) q1 = load_raw16(q_rows + (g + 8) * HEAD_DIM + 32 * s + 8 * t);
      qa[2 * s][0] = q0.x;
      qa[2 * s][1] = q1.x;
      qa[2 * s][2] = q0.y;
      qa[2 * s][3] = q1.y;
      qa[2 * s + 1][0] = q0.z;
      qa[2 * s + 1][1] = q1.z;
      qa[2 * s + 1][2] = q0.w;
      qa[2 * s + 1][3] = q1.w;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      m[r] = neg_inf();
      l[r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < NTILES; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  }

  __device__ __forceinline__ void consume(const Rows& r, int base, int n) {
    float s[CHUNKS][2][4];  // [chunk][8-key tile][c0 c1 c2 c3]
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[c][n8][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          const uint4& kv = r.k[c][n8][ks >> 1];
          tc::mma_m16n8k16(s[c][n8], qa[ks], (ks & 1) ? kv.z : kv.x, (ks & 1) ? kv.w : kv.y);
        }
      }
    // Scale into the exp2 domain, mask keys past n, then the online softmax per head row.
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int n8 = 0; n8 < 2; ++n8)
#pragma unroll
        for (int e = 0; e < 2 * ROWS; ++e) {
          const bool valid = base + c * 16 + n8 * 8 + 2 * t + (e & 1) < n;
          s[c][n8][e] = valid ? s[c][n8][e] * scale : neg_inf();
        }
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      float mx = m[rr];
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8) mx = fmaxf(mx, fmaxf(s[c][n8][2 * rr], s[c][n8][2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the quad holds one head row
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float ms = safe_max(mx);
      const float alpha = fast_exp2(m[rr] - ms);
      m[rr] = mx;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8)
#pragma unroll
          for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
            s[c][n8][e] = fast_exp2(s[c][n8][e] - ms);  // p; 0 when masked
            sum += s[c][n8][e];
          }
      l[rr] = l[rr] * alpha + sum;
#pragma unroll
      for (int i = 0; i < NTILES; ++i) {
        acc[i][2 * rr] *= alpha;
        acc[i][2 * rr + 1] *= alpha;
      }
    }
    // P.V: A = P (rows = heads, k = the chunk's 16 keys), B = V (k = keys, n = 8 dims).
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      unsigned pa[4];
      pa[0] = tc::pack2(s[c][0][0], s[c][0][1]);
      pa[1] = ROWS == 2 ? tc::pack2(s[c][0][2], s[c][0][3]) : 0u;  // heads g + 8
      pa[2] = tc::pack2(s[c][1][0], s[c][1][1]);
      pa[3] = ROWS == 2 ? tc::pack2(s[c][1][2], s[c][1][3]) : 0u;
#pragma unroll
      for (int h = 0; h < VVEC; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const unsigned x0 = word_of(r.v[c][0][h], i >> 1), x1 = word_of(r.v[c][1][h], i >> 1);
          const unsigned x2 = word_of(r.v[c][2][h], i >> 1), x3 = word_of(r.v[c][3][h], i >> 1);
          const unsigned b0 = (i & 1) ? hi_halves(x0, x1) : lo_halves(x0, x1);
          const unsigned b1 = (i & 1) ? hi_halves(x2, x3) : lo_halves(x2, x3);
          tc::mma_m16n8k16(acc[8 * h + i], pa, b0, b1);
        }
    }
  }

  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    }
  }

  __device__ __forceinline__ void write_stats(float (*s_m)[GROUP_SIZE], float (*s_l)[GROUP_SIZE],
                                              int warp, int lane) const {
    if (t != 0) return;
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const int h = g + 8 * rr;
      if (h < GROUP_SIZE) {
        s_m[warp][h] = m[rr];
        s_l[warp][h] = l[rr];
      }
    }
  }

  __device__ __forceinline__ void write_acc(float* dst) const {
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const int h = g + 8 * rr;
      if (h < GROUP_SIZE) {
#pragma unroll
        for (int hh = 0; hh < VVEC; ++hh)
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              dst[h * RED_STRIDE + 64 * hh + 8 * (2 * t + e) + i] = acc[8 * hh + i][2 * rr + e];
      }
    }
  }
};

}  // namespace decode_mma
using DecodePath = decode_mma::Path;
#endif

// A register cap only when asked for: (threads, 1) already changes ptxas's choices.
#if DECODE_MIN_BLOCKS > 1
#define DECODE_BOUNDS decode::NUM_THREADS, DECODE_MIN_BLOCKS
#else
#define DECODE_BOUNDS decode::NUM_THREADS
#endif

extern "C" __global__ void __launch_bounds__(DECODE_BOUNDS) paged_decode_kernel(
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
  constexpr int KEYS_PER_STEP = NUM_WARPS * DecodePath::WARP_KEYS;
  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int max_splits = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long head0 = (long long)seq * num_q_heads + (long long)kv_head * GROUP_SIZE;

  const int seq_len = seq_lens[seq];
  const int start = split * partition_size;
  if (start >= seq_len) {  // block-uniform exit, before any barrier
    if (max_splits == 1) {  // only when seq_len == 0: the row still must be written
      for (int i = tid; i < ROW_FLOATS; i += NUM_THREADS)
        out[head0 * HEAD_DIM + i] = from_float<scalar_t>(0.f);
    }
    return;
  }
  const int n = min(partition_size, seq_len - start);
  const int* bt = block_tables + (long long)seq * block_tables_stride;
  const long long head_off = (long long)kv_head * stride_head;

  DecodePath path;
  path.setup(lane);
  // The first step's loads go out before anything else waits on memory.
  int base = warp * DecodePath::WARP_KEYS;  // warp-uniform: every lane reaches the shuffles
  DecodePath::Rows rows;
  if (base < n)
    path.load(rows, k_cache, v_cache, bt, start, base, n, stride_block, stride_token, head_off);
  path.init(q + head0 * HEAD_DIM, scale_log2);

  for (; base < n; base += KEYS_PER_STEP) {
#if DECODE_PREFETCH
    DecodePath::Rows next;
    const bool more = base + KEYS_PER_STEP < n;  // warp-uniform
    if (more)
      path.load(next, k_cache, v_cache, bt, start, base + KEYS_PER_STEP, n, stride_block,
                stride_token, head_off);
    path.consume(rows, base, n);
    if (more) rows = next;
#else
    if (base != warp * DecodePath::WARP_KEYS)
      path.load(rows, k_cache, v_cache, bt, start, base, n, stride_block, stride_token, head_off);
    path.consume(rows, base, n);
#endif
  }
  path.finish();

  // Merge the warps: each warp's max and sum, then its accumulator row, WARPS_PER_ROUND warps
  // at a time; every thread owns OUT_PER_THREAD elements of the [GROUP_SIZE, HEAD_DIM] row.
  __shared__ float s_m[NUM_WARPS][GROUP_SIZE], s_l[NUM_WARPS][GROUP_SIZE];
  __shared__ float red[WARPS_PER_ROUND][RED_FLOATS];
  path.write_stats(s_m, s_l, warp, lane);
  float o_acc[OUT_PER_THREAD];
#pragma unroll
  for (int k = 0; k < OUT_PER_THREAD; ++k) o_acc[k] = 0.f;
#pragma unroll
  for (int r0 = 0; r0 < NUM_WARPS; r0 += WARPS_PER_ROUND) {
    if (warp >= r0 && warp < r0 + WARPS_PER_ROUND) path.write_acc(red[warp - r0]);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < OUT_PER_THREAD; ++k) {
      const int i = tid + k * NUM_THREADS;
      if (i < ROW_FLOATS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = neg_inf();
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
        const float ms = safe_max(mx);
#pragma unroll
        for (int w = r0; w < r0 + WARPS_PER_ROUND && w < NUM_WARPS; ++w)
          o_acc[k] += red[w - r0][g * RED_STRIDE + d] * fast_exp2(s_m[w][g] - ms);
      }
    }
    if (r0 + WARPS_PER_ROUND < NUM_WARPS) __syncthreads();  // before the next round's writes
  }

#pragma unroll
  for (int k = 0; k < OUT_PER_THREAD; ++k) {
    const int i = tid + k * NUM_THREADS;
    if (i < ROW_FLOATS) {
      const int g = i / HEAD_DIM, d = i % HEAD_DIM;
      float mx = neg_inf();
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
      const float ms = safe_max(mx);
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) sum += s_l[w][g] * fast_exp2(s_m[w][g] - ms);
      const float val = o_acc[k] / sum;
      if (max_splits == 1) {
        out[(head0 + g) * HEAD_DIM + d] = from_float<scalar_t>(val);
      } else {
        part_out[((head0 + g) * max_splits + split) * HEAD_DIM + d] = val;
        if (d == 0) {
          part_max[(head0 + g) * max_splits + split] = mx;
          part_sum[(head0 + g) * max_splits + split] = sum;
        }
      }
    }
  }
}

// Merge the partitions of each (sequence, query head): weights sum_s * 2^(max_s - M). One
// thread per 4 consecutive output elements; only the partitions seq_len reaches are read.
extern "C" __global__ void __launch_bounds__(128) paged_decode_reduce_kernel(
    scalar_t* __restrict__ out,              // [B, Hq, D] contiguous
    const float* __restrict__ part_out,      // [B, Hq, max_splits, D]
    const float* __restrict__ part_max,      // [B, Hq, max_splits]
    const float* __restrict__ part_sum,      // [B, Hq, max_splits]
    const int* __restrict__ seq_lens,        // [B]
    int num_q_heads, int max_splits, int partition_size) {
  constexpr int CHUNKS = HEAD_DIM / 4;  // HEAD_DIM is a multiple of VEC >= 4
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= num_q_heads * CHUNKS) return;
  const int head = idx / CHUNKS, c = idx % CHUNKS;
  const long long row = (long long)blockIdx.y * num_q_heads + head;
  const int seq_len = seq_lens[blockIdx.y];
  const int num_splits = min((seq_len + partition_size - 1) / partition_size, max_splits);
  scalar_t* dst = out + row * HEAD_DIM + c * 4;
  if (num_splits <= 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[e] = from_float<scalar_t>(0.f);
    return;
  }
  const float* pm = part_max + row * max_splits;
  const float* ps = part_sum + row * max_splits;
  const float4* po = reinterpret_cast<const float4*>(part_out + row * max_splits * HEAD_DIM) + c;
  float m = neg_inf();
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, pm[s]);
  float denom = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 4
  for (int s = 0; s < num_splits; ++s) {
    const float w = ps[s] * decode::fast_exp2(pm[s] - m);
    const float4 v = po[s * CHUNKS];
    denom += w;
    a0 += w * v.x;
    a1 += w * v.y;
    a2 += w * v.z;
    a3 += w * v.w;
  }
  const float inv = 1.f / denom;
  dst[0] = from_float<scalar_t>(a0 * inv);
  dst[1] = from_float<scalar_t>(a1 * inv);
  dst[2] = from_float<scalar_t>(a2 * inv);
  dst[3] = from_float<scalar_t>(a3 * inv);
}
