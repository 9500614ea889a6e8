// Just enough of CUDA's execution model to run heron's kernels on CPU threads, for tests.
//
// Force-included (g++ -include) ahead of a kernel source. Blocks run one after another;
// the threads of a block are real std::threads, so __syncthreads and warp shuffles are
// real barriers. It is stricter than hardware: a barrier or shuffle that not every thread
// of the block / warp reaches aborts with a message instead of silently misbehaving.
// `__shared__` becomes `static`: with one block at a time, a function-local static is
// exactly per-block shared memory.
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

struct Block {
  Block(int threads, size_t smem)
      : block_bar(threads), exchange(threads),
        dynamic_smem(smem + 1, float4{NAN, NAN, NAN, NAN}) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warp_bars.emplace_back(new Barrier(std::min(32, threads - 32 * w)));
  }
  ~Block() { for (auto* b : warp_bars) delete b; }
  Barrier block_bar;
  std::vector<Barrier*> warp_bars;
  std::vector<unsigned long long> exchange;
  std::vector<float4> dynamic_smem;  // float4: 16-byte aligned; NaN until written
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
