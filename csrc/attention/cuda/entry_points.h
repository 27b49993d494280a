// The entry points the torch host launcher (attention_cuda.cpp) calls, and the argument structs
// they take: declarations only. Torch-free on purpose: the .cu files that define them include
// nothing from torch.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only; no driver symbol is linked)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/host_device.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "generated/kernel_variants.h"

namespace flashmod::cuda_kernels {

// The Hopper backward tile whose variants (kBwdFastAdditive) take bwd_additive_fast masks at head
// dim d, or -1 where the default tile's mask variant does. At D = 64 the default runs three and
// four CTAs per SM, whose register caps leave no room for the staged dK/dV tile (64 bytes of
// spill) or the dQ kernel's batched loads (36-44); "base" runs two in both kernels. At D = 256
// the default "pair" tile's variants take only the masks that stage (bwd_stages_mask): there
// both kernels read every mask tile from shared memory (the per-score global loads of the mask
// variant were ~116 per step and warpgroup, 0.37-0.44x CUDNN forward + backward on an H200).
constexpr int bwd_sm90_additive_tile(int head_dim) {
  return head_dim == 64    ? find_tile(kBwdSm90Tiles, "base", 64)
         : head_dim == 256 ? find_tile(kBwdSm90Tiles, "pair", 256)
                           : -1;
}
// Whether head dim d's kBwdFastAdditive variants take only the masks that stage: the launch
// checks bwd_stages_mask instead of bwd_additive_fast, and the kernels keep no global-load path.
constexpr bool bwd_additive_staged_only(int head_dim) {
  return head_dim == 256;
}

struct FwdLaunchFlags {
  int out_vec16;  // out's row starts are 16-byte aligned and head_dim % 8 == 0: 16-byte stores
  // run_attention_fwd_sm90_ws: one CTA per tile for every call (FLASHMOD_SM90_WS_PERSISTENT=0;
  // tests and benchmarks compare it with the persistent grid).
  int one_tile_per_cta = 0;
  // run_attention_fwd_sm90_ws: the epilogue may store through the copy engine (default; 0:
  // FLASHMOD_SM90_WS_TMA_STORE=0); the launch keeps it only where the output has a tensor map.
  int out_tma = 0;
  // run_attention_fwd_sm90: an additive mask's tiles staged in shared memory where its layout
  // allows (default; 0: FLASHMOD_SM90_MASK_STAGING=0, each value read from global memory).
  int staged_mask = 1;
  // run_attention_fwd_sm90_ws: under a right window bound, a head's query blocks end at its last
  // row (default; 0: FLASHMOD_SM90_WS_END_ALIGNED=0, they start at its first row).
  int end_aligned = 1;
  // run_attention_fwd_sm90_ws, end-aligned blocks: a consumer's last key block is computed as its
  // left half where its rows see no key in the right half (default; 0:
  // FLASHMOD_SM90_WS_HALF_BLOCKS=0).
  int half_blocks = 1;
  // run_attention_fwd_sm90_ws: additive masks in q's dtype with aligned rows on the
  // warp-specialized kernel at head dims 64 and 128 (default; 0: FLASHMOD_SM90_WS_BIAS=0, the
  // FlashAttention-2-style kernel's staged tiles).
  int ws_bias = 1;
  // That kernel adds the values of a mask tile classified as hiding no key (mask_tiles.h,
  // kTileShownAdded: a dense bias) without testing each for hiding (default; 0:
  // FLASHMOD_MASK_SHOWN_TILES=0, every read tile tested).
  int mask_shown_tiles = 1;
};

// Device memory for a launch that needs scratch space, so the kernel files stay torch-free:
// alloc returns `bytes` usable in stream order on the launch's stream (the torch caching
// allocator in the host glue), or nullptr.
struct DeviceWorkspace {
  void* ctx = nullptr;
  void* (*alloc)(void* ctx, size_t bytes) = nullptr;
  // `count` int counters that are zero now, for kernels that leave every counter they were given
  // zero again (the last CTA to use one resets it): consecutive launches on one stream then share
  // them, without a memset node ahead of each. nullptr where not offered (e.g. while the stream is
  // captured into a graph, which may be replayed beside other work): acquire_zeroed_counters then
  // allocates and zeroes.
  int* (*zeroed_counters)(void* ctx, size_t count) = nullptr;
};

// `count` zeroed counters for one launch on `stream` into `out`: the stream's shared ones when the
// workspace offers them, else fresh memory and a memset.
inline cudaError_t acquire_zeroed_counters(const DeviceWorkspace& ws, size_t count,
                                           cudaStream_t stream, int*& out) {
  out = ws.zeroed_counters ? ws.zeroed_counters(ws.ctx, count) : nullptr;
  if (out != nullptr) return cudaSuccess;
  out = ws.alloc ? static_cast<int*>(ws.alloc(ws.ctx, count * sizeof(int))) : nullptr;
  if (out == nullptr) return cudaErrorMemoryAllocation;
  return cudaMemsetAsync(out, 0, count * sizeof(int), stream);
}

// Whether p's scores need more than a plain scaled product (a mask tensor, a soft cap, or a scale
// the kernels must take from p): the kernels' general variants, forward and backward.
FLASHMOD_HD bool general_scores(const AttentionParams& p) {
  return p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
}

// fp16/bf16 (Elem = __half or __nv_bfloat16) on tensor cores, head_dim <= kHeadDim. Requires
// q/k/v row starts to be 16-byte aligned (cp.async). Returns the first CUDA error of the set-up
// or the launch; cudaErrorInvalidConfiguration, launching nothing, when the grid would pass 2^31
// blocks.
// ws holds the classes of a mask tensor's tiles (mask_tiles.h; one byte per tile; a workspace
// without alloc leaves every tile mixed).
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              const DeviceWorkspace& ws, cudaStream_t stream);

