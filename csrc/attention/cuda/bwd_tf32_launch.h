// Tile choices per head dim and the (torch-free) launches of the fp32 (3xTF32) backward. Each
// generated bwd_tf32_fp32_hd<D>.cu instantiates one run_attention_bwd_tf32.
#pragma once

#include <cuda_runtime.h>

#include "../../common/cuda/kernel_launch.h"
#include "bwd_tf32_kernel.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {

// (warps, streamed rows per step) of both kernels: each warp owns 16 rows. Shared memory holds the
// two own tiles and the two streamed ones in two stages, (kHeadDim + 4) floats per row: 70 KB at
// D = 64 (4 warps, Bs = 32: three CTAs per H100 SM), 102 KB at D = 96 and 128 (4 warps, Bs = 32 and
// 16: two). Registers: dK and dV take D floats per thread together, S^T and dP^T (big and small
// terms) 2 Bs; past D = 128 dV and dK get a launch each (S^T is then computed twice; dP^T and V
// only in the dK launch), as in the fp16/bf16 backward.
//
// Past D = 128, kWide: 4 warps (Bo = 64), Bs = 16, 126-200 KB (+ 4.6 KB for the fused dQ's dS):
// one CTA of 4 warps per SM; past D = 192 only Hopper's 227 KB per block take them (an A100's
// 163 KB: D = 160 / 192). The A100 tiles (2 warps, Bo = 32: 84-133 KB) left D = 224 / 256 at one
// CTA of 2 warps per H200 SM, half the SM's schedulers idle. H200, B 4, H 16, N 1k / 4k, forward
// (then still on the CUDA cores) + backward, session 54: D = 256 1.70-1.72x (causal 1.59x), D = 224
// causal 1.49x, D = 192 1.11x, D = 160 1.12x. The dV launch leaves out the V tile it never reads,
// so at D = 224 / 256 it fits two A100-tile CTAs per SM (1.11-1.15x on the same steps with the A100
// tiles).
//
// At D = 192 / 256 the widest dK/dV tiles take 8 warps, two per 16 key rows, each summing S^T and
// dP^T over half the head dim and keeping half of dK / dV (kColSplit = 2): 8 warps per SM where 8
// warps of whole rows would need 266 KB of K_j / V_j rows at D = 256 (171 / 221 KB: Hopper only;
// D = 160 / 224 would not split the 256 threads' row loads evenly). The dQ kernel (the
// deterministic path) keeps 4 warps of whole rows. H200, B 4, H 16, forward + backward over 4 warps
// of whole rows: D = 192 N 1k 1.076x (causal 1.078x, session 54); D = 256 N 1k / 4k 1.18-1.22x,
// causal too (session 55, FLASHMOD_BWD_TF32_WIDE=2 against 1).
template <int kHeadDim, bool kWide = false, bool kPairsAllowed = true>
struct Tf32BwdConfig {
  static constexpr bool kSplit = kHeadDim > 128;
  static_assert(kSplit || !kWide, "the wide tiles are for D > 128");
  static constexpr bool kPairs = kWide && kPairsAllowed && kHeadDim % 64 == 0;
  using Tr = Tf32BwdTraits<kHeadDim,
                           !kWide && kSplit ? 2
                           : kPairs         ? 8
                                            : 4,
                           kHeadDim <= 96 ? 32 : 16, kPairs ? 2 : 1>;
  using TrQ = Tf32BwdTraits<kHeadDim, Tr::kRowTiles, Tr::Bs>;  // the dQ kernel's
  static_assert(kWide || Tr::kFitsA100, "the default tiles must fit an A100");
};

template <class Tr, bool kGeneral, int kWhich, bool kFusedDQ = false>
cudaError_t launch_bwd_tf32_dkdv(const AttentionBwdParams& p, const BwdRowStats& st,
                                 cudaStream_t stream) {
  const int64_t blocks = bwd_dkdv_ctas(p, Tr::Bo);
  constexpr int smem = Tr::template dkdv_smem_bytes<kWhich, kFusedDQ>();
  return cuda::launch_kernel(attention_bwd_tf32_dkdv_kernel<Tr, kGeneral, kWhich, kFusedDQ>, blocks,
                             Tr::kNThreads, smem, stream, p, st);
}

