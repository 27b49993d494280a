// sm_90a warpgroup matrix multiply (wgmma) for the Hopper forward kernel: shared-memory matrix
// descriptors, the fences that order wgmma against ordinary instructions, and the m64nNk16
// instructions it issues (N = 64 or 128, fp32 accumulators, fp16/bf16 operands).
//
// A warpgroup (4 consecutive warps, 128 threads) issues each wgmma together; the result lands
// asynchronously in the accumulator registers. Those registers hold the same layout as four
// stacked mma.sync m16n8 accumulators (warp w of the group owns rows 16w..16w+15), so the
// online softmax and the masking code of the portable kernel apply to them unchanged, and two
// adjacent n8 tiles packed to 16 bits are exactly the register A operand of the next wgmma.
//
// Everything here needs the sm_90a target; callers guard their bodies with FLASHMOD_SM90A.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHMOD_SM90A 1
#endif

namespace flashmod::cuda_kernels::sm90 {

// Shared-memory tiles use the 128-byte swizzle wgmma understands: rows of 64 elements (128 bytes),
// grouped in 8-row, 1024-byte atoms in which 16-byte chunk c of row r sits at chunk c ^ (r % 8).
// A tile wider than 64 columns is stored as column blocks of 64, each (rows x 128 bytes).
// Byte offset of (row, 16-byte chunk) in a tile of kRows rows:
template <int kRows>
__host__ __device__ __forceinline__ constexpr uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>((chunk / 8) * kRows * 128 + row * 128 +
                               (((chunk % 8) ^ (row % 8)) << 4));
}

// Descriptor of a 128-byte-swizzled operand starting at shared byte address addr (the atom grid
// must be 1024-byte aligned, so the base-offset field stays 0). K-major operands (Q, K) use only
// the stride between 8-row groups (sbo = 1024); MN-major ones (V) also the stride between 64-wide
// column blocks (lbo).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Moves a descriptor's start address by a byte offset (multiple of 16, no carry out of the field:
// shared addresses stay below 256 KB).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

#ifdef FLASHMOD_SM90A
// Before a wgmma reads registers (accumulators, A fragments) that ordinary instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) and read next by wgmma
// (the async proxy) needs this fence in every writing thread before the barrier that publishes it.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

// The compiler does not know wgmma writes its accumulators (and reads its register A operand)
// asynchronously: pinning them with an empty asm after the wait keeps every use of them after it.
template <int kRows>
__device__ __forceinline__ void pin_registers(float (&r)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}
template <int kRows>
__device__ __forceinline__ void pin_registers(uint32_t (&r)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

template <typename Elem, int N>
struct Wgmma;

#ifdef FLASHMOD_SM90A
// Wgmma<Elem, N>::ss(d, desc_a, desc_b, accumulate): d (+)= A B, A and B K-major in shared
// memory (descriptors); accumulate = 0 overwrites d.
// Wgmma<Elem, N>::ss_overwrite(d, desc_a, desc_b): d = A B, d an output only: its old registers
// are not read, so nothing has to define them while an earlier wgmma is still in flight.
// Wgmma<Elem, N>::rs_accumulate(d, a, desc_b, accumulate = 1): d (+)= A B, A from registers (the
// accumulator layout packed to 16 bits), B MN-major in shared memory (transposed read);
// accumulate = 0 overwrites d.
// One macro per N (its operand lists); the element type only changes the instruction's type token.
#define FLASHMOD_WGMMA_N64(ELEM, PTX)                                                              \
  template <>                                                                                      \
  struct Wgmma<ELEM, 64> {                                                                         \
    __device__ __forceinline__ static void ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,  \
                                              int accumulate) {                                    \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX                                \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, "  \
          "0, "                                                                                    \
          "0;\n}\n"                                                                                \
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
            "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
            "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
            "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),             \
            "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
            "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),             \
            "+f"(d[7][2]), "+f"(d[7][3])                                                           \
          : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                            \
    }                                                                                              \
    __device__ __forceinline__ static void ss_overwrite(float (&d)[8][4], uint64_t desc_a,         \
                                                        uint64_t desc_b) {                         \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX                                \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, "  \
          "0, "                                                                                    \
          "0;\n}\n"                                                                                \
          : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]),             \
            "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]),             \
            "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]),             \
            "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]),             \
            "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]),             \
            "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]),             \
            "=f"(d[7][2]), "=f"(d[7][3])                                                           \
          : "l"(desc_a), "l"(desc_b), "r"(0));                                                     \
    }                                                                                              \
    __device__ __forceinline__ static void rs_accumulate(float (&d)[8][4], const uint32_t (&a)[4], \
                                                         uint64_t desc_b, int accumulate = 1) {    \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX                                \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "     \
          "%35}, "                                                                                 \
          "%36, p, 1, 1, 1;\n}\n"                                                                  \
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
            "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
            "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
            "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),             \
            "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
            "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),             \
            "+f"(d[7][2]), "+f"(d[7][3])                                                           \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));             \
    }                                                                                              \
  };