// The Hopper variant (wgmma, sm_90a machine code only) for kHeadDim = 64, 128 and 256; same
// contract. ws holds the classes of a mask tensor's tiles (mask_tiles.h; one byte per tile).
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                   const DeviceWorkspace& ws, cudaStream_t stream);

// The warp-specialized Hopper variant (TMA loads, ping-ponged consumer warpgroups; sm_90a machine
// code only) for kHeadDim = 64, 128 and 256: plain scores (causal and windows included, GQA) on
// tensors TMA can address (16-byte aligned base, strides multiples of 16 bytes). Any other call it
// hands to run_attention_fwd_sm90 itself, so the contract is run_attention_fwd_sm90's, except for
// dropout calls (p.dropout_rng set), which that kernel has no form of: those it cannot take
// (masks, soft caps, tensors TMA cannot address) return cudaErrorNotSupported, launching nothing,
// for the caller to run elsewhere. ws holds the dynamic tile scheduler's counter (4 bytes, under a
// right window bound).
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90_ws(const AttentionParams& p, const FwdLaunchFlags& flags,
                                      const DeviceWorkspace& ws, cudaStream_t stream);

// Split-KV workspace of the decode kernel. rows = batch * heads_q * seqlen_q of the params the
// kernel gets (GQA-packed or not: same count), row id = the lse index.
struct SplitKvArgs {
  int splits = 1;        // > 1: CTAs write partials here; the combine kernel writes out and lse
  float* o = nullptr;    // (splits, rows, kHeadDim): each split's normalized O (padding cols 0)
  float* lse = nullptr;  // (splits, rows): each split's lse, -inf where it saw no visible key
  // Zeroed, one per CTA tile without its split index (cta_count(p, Br)): the fused combine. Each
  // split's CTA counts itself in after writing its partial, and the last one merges the tile's
  // rows (split_combine.h: combine_split_row) and zeroes the counter again, so no combine kernel
  // runs and the next launch needs no memset (DeviceWorkspace::zeroed_counters). nullptr: the
  // kernel.
  int* tile_counters = nullptr;
};

