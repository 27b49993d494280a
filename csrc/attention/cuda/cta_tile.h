// Which tile a CTA owns and where that tile lives in global memory. Shared by the tensor-core
// kernel (fwd_sm80_kernel.h) and the fp32 kernel (fwd_fp32_ffma.cu).
//
// CTAs are numbered ((b * heads_q + h) * splits + split) * num_m_blocks + m_block. Query blocks
// vary fastest so neighbouring CTAs share K/V in L2; the split index (split-KV, only > 0 in the
// decode kernel) comes next so the splits of one head run side by side. The grid is flat
// (blockIdx.x is that number) or, for the decode kernel, cta_grid's (splits x num_m_blocks,
// heads_q, batch), which the hardware numbers in the same order and whose CTAs read h and b off
// blockIdx.
#pragma once

#include <cuda_runtime.h>

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

// The decode kernel's grid: (splits x num_m_blocks, heads_q, batch) where heads and batch rows fit
// gridDim.y / .z, else (or with `flat`: FLASHMOD_FLAT_GRID=1, for measurements) flat. A CTA of
// the flat grid finds its head and batch row through a chain of 64-bit divisions: in the decode
// kernel, with the query positions' 64-bit remainders, they held its first copies back by 0.3 us
// (1.70 -> 1.40 us after its start; the step 0.3-0.4 us shorter at 4k and 16k tokens; H100, B 8,
// 32 / 8 heads, D 128, tools/decode_timeline.cu; design log cuda-serving.md, session 34). The
// caller checks the CTA count against cuda::kMaxGridBlocks first. Host code.
inline dim3 cta_grid(const AttentionParams& p, int br, int splits, bool flat) {
  constexpr int64_t kMaxGridYZ = 65535;
  if (!flat && p.heads_q <= kMaxGridYZ && p.batch <= kMaxGridYZ)
    return dim3(static_cast<unsigned>((p.seqlen_q + br - 1) / br * splits),
                static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  return dim3(static_cast<unsigned>(cta_count(p, br, splits)));
}

__device__ __forceinline__ CtaTile cta_tile(const AttentionParams& p, int num_m_blocks,
                                            int splits) {
  return cta_tile_at<int64_t>(p, blockIdx.x, num_m_blocks, splits);
}

// The tile of a CTA of cta_grid's grid, in either of its shapes (the decode kernel's; the other
// kernels keep cta_tile's flat grid, whose register allocation the extra branch moved: the
// portable prefill kernel's paged variant spilled 146 bytes instead of 90).
__device__ __forceinline__ CtaTile cta_tile_of_grid(const AttentionParams& p, int num_m_blocks,
                                                    int splits) {
  if (gridDim.y != p.heads_q || gridDim.z != p.batch) return cta_tile(p, num_m_blocks, splits);
  // Unsigned 32-bit divisions, skipped where they divide by 1 (one query block; GQA-packed rows,
  // where heads_q is the kv heads' count): each is ~20 dependent instructions ahead of the first
  // copies.
  CtaTile t;
  const unsigned x = blockIdx.x, y = blockIdx.y, blocks = static_cast<unsigned>(num_m_blocks);
  t.m_block = blocks == 1 ? 0 : static_cast<int>(x % blocks);
  t.split = blocks == 1 ? static_cast<int>(x) : static_cast<int>(x / blocks);
  t.h = y;
  t.b = blockIdx.z;
  if (p.window_right >= 0) t.m_block = num_m_blocks - 1 - t.m_block;
  const unsigned heads_q = static_cast<unsigned>(p.heads_q);
  const unsigned heads_kv = static_cast<unsigned>(p.heads_kv);
  t.hk = heads_q == heads_kv ? y : y / (heads_q / heads_kv);
  return t;
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
