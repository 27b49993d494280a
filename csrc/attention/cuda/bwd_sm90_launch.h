// Tile shapes and the (torch-free) launches of the Hopper backward. Each
// generated/bwd_sm90_<dtype>_hd<D>_<tile>.cu (tools/gen_kernels.py) instantiates one
// run_attention_bwd_sm90.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "../../common/cuda/kernel_launch.h"
#include "bwd_sm90_halves_kernel.h"
#include "bwd_sm90_kernel.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"

namespace flashmod::cuda_kernels {
namespace sm90 {

// The tile shapes come from the variant table (tools/gen_kernels.py, BWD_SM90_TILES; one
// translation unit per dtype and tile): its default per head dim runs unless
// FLASHMOD_BWD_SM90_TILE names another (attention_backward_cuda.cpp). One warpgroup per CTA in
// both kernels: independent CTAs overlap one's elementwise work with the other's wgmma; measured
// on an H100 against two warpgroups per CTA, which run in lockstep through the per-block barrier
// (tools/bwd_kernel_times.py, bf16, B * N = 16k, H * D = 2048;
// benchmarks/results/design/cuda-backward.md): D = 64 step 8.92 -> 7.79 ms at N = 4k (dQ 3.10 ->
// 2.30 ms, dK/dV 4.37 -> 4.05), D = 128 6.30 -> 6.19 ms. The measurements of the other tiles
// and the registers of each are in the design log ("Hopper v4").
// D = 256: dK and dV (128 accumulator floats per thread each) get a launch each, and the tiles
// (K_j, V_j 64 KB; two stages of Q_i, dO_i 128 KB) leave room for one CTA per SM.
template <typename Elem, int kHeadDim, int kTile, bool kDropout = false>
struct BwdConfigSm90 {
  static constexpr KernelTile kT = kBwdSm90Tiles[kTile];
  static_assert(kT.head_dim == kHeadDim, "a tile of the table is built for its own head dim");
  // kv_split: 0 dK and dV by one warpgroup, 1 one launch each, 2 one warpgroup each (kBwdPair).
  static constexpr int kSplit = kT.kv_split;
  static_assert(kSplit != 0 || kHeadDim <= 128, "D >= 192: dK and dV do not fit one warpgroup");
  // Dropout variants: the keep bits' Philox rounds need registers. At the D = 64 tile's four dQ
  // CTAs per SM (128 registers) the dQ variants spilled 48-64 bytes, at three none (148-152
  // registers); the dK/dV variants stay at three CTAs (168 registers, 16-28 bytes of spill in the
  // plain ones; at two CTAs none, 214-244 registers). Chosen by ptxas, not yet timed against the
  // other counts.
  static constexpr int kKVCtas = kDropout && kT.kv_ctas > 3 ? 3 : kT.kv_ctas;
  static constexpr int kQCtas = kDropout && kT.q_ctas > 3 ? 3 : kT.q_ctas;
  using KV = BwdKVTraitsSm90<Elem, kHeadDim, 1, kT.kv_rows, kKVCtas, kT.kv_stages,
                             kT.kv_overlap != 0, kSplit == 2>;
  using Q = BwdQTraitsSm90<Elem, kHeadDim, 1, kT.q_cols, kQCtas, kT.q_stages, kT.q_overlap != 0>;
};

// kTmaLoads: the step loads through the copy engine, maps over q and grad_out in boxes of KV::Br
// rows (the kernel's stages then end in their mbarriers).
template <class KV, bool kGeneral, int kWhich, bool kExtents, int kFast, bool kTmaLoads = false,
          bool kDropout = false>
cudaError_t launch_dkdv(const AttentionBwdParams& p, const BwdRowStats& st, cudaStream_t stream,
                        const BwdStepMaps& maps = {}) {
  const int64_t blocks = bwd_dkdv_ctas(p, KV::Bc);
  constexpr bool kStageMask = dkdv_stages_mask<KV, kGeneral, kWhich, kExtents, kFast>();
  // kDropout: the keep bits' exchange after the staged mask tile or the mbarriers (the kernel's
  // layout; its place does not depend on whether the tile is staged).
  constexpr int64_t kExchange = kDropout ? 2 * KV::kNThreads * 8 : 0;
  static_assert(
      kExchange == 0 || KV::kMinBlocks * (KV::kSmemBytes + (kStageMask ? KV::Br * KV::Bc * 2 : 0) +
                                          8 * KV::kStages + kExchange + 1024) <=
                            228 * 1024,
      "the dropout exchange keeps kMinBlocks CTAs per SM");
  const int64_t smem =
      KV::kSmemBytes + (kTmaLoads ? 8 * KV::kStages : 0) +
      (kStageMask && (kExchange != 0 || bwd_stages_mask(p, st)) ? KV::Br * KV::Bc * 2 : 0) +
      kExchange;
  return cuda::launch_kernel(
      attention_bwd_dkdv_sm90_kernel<KV, kGeneral, kWhich, kExtents, kFast, kTmaLoads, kDropout>,
      blocks, KV::kNThreads, smem, stream, p, st, maps);
}

// The maps of BwdStepMaps in boxes of box_rows rows x 64 columns: over q and grad_out as (batch,
// heads_q, seqlen_q, head_dim) for the dK/dV kernel (packed rows: (1, heads_q, total, head_dim)),
// over k and v as (batch, heads_kv, seqlen_k, head_dim) with `keys` for the dQ kernel; false where
// TMA cannot take either (tma_ops.h).
template <typename Elem>
bool encode_bwd_step_maps(const AttentionBwdParams& p, bool keys, int box_rows, BwdStepMaps& maps) {
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  const int64_t heads = keys ? p.heads_kv : p.heads_q;
  // Packed rows (the fused variant's steps): one (batch, head) plane of all rows, as the
  // forward's maps.
  const bool packed = !keys && p.cu_seqlens_q != nullptr;
  const int64_t batch = packed ? 1 : p.batch;
  const int64_t rows = keys ? p.seqlen_k : packed ? p.packed_rows_q : p.seqlen_q;
  if (keys)
    return encode_rows_tensor_map(&maps.first, kBf16, p.k, p.batch, heads, rows, p.head_dim,
                                  p.k_batch_stride, p.k_head_stride, p.k_row_stride, box_rows) &&
           encode_rows_tensor_map(&maps.second, kBf16, p.v, p.batch, heads, rows, p.head_dim,
                                  p.v_batch_stride, p.v_head_stride, p.v_row_stride, box_rows);
  return encode_rows_tensor_map(&maps.first, kBf16, p.q, batch, heads, rows, p.head_dim,
                                p.q_batch_stride, p.q_head_stride, p.q_row_stride, box_rows) &&
         encode_rows_tensor_map(&maps.second, kBf16, p.grad_out, batch, heads, rows, p.head_dim,
                                p.grad_out_batch_stride, p.grad_out_head_stride,
                                p.grad_out_row_stride, box_rows);
}

// grad_q = scale * dq_accum, the fused variant's fp32 sums. A warp per 16-row slab of a 64 x 64
// sum tile (1024 floats, stored together: dq_tile_offset, each lane's fragment holding rows g and
// g + 8 of columns 2t and 2t + 1): eight whole float4 reads a lane, then the slab through shared
// memory as rows of Elem, so each row's 64 columns leave as 16-byte stores. (A thread per float4
// writing its two column pairs, each 32-byte sector of grad_q in two warps' halves, moved 3.2 TB/s:
// 63 us at B 16, H 16, N 1k, D 128 on an H200; session 47.)
// kPacked (packed rows, dq_packed_row_blocks' layout): the warps walk (sequence, head,
// max_seqlen_q's row blocks) as for dense rows, and slabs past their sequence's end are skipped.
constexpr int kDQSlabWarps = 8;
template <typename Elem, int kColBlocks, bool kPacked>
__global__ void __launch_bounds__(kDQSlabWarps * 32)
    attention_bwd_dq_from_sums_kernel(const AttentionBwdParams p, const BwdRowStats st) {
  static_assert(sizeof(Elem) == 2, "the fused dQ is an fp16 / bf16 variant");
  // 16 bytes of padding a row: lane (g, t)'s column pair of block ni sits in bank
  // (4g + 4ni + t) mod 32, so the 8 rows x 4 pairs of one store instruction hit all 32 banks.
  constexpr int kRowBytes = 64 * 2 + 16;
  __shared__ alignas(16) unsigned char slabs[kDQSlabWarps][16 * kRowBytes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* slab = slabs[warp];
  const int head_dim = static_cast<int>(p.head_dim);
  const int64_t row_blocks = st.rows_padded / 64;
  const int64_t slab_count = p.batch * p.heads_q * row_blocks * kColBlocks * 4;
  const float scale = static_cast<float>(p.scale);
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kDQSlabWarps + warp; s < slab_count;
       s += static_cast<int64_t>(gridDim.x) * kDQSlabWarps) {
    // Warp-uniform indices: (b, h, row block m, column block w, 16-row slab w4).
    const int w4 = static_cast<int>(s % 4), w = static_cast<int>(s / 4 % kColBlocks);
    const int64_t m = s / 4 / kColBlocks % row_blocks, bh = s / 4 / kColBlocks / row_blocks;
    const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    const int64_t r0 = m * 64 + w4 * 16;
    int64_t rows = p.seqlen_q, first_row = 0, at = s * 256;  // at: the slab's first float4
    if constexpr (kPacked) {
      first_row = p.cu_seqlens_q[b];
      rows = p.cu_seqlens_q[b + 1] - first_row;
      at = dq_tile_offset(h, dq_packed_row_blocks(p), dq_packed_block0(first_row, b) + m, w,
                          kColBlocks) /
               4 +
           w4 * 256;
    }
    if (r0 >= rows || w * 64 >= head_dim) continue;
    float4 sum[8];
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
      sum[ni] = reinterpret_cast<const float4*>(st.dq_accum)[at + ni * 32 + lane];
    __syncwarp();  // the previous slab's rows have been read out of `slab`
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
      unsigned char* at_g = slab + (lane / 4) * kRowBytes + (ni * 8 + 2 * (lane % 4)) * 2;
      *reinterpret_cast<uint32_t*>(at_g) =
          Mma16816<Elem>::pack(sum[ni].x * scale, sum[ni].y * scale);
      *reinterpret_cast<uint32_t*>(at_g + 8 * kRowBytes) =
          Mma16816<Elem>::pack(sum[ni].z * scale, sum[ni].w * scale);
    }
    __syncwarp();  // every lane's pairs are in `slab` before any lane reads a row of it
    const int c = w * 64 + (lane % 8) * 8;  // this lane's 8 columns of a row
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = k * 4 + lane / 8;
      if (r0 + r >= rows || c >= head_dim) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(slab + r * kRowBytes + (lane % 8) * 16);
      Elem* dst = static_cast<Elem*>(p.grad_q) + b * p.grad_q_batch_stride +
                  h * p.grad_q_head_stride + (first_row + r0 + r) * p.grad_q_row_stride + c;
      if (st.vec_store == kGradStoreRows16) {  // 16-byte aligned rows, head_dim % 8 == 0
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        const Elem* e = reinterpret_cast<const Elem*>(&v);
        for (int j = 0; j < 8 && c + j < head_dim; ++j) dst[j] = e[j];
      }
    }
  }
}