struct DecodeOptions {
  int num_sms = 1;
  int forced_splits = 0;      // > 0: use exactly this many splits (tests, tuning); 0: heuristic
  bool fused_combine = true;  // split-KV partials merged by each tile's last CTA, not a kernel
  // Paged K/V tiles through the copy engine where the decode kernel's build and the pages allow
  // (KvTensorMaps; FLASHMOD_DECODE_TMA=0: cp.async only). kv_outer: the pages of the pools (their
  // first dimension); 0 where the call has no page pool.
  bool kv_tma = false;
  int64_t kv_outer = 0;
  bool flat_grid = false;  // FLASHMOD_FLAT_GRID=1: a 1-D grid (cta_tile.h: cta_grid)
  // Tiles of at most 16 rows on the key-split kernel (kernel_traits.h: KeySplitTraits; 0:
  // FLASHMOD_DECODE_KEY_SPLIT=0, every tile on the row-split one).
  bool key_split = true;
};

// The decode kernel's whole key blocks of a paged cache through the copy engine (sm_90a builds,
// pages shorter than a key block): tensor maps over the K and V pools as (head dim, page rows, kv
// heads, pages) (tma_ops.h: encode_rows_tensor_map), boxes of box_rows = page size rows. box_rows
// = 0: every tile by cp.async (no maps; prefill, sm_80 builds, other layouts).
struct KvTensorMaps {
  CUtensorMap k, v;
  int box_rows = 0;
};

// The decode path: query rows per head <= kDecodeMaxNq (one 64-row tile when GQA-packed rows fit).
constexpr int64_t kDecodeMaxNq = 64;

// Decode kernel (fp16/bf16 tensor cores, 64-row tiles) for p.seqlen_q <= kDecodeMaxNq, with
// split-KV when the grid is small; p may be GQA-packed (decode_heuristics.h: pack_gqa_rows). Same
// alignment rules as run_attention_fwd.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_decode(const AttentionParams& p, const FwdLaunchFlags& flags,
                                     const DecodeOptions& opt, const DeviceWorkspace& ws,
                                     cudaStream_t stream);

// fp32: the 3xTF32 tensor-core kernels for more than 32 query rows: with sm90 (the caller's
// check that the sm_90a kernels run here and FLASHMOD_FP32_WGMMA) the wgmma one where it takes
// the call (head dims <= 128, rows 16-byte aligned; cudaErrorNotSupported otherwise), else the
// mma.sync one where the device's shared memory takes its tiles (every head dim on Hopper; <= 192
// on an A100); else (or with force_ffma, the host's FLASHMOD_FP32_FFMA=1) the CUDA-core kernel.
// All keep fp32 accuracy; any alignment.
cudaError_t run_attention_fwd_fp32(const AttentionParams& p, bool force_ffma, bool sm90,
                                   cudaStream_t stream);
cudaError_t run_attention_fwd_fp32_tc(const AttentionParams& p, cudaStream_t stream);
cudaError_t run_attention_fwd_fp32_sm90(const AttentionParams& p, cudaStream_t stream);
bool attention_fwd_fp32_tc_fits(int64_t head_dim);
// Every row of q, k and v starts 16-byte aligned and head_dim % 4 == 0 (whole 16-byte copies).
bool fp32_rows_aligned16(const AttentionParams& p);

// ---------------------------------------------------------------------------------------------
// The backward (bwd_sm80_kernel.h).

// Row statistics of the backward, (B, Hq, rows_padded) fp32 each: rows_padded rounds seqlen_q up
// to kBwdRowPad so the kernels read whole blocks of them; the pad rows hold lse2 = +inf and
// delta = 0 (P = 0: they contribute nothing).
constexpr int kBwdRowPad = 128;
// BwdRowStats::vec_store: grad_q/k/v rows start at even elements (element pairs stored as one
// word), and also at 16-byte boundaries with head_dim % 8 == 0 (the fp16/bf16 kernels stage a
// warp's rows in shared memory and store whole 16-byte chunks).
constexpr int kGradStoreElements = 0, kGradStorePairs = 1, kGradStoreRows16 = 2;

