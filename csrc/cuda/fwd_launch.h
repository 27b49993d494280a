// Tile choices per head dim and the (torch-free) launch of the tensor-core kernel. Each
// attention_fwd_<dtype>_hd<D>.cu instantiates one run_attention_fwd so ninja compiles the
// 16 variants in parallel.
#pragma once

#include <cuda_runtime.h>

#include "fwd_tile_loop.h"
#include "launch.h"

namespace flashmod::cuda_kernels {

// (Br, Bc, warps, stages, Q in registers) per padded head dim. Each warp owns 32 query rows (two
// m16 tiles) where registers allow: every K_j/V_j fragment a warp reads from shared memory then
// feeds twice the mma work, and ldmatrix traffic stays under shared-memory bandwidth. Past
// D = 128 the O accumulator alone (D fp32 registers per thread at 32 rows per warp) would not
// fit, so warps own 16 rows. Measured on an H100 (bf16, N = 1k..16k, vs SDPA FLASH in the same
// process; benchmarks/results/NOTES.md):
//   D = 64:  128x64 with Q in registers 1.02-1.08x FLASH; 128x64 re-reading Q 0.97-1.02x;
//            128x128 1.00-1.08x; 128x64 3 stages + Q in regs 1.01-1.08x (no better, more smem).
//   D = 128: 128x64 0.96-1.08x over three runs (FLASH itself moves ~3% run to run); 128x32
//            0.94-1.02x; 8 warps x 16 rows 0.79-0.89x (smem-bound); 3 stages 0.83-0.96x (one
//            CTA per SM instead of two).
//   D = 160..256: 64x64, 4 warps of 16 rows: fits sm80's 163 KB; 0.77-0.86x FLASH at D = 256.
template <typename Elem, int kHeadDim>
struct FwdConfig;
// Tuning hook: -DFLASHMOD_TUNE_<D>=v swaps in candidate v below for head dim D = 64, 128, 256
// (setup.py forwards FLASHMOD_NVCC_EXTRA; nvcc splits -D values at commas, hence the indirection).
#define FLASHMOD_CAND_1 128, 64, 4, 2, true
#define FLASHMOD_CAND_2 128, 128, 4, 2, false
#define FLASHMOD_CAND_3 128, 128, 4, 2, true
#define FLASHMOD_CAND_4 128, 64, 4, 3, true
#define FLASHMOD_CAND_5 128, 64, 4, 3, false
#define FLASHMOD_CAND_6 64, 64, 4, 2, false
#define FLASHMOD_CAND_7 128, 32, 4, 2, false
#define FLASHMOD_CAND_8 128, 64, 8, 2, false
#define FLASHMOD_CAND_(v) FLASHMOD_CAND_##v
#define FLASHMOD_CAND(v) FLASHMOD_CAND_(v)
#define FLASHMOD_TILE_DEFAULT_32 128, 64, 4, 2, true
#define FLASHMOD_TILE_DEFAULT_64 128, 64, 4, 2, true
#define FLASHMOD_TILE_DEFAULT_96 128, 64, 4, 2, false
#define FLASHMOD_TILE_DEFAULT_128 128, 64, 4, 2, false
#define FLASHMOD_TILE_DEFAULT_160 64, 64, 4, 2, false
#define FLASHMOD_TILE_DEFAULT_192 64, 64, 4, 2, false
#define FLASHMOD_TILE_DEFAULT_224 64, 64, 4, 2, false
#define FLASHMOD_TILE_DEFAULT_256 64, 64, 4, 2, false
#ifdef FLASHMOD_TUNE_64
#define FLASHMOD_TILE_64 FLASHMOD_CAND(FLASHMOD_TUNE_64)
#else
#define FLASHMOD_TILE_64 FLASHMOD_TILE_DEFAULT_64
#endif
#ifdef FLASHMOD_TUNE_128
#define FLASHMOD_TILE_128 FLASHMOD_CAND(FLASHMOD_TUNE_128)
#else
#define FLASHMOD_TILE_128 FLASHMOD_TILE_DEFAULT_128
#endif
#ifdef FLASHMOD_TUNE_256
#define FLASHMOD_TILE_256 FLASHMOD_CAND(FLASHMOD_TUNE_256)
#else
#define FLASHMOD_TILE_256 FLASHMOD_TILE_DEFAULT_256
#endif
#define FLASHMOD_TILE_32 FLASHMOD_TILE_DEFAULT_32
#define FLASHMOD_TILE_96 FLASHMOD_TILE_DEFAULT_96
#define FLASHMOD_TILE_160 FLASHMOD_TILE_DEFAULT_160
#define FLASHMOD_TILE_192 FLASHMOD_TILE_DEFAULT_192
#define FLASHMOD_TILE_224 FLASHMOD_TILE_DEFAULT_224
#define FLASHMOD_CONFIG(D)                                                      \
  template <typename Elem>                                                      \
  struct FwdConfig<Elem, D> {                                                   \
    using Traits = FwdTraits<Elem, D, FLASHMOD_TILE_##D>;                       \
  };
FLASHMOD_CONFIG(32)
FLASHMOD_CONFIG(64)
FLASHMOD_CONFIG(96)
FLASHMOD_CONFIG(128)
FLASHMOD_CONFIG(160)
FLASHMOD_CONFIG(192)
FLASHMOD_CONFIG(224)
FLASHMOD_CONFIG(256)
#undef FLASHMOD_CONFIG

template <class Tr>
cudaError_t launch_fwd(const AttentionParams& p, const FwdLaunchFlags& flags, cudaStream_t stream) {
  const bool general = p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
  const int64_t blocks = (p.seqlen_q + Tr::Br - 1) / Tr::Br * p.heads_q * p.batch;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  auto kernel = general ? attention_fwd_kernel<Tr, true> : attention_fwd_kernel<Tr, false>;
  if (Tr::kSmemBytes > 48 * 1024) {
    // Dynamic shared memory above 48 KB is opt-in per kernel.
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, flags);
  return cudaSuccess;  // the caller checks the launch itself (cudaGetLastError)
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              cudaStream_t stream) {
  return launch_fwd<typename FwdConfig<Elem, kHeadDim>::Traits>(p, flags, stream);
}

}  // namespace flashmod::cuda_kernels
