// Scores of one key block -> logit units with hidden keys at -inf, over the mma accumulator
// layout (shared by the mma.sync and the wgmma kernels: both hold, per warp, m16 tiles whose
// lane owns rows lane/4 and lane/4 + 8 and columns 2 * (lane % 4) + {0, 1} of every n8 tile).
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../attention_params.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// Per-kernel constants of the score transform.
struct ScoreTransform {
  float scale, softcap, inv_softcap;
  __device__ __forceinline__ explicit ScoreTransform(const AttentionParams& p)
      : scale(static_cast<float>(p.scale)),
        softcap(static_cast<float>(p.softcap)),
        inv_softcap(p.softcap > 0.0 ? static_cast<float>(1.0 / p.softcap) : 0.f) {}
};

// mask_scores' plain-path test with the lane's row windows computed by the caller: hides the
// columns of each of its rows outside win[mi][hh]; key0 is the lane's first column
// (key_block * Bc + 2 * (lane % 4)). For kernels short of registers, which compute the windows
// once outside their key loop (the warp-specialized one: the per-block int64 window arithmetic
// spilled at Bc = 176). mask_scores keeps its own loop: routing it through here changed the
// other kernels' register allocation (sm_90 D = 64: 109 -> 125).
template <int MT, int NT>
__device__ __forceinline__ void mask_outside_windows(float (&S)[MT][NT][4],
                                                     const RowWindow (&win)[MT][2], int key0) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      // Columns relative to key0: both bounds stay in int range (windows are clamped to
      // [-1, seqlen_k]).
      const int lo = win[mi][hh].lo - key0, hi = win[mi][hh].hi - key0;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (ni * 8 + e < lo || ni * 8 + e > hi) S[mi][ni][2 * hh + e] = -CUDART_INF_F;
    }
}

// mask_scores' default mask source: each value loaded from p.mask in global memory where it is
// used. (staged_mask.h's StagedMaskTile reads a tile staged in shared memory instead.)
struct GlobalMaskValues {
  static constexpr bool kStaged = false;
};

// mask_scores' general path with an additive mask staged in shared memory (staged_mask.h). The
// soft cap and the window test are decided once per block (kWindowTest false: the block lies
// inside every row's window): tested per score, as the global-memory path does, the cap compiled
// to a branch per score (D = 128: 406 branches in the kernel against 39 on the plain path).
// Unmasked blocks (use_mask false) add 0.
template <bool kSoftcap, bool kWindowTest, int MT, int NT, class PosOf, class MaskTile>
__device__ __forceinline__ void transform_staged_scores(float (&S)[MT][NT][4],
                                                        const AttentionParams& p,
                                                        const ScoreTransform& tf, int64_t warp_row0,
                                                        int key0, int lane, PosOf pos_of,
                                                        bool use_mask, const MaskTile& tile) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t i = warp_row0 + mi * 16 + (lane >> 2) + 8 * hh;
      const RowWindow win = kWindowTest ? row_window(p, pos_of(i)) : RowWindow{0, 0};
      const typename MaskTile::Row row = tile.row(i, lane);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const float2 values = MaskTile::pair(row, ni, use_mask);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float value = e == 0 ? values.x : values.y;
          float x = S[mi][ni][2 * hh + e] * tf.scale;
          if constexpr (kSoftcap) x = soft_cap(x, tf.softcap, tf.inv_softcap);
          bool visible = !mask_value_hides(value);
          if constexpr (kWindowTest) visible = visible && win.contains(key0 + ni * 8 + e);
          S[mi][ni][2 * hh + e] = visible ? x + value : -CUDART_INF_F;
        }
      }
    }
}

// kGeneral (a mask tensor, a soft cap or a non-positive scale): every score is scaled, capped
// and masked. Otherwise scores stay raw q.k (the scale is folded into the softmax's exp2) and
// only key blocks that straddle the window or seqlen_k pay for per-element checks.
// warp_row0: row index of the warp's first row; block_pos_first/last: the query positions the
// CTA's rows span (for the block-level test); key_block: index of the Bc-wide key block;
// pos_of(row): the query position of a row (the row itself, except for GQA-packed decode rows).
// use_mask: false where the block's mask entries are all "show, add nothing" (mask_tiles.h).
// staged: where an additive mask's values come from (GlobalMaskValues or a StagedMaskTile).
template <typename Elem, bool kGeneral, int MT, int NT, class PosOf,
          class MaskSource = GlobalMaskValues>
