// Tile choices and the (torch-free) launch of the Hopper wgmma kernel. Each
// attention_fwd_sm90_<dtype>_hd<D>.cu instantiates one run_attention_fwd_sm90.
#pragma once

#include <cuda_runtime.h>

#include "fwd_tile_loop_sm90.h"
#include "launch.h"

namespace flashmod::cuda_kernels {
namespace sm90 {

// (Bc, warpgroups, stages, overlap) per head dim; Br = 64 * warpgroups.
// Tuning hook: -DFLASHMOD_TUNE_SM90_<D>=v picks candidate v (benchmarks/tune_variants.sh).
#define FLASHMOD_SM90_CAND_1 128, 2, 2, false
#define FLASHMOD_SM90_CAND_2 64, 2, 2, false
#define FLASHMOD_SM90_CAND_3 128, 2, 3, true
#define FLASHMOD_SM90_CAND_4 64, 2, 3, true
#define FLASHMOD_SM90_CAND_5 128, 2, 3, false
#define FLASHMOD_SM90_CAND_(v) FLASHMOD_SM90_CAND_##v
#define FLASHMOD_SM90_CAND(v) FLASHMOD_SM90_CAND_(v)
#ifdef FLASHMOD_TUNE_SM90_64
#define FLASHMOD_SM90_TILE_64 FLASHMOD_SM90_CAND(FLASHMOD_TUNE_SM90_64)
#else
#define FLASHMOD_SM90_TILE_64 128, 2, 2, false
#endif
#ifdef FLASHMOD_TUNE_SM90_128
#define FLASHMOD_SM90_TILE_128 FLASHMOD_SM90_CAND(FLASHMOD_TUNE_SM90_128)
#else
#define FLASHMOD_SM90_TILE_128 128, 2, 2, false
#endif

template <typename Elem, int kHeadDim>
struct FwdConfigSm90;
template <typename Elem>
struct FwdConfigSm90<Elem, 64> {
  using Traits = FwdTraitsSm90<Elem, 64, FLASHMOD_SM90_TILE_64>;
};
template <typename Elem>
struct FwdConfigSm90<Elem, 128> {
  using Traits = FwdTraitsSm90<Elem, 128, FLASHMOD_SM90_TILE_128>;
};

template <class Tr>
cudaError_t launch_fwd(const AttentionParams& p, const FwdLaunchFlags& flags, cudaStream_t stream) {
  const bool general = p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
  const int64_t blocks = (p.seqlen_q + Tr::Br - 1) / Tr::Br * p.heads_q * p.batch;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  auto kernel =
      general ? attention_fwd_sm90_kernel<Tr, true> : attention_fwd_sm90_kernel<Tr, false>;
  // Over 48 KB of dynamic shared memory is opt-in per kernel.
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, flags);
  return cudaSuccess;  // the caller checks the launch itself (cudaGetLastError)
}

}  // namespace sm90

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                   cudaStream_t stream) {
  return sm90::launch_fwd<typename sm90::FwdConfigSm90<Elem, kHeadDim>::Traits>(p, flags, stream);
}

}  // namespace flashmod::cuda_kernels
