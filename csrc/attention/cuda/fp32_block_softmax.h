// One key block's scores to P in the fp32 forward kernels (fwd_fp32_3xtf32.cu on mma.sync,
// fwd_fp32_sm90.cu on wgmma): scale, soft cap and mask, the online softmax of the thread's two
// rows (quads share a row), and P split into tf32 halves as the A operand of P V_j. Both kernels
// hold S in the mma accumulator layout (a wgmma's accumulators are four stacked m16n8 ones), so
// one copy serves both.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"
#include "../attention_params.h"
#include "cta_tile.h"
#include "online_softmax.h"
#include "tf32_tile.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// A thread's view of its two query rows (g and g + 8 of its warp's m16 tile).
struct Fp32Rows {
  RowWindow win[2];
  int64_t mask_row[2];
  OnlineSoftmaxRowF64 softmax[2];
  float scale, softcap, inv_softcap;

  // rows: the two rows' indices in the sequence (possibly past seqlen_q, whose outputs are not
  // stored; their mask row is clamped to the last one).
  __device__ __forceinline__ Fp32Rows(const AttentionParams& p, int64_t b, int64_t h,
                                      const int64_t (&rows)[2]) {
    const int64_t Nq = p.seqlen_q;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      win[ri] = row_window(p, rows[ri]);
      mask_row[ri] = b * p.mask_batch_stride + h * p.mask_head_stride +
                     (rows[ri] < Nq ? rows[ri] : Nq - 1) * p.mask_row_stride;
      softmax[ri].init();
    }
    scale = static_cast<float>(p.scale), softcap = static_cast<float>(p.softcap);
    inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
  }

  // S (kKTiles n8 tiles of key block n, Bc keys from key0 = n * Bc) -> P's tf32 halves, relabelled
  // for the A operand of P V_j (position t <-> key 2t, t + 4 <-> key 2t + 1 of each 8 keys, where
  // the accumulator holds columns 2t, 2t + 1); alpha: the rows' rescale factors for O. unmasked:
  // no key of the block is hidden from any row of the tile (no window or mask test needed).
  template <int kKTiles>
  __device__ __forceinline__ void block_to_p(const AttentionParams& p, float (&s)[kKTiles][4],
                                             int64_t key0, int t, bool unmasked, float (&alpha)[2],
                                             uint32_t (&p_hi)[kKTiles][4],
                                             uint32_t (&p_lo)[kKTiles][4]) {
    const float log2e = 1.4426950408889634f;
    float block_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ri = e / 2;
        const int j = static_cast<int>(key0) + nt * 8 + 2 * t + e % 2;
        float x = s[nt][e] * scale;
        if (softcap > 0.f) x = soft_cap(x, softcap, inv_softcap);
        if (!unmasked) {
          bool visible = win[ri].contains(j);
          if (visible && p.mask_kind != MaskKind::kNone)
            visible = apply_mask<float>(p, mask_row[ri] + j * p.mask_col_stride, x);
          x = visible ? x : -CUDART_INF_F;
        }
        s[nt][e] = x;
        block_max[ri] = fmaxf(block_max[ri], x);
      }
    float cm[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri)
      alpha[ri] = softmax[ri].rescale(quad_max(block_max[ri]), log2e, cm[ri]);
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int kt = 0; kt < kKTiles; ++kt) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = exp2f(fmaf(s[kt][e], log2e, -cm[e / 2]));
        sum[e / 2] += pr[e];
      }
      split_tf32_fast(__float_as_uint(pr[0]), p_hi[kt][0], p_lo[kt][0]);
      split_tf32_fast(__float_as_uint(pr[2]), p_hi[kt][1], p_lo[kt][1]);
      split_tf32_fast(__float_as_uint(pr[1]), p_hi[kt][2], p_lo[kt][2]);
      split_tf32_fast(__float_as_uint(pr[3]), p_hi[kt][3], p_lo[kt][3]);
    }
    softmax[0].add(sum[0]), softmax[1].add(sum[1]);
  }

  // O / l for this thread's columns d0 + (the n8 tiles of o) of its two rows (row_in_tile, from
  // the tile's first row; rows from rows_q on are not stored), and their lse where write_lse
  // (one thread of each row). All lanes must call it: the row sums are added within the quad.
  template <int kDTiles>
  __device__ __forceinline__ void store(const AttentionParams& p, const TilePointers<float>& gp,
                                        const float (&o)[kDTiles][4], const int (&row_in_tile)[2],
                                        int rows_q, int d0, int t, bool write_lse) const {
    const float log2e = 1.4426950408889634f;
    const int head_dim = static_cast<int>(p.head_dim);
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      float inv_l, lse;
      softmax[ri].finish(log2e, inv_l, lse);
      const int r = row_in_tile[ri];
      if (r >= rows_q) continue;
      float* o_row = gp.out + static_cast<int64_t>(r) * p.out_row_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = d0 + dt * 8 + 2 * t + e;
          if (col < head_dim) o_row[col] = o[dt][2 * ri + e] * inv_l;
        }
      if (write_lse) gp.lse[r] = lse;
    }
  }
};

}  // namespace flashmod::cuda_kernels
