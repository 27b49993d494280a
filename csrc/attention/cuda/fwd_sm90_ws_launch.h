// Tile choices, tensor maps and the (torch-free) launch of the warp-specialized Hopper kernel
// (fwd_sm90_ws_kernel.h). Each generated/fwd_sm90_ws_<dtype>_hd<D>.cu (tools/gen_kernels.py)
// instantiates one run_attention_fwd_sm90_ws.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/tma_ops.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fwd_sm90_ws_kernel.h"
#include "mask_tiles.h"
#include "staged_mask.h"

namespace flashmod::cuda_kernels {
namespace sm90 {

// (Bc, consumer warpgroups, stages) per head dim; Br = 64 * consumers.
// benchmarks/results/design/cuda-hopper-forward.md has the measurements behind them.
template <typename Elem, int kHeadDim>
struct FwdWsConfig;
// D = 64: three consumers (Br 192). A consumer's two matmuls per key block are half as long as
// at D = 128 while its softmax is not, so two consumers cannot hide one's softmax under the
// other's matmuls; with three, each softmax has two others' to hide under: +8-20% non-causal,
// +6-13% causal from N = 2k (H200, bf16), and at N = 512-1k, where the last 192-row tile of a
// head is a third full, still +6-7% non-causal and +2% causal (H100, session 12, the benchmark's
// order rotating; two consumers had been kept for causal N <= 1k on a fixed-order measurement).
template <typename Elem>
struct FwdWsConfig<Elem, 64> {
  using Traits = FwdWsTraits<Elem, 64, 128, 3, 2>;
};
template <typename Elem>
struct FwdWsConfig<Elem, 128> {
  using Traits = FwdWsTraits<Elem, 128, 128, 2, 2>;
};

// D = 256: Q (128 rows) and two stages of 64-key K_j, V_j fill 192 KB of shared memory, O
// stays in registers (128 per consumer thread) and the epilogue stores from them.
template <typename Elem>
struct FwdWsConfig<Elem, 192> {
  using Traits = FwdWsTraits<Elem, 192, 64, 2, 2>;
};
template <typename Elem>
struct FwdWsConfig<Elem, 256> {
  using Traits = FwdWsTraits<Elem, 256, 64, 2, 2>;
};

// An additive mask the kBias variants take: in q's dtype, rows of their own (a row stride: TMA
// boxes of rows) 16-byte aligned, keys contiguous; no soft cap.
inline bool ws_takes_mask_rows(const AttentionParams& p) {
  return additive_mask_stageable(p) && p.mask_row_stride != 0 && p.softcap == 0.0;
}

// What the kernel does not take: scores other than plain, soft-capped or behind a key-padding
// mask (other mask tensors, a soft cap with a mask, a scale <= 0; with mask_rows, where the head
// dim has kBias variants, also ws_takes_mask_rows' additive masks), and per-sequence extents
// other than packed queries and keys (cache lengths, pages).
inline bool ws_takes_options(const AttentionParams& p, bool mask_rows) {
  const bool packed = p.cu_seqlens_q != nullptr && p.cu_seqlens_k != nullptr;
  const bool capped = p.softcap > 0.0;
  const bool masks = (key_padding_mask(p) && !capped) || (mask_rows && ws_takes_mask_rows(p));
  return (p.mask_kind == MaskKind::kNone || (masks && !packed)) && p.scale > 0.0 &&
         p.pos_period == 0 && (packed || !has_sequence_extents(p)) && p.seqused_k == nullptr &&
         p.kv_batch_idx == nullptr && p.block_table == nullptr;
}

// Dropout: this kernel's dropout variants take plain scores (no mask tensor, no soft cap) under
// any window, dense or packed rows.
inline bool ws_takes_dropout(const AttentionParams& p) {
  return ws_takes_options(p, false) && p.mask_kind == MaskKind::kNone && p.softcap == 0.0;
}

template <class Tr>
cudaError_t launch_fwd_ws(const AttentionParams& params, const FwdLaunchFlags& flags,
                          const DeviceWorkspace& ws, cudaStream_t stream, bool& launched) {
  launched = false;
  AttentionParams p = params;
  // The key-padding mask's bits come 128 keys to a block (kKeyMask).
  if (Tr::Bc != 128 && key_padding_mask(p)) return cudaSuccess;
  // 32-bit tile indices (the kernel's divisions), with room for the dynamic scheduler's claims
  // past the end (one per CTA). Near 2^31 tiles q alone would be terabytes.
  const int64_t tiles = cta_count(p, Tr::Br);
  if (tiles > (int64_t{1} << 31) - (int64_t{1} << 20)) return cudaSuccess;
  // Packed rows (varlen): each tensor is one (batch, head) plane of all its rows, the sequences
  // found by their first row; the kernel carries row indices in 32 bits.
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen && (p.packed_rows_q >= (int64_t{1} << 31) || p.packed_rows_k >= (int64_t{1} << 31)))
    return cudaSuccess;
  const int64_t batch = varlen ? 1 : p.batch;
  const int64_t rows_q = varlen ? p.packed_rows_q : p.seqlen_q;
  const int64_t rows_k = varlen ? p.packed_rows_k : p.seqlen_k;
  constexpr bool kBf16 = std::is_same_v<typename Tr::Elem, __nv_bfloat16>;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  if (!encode_rows_tensor_map(&tm_q, kBf16, p.q, batch, p.heads_q, rows_q, p.head_dim,
                              p.q_batch_stride, p.q_head_stride, p.q_row_stride, Tr::Br) ||
      !encode_rows_tensor_map(&tm_k, kBf16, p.k, batch, p.heads_kv, rows_k, p.head_dim,
                              p.k_batch_stride, p.k_head_stride, p.k_row_stride, Tr::Bc) ||
      !encode_rows_tensor_map(&tm_v, kBf16, p.v, batch, p.heads_kv, rows_k, p.head_dim,
                              p.v_batch_stride, p.v_head_stride, p.v_row_stride, Tr::Bc))
    return cudaSuccess;
  // The output through the copy engine, in boxes of one consumer warp's 16 rows (the kernel's
  // store_out_rows_tma), where TMA takes it; otherwise (and for packed rows) the warps store it.
  FwdLaunchFlags launch_flags = flags;
  launch_flags.out_tma =
      flags.out_tma && !varlen && Tr::kStageOut &&
      encode_rows_tensor_map(&tm_o, kBf16, p.out, batch, p.heads_q, rows_q, p.head_dim,
                             p.out_batch_stride, p.out_head_stride, p.out_row_stride, 16);
  if (!launch_flags.out_tma) tm_o = tm_q;  // passed, never read
  // An additive mask (kBias): its rows through a tensor map of their own, in boxes of a
  // consumer's 64 rows; its tiles classified at this kernel's Br x Bc first (mask_tiles.h).
  CUtensorMap tm_mask = tm_q;  // passed, never read, where the call has no mask rows
  const bool mask_rows = p.mask_kind == MaskKind::kAdditive;
  if (mask_rows && !Tr::kTakesBias) return cudaSuccess;
  if constexpr (Tr::kTakesBias) {
    if (mask_rows) {
      const int64_t mask_batches = p.mask_batch_stride != 0 ? p.batch : 1;
      const int64_t mask_heads = p.mask_head_stride != 0 ? p.heads_q : 1;
      if (!encode_rows_tensor_map(&tm_mask, kBf16, p.mask, mask_batches, mask_heads, p.seqlen_q,
                                  p.seqlen_k, p.mask_batch_stride, p.mask_head_stride,
                                  p.mask_row_stride, 64))
        return cudaSuccess;
    }
  }
  launched = true;  // from here on an error is this launch's, not a reason to hand the call over
  if constexpr (Tr::kTakesBias) {
    if (mask_rows) {
      const cudaError_t err = classify_mask_tiles<typename Tr::Elem>(p, Tr::Br, Tr::Bc, ws, stream);
      if (err != cudaSuccess) return err;
    }
  }
  // Persistent (one CTA per SM, or per tile where there are fewer tiles): the next tile's loads
  // hide under the current one's epilogue (H100, N = 1k: +9% at D = 128, +18% at D = 64).
  // Tiles of equal cost (no right window bound, whole query blocks) go round-robin. Under one
  // (causal) a static round-robin left SMs idle behind the long diagonal tiles (-2 to -7%
  // against one CTA per tile), so there a counter hands tiles out as CTAs free up, each head's
  // longest first: +3-11% against one CTA per tile (H100, bf16 causal, N = 1k-16k). An order
  // over L2-sized sections of heads, longest first across the section, lost 1-7% to this one:
  // a head's query blocks running side by side read its K/V from L2 once. Packed sequences
  // always take the counter: only the producer knows which tiles lie past their sequence's end.
  WsSchedule sched;
  int64_t grid = tiles;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (varlen || !flags.one_tile_per_cta) grid = tiles < sms ? tiles : sms;
  // Tiles differ in cost under a right window bound, and also where a head's last query block is
  // partial (N not a multiple of Br: every power of two at D = 64, Br = 192). Round-robin then
  // hands CTA k the query blocks k mod (blocks per head) whenever that count divides the grid
  // (D = 64, N = 1k-4k on 132 SMs: 22 CTAs got only the short last tiles, the other 110 only
  // full ones), so those calls take the counter too. A grid of one CTA has nothing to balance.
  // A mask's hidden tiles (transformers' causal mask as a tensor) make tile costs differ too.
  const bool uneven = p.window_right >= 0 || rows_q % Tr::Br != 0 || mask_rows;
  if (varlen || (!flags.one_tile_per_cta && uneven && grid > 1)) {
    int* counters = nullptr;
    err = acquire_zeroed_counters(ws, 2, stream, counters);
    if (err != cudaSuccess) return err;
    sched.next_tile = reinterpret_cast<unsigned*>(counters);
  }
  auto launch = [&](auto kernel, int smem_bytes = Tr::kSmemBytes) {
    return cuda::launch_kernel(kernel, grid, Tr::kNThreads, smem_bytes, stream, tm_q, tm_k, tm_v,
                               tm_o, tm_mask, p, launch_flags, sched);
  };
  // Dropout calls come with plain scores (ws_takes_dropout).
  if (p.dropout_rng != nullptr)
    return varlen ? launch(attention_fwd_sm90_ws_kernel<Tr, true, false, false, false, true>)
                  : launch(attention_fwd_sm90_ws_kernel<Tr, false, false, false, false, true>);
  const bool capped = p.softcap > 0.0;
  if (varlen)
    return capped ? launch(attention_fwd_sm90_ws_kernel<Tr, true, false, true>)
                  : launch(attention_fwd_sm90_ws_kernel<Tr, true, false, false>);
  if constexpr (Tr::Bc == 128) {
    if (key_padding_mask(p)) return launch(attention_fwd_sm90_ws_kernel<Tr, false, true, false>);
  }
  // Plain row blocks (not end-aligned: the mask's tiles are classified at them).
  if constexpr (Tr::kTakesBias) {
    if (mask_rows)
      return launch(attention_fwd_sm90_ws_kernel<Tr, false, false, false, false, false, true>,
                    Tr::kSmemBytesBias);
  }
  if (capped) return launch(attention_fwd_sm90_ws_kernel<Tr, false, false, true>);
  // Under a right window bound (causal) a head's last rows see the most keys. Where Br does not
  // divide the rows, blocks that start at the first row leave the partial block last, on the
  // longest key range (D = 64, Br = 192, N = 1k: 64 rows over all 8 key blocks, one consumer
  // busy, the other two waiting); ending them at (up to 15 rows past) the last row makes it the
  // first rows, over the fewest keys. The same kernel halves a consumer's last key block where
  // its rows see only the left half (Tr::kHalfBlocks), which pays where Br divides the rows too.
  // Its epilogue is the copy engine's only (the warps' stores would write rows before the
  // first). Non-causal calls keep the plain kernel: every block sees the same keys there.
  if constexpr (Tr::kStageOut) {
    if (launch_flags.end_aligned && launch_flags.out_tma && p.window_right >= 0 &&
        (rows_q % Tr::Br != 0 || Tr::kHalfBlocks))
      return launch(attention_fwd_sm90_ws_kernel<Tr, false, false, false, true>);
  }
  return launch(attention_fwd_sm90_ws_kernel<Tr, false, false, false>);
}

}  // namespace sm90

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90_ws(const AttentionParams& p, const FwdLaunchFlags& flags,
                                      const DeviceWorkspace& ws, cudaStream_t stream) {
  // Dropout where this kernel cannot take it is cudaErrorNotSupported: the host then runs the
  // mma.sync kernels, which carry dropout for every option (the other Hopper kernel has none).
  const bool dropout = p.dropout_rng != nullptr;
  if (dropout && !sm90::ws_takes_dropout(p)) return cudaErrorNotSupported;
  using Traits = typename sm90::FwdWsConfig<Elem, kHeadDim>::Traits;
  if (sm90::ws_takes_options(p, Traits::kTakesBias && flags.ws_bias) &&
      p.seqlen_q < (int64_t{1} << 31) && p.seqlen_k < (int64_t{1} << 31) &&
      p.batch < (int64_t{1} << 31) && p.heads_q < (int64_t{1} << 31)) {
    bool launched = false;
    const cudaError_t err = sm90::launch_fwd_ws<Traits>(p, flags, ws, stream, launched);
    if (launched) return err;
  }
  if (dropout) return cudaErrorNotSupported;
  // The tensors or options TMA or this kernel cannot take: the FlashAttention-2-style kernel.
  return run_attention_fwd_sm90<Elem, kHeadDim>(p, flags, ws, stream);
}

}  // namespace flashmod::cuda_kernels
