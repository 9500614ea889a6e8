// Just enough of CUDA's execution model to run heron's kernels on CPU threads, for tests.
//
// Force-included (g++ -include) ahead of a kernel source. Blocks run one after another;
// the threads of a block are real std::threads, so __syncthreads and warp shuffles are
// real barriers. It is stricter than hardware: a barrier or shuffle that not every thread
// of the block / warp reaches aborts with a message instead of silently misbehaving.
// `__shared__` becomes `static`: with one block at a time, a function-local static is
// exactly per-block shared memory.
//
// Warp-collective tensor-core instructions (mma.sync m16n8k16, ldmatrix) and cp.async are
// emulated at the end of this file, following the PTX ISA fragment layouts; kernels reach
// them through core/ops/kernels/mma.cuh. A collective is a real rendezvous of the warp's 32
// lanes (each lane publishes its operands, then computes its own results from everyone's),
// so a lane that skips one, or diverges around it, aborts the run as a shuffle does.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define HERON_EMULATE 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

using std::max;
using std::min;

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

inline float heron_f16_to_f32(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short heron_f32_to_f16(float f) {
  _Float16 v = (_Float16)f;  // round to nearest even
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline unsigned short heron_f32_to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return (unsigned short)(u >> 16);
}

namespace heron_emu {

struct Barrier {
  explicit Barrier(int n) : count(n) {}
  void wait(const char* what) {
    std::unique_lock<std::mutex> lk(m);
    const long g = gen;
    if (++waiting == count) {
      waiting = 0;
      ++gen;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lk, std::chrono::seconds(30), [&] { return gen != g; })) {
      std::fprintf(stderr, "heron emulator: %s not reached by every thread (block %u,%u,%u)\n",
                   what, blockIdx.x, blockIdx.y, blockIdx.z);
      std::abort();
    }
  }
  std::mutex m;
  std::condition_variable cv;
  int count, waiting = 0;
  long gen = 0;
};

// Operands of one warp-collective instruction: two slots (alternating between consecutive
// collectives, so one barrier per collective suffices) x 32 lanes x 8 words.
struct WarpScratch { unsigned int w[2][32][8]; };

struct Block {
  Block(int threads, size_t smem)
      : block_bar(threads), exchange(threads), scratch((threads + 31) / 32),
        dynamic_smem(smem + 1, float4{NAN, NAN, NAN, NAN}), dynamic_bytes(smem * 16) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warp_bars.emplace_back(new Barrier(std::min(32, threads - 32 * w)));
  }
  ~Block() { for (auto* b : warp_bars) delete b; }
  Barrier block_bar;
  std::vector<Barrier*> warp_bars;
  std::vector<unsigned long long> exchange;
  std::vector<WarpScratch> scratch;
  std::vector<float4> dynamic_smem;  // float4: 16-byte aligned; NaN until written
  size_t dynamic_bytes;              // what the launch asked for (rounded up to 16)
};

inline thread_local Block* block = nullptr;
inline thread_local int linear_tid = 0;

template <class F>
void launch(dim3 grid, dim3 blk, size_t smem, F body) {
  const int threads = (int)(blk.x * blk.y * blk.z);
  if (threads % 32) { std::fprintf(stderr, "heron emulator: block size must be a multiple of 32\n"); std::abort(); }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b(threads, (smem + 15) / 16);
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            threadIdx = dim3(t % blk.x, (t / blk.x) % blk.y, t / (blk.x * blk.y));
            blockIdx = dim3(bx, by, bz);
            blockDim = blk;
            gridDim = grid;
            block = &b;
            linear_tid = t;
            body();
          });
        for (auto& th : pool) th.join();
      }
}

}  // namespace heron_emu

#define HERON_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(heron_emu::block->dynamic_smem.data())

inline void __syncthreads() { heron_emu::block->block_bar.wait("__syncthreads"); }

