// Tile choices and the (torch-free) launches of the Hopper backward. Each
// generated/bwd_sm90_<dtype>_hd<D>.cu (tools/gen_kernels.py) instantiates one
// run_attention_bwd_sm90.
#pragma once

#include <cuda_runtime.h>

#include "../../common/cuda/kernel_launch.h"
#include "bwd_sm90_kernel.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {
namespace sm90 {

// dK/dV: 2 warpgroups (128 key rows) x 64-query steps; dQ: 2 warpgroups (128 query rows) x
// 64-key blocks. Per thread: dK + dV take D floats, S^T and dP^T 32 each (dQ: D / 2 + 64).
template <typename Elem, int kHeadDim, int kVariant>
struct BwdConfigSm90 {
  using KV = BwdKVTraitsSm90<Elem, kHeadDim, 2, 64>;
  using Q = BwdQTraitsSm90<Elem, kHeadDim, 2, 64>;
};
// Experiment: one warpgroup per CTA, two CTAs per SM (independent CTAs overlap one's elementwise
// work with the other's wgmma).
template <typename Elem, int kHeadDim>
struct BwdConfigSm90<Elem, kHeadDim, 1> {
  using KV = BwdKVTraitsSm90<Elem, kHeadDim, 1, 64, 2>;
  using Q = BwdQTraitsSm90<Elem, kHeadDim, 1, 64, 2>;
};

template <typename Elem, int kHeadDim, bool kGeneral, int kVariant>
cudaError_t launch_bwd(const AttentionBwdParams& p, const BwdRowStats& st, cudaStream_t stream) {
  using KV = typename BwdConfigSm90<Elem, kHeadDim, kVariant>::KV;
  using Q = typename BwdConfigSm90<Elem, kHeadDim, kVariant>::Q;
  const int64_t kv_blocks = (p.seqlen_k + KV::Bc - 1) / KV::Bc * p.heads_kv * p.batch;
  cudaError_t err = cuda::launch_kernel(attention_bwd_dkdv_sm90_kernel<KV, kGeneral>, kv_blocks,
                                        KV::kNThreads, KV::kSmemBytes, stream, p, st);
  if (err != cudaSuccess) return err;
  const int64_t q_blocks = (p.seqlen_q + Q::Br - 1) / Q::Br * p.heads_q * p.batch;
  return cuda::launch_kernel(attention_bwd_dq_sm90_kernel<Q, kGeneral>, q_blocks, Q::kNThreads,
                             Q::kSmemBytes, stream, p, st);
}

}  // namespace sm90

template <typename Elem, int kHeadDim>
cudaError_t run_attention_bwd_sm90(const AttentionBwdParams& p, const BwdRowStats& st,
                                   cudaStream_t stream) {
  const bool general = p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
  if (st.tile_variant == 1)
    return general ? sm90::launch_bwd<Elem, kHeadDim, true, 1>(p, st, stream)
                   : sm90::launch_bwd<Elem, kHeadDim, false, 1>(p, st, stream);
  return general ? sm90::launch_bwd<Elem, kHeadDim, true, 0>(p, st, stream)
                 : sm90::launch_bwd<Elem, kHeadDim, false, 0>(p, st, stream);
}

}  // namespace flashmod::cuda_kernels
