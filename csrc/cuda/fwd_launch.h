// Tile choices per head dim and the (torch-free) launch of the tensor-core kernel. Each
// attention_fwd_<dtype>_hd<D>.cu instantiates one run_attention_fwd so ninja compiles the
// 16 variants in parallel.
#pragma once

#include <cuda_runtime.h>

#include "fwd_tile_loop.h"
#include "launch.h"

namespace flashmod::cuda_kernels {

// (Br, Bc, warps, stages) per padded head dim. Each warp owns 32 query rows (two m16 tiles)
// where registers allow: the K_j/V_j fragments a warp reads from shared memory are then reused
// by twice the mma work, which keeps ldmatrix traffic under the shared-memory bandwidth.
// Past D = 128 the O accumulator alone (32 x D fp32 per warp = D regs/thread) would not fit, so
// warps own 16 rows. Measurements that chose them: benchmarks/results/NOTES.md.
template <typename Elem, int kHeadDim>
struct FwdConfig;
template <typename Elem>
struct FwdConfig<Elem, 32> { using Traits = FwdTraits<Elem, 32, 128, 128, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 64> { using Traits = FwdTraits<Elem, 64, 128, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 96> { using Traits = FwdTraits<Elem, 96, 128, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 128> { using Traits = FwdTraits<Elem, 128, 128, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 160> { using Traits = FwdTraits<Elem, 160, 64, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 192> { using Traits = FwdTraits<Elem, 192, 64, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 224> { using Traits = FwdTraits<Elem, 224, 64, 64, 4, 2>; };
template <typename Elem>
struct FwdConfig<Elem, 256> { using Traits = FwdTraits<Elem, 256, 64, 64, 4, 2>; };

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