// The fused variant (bwd_fused_dq, where the host gave st.dq_accum): one CTA of two warpgroups
// over 128 keys (64 each) per SM, 64-query steps, three stages of Q_i / dO_i, each step's dQ
// partial added into dq_accum by the copy engine; then grad_q from the sums. Five matmuls per
// block pair against the two kernels' seven. H100, bf16, B 4, H 16, N 4k, D 128 (design log,
// session 28): dK/dV with dQ 3.00 ms + 0.12 (clearing and converting the sums) against dK/dV 2.18
// + dQ 1.49; two stages of Q_i / dO_i with two dQ tiles per warpgroup 3.29 ms; the dQ partials
// added by red.global.add.v4 from the registers 3.45 ms; without adding them at all 2.07. Each
// step's dQ product deferred to the next step, past its loop-top barrier instead of a barrier of
// its own: forward + backward +4-11 % (session 31).
// D = 64: steps of 128 queries, so that each warpgroup's dQ partial is again a 64 x 64 tile (its
// 64 of the step's rows) and the registers are D = 128's; two stages (three would not fit 227 KB
// with the steps' 32 KB dS^T tiles). Forward + backward against the seven matmuls +3-11 % from
// N = 2k, causal +2-13 % from 4k (H100, session 32; backward_dispatch.h has the rule).
// kOverlap (D = 128, plain dense variant): each step's gradient products stay in flight across
// the loop top and are waited for with the next step's dQ product, so they run under the CTA
// barrier and the dQ product's issue; the prefetch then runs one step ahead instead of two. H200,
// bf16, B * N = 16k, session 50, against the variant that waits at the step's end, two rounds:
// fused kernel 4k 2.35-2.39 against 2.43 ms, 1k 0.665 against 0.685, causal 1.31-1.39 against
// 1.38-1.39; forward + backward +1.7 % (1.00-1.03x, the quick set's D = 128 paper and GQA shapes).
// Dropout and packed rows keep the plain pipeline (not measured with it).
template <typename Elem, int kHeadDim, bool kOverlap = false>
using FusedDQTraits =
    std::conditional_t<kHeadDim == 128, BwdKVTraitsSm90<Elem, 128, 2, 64, 1, 3, kOverlap>,
                       BwdKVTraitsSm90<Elem, 64, 2, 128, 1, 2>>;

