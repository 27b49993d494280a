// Tile choices and the (torch-free) launch of the Hopper wgmma kernel. Each
// generated/fwd_sm90_<dtype>_hd<D>.cu (tools/gen_kernels.py) instantiates one
// run_attention_fwd_sm90.
#pragma once

#include <cuda_runtime.h>

#include "../../common/cuda/kernel_launch.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fwd_sm90_kernel.h"

namespace flashmod::cuda_kernels {
namespace sm90 {

// (Bc, warpgroups, stages[, CTAs per SM]) per head dim; Br = 64 * warpgroups.
// Measured on an H100 (bf16, N = 1k..16k, causal and not, ratio to SDPA FLASH in the same process;
// benchmarks/results/design/cuda-sm90.md):
//   D = 64:  64 x 64-key tiles, 2 warpgroups, 2 CTAs per SM (109 registers)  1.18-1.30x
//            Br 128 x Bc 128, 1 CTA per SM                                  0.95-1.14x
//            Br 64 (1 warpgroup) x Bc 64, 3 CTAs per SM                      1.06-1.16x
//            Br 64 x Bc 128, 2 CTAs per SM                                   1.05-1.15x
//            S_{j+1} overlapped with the softmax of S_j (3 stages)           0.80-1.07x
//            (that variant, FA3's intra-warpgroup overlap, was removed after it lost)
//   D = 128: Br 128 x Bc 128, 2 warpgroups, 1 CTA per SM (232 registers)    1.13-1.43x
//            the same with 3 stages                                          1.18-1.36x (no gain)
//            Br 64 x Bc 64, 2 CTAs per SM                                    1.08-1.21x
//            Br 64 x Bc 128 (smem allows 1 CTA per SM)                       0.81-1.08x
//            S_{j+1} overlapped (Bc 64 or 128)                               1.01-1.40x (no gain)
//            2 CTAs per SM at 128 registers spills (48-120 bytes): not run.
template <typename Elem, int kHeadDim>
struct FwdConfigSm90;
template <typename Elem>
struct FwdConfigSm90<Elem, 64> {
  using Traits = FwdTraitsSm90<Elem, 64, 64, 2, 2, 2>;
};
template <typename Elem>
struct FwdConfigSm90<Elem, 128> {
  using Traits = FwdTraitsSm90<Elem, 128, 128, 2, 2>;
};
// D = 192 as D = 256 (its zero columns ran these calls until session 58): Q 48 KB and two stages
// of 64-key K_j, V_j 96 KB. H200, session 59: 1.19-1.24x the D = 256 form on the calls it takes
// (key padding, additive masks), 298-441 TFLOP/s.
template <typename Elem>
struct FwdConfigSm90<Elem, 192> {
  using Traits = FwdTraitsSm90<Elem, 192, 64, 2, 2>;
};
template <typename Elem>
struct FwdConfigSm90<Elem, 256> {
  using Traits = FwdTraitsSm90<Elem, 256, 64, 2, 2>;
};

// The variant for K/V addressing kAddr (paged_kv.h). Variable-length and KV-cache calls take no
// mask tensor (flash-attn's APIs have none), so they have no bool-mask variant.
template <class Tr, KvAddressing kAddr>
auto pick_fwd_kernel_sm90(bool general) {
  return general ? attention_fwd_sm90_kernel<Tr, true, false, kAddr>
                 : attention_fwd_sm90_kernel<Tr, false, false, kAddr>;
}

template <class Tr>
cudaError_t launch_fwd(const AttentionParams& params, const FwdLaunchFlags& flags,
                       const DeviceWorkspace& ws, cudaStream_t stream) {
  AttentionParams p = params;
  const cudaError_t err = classify_mask_tiles<typename Tr::Elem>(p, Tr::Br, Tr::Bc, ws, stream);
  if (err != cudaSuccess) return err;
  // Plain: raw scores, scale folded into exp2. Bool mask alone: the same plus prefetched mask bits.
  // Anything else (additive masks, soft cap, scale <= 0): every score transformed.
  const bool transformed = p.softcap > 0.0 || !(p.scale > 0.0);
  const bool bool_mask = p.mask_kind == MaskKind::kBool && !transformed;
  const bool general = transformed || (p.mask_kind != MaskKind::kNone && !bool_mask);
  // An additive mask in the inputs' type with aligned rows: its tiles staged in shared memory.
  const bool staged_mask = flags.staged_mask && general && additive_mask_stageable(p) &&
                           kv_addressing(p, Tr::Bc) == kDense;
  auto kernel = staged_mask ? attention_fwd_sm90_kernel<Tr, true, false, kDense, true>
                : general   ? attention_fwd_sm90_kernel<Tr, true, false>
                : bool_mask ? attention_fwd_sm90_kernel<Tr, false, true>
                            : attention_fwd_sm90_kernel<Tr, false, false>;
  switch (kv_addressing(p, Tr::Bc)) {
    case kSequences: kernel = pick_fwd_kernel_sm90<Tr, kSequences>(general); break;
    case kBlockPages: kernel = pick_fwd_kernel_sm90<Tr, kBlockPages>(general); break;
    case kRowPages: kernel = pick_fwd_kernel_sm90<Tr, kRowPages>(general); break;
    default: break;
  }
  if (has_sequence_extents(p) && p.mask_kind != MaskKind::kNone) return cudaErrorInvalidValue;
  return cuda::launch_kernel(kernel, cta_count(p, Tr::Br), Tr::kNThreads,
                             staged_mask ? Tr::kSmemBytesStagedMask : Tr::kSmemBytes, stream, p,
                             flags);
}

}  // namespace sm90

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                   const DeviceWorkspace& ws, cudaStream_t stream) {
  return sm90::launch_fwd<typename sm90::FwdConfigSm90<Elem, kHeadDim>::Traits>(p, flags, ws,
                                                                                stream);
}

}  // namespace flashmod::cuda_kernels
