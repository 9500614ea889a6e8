// Tensor-core building blocks (sm_80+): cp.async 16-byte copies, ldmatrix, and
// mma.sync.aligned.m16n8k16 with float32 accumulation, for float16 / bfloat16 (HERON_DTYPE
// 1 / 2). Include after common.cuh.
//
// Each function hides one PTX instruction. Under HERON_EMULATE (the CPU emulator in
// tests/gpu/emulator) they call the emulator's plain C++ implementation of the same
// instruction (cuda_shim.h: heron_emu::mma_m16n8k16, ldmatrix, cp_async16, ...), so one
// kernel source runs on both.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// A warp's 32 lanes: groupID g = lane >> 2, threadID_in_group t = lane & 3. Each .b32
// register holds two 16-bit elements, the lower column (A, C) or row (B) index in the low
// half.
//   A (16 x 16, row major), 4 regs: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//                                    a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8, "col"), 2 regs:       b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C, D (16 x 8, float32), 4 regs:  c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.m8n8.x4.b16: lanes 8i .. 8i+7 give the row addresses (16 bytes each) of matrix i;
// register i of lane l receives matrix i's row l/4, elements 2(l%4), 2(l%4)+1. With .trans
// it receives matrix i's elements [2(l%4)][l/4] and [2(l%4)+1][l/4] (the transpose).
// (No include guard: the loader inlines each header once per compiled text.)

#if HERON_DTYPE != 1 && HERON_DTYPE != 2
#error "mma.cuh: tensor-core mma needs HERON_DTYPE 1 (float16) or 2 (bfloat16)"
#endif

namespace tc {

#ifndef HERON_EMULATE

// A shared-memory address as the instructions take it: the 32-bit shared-window offset.
// Kernels compute one base per buffer and add byte offsets to it (integer arithmetic that
// ptxas folds into the instructions' immediate offsets).
typedef unsigned int sptr;

__device__ __forceinline__ sptr to_sptr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16 bytes global -> shared, asynchronous (bypasses L1). Both addresses 16-byte aligned.
// With `valid` false nothing is read (gmem need only be some valid address) and the 16
// shared bytes are zero-filled (src-size 0), without a branch.
__device__ __forceinline__ void cp_async16(sptr smem, const void* gmem, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait for every committed copy of this thread (then __syncthreads to see the others').
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 b16 matrices from shared memory; `row` is this lane's row address (see above).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], sptr row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], sptr row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}

// d += A * B (16x8x16), A and B in scalar_t, d in float32.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
#if HERON_DTYPE == 2
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Hides x's value from the compiler, so that it recomputes what depends on it instead of
// keeping a copy alive (in registers or spilled) from an earlier identical computation.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// 2^x by the special-function unit (ex2.approx.ftz: ~2 ulp, denormal results flushed to 0,
// 2^-inf = 0): the softmax's exponent, as FlashAttention uses it.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded (to nearest even) to scalar_t, `lo` in the low half.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
#if HERON_DTYPE == 2
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // d.hi = a, d.lo = b
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

#else  // HERON_EMULATE: the emulator's C++ versions of the same instructions

typedef unsigned long long sptr;  // the host address itself
inline sptr to_sptr(const void* p) { return (sptr)(uintptr_t)p; }
inline void* from_sptr(sptr a) { return (void*)(uintptr_t)a; }

__device__ __forceinline__ void cp_async16(sptr smem, const void* gmem, bool valid = true) {
  heron_emu::cp_async16(from_sptr(smem), gmem, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { heron_emu::cp_async_commit(); }
__device__ __forceinline__ void cp_async_wait_all() { heron_emu::cp_async_wait_group(0); }
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], sptr row) {
  heron_emu::ldmatrix(r, 4, false, from_sptr(row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], sptr row) {
  heron_emu::ldmatrix(r, 4, true, from_sptr(row));
}
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
  heron_emu::mma_m16n8k16(d, a, b0, b1, HERON_DTYPE);
}
__device__ __forceinline__ int opaque(int x) { return x; }
__device__ __forceinline__ float exp2_approx(float x) { return exp2f(x); }
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_float<scalar_t>(lo).bits | ((unsigned)from_float<scalar_t>(hi).bits << 16);
}

#endif

}  // namespace tc