// kExtents: packed rows (bwd_fused_dq_packed), the maps over all of q and grad_out.
template <typename Elem, int kHeadDim, bool kDropout, bool kExtents>
cudaError_t launch_bwd_fused_dq(const AttentionBwdParams& p, const BwdRowStats& st,
                                const BwdStepMaps& maps, cudaStream_t stream) {
  using KV = FusedDQTraits<Elem, kHeadDim>;
  // + two steps' dS^T, each warpgroup's dQ tile and the stages' mbarriers (the kernel's layout;
  // kDropout's keep-bit exchange lives in the dS^T tiles)
  constexpr int64_t kSmem =
      KV::kSmemBytes + 2 * KV::Bc * KV::Br * 2 + 2 * kDQTileFloats * 4 + 8 * KV::kStages;
  static_assert(kSmem <= 227 * 1024, "sm_90's per-block shared-memory limit");
  // Deferred fences (the kernel's kDeferFences), H200, bf16, B * N = 16k, the fused kernel's time
  // deferred / right behind the stores (session 49, two rounds each): D = 64 4k 2.60-2.62 against
  // 2.80-2.81 ms, causal 1.47-1.50 against 1.57-1.58 (the dQ tile's fence is the part that pays);
  // D = 128 4k 2.50 against 2.43-2.45 ms, causal 1.43-1.51 against 1.35-1.38, 1k level; each move
  // alone lost there too. So D = 128 keeps the fences behind the stores.
  auto launch_fused = [&](auto traits, auto defer) {
    using Tr = decltype(traits);
    static_assert(Tr::kSmemBytes == KV::kSmemBytes, "kSmem is the layout of KV's tiles");
    return cuda::launch_kernel(
        attention_bwd_dkdv_sm90_kernel<Tr, false, kBwdFusedDQ, kExtents, kBwdFastNone, false,
                                       kDropout, decltype(defer)::value>,
        bwd_dkdv_ctas(p, Tr::Bc), Tr::kNThreads, kSmem, stream, p, st, maps);
  };
  cudaError_t err;
  if constexpr (kHeadDim == 64) {
    err = st.defer_fences ? launch_fused(KV{}, std::true_type{})
                          : launch_fused(KV{}, std::false_type{});
  } else if constexpr (!kDropout && !kExtents) {
    err = st.fused_overlap ? launch_fused(FusedDQTraits<Elem, kHeadDim, true>{}, std::false_type{})
                           : launch_fused(KV{}, std::false_type{});
  } else {
    err = launch_fused(KV{}, std::false_type{});
  }
  if (err != cudaSuccess) return err;
  const int64_t slabs = p.batch * p.heads_q * st.rows_padded / 16 * (kHeadDim / 64);
  const int64_t blocks = (slabs + kDQSlabWarps - 1) / kDQSlabWarps;
  return cuda::launch_kernel(attention_bwd_dq_from_sums_kernel<Elem, kHeadDim / 64, kExtents>,
                             blocks < 65536 ? blocks : 65536, kDQSlabWarps * 32, 0, stream, p, st);
}

