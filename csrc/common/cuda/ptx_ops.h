// Thin wrappers over the sm80+ PTX instructions the tensor-core kernel is built from:
// cp.async (global -> shared without a register round trip), ldmatrix (shared -> mma fragments)
// and mma.sync m16n8k16 (m16n8k8 for tf32) with fp32 accumulators. Everything here exists on sm80
// and sm90, so one source serves both targets.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashmod::cuda_kernels {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// *p += v at gpu scope, acquire and release in one (sm70+); returns the old value.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// 16-byte copy; bytes < 16 zero-fills the rest, which is how rows past seqlen and columns past
// head_dim become zeros without a separate predicate path. The source must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// volatile + memory clobber: these must not be hoisted above the __syncthreads that publishes
// the tile they read.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Shared-memory loads and stores. volatile + memory clobber, as ldmatrix: they must stay
// between the barriers that order them with the other threads' accesses.
__device__ __forceinline__ void lds_128(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ uint16_t lds_16(uint32_t addr) {
  uint16_t r;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(r) : "r"(addr) : "memory");
  return r;
}

__device__ __forceinline__ uint32_t lds_32(uint32_t addr) {
  uint32_t r;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(addr) : "memory");
  return r;
}

__device__ __forceinline__ void sts_32(uint32_t addr, uint32_t r) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(r) : "memory");
}

__device__ __forceinline__ void sts_128(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// 16-byte global store. Spelled out because NVVM splits a store of a 16-byte-aligned struct of
// 16-bit elements into 2-byte stores in some contexts (seen in the stream softmax's split-row
// kernel, 3x slower).
__device__ __forceinline__ void stg_128(void* ptr, const uint32_t (&r)[4]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

template <typename Elem>
struct Mma16816;

// Not volatile: the mma has no side effects, so the compiler may interleave it with the
// fragment loads of the next k-step.

template <>
struct Mma16816<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Mma16816<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// fp32 operands on the tensor cores (m16n8k8, tf32 inputs, fp32 accumulators). The fragments have
// the m16n8k16 layout with 32-bit elements: a = (row g, col t), (g + 8, t), (g, t + 4), (g + 8,
// t + 4); b = (k t, n g), (t + 4, g); so ldmatrix (b16) of 8 x 16-byte rows loads them unchanged.
struct MmaTf32 {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// tf32(x), rounded to nearest; an infinite or NaN x stays itself. sm_90 converts with ties to even
// in one instruction (cvt.rn); cvt.rna (ties away, the only tf32 rounding before sm_90) is
// emulated there in four (an integer add and mask, and a compare and select that keep inf and
// NaN): in the fp32 backward those four were a third of all instructions issued (H200, session 56:
// ~1.1 splits per mma). The two roundings differ only on exact ties.
__device__ __forceinline__ uint32_t round_tf32(float x) {
  uint32_t r;
#if __CUDA_ARCH__ >= 900
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#endif
  return r;
}

// The 3xTF32 split of an fp32 word x: hi = tf32(x), lo = tf32(x - hi), both rounded to nearest.
// x - hi is exact, so hi + lo carries ~22 of x's 24 bits. Inline PTX, so that fast math cannot see
// that x - hi is "zero".
// An infinite x keeps all of itself in hi and lo = 0 (inf - inf would make lo, and so every
// product with it, NaN where the plain product is +-inf); a NaN x stays NaN through hi. The test is
// on the bits, which fast math cannot fold away.
__device__ __forceinline__ void split_tf32(uint32_t x, uint32_t& hi, uint32_t& lo) {
  hi = round_tf32(__uint_as_float(x));
  const bool inf = (hi & 0x7fffffffu) == 0x7f800000u;
  lo = round_tf32(inf ? 0.f : __uint_as_float(x) - __uint_as_float(hi));
}

// c += a * b with fp32-level error from tf32 halves: a_lo * b_hi + a_hi * b_lo + a_hi * b_hi,
// small terms first (a_lo * b_lo, ~2^-22 relative, is dropped).
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const uint32_t (&a_hi)[4],
                                           const uint32_t (&a_lo)[4], uint32_t b_hi0,
                                           uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  MmaTf32::run(c, a_lo, b_hi0, b_hi1);
  MmaTf32::run(c, a_hi, b_lo0, b_lo1);
  MmaTf32::run(c, a_hi, b_hi0, b_hi1);
}

// Explicit conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__ (and the bf16 twin), so
// the implicit ones do not exist there.
__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// big + small of a 3xTF32 product (mma_3xtf32_apart): where the big term is infinite the small
// ones (a_lo * inf, of either sign) carry nothing and could only turn it into NaN where the plain
// fp32 product is +-inf. The test is on the bits, which fast math cannot fold away.
__device__ __forceinline__ float add_small_terms(float big, float small) {
  return (__float_as_uint(big) & 0x7fffffffu) == 0x7f800000u ? big : big + small;
}

// As mma_3xtf32, with the small terms (a_lo * b_hi + a_hi * b_lo) in their own accumulator: two
// independent mma chains instead of one, and the small terms are not rounded against the large
// running sum. The caller adds big + small once, in fp32.
__device__ __forceinline__ void mma_3xtf32_apart(float (&big)[4], float (&small)[4],
                                                 const uint32_t (&a_hi)[4],
                                                 const uint32_t (&a_lo)[4], uint32_t b_hi0,
                                                 uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  MmaTf32::run(small, a_lo, b_hi0, b_hi1);
  MmaTf32::run(small, a_hi, b_lo0, b_lo1);
  MmaTf32::run(big, a_hi, b_hi0, b_hi1);
}

// A barrier among `threads` threads of the block (whole warps) that reach barrier `id` (id 0 is
// __syncthreads').
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Reductions over the 4 lanes (a "quad") that share one accumulator row in the mma layout.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace flashmod::cuda_kernels