#define FLASHMOD_WGMMA_N128(ELEM, PTX)                                                             \
  template <>                                                                                      \
  struct Wgmma<ELEM, 128> {                                                                        \
    __device__ __forceinline__ static void ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, \
                                              int accumulate) {                                    \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX                               \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
          "%36, "                                                                                  \
          "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "  \
          "%54, "                                                                                  \
          "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"            \
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
            "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
            "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
            "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),             \
            "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
            "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),             \
            "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),             \
            "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),             \
            "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]),        \
            "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]),        \
            "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]),        \
            "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),        \
            "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                         \
          : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                            \
    }                                                                                              \
    __device__ __forceinline__ static void ss_overwrite(float (&d)[16][4], uint64_t desc_a,        \
                                                        uint64_t desc_b) {                         \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX                               \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
          "%36, "                                                                                  \
          "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "  \
          "%54, "                                                                                  \
          "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"            \
          : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]),             \
            "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]),             \
            "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]),             \
            "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]),             \
            "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]),             \
            "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]),             \
            "=f"(d[7][2]), "=f"(d[7][3]), "=f"(d[8][0]), "=f"(d[8][1]), "=f"(d[8][2]),             \
            "=f"(d[8][3]), "=f"(d[9][0]), "=f"(d[9][1]), "=f"(d[9][2]), "=f"(d[9][3]),             \
            "=f"(d[10][0]), "=f"(d[10][1]), "=f"(d[10][2]), "=f"(d[10][3]), "=f"(d[11][0]),        \
            "=f"(d[11][1]), "=f"(d[11][2]), "=f"(d[11][3]), "=f"(d[12][0]), "=f"(d[12][1]),        \
            "=f"(d[12][2]), "=f"(d[12][3]), "=f"(d[13][0]), "=f"(d[13][1]), "=f"(d[13][2]),        \
            "=f"(d[13][3]), "=f"(d[14][0]), "=f"(d[14][1]), "=f"(d[14][2]), "=f"(d[14][3]),        \
            "=f"(d[15][0]), "=f"(d[15][1]), "=f"(d[15][2]), "=f"(d[15][3])                         \
          : "l"(desc_a), "l"(desc_b), "r"(0));                                                     \
    }                                                                                              \
    __device__ __forceinline__ static void rs_accumulate(float (&d)[16][4],                        \
                                                         const uint32_t (&a)[4], uint64_t desc_b,  \
                                                         int accumulate = 1) {                     \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                             \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX                               \
          " "                                                                                      \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
          "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
          "%36, "                                                                                  \
          "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "  \
          "%54, "                                                                                  \
          "%55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, "     \
          "1;\n}\n"                                                                                \
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
            "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
            "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
            "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),             \
            "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
            "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),             \
            "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),             \
            "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),             \
            "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]),        \
            "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]),        \
            "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]),        \
            "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),        \
            "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                         \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));             \
    }                                                                                              \
  };