// The dQ kernel of the seven-matmul backward; kTmaLoads: its key blocks through the copy engine,
// maps over k and v in boxes of Q::Bc rows.
template <typename Elem, int kHeadDim, int kTile, bool kGeneral, bool kExtents,
          int kFast = kBwdFastNone, bool kTmaLoads = false, bool kDropout = false>
cudaError_t launch_dq(const AttentionBwdParams& p, const BwdRowStats& st, cudaStream_t stream,
                      const BwdStepMaps& maps = {}) {
  using Q = typename BwdConfigSm90<Elem, kHeadDim, kTile, kDropout>::Q;
  const int64_t q_blocks = bwd_dq_ctas(p, Q::Br);
  // The dQ kernel's staged mask tiles (additive_fast_variant, bwd_stages_mask): one per stage.
  constexpr bool kQStages = additive_fast_variant<kGeneral, kExtents, kFast, kHeadDim>();
  static_assert(
      !kQStages ||
          Q::kMinBlocks * (Q::kSmemBytes + Q::kStages * Q::Br * Q::Bc * 2 + 1024) <= 228 * 1024,
      "the staged mask tiles keep kMinBlocks CTAs per SM");
  const int64_t q_smem = Q::kSmemBytes + (kTmaLoads ? 8 * Q::kStages : 0) +
                         (kQStages && bwd_stages_mask(p, st) ? Q::kStages * Q::Br * Q::Bc * 2 : 0);
  return cuda::launch_kernel(
      attention_bwd_dq_sm90_kernel<Q, kGeneral, kExtents, kFast, kTmaLoads, kDropout>, q_blocks,
      Q::kNThreads, q_smem, stream, p, st, maps);
}

