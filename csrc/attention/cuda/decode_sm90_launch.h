// The (torch-free) launch of the streaming Hopper decode kernel (decode_sm90_kernel.h): what it
// takes, its split-KV count, its workspace. Each generated/decode_sm90_<dtype>_hd<D>.cu
// (tools/gen_kernels.py) instantiates one run_attention_decode_sm90.
#pragma once

#include <cuda_runtime.h>

#include "../../common/cuda/kernel_launch.h"
#include "cta_tile.h"
#include "decode_heuristics.h"
#include "decode_sm90_kernel.h"
#include "entry_points.h"
#include "split_combine.h"

namespace flashmod::cuda_kernels {

// Blocks in flight per warp: 4 warps x kStages x 16 KB (D = 128) or 8 KB (D = 64) of K/V, with
// the ring at most ~200 KB (one CTA per SM).
template <typename Elem, int kHeadDim>
struct DecodeSm90Config {
  using Traits = DecodeSm90Traits<Elem, kHeadDim, kHeadDim == 128 ? 3 : 4>;
};

// What the kernel takes: one m16 tile of query rows (after GQA packing), plain or soft-capped
// scores with windows (no mask tensor), whole rows of exactly kHeadDim columns, no packed queries
// or keys (varlen calls are not decode-shaped), 32-bit key indices.
template <class Tr>
bool decode_sm90_takes(const AttentionParams& p) {
  return p.seqlen_q <= Tr::kRows && p.head_dim == Tr::kHeadDim &&
         p.mask_kind == MaskKind::kNone && p.cu_seqlens_q == nullptr &&
         p.cu_seqlens_k == nullptr && p.seqlen_k + p.seqlen_new < (int64_t{1} << 31) &&
         p.page_size < (int64_t{1} << 31);
}

template <class Tr>
cudaError_t launch_decode_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                               const DecodeOptions& opt, const DeviceWorkspace& ws,
                               cudaStream_t stream) {
  constexpr int kHeadDim = Tr::kHeadDim;
  const int64_t ctas = cta_count(p, Tr::kRows);
  // One CTA per SM (its ring takes most of shared memory): a grid short of the SMs splits the
  // keys so every SM streams. kMinBlocksPerSplit counts blocks of one per warp, 4 Bc keys.
  int splits = opt.forced_splits;
  if (splits <= 0)
    splits = choose_splits(ctas, decode_key_blocks(p, Tr::kWarps * Tr::Bc), opt.num_sms);
  if (ctas * splits > cuda::kMaxGridBlocks) return cudaErrorInvalidConfiguration;
  SplitKvArgs sk;
  sk.splits = splits;
  if (splits > 1) {
    const cudaError_t err = alloc_split_workspace<kHeadDim>(
        sk, p.batch * p.heads_q * p.seqlen_q, ctas, opt.fused_combine, ws, stream);
    if (err != cudaSuccess) return err;
  }
  auto kernel = opt.bulk_row_copies ? attention_decode_sm90_kernel<Tr, true>
                                    : attention_decode_sm90_kernel<Tr, false>;
  const cudaError_t err = cuda::launch_kernel(kernel, ctas * splits, Tr::kNThreads,
                                              Tr::kSmemBytes, stream, p, flags, sk);
  if (err != cudaSuccess || splits == 1 || sk.tile_counters != nullptr) return err;
  return launch_split_combine<typename Tr::Elem, kHeadDim>(p, sk, stream);
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_decode_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                      const DecodeOptions& opt, const DeviceWorkspace& ws,
                                      cudaStream_t stream) {
  using Tr = typename DecodeSm90Config<Elem, kHeadDim>::Traits;
  if (decode_sm90_takes<Tr>(p)) return launch_decode_sm90<Tr>(p, flags, opt, ws, stream);
  // What it does not take: the mma.sync decode kernel.
  return run_attention_fwd_decode<Elem, kHeadDim>(p, flags, opt, ws, stream);
}

}  // namespace flashmod::cuda_kernels