struct BwdRowStats {
  float* lse2 = nullptr;   // lse * log2(e); +inf where lse = -inf
  float* delta = nullptr;  // rowsum(dO * O) - grad_lse
  int64_t rows_padded = 0;
  int vec_store = 0;  // how gradient rows may be stored: kGradStoreElements, ...Pairs, ...Rows16
  int vec_rows = 0;   // out and grad_out rows are 16-byte aligned and head_dim % 8 == 0
  // The Hopper kernels' paths for additive masks in q's dtype (bwd_additive_fast); 0:
  // FLASHMOD_BWD_ADDITIVE_FAST=0, the general path. (Here, not in AttentionBwdParams: a field
  // there moved ptxas's allocation of the variable-length soft-cap dK/dV variant, 0 -> 96 bytes
  // of spill at D = 128.)
  int additive_fast = 1;
  // dq_sums_floats fp32, zeroed: the Hopper backward's fused variant (bwd_fused_dq) adds each
  // step's dQ partial here and a conversion writes grad_q from it. Tiles of 64 rows x 64 columns
  // (row block, then column block), each in the accumulator's fragment order
  // (bwd_sm90_kernel.h: dq_tile_offset); B * Hq * rows_padded rows, or with packed rows
  // dq_packed_row_blocks' layout. nullptr: dQ by its own kernel (no atomics: bitwise
  // reproducible).
  float* dq_accum = nullptr;
  // The Hopper backward's step loads through the copy engine in its plain variants
  // (bwd_sm90_launch.h), FLASHMOD_BWD_TMA_LOADS: 1 (the default) in the dK/dV and dQ kernels, 2 in
  // the dK/dV kernel only, 0 in neither (every thread's cp.async; for measurements).
  int tma_loads = 1;
  // The fused dQ variant's proxy fences after the work that follows their tiles' stores (its
  // kDeferFences, taken at D = 64); FLASHMOD_BWD_DEFERRED_FENCES=0: right behind the stores.
  int defer_fences = 1;
  // The fused dQ variant's gradient products in flight across its loop top (kOverlap, taken at
  // D = 128 in the plain dense variant); FLASHMOD_BWD_FUSED_OVERLAP=0: waited for at each step's
  // end.
  int fused_overlap = 1;
  // Host only (no kernel reads it): where the backward's dQ kernel runs beside the dK/dV launch
  // (kernel_launch.h: launch_beside); nullptr, FLASHMOD_BWD_DQ_BESIDE=0: after it, on the call's
  // stream.
  cudaStream_t dq_stream = nullptr;
  // The fp32 (3xTF32) backward: its dK/dV kernel (past head dim 128 its dK launch) adds dQ into
  // grad_q (zeroed by the host) by atomics and no dQ kernel runs (bwd_tf32_kernel.h: kFusedDQ); 0:
  // the dQ kernel, bitwise reproducible.
  int tf32_fused_dq = 0;
  // The device's opt-in shared memory per block, in bytes, where the fp32 backward may take its
  // wide tiles past head dim 128 (bwd_tf32_launch.h: the widest that fit it); 0 keeps the 2-warp
  // tiles every sm_80+ device fits (FLASHMOD_BWD_TF32_WIDE=0). tf32_pairs = 0: no tiles whose warp
  // pairs split the head dim (FLASHMOD_BWD_TF32_WIDE=2).
  int tf32_wide_smem = 0;
  int tf32_pairs = 1;
};

// Whether the Hopper backward can take dQ into its dK/dV kernel (five matmuls per block pair
// instead of seven; dQ added up in fp32 by atomics, so not bitwise reproducible): padded head
// dim 64 or 128, plain scores (windows and causal included; dropout too), dense rows or packed
// ones (cu_seqlens on both sides, fewer than 2^31 rows: the copy engine's row coordinate).
FLASHMOD_HD constexpr bool bwd_fused_dq_head_dim(int padded_head_dim) {
  return padded_head_dim == 64 || padded_head_dim == 128;
}
FLASHMOD_HD bool bwd_fused_dq_packed(const AttentionParams& p) {
  return p.cu_seqlens_q != nullptr && p.cu_seqlens_k != nullptr && p.seqused_k == nullptr &&
         p.kv_batch_idx == nullptr && p.block_table == nullptr &&
         p.packed_rows_q < (int64_t{1} << 31);
}
FLASHMOD_HD bool bwd_fused_dq(const AttentionBwdParams& p, int padded_head_dim) {
  return bwd_fused_dq_head_dim(padded_head_dim) && !general_scores(p) &&
         (!has_sequence_extents(p) || bwd_fused_dq_packed(p));
}