template <typename Elem, int kHeadDim, int kTile, bool kGeneral, bool kExtents,
          int kFast = kBwdFastNone, bool kDropout = false>
cudaError_t launch_bwd(const AttentionBwdParams& p, const BwdRowStats& st, cudaStream_t stream) {
  using Cfg = BwdConfigSm90<Elem, kHeadDim, kTile, kDropout>;
  using KV = typename Cfg::KV;
  if constexpr (!kGeneral && kFast == kBwdFastNone && bwd_fused_dq_head_dim(kHeadDim) &&
                kBwdSm90Tiles[kTile].is_default) {
    // The fused variant's loads need tensor maps over q and grad_out (16-byte aligned bases and
    // strides); where TMA cannot take them, the seven-matmul kernels run (its sums go unused).
    // The host gives the sums only where bwd_fused_dq allows (packed rows among the extents).
    BwdStepMaps fused_maps;
    if (st.dq_accum != nullptr &&
        encode_bwd_step_maps<Elem>(p, false, FusedDQTraits<Elem, kHeadDim>::Br, fused_maps))
      return launch_bwd_fused_dq<Elem, kHeadDim, kDropout, kExtents>(p, st, fused_maps, stream);
  }
  // The dK/dV launches of the tile's split (one warpgroup for both, a launch each, or a warpgroup
  // each), with the step loads of kTma.
  auto launch_dkdv_set = [&](auto tma, const BwdStepMaps& maps, cudaStream_t stream) {
    constexpr bool kTma = decltype(tma)::value;
    if constexpr (Cfg::kSplit == 1) {
      const cudaError_t err =
          launch_dkdv<KV, kGeneral, kBwdOnlyDV, kExtents, kFast, kTma, kDropout>(p, st, stream,
                                                                                 maps);
      return err != cudaSuccess
                 ? err
                 : launch_dkdv<KV, kGeneral, kBwdOnlyDK, kExtents, kFast, kTma, kDropout>(
                       p, st, stream, maps);
    } else if constexpr (Cfg::kSplit == 2) {
      if constexpr (kHeadDim == 256 && kTma && !kGeneral && !kExtents && kFast == kBwdFastNone &&
                    !kDropout) {
        // Plain dense D = 256: the warpgroups split the head dim (bwd_sm90_halves_kernel.h), four
        // matmuls a block pair against the pair's five. H200, bf16, B * N = 16k, H * D = 2048,
        // session 51, dK/dV kernel ms, halves / pair: 1k 0.566 / 0.618, 4k 2.016 / 2.222, causal
        // 1k 0.341 / 0.391, causal 4k 1.094 / 1.265; forward + backward +2-6 %.
        return cuda::launch_kernel(attention_bwd_halves_sm90_kernel<BwdHalvesTraits<Elem>>,
                                   bwd_dkdv_ctas(p, BwdHalvesTraits<Elem>::Bc),
                                   BwdHalvesTraits<Elem>::kNThreads,
                                   BwdHalvesTraits<Elem>::kSmemBytes, stream, p, st, maps);
      } else {
        return launch_dkdv<KV, kGeneral, kBwdPair, kExtents, kFast, kTma, kDropout>(p, st, stream,
                                                                                    maps);
      }
    } else {
      return launch_dkdv<KV, kGeneral, kBwdBoth, kExtents, kFast, kTma, kDropout>(p, st, stream,
                                                                                  maps);
    }
  };
  // dK/dV, and dQ beside it on st.dq_stream where the host gave one (cuda::launch_beside). H200,
  // bf16, B * N = 16k, H * D = 2048, session 52, forward + backward against one after the other in
  // one process: D = 256 1k +2 %, causal 1k +3 %, 4k +1 %, causal 4k +3 %; causal 1k D = 64 +2 %,
  // D = 128 +3 %, GQA 32/8 +2 %; the shapes that take the fused variant (no dQ kernel) level.
  // Plain dense variants load their steps through the copy engine where TMA takes q and grad_out
  // (and the dQ kernel its key blocks where it takes k and v); BwdRowStats::tma_loads says
  // otherwise for measurements.
  if constexpr (!kGeneral && !kExtents && kFast == kBwdFastNone && !KV::kOverlap) {
    BwdStepMaps maps;
    if (st.tma_loads && encode_bwd_step_maps<Elem>(p, false, KV::Br, maps)) {
      using Q = typename Cfg::Q;
      BwdStepMaps key_maps;
      const bool key_tma =
          !Q::kOverlap && st.tma_loads == 1 && encode_bwd_step_maps<Elem>(p, true, Q::Bc, key_maps);
      return cuda::launch_beside(
          stream, st.dq_stream,
          [&](cudaStream_t s) { return launch_dkdv_set(std::true_type{}, maps, s); },
          [&](cudaStream_t s) {
            if constexpr (!Q::kOverlap) {
              if (key_tma)
                return launch_dq<Elem, kHeadDim, kTile, false, false, kBwdFastNone, true, kDropout>(
                    p, st, s, key_maps);
            }
            return launch_dq<Elem, kHeadDim, kTile, false, false, kBwdFastNone, false, kDropout>(
                p, st, s);
          });
    }
  }
  return cuda::launch_beside(
      stream, st.dq_stream,
      [&](cudaStream_t s) { return launch_dkdv_set(std::false_type{}, BwdStepMaps{}, s); },
      [&](cudaStream_t s) {
        return launch_dq<Elem, kHeadDim, kTile, kGeneral, kExtents, kFast, false, kDropout>(p, st,
                                                                                            s);
      });
}

}  // namespace sm90