template <class T>
inline T heron_emu_shuffle(unsigned mask, T v, int src_lane_of_mine_xor, bool is_xor) {
  if (mask != 0xffffffffu) { std::fprintf(stderr, "heron emulator: only full-mask shuffles\n"); std::abort(); }
  static_assert(sizeof(T) <= 8, "shuffle of a large type");
  auto* b = heron_emu::block;
  const int tid = heron_emu::linear_tid, warp = tid / 32, lane = tid % 32;
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b->exchange[tid] = bits;
  b->warp_bars[warp]->wait("warp shuffle");
  const int src = is_xor ? (lane ^ src_lane_of_mine_xor) : src_lane_of_mine_xor;
  bits = b->exchange[warp * 32 + (src & 31)];
  b->warp_bars[warp]->wait("warp shuffle");
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) { return heron_emu_shuffle(mask, v, lane_mask, true); }
template <class T> inline T __shfl_sync(unsigned mask, T v, int src) { return heron_emu_shuffle(mask, v, src, false); }
inline void __syncwarp(unsigned = 0xffffffffu) { heron_emu::block->warp_bars[heron_emu::linear_tid / 32]->wait("__syncwarp"); }

// ---------------------------------------------------------------------------------------
// Tensor-core instructions (sm_80+), as used through core/ops/kernels/mma.cuh.
//
// Reference: PTX ISA, "Warp-level matrix instructions: mma" (section "Matrix Fragments for
// mma.m16n8k16 with floating point type") and "ldmatrix". Per lane: groupID g = lane >> 2,
// threadID_in_group t = lane & 3; a .b32 register packs two 16-bit elements, the one with
// the lower column (A, C) or row (B) index in bits 0..15.
//
//   A, 16 x 16 (.row), four .b32 regs, a0..a7 = the eight halves:
//     a0,a1 = A[g  ][2t, 2t+1]     (reg 0)      a2,a3 = A[g+8][2t, 2t+1]     (reg 1)
//     a4,a5 = A[g  ][2t+8, 2t+9]   (reg 2)      a6,a7 = A[g+8][2t+8, 2t+9]   (reg 3)
//   B, 16 x 8 (.col), two .b32 regs:
//     b0,b1 = B[2t, 2t+1][g]       (reg 0)      b2,b3 = B[2t+8, 2t+9][g]     (reg 1)
//   C and D, 16 x 8, four .f32 regs:
//     c0,c1 = C[g][2t, 2t+1]                    c2,c3 = C[g+8][2t, 2t+1]
//   So A[r][k] lives in lane (r % 8) * 4 + (k % 8) / 2, reg (r >= 8) + 2 * (k >= 8), half k % 2;
//   B[k][n] in lane n * 4 + (k % 8) / 2, reg (k >= 8), half k % 2.
//
//   ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: N 8x8 matrices of 16-bit elements.
//   Lanes 8i .. 8i+7 hold the addresses of rows 0..7 of matrix i (16 contiguous bytes each,
//   16-byte aligned); lane l's register i receives matrix i's row l / 4, elements
//   2(l % 4) and 2(l % 4) + 1. With .trans it receives elements [2(l % 4)][l / 4] and
//   [2(l % 4) + 1][l / 4], i.e. the same fragment of the transposed matrix.
//
// The products of two 16-bit floats are exact in float32; the emulator sums the 16 products
// in order onto C in float32 (the hardware's internal order and precision differ slightly:
// results agree to float32 rounding, well inside the bf16/fp16 tolerances).

namespace heron_emu {

inline thread_local unsigned collective_count = 0;  // fresh for every block's threads

// Publish `nwords` words of this lane's operands; returns the warp's 32 published rows once
// every lane has arrived. Valid until this lane's next-but-one collective.
inline const unsigned int (*warp_collective(const unsigned int* mine, int nwords, const char* what))[8] {
  Block* b = block;
  const int warp = linear_tid / 32, lane = linear_tid % 32;
  auto& slot = b->scratch[warp].w[collective_count++ & 1];
  std::memcpy(slot[lane], mine, sizeof(unsigned int) * nwords);
  b->warp_bars[warp]->wait(what);
  return slot;
}

inline void check_shared(const void* p, size_t n, const char* what) {
  const char* lo = reinterpret_cast<const char*>(block->dynamic_smem.data());
  const char* c = reinterpret_cast<const char*>(p);
  if (c < lo || c + n > lo + block->dynamic_bytes) {
    std::fprintf(stderr, "heron emulator: %s address %p outside the block's dynamic shared memory\n", what, p);
    std::abort();
  }
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    std::fprintf(stderr, "heron emulator: %s address %p not 16-byte aligned\n", what, p);
    std::abort();
  }
}

