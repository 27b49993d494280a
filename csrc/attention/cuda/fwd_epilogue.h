// The last steps of the fp16/bf16 forward kernels (sm80 and sm90): the output of a tile whose rows
// see no key, and the normalize-stage-store of O.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../attention_params.h"
#include "entry_points.h"
#include "online_softmax.h"

namespace flashmod::cuda_kernels {

// No key is visible to any of the tile's rows_q rows: out = 0, lse = -inf.
template <int kThreads, typename Elem>
__device__ __forceinline__ void write_rows_without_keys(const AttentionParams& p, Elem* gO,
                                                        float* gLse, int rows_q, int tid) {
  const int head_dim = static_cast<int>(p.head_dim);
  for (int idx = tid; idx < rows_q * head_dim; idx += kThreads)
    gO[static_cast<int64_t>(idx / head_dim) * p.out_row_stride + idx % head_dim] =
        from_float<Elem>(0.f);
  for (int r = tid; r < rows_q; r += kThreads) gLse[r] = -CUDART_INF_F;
}

// A warp's kRowsPerWarp rows from warp_row0 on (MT m16 tiles of the mma accumulator layout):
// normalizes O by 1/l, stages it as Elem in the same rows of sO (a D-wide tile_offset layout that
// no other warp reads; the caller makes sure no lane still reads them), writes lse, then copies
// the rows out in 16-byte chunks so global stores are full sectors (flags.out_vec16), else
// element by element.
template <int D, int kRowsPerWarp, int MT, int DT, typename Elem>
__device__ __forceinline__ void store_out_rows(OnlineSoftmax<MT>& softmax, float (&O)[MT][DT][4],
                                               float c, Elem* sO, const AttentionParams& p,
                                               const FwdLaunchFlags& flags, Elem* gO, float* gLse,
                                               int warp_row0, int rows_q, int lane) {
  using Mma = Mma16816<Elem>;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float inv_l, lse;
      softmax.finish(mi, hh, c, inv_l, lse);
      const int row = warp_row0 + mi * 16 + g + 8 * hh;
#pragma unroll
      for (int di = 0; di < DT; ++di) {
        const uint32_t v = Mma::pack(O[mi][di][2 * hh] * inv_l, O[mi][di][2 * hh + 1] * inv_l);
        *reinterpret_cast<uint32_t*>(sO + tile_offset<D>(row, di) + 2 * t) = v;
      }
      if (t == 0 && row < rows_q) gLse[row] = lse;
    }
  // The copy-out below reads chunks other lanes of this warp wrote.
  __syncwarp();
  const int head_dim = static_cast<int>(p.head_dim);
  constexpr int kChunks = D / 8;
  for (int id = lane; id < kRowsPerWarp * kChunks; id += 32) {
    const int row = warp_row0 + id / kChunks, chunk = id % kChunks;
    if (row >= rows_q || chunk * 8 >= head_dim) continue;
    const Elem* src = sO + tile_offset<D>(row, chunk);
    Elem* dst = gO + static_cast<int64_t>(row) * p.out_row_stride + chunk * 8;
    if (flags.out_vec16) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && chunk * 8 + e < head_dim; ++e) dst[e] = src[e];
    }
  }
}

// store_out_rows without a staging area, for a warp's single m16 tile (rows warp_row0 + g and
// + 8): each lane writes its accumulator pairs to gO itself, 4-byte stores of which a quad's fill
// 16 contiguous bytes of a row (flags.out_vec16: rows 16-byte aligned and head_dim % 8 == 0;
// otherwise element by element). lse as store_out_rows writes it.
template <int DT, typename Elem>
__device__ __forceinline__ void store_out_rows_from_registers(
    OnlineSoftmax<1>& softmax, float (&O)[1][DT][4], float c, const AttentionParams& p,
    const FwdLaunchFlags& flags, Elem* gO, float* gLse, int warp_row0, int rows_q, int lane) {
  using Mma = Mma16816<Elem>;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(p.head_dim);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float inv_l, lse;
    softmax.finish(0, hh, c, inv_l, lse);  // all lanes: it shuffles within the quad
    const int row = warp_row0 + g + 8 * hh;
    if (row >= rows_q) continue;
    if (t == 0) gLse[row] = lse;
    Elem* dst = gO + static_cast<int64_t>(row) * p.out_row_stride + 2 * t;
#pragma unroll
    for (int di = 0; di < DT; ++di) {
      const int col = di * 8 + 2 * t;
      const uint32_t v = Mma::pack(O[0][di][2 * hh] * inv_l, O[0][di][2 * hh + 1] * inv_l);
      if (flags.out_vec16) {
        if (col < head_dim) *reinterpret_cast<uint32_t*>(dst + di * 8) = v;
      } else {
        const Elem* pair = reinterpret_cast<const Elem*>(&v);
        if (col < head_dim) dst[di * 8] = pair[0];
        if (col + 1 < head_dim) dst[di * 8 + 1] = pair[1];
      }
    }
  }
}

}  // namespace flashmod::cuda_kernels
