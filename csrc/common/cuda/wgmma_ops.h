// sm_90a warpgroup matrix multiply (wgmma) for the Hopper kernels: shared-memory matrix
// descriptors, the fences that order wgmma against ordinary instructions, and the instructions
// they issue (fp32 accumulators; m64nNk16 with fp16/bf16 operands, m64nNk8 with tf32 ones).
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
// The N of the wgmmas that cover `cols` accumulator columns (O += P V, dK and dV) in equal
// chunks: all of them up to 128 (the widest N these kernels issue), 128 at 256, and 64 where 128
// does not divide them (192: three chunks).
__host__ __device__ constexpr int wgmma_column_chunk(int cols) {
  return cols % 128 != 0 ? 64 : cols < 128 ? cols : 128;
}

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

// Wgmma<Elem, N>::ss(d, desc_a, desc_b, accumulate): d (+)= A B, A and B K-major in shared
// memory (descriptors); accumulate = 0 overwrites d.
// Wgmma<Elem, N>::ss_overwrite(d, desc_a, desc_b): d = A B, d an output only: its old registers
// are not read, so nothing has to define them while an earlier wgmma is still in flight.
// Wgmma<Elem, N>::rs_accumulate(d, a, desc_b, accumulate = 1): d (+)= A B, A from registers (the
// accumulator layout packed to 16 bits), B MN-major in shared memory (transposed read);
// accumulate = 0 overwrites d.
// WgmmaSS<Elem, N>::mma<kTransA, kTransB>(d, desc_a, desc_b, accumulate) and
// ::overwrite<kTransA, kTransB>(d, desc_a, desc_b): as ss and ss_overwrite with each operand
// K-major (0) or MN-major (1: a transposed read; A stored with its M rows contiguous, K rows of M
// elements; B with its N columns contiguous). The D = 256 dK/dV kernel (bwd_sm90_halves_kernel.h)
// takes its score halves at N = 32 and its gradient products from these, the fused dQ variant its
// dQ product.
template <typename Elem, int N>
struct Wgmma;
template <typename Elem, int N>
struct WgmmaSS;

#ifdef FLASHMOD_SM90A
// The operand lists, one per N; the element type only changes the instruction's type token.
// The accumulator registers of n8 tiles i .. i + 3 (four floats a thread each), as asm outputs.
#define FLASHMOD_WGMMA_ACC4(OUT, i)                                                             \
  OUT(d[i][0]), OUT(d[i][1]), OUT(d[i][2]), OUT(d[i][3]), OUT(d[i + 1][0]), OUT(d[i + 1][1]),   \
      OUT(d[i + 1][2]), OUT(d[i + 1][3]), OUT(d[i + 2][0]), OUT(d[i + 2][1]), OUT(d[i + 2][2]), \
      OUT(d[i + 2][3]), OUT(d[i + 3][0]), OUT(d[i + 3][1]), OUT(d[i + 3][2]), OUT(d[i + 3][3])
#define FLASHMOD_WGMMA_ACC_32(OUT) FLASHMOD_WGMMA_ACC4(OUT, 0)
#define FLASHMOD_WGMMA_ACC_64(OUT) FLASHMOD_WGMMA_ACC4(OUT, 0), FLASHMOD_WGMMA_ACC4(OUT, 4)
#define FLASHMOD_WGMMA_ACC_128(OUT) \
  FLASHMOD_WGMMA_ACC_64(OUT), FLASHMOD_WGMMA_ACC4(OUT, 8), FLASHMOD_WGMMA_ACC4(OUT, 12)
// "{%0, ..}" for the N / 2 accumulator registers, and the operands' numbers after them.
#define FLASHMOD_WGMMA_REGS_32                                           \
  "{"                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
  "}"
#define FLASHMOD_WGMMA_REGS_64                                                     \
  "{"                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define FLASHMOD_WGMMA_REGS_128                                                      \
  "{"                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"   \
  "}"