FLASHMOD_WGMMA_N64(__nv_bfloat16, "bf16")
FLASHMOD_WGMMA_N64(__half, "f16")
FLASHMOD_WGMMA_N128(__nv_bfloat16, "bf16")
FLASHMOD_WGMMA_N128(__half, "f16")
#undef FLASHMOD_WGMMA_N64
#undef FLASHMOD_WGMMA_N128
#endif  // FLASHMOD_SM90A

// WgmmaSS<Elem, N>::mma<kTransA, kTransB>(d, desc_a, desc_b, accumulate): d (+)= A B with both
// operands in shared memory, each K-major (0) or MN-major (1: a transposed read); accumulate = 0
// overwrites d. ::overwrite<kTransA, kTransB>(d, desc_a, desc_b): d = A B with d an output only (as
// Wgmma's ss_overwrite). The D = 256 dK/dV kernel (bwd_sm90_halves_kernel.h) takes its score
// halves at N = 32 and its gradient products from these, the fused dQ variant its dQ product (both
// operands MN-major: A stored with its M rows contiguous, K rows of M elements; B with its N
// columns contiguous).
template <typename Elem, int N>
struct WgmmaSS;
#ifdef FLASHMOD_SM90A
// The accumulator operands of n8 tile i (four floats a thread), as asm outputs.
#define FLASHMOD_WGMMA_ACC_TILE(OUT, i) OUT(d[i][0]), OUT(d[i][1]), OUT(d[i][2]), OUT(d[i][3])
#define FLASHMOD_WGMMA_SS_N32(PTX, OUT, ACC)                                \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                              \
  "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX "." PTX                 \
  " {"                                                                      \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"    \
  "}, %16, %17, p, 1, 1, %19, %20;\n}\n" : FLASHMOD_WGMMA_ACC_TILE(OUT, 0), \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 1), \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 2), \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 3)  \
      : "l"(desc_a), "l"(desc_b), "r"(ACC), "n"(kTransA), "n"(kTransB)
#define FLASHMOD_WGMMA_SS_N64(PTX, OUT, ACC)                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                     \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX                        \
  " {"                                                                             \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, %32, %33, p, 1, 1, %35, %36;\n}\n" : FLASHMOD_WGMMA_ACC_TILE(OUT, 0),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 1),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 2),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 3),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 4),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 5),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 6),        \
                                           FLASHMOD_WGMMA_ACC_TILE(OUT, 7)         \
      : "l"(desc_a), "l"(desc_b), "r"(ACC), "n"(kTransA), "n"(kTransB)
#define FLASHMOD_WGMMA_SS(ELEM, PTX, N)                                                     \
  template <>                                                                               \
  struct WgmmaSS<ELEM, N> {                                                                 \
    template <int kTransA, int kTransB>                                                     \
    __device__ __forceinline__ static void mma(float (&d)[N / 8][4], uint64_t desc_a,       \
                                               uint64_t desc_b, int accumulate) {           \
      asm volatile(FLASHMOD_WGMMA_SS_N##N(PTX, "+f", accumulate));                          \
    }                                                                                       \
    template <int kTransA, int kTransB>                                                     \
    __device__ __forceinline__ static void overwrite(float (&d)[N / 8][4], uint64_t desc_a, \
                                                     uint64_t desc_b) {                     \
      asm volatile(FLASHMOD_WGMMA_SS_N##N(PTX, "=f", 0));                                   \
    }                                                                                       \
  };
FLASHMOD_WGMMA_SS(__nv_bfloat16, "bf16", 32)
FLASHMOD_WGMMA_SS(__nv_bfloat16, "bf16", 64)
FLASHMOD_WGMMA_SS(__half, "f16", 32)
FLASHMOD_WGMMA_SS(__half, "f16", 64)
#undef FLASHMOD_WGMMA_SS
#undef FLASHMOD_WGMMA_SS_N32
#undef FLASHMOD_WGMMA_SS_N64
#undef FLASHMOD_WGMMA_ACC_TILE
#endif  // FLASHMOD_SM90A

}  // namespace flashmod::cuda_kernels::sm90