__device__ __forceinline__ void mask_scores(float (&S)[MT][NT][4], const AttentionParams& p,
                                            const ScoreTransform& tf, int64_t b, int64_t h,
                                            int64_t warp_row0, int64_t block_pos_first,
                                            int64_t block_pos_last, int key_block, int Bc, int lane,
                                            PosOf pos_of, bool use_mask = true,
                                            const MaskSource& staged = {}) {
  const int g = lane >> 2, key0 = key_block * Bc + 2 * (lane & 3);
  if constexpr (kGeneral && MaskSource::kStaged) {
    if (tf.softcap > 0.f) {
      transform_staged_scores<true, true>(S, p, tf, warp_row0, key0, lane, pos_of, use_mask,
                                          staged);
    } else if (key_block_unmasked(p, block_pos_first, block_pos_last, key_block, Bc)) {
      transform_staged_scores<false, false>(S, p, tf, warp_row0, key0, lane, pos_of, use_mask,
                                            staged);
    } else {
      transform_staged_scores<false, true>(S, p, tf, warp_row0, key0, lane, pos_of, use_mask,
                                           staged);
    }
  } else if constexpr (kGeneral) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t i = warp_row0 + mi * 16 + g + 8 * hh;
        const RowWindow win = row_window(p, pos_of(i));
        // (Packed rows never carry a mask tensor, so the mask row is the row itself.)
        const int64_t ic =
            i < p.seqlen_q ? i : p.seqlen_q - 1;  // rows past Nq are computed, never stored
        const int64_t mask_row =
            b * p.mask_batch_stride + h * p.mask_head_stride + ic * p.mask_row_stride;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = key0 + ni * 8 + e;
            float x = S[mi][ni][2 * hh + e] * tf.scale;
            if (tf.softcap > 0.f) x = soft_cap(x, tf.softcap, tf.inv_softcap);
            bool visible = win.contains(j);
            if (visible && use_mask && p.mask_kind != MaskKind::kNone)
              visible = apply_mask<Elem>(p, mask_row + j * p.mask_col_stride, x);
            S[mi][ni][2 * hh + e] = visible ? x : -CUDART_INF_F;
          }
      }
  } else if (!key_block_unmasked(p, block_pos_first, block_pos_last, key_block, Bc)) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const RowWindow win = row_window(p, pos_of(warp_row0 + mi * 16 + g + 8 * hh));
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!win.contains(key0 + ni * 8 + e)) S[mi][ni][2 * hh + e] = -CUDART_INF_F;
      }
  }
}

// A bool mask tensor as bits: bit 2 * ni + e of word [mi][hh] is the mask at this lane's row
// (mi, hh) and column key_block * Bc + 8 * ni + 2 * (lane % 4) + e (set = attend). Loaded before
// the block's S = Q K^T is issued, so the loads' latency hides behind the matmul; the scores
// themselves then stay raw (the scale rides in the softmax's exp2) as on the plain path.
// Columns past seqlen_k read as 0 (the window test hides them anyway).
template <int MT, int NT>
struct BoolMaskBits {
  static_assert(NT * 2 <= 32, "one word per row: Bc <= 128");
  uint32_t bits[MT][2];

  __device__ __forceinline__ void load(const AttentionParams& p, int64_t b, int64_t h,
                                       int64_t warp_row0, int key_block, int Bc, int lane) {
    const uint8_t* mask =
        static_cast<const uint8_t*>(p.mask) + b * p.mask_batch_stride + h * p.mask_head_stride;
    const int64_t key0 = static_cast<int64_t>(key_block) * Bc + 2 * (lane & 3);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t i = warp_row0 + mi * 16 + (lane >> 2) + 8 * hh;
        const int64_t ic = i < p.seqlen_q ? i : p.seqlen_q - 1;  // rows past Nq: never stored
        const uint8_t* row = mask + ic * p.mask_row_stride;
        uint32_t w = 0;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = key0 + ni * 8 + e;
            if (j < p.seqlen_k && row[j * p.mask_col_stride] != 0) w |= 1u << (2 * ni + e);
          }
        bits[mi][hh] = w;
      }
  }

  template <int kMT, int kNT>
  __device__ __forceinline__ void apply(float (&S)[kMT][kNT][4]) const {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!((bits[mi][hh] >> (2 * ni + e)) & 1u)) S[mi][ni][2 * hh + e] = -CUDART_INF_F;
  }
};

}  // namespace flashmod::cuda_kernels