#define FLASHMOD_WGMMA_SS_OPS_32 ", %16, %17, p, 1, 1, %19, %20;\n}\n"
#define FLASHMOD_WGMMA_SS_PRED_32 "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
#define FLASHMOD_WGMMA_SS_OPS_64 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
#define FLASHMOD_WGMMA_SS_PRED_64 "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
#define FLASHMOD_WGMMA_SS_OPS_128 ", %64, %65, p, 1, 1, %67, %68;\n}\n"
#define FLASHMOD_WGMMA_SS_PRED_128 "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
#define FLASHMOD_WGMMA_RS_OPS_64 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
#define FLASHMOD_WGMMA_RS_PRED_64 "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
#define FLASHMOD_WGMMA_RS_OPS_128 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
#define FLASHMOD_WGMMA_RS_PRED_128 "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
// d (+)= A B from shared memory: OUT "+f" (accumulate = ACC) or "=f" (ACC = 0, d an output only).
#define FLASHMOD_WGMMA_SS_ASM(N, PTX, OUT, ACC)                                            \
  FLASHMOD_WGMMA_SS_PRED_##N "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX \
                             " " FLASHMOD_WGMMA_REGS_##N FLASHMOD_WGMMA_SS_OPS_##N         \
      : FLASHMOD_WGMMA_ACC_##N(OUT)                                                        \
      : "l"(desc_a), "l"(desc_b), "r"(ACC), "n"(kTransA), "n"(kTransB)
#define FLASHMOD_WGMMA(ELEM, PTX, N)                                                        \
  template <>                                                                               \
  struct WgmmaSS<ELEM, N> {                                                                 \
    template <int kTransA, int kTransB>                                                     \
    __device__ __forceinline__ static void mma(float (&d)[N / 8][4], uint64_t desc_a,       \
                                               uint64_t desc_b, int accumulate) {           \
      asm volatile(FLASHMOD_WGMMA_SS_ASM(N, PTX, "+f", accumulate));                        \
    }                                                                                       \
    template <int kTransA, int kTransB>                                                     \
    __device__ __forceinline__ static void overwrite(float (&d)[N / 8][4], uint64_t desc_a, \
                                                     uint64_t desc_b) {                     \
      asm volatile(FLASHMOD_WGMMA_SS_ASM(N, PTX, "=f", 0));                                 \
    }                                                                                       \
  };