template <typename Elem, int kHeadDim, int kTile>
cudaError_t run_attention_bwd_sm90(const AttentionBwdParams& p, const BwdRowStats& st,
                                   cudaStream_t stream) {
  // Variable-length calls (sequence_view_bwd) take their own variants, as in run_attention_bwd,
  // built for the default tile of each head dim only (they double a unit's kernels; the host
  // sends them there, backward_dispatch.h).
  const bool general = general_scores(p);
  // Dropout (dense calls, attention_dropout, and variable-length ones, attention_varlen) on
  // variants of its own, built for the default tile only, as the variable-length ones.
  if (p.dropout_rng != nullptr) {
    if constexpr (kBwdSm90Tiles[kTile].is_default) {
      if (has_sequence_extents(p))
        return general ? sm90::launch_bwd<Elem, kHeadDim, kTile, true, true, kBwdFastNone, true>(
                             p, st, stream)
                       : sm90::launch_bwd<Elem, kHeadDim, kTile, false, true, kBwdFastNone, true>(
                             p, st, stream);
      return general ? sm90::launch_bwd<Elem, kHeadDim, kTile, true, false, kBwdFastNone, true>(
                           p, st, stream)
                     : sm90::launch_bwd<Elem, kHeadDim, kTile, false, false, kBwdFastNone, true>(
                           p, st, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  if (has_sequence_extents(p)) {
    if constexpr (kBwdSm90Tiles[kTile].is_default) {
      return general ? sm90::launch_bwd<Elem, kHeadDim, kTile, true, true>(p, st, stream)
                     : sm90::launch_bwd<Elem, kHeadDim, kTile, false, true>(p, st, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  if (!general) return sm90::launch_bwd<Elem, kHeadDim, kTile, false, false>(p, st, stream);
  // Masks whose blocks the kernels can tell apart (key-padding ones; others with tile classes)
  // and mask-free soft caps on variants of their own (bwd_sm90_kernel.h: kFast), built for the
  // default tile of each head dim only, as the variable-length ones; other tiles take them the
  // general way.
  if constexpr (kTile == bwd_sm90_additive_tile(kHeadDim)) {
    if (bwd_additive_staged_only(kHeadDim) ? bwd_stages_mask(p, st) : bwd_additive_fast(p, st))
      return sm90::launch_bwd<Elem, kHeadDim, kTile, true, false, kBwdFastAdditive>(p, st, stream);
  }
  if constexpr (kBwdSm90Tiles[kTile].is_default) {
    if (key_padding_mask(p) || p.mask_tiles != nullptr)
      return sm90::launch_bwd<Elem, kHeadDim, kTile, true, false, kBwdFastMask>(p, st, stream);
    if (p.mask_kind == MaskKind::kNone && p.softcap > 0.0 && p.scale > 0.0)
      return sm90::launch_bwd<Elem, kHeadDim, kTile, true, false, kBwdFastSoftcap>(p, st, stream);
  }
  return sm90::launch_bwd<Elem, kHeadDim, kTile, true, false>(p, st, stream);
}

}  // namespace flashmod::cuda_kernels