// The fused variant's sums for packed rows come per query head, every sequence's 64-row tiles in
// turn, sequence b's from block floor(cu_seqlens_q[b] / 64) + 2 b on: at least ceil(len / 64) + 1
// blocks of its own (a D = 64 step's second row block may lie wholly past the sequence's end),
// so about the tokens' own bytes where padding each sequence to max_seqlen_q would take up to
// batch * max_seqlen_q rows.
FLASHMOD_HD int64_t dq_packed_row_blocks(const AttentionParams& p) {
  return p.packed_rows_q / 64 + 2 * p.batch;
}
FLASHMOD_HD int64_t dq_packed_block0(int64_t q_start, int64_t b) {
  return q_start / 64 + 2 * b;
}
// Floats of BwdRowStats::dq_accum for p at padded head dim d.
FLASHMOD_HD int64_t dq_sums_floats(const AttentionParams& p, const BwdRowStats& st, int d) {
  const int64_t rows = has_sequence_extents(p) ? p.heads_q * dq_packed_row_blocks(p) * 64
                                               : p.batch * p.heads_q * st.rows_padded;
  return rows * d;
}

// Whether the Hopper backward takes p's mask through its paths for additive masks in q's dtype
// without a soft cap (bwd_common.h: staged dK/dV tiles, batched dQ loads). Host and kernels decide
// alike.
FLASHMOD_HD bool bwd_additive_fast(const AttentionBwdParams& p, const BwdRowStats& st) {
  return p.mask_kind == MaskKind::kAdditive && !(p.softcap > 0.0) && st.additive_fast != 0;
}

// Fills st.lse2 and st.delta from p's lse, out, grad_out and grad_lse (bwd_rowstats.cu); any of
// the three dtypes. The first clear_floats floats of st.dq_accum (the fused dQ's sums: a multiple
// of 4, 16-byte aligned), when it is set, are zeroed by the same kernel.
cudaError_t run_attention_bwd_rowstats(const AttentionBwdParams& p, const BwdRowStats& st,
                                       cudaStream_t stream, int64_t clear_floats = 0);

// The classes of p's mask tensor at kBwdMaskTile x kBwdMaskTile tiles (mask_tiles.h) for the
// fp16/bf16 backward kernels (bwd_common.h: bwd_tile_class), in workspace memory that p.mask_tiles
// then points at; nothing for calls without a mask, for key-padding masks (the kernels vote on
// their key blocks), for fp32 and where ws cannot allocate (p unchanged: every tile then mixed).
constexpr int kBwdMaskTile = 64;
cudaError_t classify_bwd_mask_tiles(AttentionBwdParams& p, const DeviceWorkspace& ws,
                                    cudaStream_t stream);

// dK/dV and dQ of fp16/bf16 attention on tensor cores for head_dim <= kHeadDim, after
// run_attention_bwd_rowstats filled st. Same alignment rules as run_attention_fwd (q, k, v,
// grad_out rows 16-byte aligned). p.grad_mask, when set, must be zero-filled by the caller.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_bwd(const AttentionBwdParams& p, const BwdRowStats& st,
                              cudaStream_t stream);

// dK/dV and dQ of fp32 attention on the tensor cores with 3xTF32 products (bwd_tf32_kernel.h),
// Elem = float, head_dim <= kHeadDim; same contract as run_attention_bwd.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_bwd_tf32(const AttentionBwdParams& p, const BwdRowStats& st,
                                   cudaStream_t stream);

// The Hopper variant (wgmma, sm_90a machine code only) for kHeadDim = 64, 128 and 256, with the
// tile shapes of row kTile of kBwdSm90Tiles (generated/kernel_variants.h); same contract.
template <typename Elem, int kHeadDim, int kTile>
cudaError_t run_attention_bwd_sm90(const AttentionBwdParams& p, const BwdRowStats& st,
                                   cudaStream_t stream);

}  // namespace flashmod::cuda_kernels
