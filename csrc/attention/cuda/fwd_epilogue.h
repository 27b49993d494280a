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

// Copies kRows staged rows (rows stage_row0.. of sO, a D-wide tile_offset layout; stage_row0 a
// multiple of 8, so each row keeps its swizzle) out to rows row0.. of gO in 16-byte chunks, so
// global stores are full sectors (flags.out_vec16), else element by element. Rows from rows_q on
// are not stored.
template <int D, int kRows, typename Elem>
__device__ __forceinline__ void copy_out_staged_rows(const Elem* sO, int stage_row0,
                                                     const AttentionParams& p,
                                                     const FwdLaunchFlags& flags, Elem* gO,
                                                     int row0, int rows_q, int lane) {
  const int head_dim = static_cast<int>(p.head_dim);
  constexpr int kChunks = D / 8;
  for (int id = lane; id < kRows * kChunks; id += 32) {
    const int r = id / kChunks, chunk = id % kChunks;
    if (row0 + r >= rows_q || chunk * 8 >= head_dim) continue;
    const Elem* src = sO + tile_offset<D>(stage_row0 + r, chunk);
    Elem* dst = gO + static_cast<int64_t>(row0 + r) * p.out_row_stride + chunk * 8;
    if (flags.out_vec16) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && chunk * 8 + e < head_dim; ++e) dst[e] = src[e];
    }
  }
}

// A warp's kRowsPerWarp rows from warp_row0 on (MT m16 tiles of the mma accumulator layout):
// normalizes O by 1/l, stages it as Elem in the same rows of sO (a D-wide tile_offset layout that
// no other warp reads; the caller makes sure no lane still reads them), writes lse, then copies
// the rows out (copy_out_staged_rows).
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
  // The copy-out reads chunks other lanes of this warp wrote.
  __syncwarp();
  copy_out_staged_rows<D, kRowsPerWarp>(sO, warp_row0, p, flags, gO, warp_row0, rows_q, lane);
}

// store_out_rows for a warp's single m16 tile through a staging area of only 8 rows (at shared
// address sO8: 8 x D, this warp's alone), for kernels whose shared memory has no room for the
// whole tile (D = 256 on the warp-specialized kernel: 4 KB a warp, 32 KB for 8 consumer warps):
// rows g, then rows g + 8, each half normalized, staged and copied out in 16-byte chunks. Before
// it, each lane stored its accumulator pairs itself: 64 four-byte stores a thread, each warp
// store touching 8 rows' lines with half-filled sectors; now 16 full 512-byte rows a warp.
// The caller should derive sO8 from values it keeps live anyway (the warp-specialized kernel:
// from warp_row0): a per-warp offset of its own, live across the main loop, spilled 16-96 bytes.
template <int D, typename Elem>
__device__ __forceinline__ void store_out_rows_by_halves(OnlineSoftmax<1>& softmax,
                                                         float (&O)[1][D / 8][4], float c,
                                                         uint32_t sO8, const AttentionParams& p,
                                                         const FwdLaunchFlags& flags, Elem* gO,
                                                         float* gLse, int warp_row0, int rows_q,
                                                         int lane) {
  using Mma = Mma16816<Elem>;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(p.head_dim);
  static_assert(D / 8 <= 32, "a lane per 16-byte chunk of a row");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float inv_l, lse;
    softmax.finish(0, hh, c, inv_l, lse);  // all lanes: it shuffles within the quad
#pragma unroll
    for (int di = 0; di < D / 8; ++di)
      sts_32(sO8 + 2 * (tile_offset<D>(g, di) + 2 * t),
             Mma::pack(O[0][di][2 * hh] * inv_l, O[0][di][2 * hh + 1] * inv_l));
    const int row0 = warp_row0 + 8 * hh;
    if (t == 0 && row0 + g < rows_q) gLse[row0 + g] = lse;
    // The copy-out reads chunks other lanes of this warp staged.
    __syncwarp();
    // Lane l copies chunk l of each row (a whole 512-byte row per warp store). All eight loads
    // first: one shared-memory latency for the half instead of one per row.
    const int rows = min(8, rows_q - row0);
    if (lane * 8 < head_dim) {
      uint32_t v[8][4];
#pragma unroll
      for (int r = 0; r < 8; ++r) lds_128(v[r], sO8 + 2 * tile_offset<D>(r, lane));
      Elem* dst = gO + static_cast<int64_t>(row0) * p.out_row_stride + lane * 8;
#pragma unroll
      for (int r = 0; r < 8; ++r, dst += p.out_row_stride) {
        if (r >= rows) break;
        if (flags.out_vec16) {
          stg_128(dst, v[r]);
        } else {
          const Elem* e8 = reinterpret_cast<const Elem*>(v[r]);
          for (int e = 0; e < 8 && lane * 8 + e < head_dim; ++e) dst[e] = e8[e];
        }
      }
    }
    // The next half overwrites the rows this copy-out read.
    __syncwarp();
  }
}

}  // namespace flashmod::cuda_kernels