// dK and dV: one launch, or past D = 128 a dV launch and a dK launch; kFusedDQ: the launch that
// computes dS (dK's) adds dQ too.
template <class Cfg, bool kGeneral, bool kFusedDQ>
cudaError_t launch_bwd_tf32_key_grads(const AttentionBwdParams& p, const BwdRowStats& st,
                                      cudaStream_t stream) {
  using Tr = typename Cfg::Tr;
  if constexpr (Cfg::kSplit) {
    const cudaError_t err = launch_bwd_tf32_dkdv<Tr, kGeneral, kBwdOnlyDV>(p, st, stream);
    return err != cudaSuccess
               ? err
               : launch_bwd_tf32_dkdv<Tr, kGeneral, kBwdOnlyDK, kFusedDQ>(p, st, stream);
  } else {
    return launch_bwd_tf32_dkdv<Tr, kGeneral, kBwdBoth, kFusedDQ>(p, st, stream);
  }
}

template <class Cfg, bool kGeneral>
cudaError_t launch_bwd_tf32(const AttentionBwdParams& p, const BwdRowStats& st,
                            cudaStream_t stream) {
  if (st.tf32_fused_dq) return launch_bwd_tf32_key_grads<Cfg, kGeneral, true>(p, st, stream);
  // dQ beside dK/dV on st.dq_stream where the host gave one, as in the fp16/bf16 backward
  // (bwd_sm80_launch.h). H200, B 4, H 16, D 64 / 128, N 1k / 4k, session 53: forward + backward
  // +1-10 % (causal 1k the most) against one after the other.
  return cuda::launch_beside(
      stream, st.dq_stream,
      [&](cudaStream_t s) { return launch_bwd_tf32_key_grads<Cfg, kGeneral, false>(p, st, s); },
      [&](cudaStream_t s) {
        using TrQ = typename Cfg::TrQ;
        return cuda::launch_kernel(attention_bwd_tf32_dq_kernel<TrQ, kGeneral>,
                                   bwd_dq_ctas(p, TrQ::Bo), TrQ::kNThreads, TrQ::kSmemBytes, s, p,
                                   st);
      });
}

template <int kHeadDim, bool kGeneral>
cudaError_t launch_bwd_tf32_tiles(const AttentionBwdParams& p, const BwdRowStats& st,
                                  cudaStream_t stream) {
  if constexpr (Tf32BwdConfig<kHeadDim>::kSplit) {
    // The widest tiles the device's shared memory takes: the pairs (D = 192 / 256), 4 warps of
    // whole rows, or the A100 tiles.
    using Pairs = Tf32BwdConfig<kHeadDim, true>;
    using Quads = Tf32BwdConfig<kHeadDim, true, false>;
    if constexpr (Pairs::kPairs) {
      if (st.tf32_pairs && st.tf32_wide_smem >= Pairs::Tr::kFusedDQSmemBytes)
        return launch_bwd_tf32<Pairs, kGeneral>(p, st, stream);
    }
    if (st.tf32_wide_smem >= Quads::Tr::kFusedDQSmemBytes)
      return launch_bwd_tf32<Quads, kGeneral>(p, st, stream);
  }
  return launch_bwd_tf32<Tf32BwdConfig<kHeadDim>, kGeneral>(p, st, stream);
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_bwd_tf32(const AttentionBwdParams& p, const BwdRowStats& st,
                                   cudaStream_t stream) {
  static_assert(sizeof(Elem) == 4, "the 3xTF32 backward is for fp32");
  const bool general = general_scores(p);
  return general ? launch_bwd_tf32_tiles<kHeadDim, true>(p, st, stream)
                 : launch_bwd_tf32_tiles<kHeadDim, false>(p, st, stream);
}

}  // namespace flashmod::cuda_kernels
