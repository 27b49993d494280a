// Tile choices per head dim and the (torch-free) launches of the tensor-core backward. Each
// attention_bwd_<dtype>_hd<D>.cu instantiates one run_attention_bwd.
#pragma once

#include <cuda_runtime.h>

#include "../../common/cuda/kernel_launch.h"
#include "bwd_sm80_kernel.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {

// dK/dV: (warps, Br, one kernel for both or one per gradient); each warp owns 16 key rows, so
// Bc = 16 x warps. The per-thread accumulators hold 16 x D x 2 / 32 = D floats for dK and dV
// together, plus Br / 2 each for S^T and dP^T: past D = 128 they cannot share the registers, and
// dV and dK get a launch each (S^T is then computed twice; dP^T only in the dK launch).
// dQ: (warps, Bc), 16 query rows per warp; D / 2 + Bc accumulator floats per thread.
template <typename Elem, int kHeadDim>
struct BwdConfig {
  static constexpr bool kSplit = kHeadDim > 128;
  using KV = BwdKVTraits<Elem, kHeadDim, kSplit ? 4 : 8, kHeadDim <= 64 ? 64 : 32>;
  using Q = BwdQTraits<Elem, kHeadDim, 4, kHeadDim <= 128 ? 64 : 32>;
};

template <class Tr, bool kGeneral, int kWhich, bool kExtents, bool kDropout>
cudaError_t launch_bwd_dkdv(const AttentionBwdParams& p, const BwdRowStats& st,
                            cudaStream_t stream) {
  const int64_t blocks = bwd_dkdv_ctas(p, Tr::Bc);
  return cuda::launch_kernel(attention_bwd_dkdv_kernel<Tr, kGeneral, kWhich, kExtents, kDropout>,
                             blocks, Tr::kNThreads, Tr::kSmemBytes, stream, p, st);
}

template <typename Elem, int kHeadDim, bool kGeneral, bool kExtents, bool kDropout = false>
cudaError_t launch_bwd(const AttentionBwdParams& p, const BwdRowStats& st, cudaStream_t stream) {
  using Cfg = BwdConfig<Elem, kHeadDim>;
  using KV = typename Cfg::KV;
  using TrQ = typename Cfg::Q;
  // dQ beside dK/dV on st.dq_stream where the host gave one, as on Hopper (bwd_sm90_launch.h).
  // H200 with these kernels forced, bf16, B * N = 16k, H * D = 2048, session 52: forward + backward
  // +0.5-2.4 % (D = 64 / 128, N = 1k / 4k, causal and not) against one after the other.
  return cuda::launch_beside(
      stream, st.dq_stream,
      [&](cudaStream_t s) {
        if constexpr (Cfg::kSplit) {
          const cudaError_t err =
              launch_bwd_dkdv<KV, kGeneral, kBwdOnlyDV, kExtents, kDropout>(p, st, s);
          return err != cudaSuccess
                     ? err
                     : launch_bwd_dkdv<KV, kGeneral, kBwdOnlyDK, kExtents, kDropout>(p, st, s);
        } else {
          return launch_bwd_dkdv<KV, kGeneral, kBwdBoth, kExtents, kDropout>(p, st, s);
        }
      },
      [&](cudaStream_t s) {
        return cuda::launch_kernel(attention_bwd_dq_kernel<TrQ, kGeneral, kExtents, kDropout>,
                                   bwd_dq_ctas(p, TrQ::Br), TrQ::kNThreads, TrQ::kSmemBytes, s, p,
                                   st);
      });
}

// Variable-length calls (per-sequence extents: sequence_view_bwd) take their own variants; they
// carry no mask tensor, so only the soft cap and the scale make them general.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_bwd(const AttentionBwdParams& p, const BwdRowStats& st,
                              cudaStream_t stream) {
  const bool general = general_scores(p);
  // Dropout: dense calls (attention_dropout) and variable-length ones (attention_varlen).
  if (p.dropout_rng != nullptr && has_sequence_extents(p))
    return general ? launch_bwd<Elem, kHeadDim, true, true, true>(p, st, stream)
                   : launch_bwd<Elem, kHeadDim, false, true, true>(p, st, stream);
  if (p.dropout_rng != nullptr)
    return general ? launch_bwd<Elem, kHeadDim, true, false, true>(p, st, stream)
                   : launch_bwd<Elem, kHeadDim, false, false, true>(p, st, stream);
  if (has_sequence_extents(p)) {
    return general ? launch_bwd<Elem, kHeadDim, true, true>(p, st, stream)
                   : launch_bwd<Elem, kHeadDim, false, true>(p, st, stream);
  }
  return general ? launch_bwd<Elem, kHeadDim, true, false>(p, st, stream)
                 : launch_bwd<Elem, kHeadDim, false, false>(p, st, stream);
}

}  // namespace flashmod::cuda_kernels
