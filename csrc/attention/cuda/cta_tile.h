// Which tile a CTA owns and where that tile lives in global memory. Shared by the tensor-core
// kernel (fwd_sm80_kernel.h) and the fp32 kernel (fwd_fp32_ffma.cu).
//
// The grid is flat: blockIdx.x = ((b * heads_q + h) * splits + split) * num_m_blocks + m_block.
// Query blocks vary fastest so neighbouring CTAs share K/V in L2; the split index (split-KV,
// only > 0 in the decode kernel) comes next so the splits of one head run side by side.
#pragma once

#include <cstdint>

#include "../attention_params.h"

namespace flashmod::cuda_kernels {

// CTAs of that grid: one per (query block of br rows, split, head, batch). Host and device.
__host__ __device__ inline int64_t cta_count(const AttentionParams& p, int br, int splits = 1) {
  return (p.seqlen_q + br - 1) / br * splits * p.heads_q * p.batch;
}

struct CtaTile {
  int m_block;  // query block (already reversed for right-bounded windows, see below)
  int split;    // key range part, 0 .. splits-1
  int64_t b, h, hk;
};

// The tile of flat index `index` in that order (blockIdx.x for one CTA per tile; persistent
// kernels walk several). Index is the type of the divisions: the warp-specialized kernel passes
// 32-bit indices, since its producer warp has 24 registers and 64-bit divisions spilled there.
template <typename Index = int64_t>
__device__ __forceinline__ CtaTile cta_tile_at(const AttentionParams& p, Index index,
                                               Index num_m_blocks, Index splits) {
  CtaTile t;
  Index bid = index;
  t.m_block = static_cast<int>(bid % num_m_blocks);
  bid /= num_m_blocks;
  t.split = static_cast<int>(bid % splits);
  bid /= splits;
  const Index heads_q = static_cast<Index>(p.heads_q);
  const Index h = bid % heads_q;
  t.h = h;
  t.b = bid / heads_q;
  // With a right window bound (causal) the last query blocks see the most keys: start them
  // first to shorten the tail.
  if (p.window_right >= 0) t.m_block = static_cast<int>(num_m_blocks) - 1 - t.m_block;
  t.hk = h / (heads_q / static_cast<Index>(p.heads_kv));
  return t;
}

__device__ __forceinline__ CtaTile cta_tile(const AttentionParams& p, int num_m_blocks,
                                            int splits) {
  return cta_tile_at<int64_t>(p, blockIdx.x, num_m_blocks, splits);
}

// Global pointers of the tile: its q/out/lse rows from row r0 on and its kv head's k/v.
template <typename Elem>
struct TilePointers {
  const Elem* q;
  const Elem* k;
  const Elem* v;
  Elem* out;
  float* lse;
  int64_t row_id;  // flat (B, Hq, Nq) index of row r0: split-KV's partial row
};

template <typename Elem>
__device__ __forceinline__ TilePointers<Elem> tile_pointers(const AttentionParams& p,
                                                            const CtaTile& t, int r0) {
  TilePointers<Elem> g;
  g.q = static_cast<const Elem*>(p.q) + t.b * p.q_batch_stride + t.h * p.q_head_stride +
        static_cast<int64_t>(r0) * p.q_row_stride;
  g.k = static_cast<const Elem*>(p.k) + t.b * p.k_batch_stride + t.hk * p.k_head_stride;
  g.v = static_cast<const Elem*>(p.v) + t.b * p.v_batch_stride + t.hk * p.v_head_stride;
  g.out = static_cast<Elem*>(p.out) + t.b * p.out_batch_stride + t.h * p.out_head_stride +
          static_cast<int64_t>(r0) * p.out_row_stride;
  g.row_id = (t.b * p.heads_q + t.h) * p.seqlen_q + r0;
  g.lse = p.lse + t.b * p.lse_batch_stride + t.h * p.lse_head_stride + r0;
  return g;
}

}  // namespace flashmod::cuda_kernels