#define FLASHMOD_WGMMA_RS(ELEM, PTX, N)                                                           \
  FLASHMOD_WGMMA(ELEM, PTX, N)                                                                    \
  template <>                                                                                     \
  struct Wgmma<ELEM, N> {                                                                         \
    __device__ __forceinline__ static void ss(float (&d)[N / 8][4], uint64_t desc_a,              \
                                              uint64_t desc_b, int accumulate) {                  \
      WgmmaSS<ELEM, N>::mma<0, 0>(d, desc_a, desc_b, accumulate);                                 \
    }                                                                                             \
    __device__ __forceinline__ static void ss_overwrite(float (&d)[N / 8][4], uint64_t desc_a,    \
                                                        uint64_t desc_b) {                        \
      WgmmaSS<ELEM, N>::overwrite<0, 0>(d, desc_a, desc_b);                                       \
    }                                                                                             \
    __device__ __forceinline__ static void rs_accumulate(float (&d)[N / 8][4],                    \
                                                         const uint32_t (&a)[4], uint64_t desc_b, \
                                                         int accumulate = 1) {                    \
      asm volatile(FLASHMOD_WGMMA_RS_PRED_##N                                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX                  \
                   " " FLASHMOD_WGMMA_REGS_##N FLASHMOD_WGMMA_RS_OPS_##N                          \
                   : FLASHMOD_WGMMA_ACC_##N("+f")                                                 \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));   \
    }                                                                                             \
  };
FLASHMOD_WGMMA(__nv_bfloat16, "bf16", 32)
FLASHMOD_WGMMA(__half, "f16", 32)
FLASHMOD_WGMMA_RS(__nv_bfloat16, "bf16", 64)
FLASHMOD_WGMMA_RS(__half, "f16", 64)
FLASHMOD_WGMMA_RS(__nv_bfloat16, "bf16", 128)
FLASHMOD_WGMMA_RS(__half, "f16", 128)
#undef FLASHMOD_WGMMA_RS
#undef FLASHMOD_WGMMA

// WgmmaTf32<N>::ss(d, desc_a, desc_b, accumulate) and ::rs(d, a, desc_b, accumulate): m64nNk8 with
// tf32 operands (fp32 words whose low 13 bits the tensor cores ignore), d (+)= A B; A from shared
// memory or from registers (the m16n8k8 tf32 A fragment of each warp's 16 rows), B from shared
// memory. tf32 wgmma reads both operands K-major only (no transposed read): the fp32 forward
// (fwd_fp32_sm90.cu) writes V^T for its P V product.
#define FLASHMOD_WGMMA_TF32_SS_OPS_32 ", %16, %17, p, 1, 1;\n}\n"
#define FLASHMOD_WGMMA_TF32_SS_OPS_64 ", %32, %33, p, 1, 1;\n}\n"
#define FLASHMOD_WGMMA_TF32_RS_OPS_64 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
template <int N>
struct WgmmaTf32;
template <>
struct WgmmaTf32<32> {
  __device__ __forceinline__ static void ss(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b,
                                            int accumulate) {
    asm volatile(FLASHMOD_WGMMA_SS_PRED_32
                 "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " FLASHMOD_WGMMA_REGS_32
                     FLASHMOD_WGMMA_TF32_SS_OPS_32
                 : FLASHMOD_WGMMA_ACC_32("+f")
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
};
template <>
struct WgmmaTf32<64> {
  __device__ __forceinline__ static void ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                            int accumulate) {
    asm volatile(FLASHMOD_WGMMA_SS_PRED_64
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FLASHMOD_WGMMA_REGS_64
                     FLASHMOD_WGMMA_TF32_SS_OPS_64
                 : FLASHMOD_WGMMA_ACC_64("+f")
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
  __device__ __forceinline__ static void rs(float (&d)[8][4], const uint32_t (&a)[4],
                                            uint64_t desc_b, int accumulate) {
    asm volatile(FLASHMOD_WGMMA_RS_PRED_64
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FLASHMOD_WGMMA_REGS_64
                     FLASHMOD_WGMMA_TF32_RS_OPS_64
                 : FLASHMOD_WGMMA_ACC_64("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
};
#undef FLASHMOD_WGMMA_TF32_SS_OPS_32
#undef FLASHMOD_WGMMA_TF32_SS_OPS_64
#undef FLASHMOD_WGMMA_TF32_RS_OPS_64
#undef FLASHMOD_WGMMA_SS_ASM
#undef FLASHMOD_WGMMA_SS_OPS_32
#undef FLASHMOD_WGMMA_SS_OPS_64
#undef FLASHMOD_WGMMA_SS_OPS_128
#undef FLASHMOD_WGMMA_SS_PRED_32
#undef FLASHMOD_WGMMA_SS_PRED_64
#undef FLASHMOD_WGMMA_SS_PRED_128
#undef FLASHMOD_WGMMA_RS_OPS_64
#undef FLASHMOD_WGMMA_RS_OPS_128
#undef FLASHMOD_WGMMA_RS_PRED_64
#undef FLASHMOD_WGMMA_RS_PRED_128
#undef FLASHMOD_WGMMA_REGS_32
#undef FLASHMOD_WGMMA_REGS_64
#undef FLASHMOD_WGMMA_REGS_128
#undef FLASHMOD_WGMMA_ACC_32
#undef FLASHMOD_WGMMA_ACC_64
#undef FLASHMOD_WGMMA_ACC_128
#undef FLASHMOD_WGMMA_ACC4
#endif  // FLASHMOD_SM90A

}  // namespace flashmod::cuda_kernels::sm90