inline float half_bits_to_float(unsigned int bits, int dtype) {  // dtype: 1 float16, 2 bfloat16
  return dtype == 2 ? __uint_as_float(bits << 16) : heron_f16_to_f32((unsigned short)bits);
}
inline unsigned int half_of(unsigned int word, int which) { return which ? word >> 16 : word & 0xffffu; }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32  d, a, {b0, b1}, d
inline void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1, int dtype) {
  const unsigned int mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto* ops = warp_collective(mine, 6, "mma.sync (warp-collective)");
  const int lane = linear_tid % 32, g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const unsigned int* al = ops[(r % 8) * 4 + (k % 8) / 2];
      const unsigned int* bl = ops[n * 4 + (k % 8) / 2];
      const float av = half_bits_to_float(half_of(al[(r >= 8) + 2 * (k >= 8)], k & 1), dtype);
      const float bv = half_bits_to_float(half_of(bl[4 + (k >= 8)], k & 1), dtype);
      acc += av * bv;
    }
    d[e] = acc;
  }
}

// ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16  {r0..}, [row]
inline void ldmatrix(unsigned int* r, int num, bool trans, const void* row) {
  const int lane = linear_tid % 32;
  unsigned int mine[4] = {0, 0, 0, 0};
  if (lane < 8 * num) {  // the other lanes' addresses are ignored, as on hardware
    check_shared(row, 16, "ldmatrix");
    std::memcpy(mine, row, 16);
  }
  const auto* rows = warp_collective(mine, 4, "ldmatrix (warp-collective)");
  for (int i = 0; i < num; ++i) {
    if (!trans) {
      r[i] = rows[8 * i + lane / 4][lane % 4];
    } else {
      const int rr = 2 * (lane % 4), col = lane / 4;
      const unsigned int lo = half_of(rows[8 * i + rr][col / 2], col & 1);
      const unsigned int hi = half_of(rows[8 * i + rr + 1][col / 2], col & 1);
      r[i] = lo | (hi << 16);
    }
  }
}

// cp.async.cg.shared.global [smem], [gmem], 16, src_size / commit_group / wait_group N.
// src_size 16 copies, 0 zero-fills (nothing read). The source is read at issue; the
// shared-memory write happens only at the wait that covers it, so a kernel that reads a
// tile before waiting sees the NaN poison, not the data.
struct AsyncCopy { void* dst; unsigned char bytes[16]; };
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;  // committed groups, oldest first
inline thread_local std::vector<AsyncCopy> async_open;                 // not yet committed

inline void cp_async16(void* smem, const void* gmem, int src_size) {
  check_shared(smem, 16, "cp.async destination");
  if (src_size != 0 && src_size != 16) {
    std::fprintf(stderr, "heron emulator: cp.async src_size %d (0 or 16 supported)\n", src_size);
    std::abort();
  }
  if (src_size && reinterpret_cast<uintptr_t>(gmem) % 16) {
    std::fprintf(stderr, "heron emulator: cp.async source %p not 16-byte aligned\n", gmem);
    std::abort();
  }
  AsyncCopy c;
  c.dst = smem;
  if (src_size) std::memcpy(c.bytes, gmem, 16);
  else std::memset(c.bytes, 0, 16);
  async_open.push_back(c);
}
inline void cp_async_commit() {
  async_groups.push_back(std::move(async_open));
  async_open.clear();
}
inline void cp_async_wait_group(int n) {
  while ((int)async_groups.size() > n) {
    for (const AsyncCopy& c : async_groups.front()) std::memcpy(c.dst, c.bytes, 16);
    async_groups.erase(async_groups.begin());
  }
}

}  // namespace heron_emu
