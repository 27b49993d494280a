// K/V tile loads through a block table (paged KV caches): the TileCopyPlan copy with each key
// row's address resolved through its page (sequence_view.h: kv_row_offset).
#pragma once

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../sequence_view.h"

namespace flashmod::cuda_kernels {

// How a kernel finds K/V rows: kDense (params as they are), kSequences (per-sequence extents,
// contiguous K/V: varlen, cache lengths), kBlockPages (pages holding whole key blocks: one
// block-table lookup per block) or kRowPages (pages smaller than or misaligned with a key block:
// one lookup per row). Separate kernel variants because each step costs registers: bf16,
// D = 128 prefill on sm_80 spills 4 / 44 / 160 / 288 bytes (stores) in that order.
enum KvAddressing : int { kDense = 0, kSequences = 1, kBlockPages = 2, kRowPages = 3 };

inline KvAddressing kv_addressing(const AttentionParams& p, int key_block) {
  if (!has_sequence_extents(p)) return kDense;
  if (p.block_table == nullptr) return kSequences;
  return p.page_size % key_block == 0 ? kBlockPages : kRowPages;
}

// Copies key rows [first_key, first_key + valid_rows) of one kv head (base: the pool, or the
// sequence's K/V, plus the head's offset) into the smem tile at smem_base, zero-filling the rest,
// like Plan::load (kDense callers use Plan::load itself). kBlockPages: first_key starts a key
// block, which lies in one page.
template <KvAddressing kAddr, class Plan, typename Elem>
__device__ __forceinline__ void load_kv_block(const Plan& plan, uint32_t smem_base,
                                              const Elem* base, const AttentionParams& s,
                                              int64_t first_key, int64_t page_stride,
                                              int64_t row_stride, int valid_rows) {
  if constexpr (kAddr == kSequences) {
    plan.load(smem_base, base + first_key * row_stride, row_stride, valid_rows);
  } else if constexpr (kAddr == kBlockPages) {
    plan.load(smem_base, base + kv_row_offset(s, first_key, page_stride, row_stride), row_stride,
              valid_rows);
  } else {
    if (!plan.active) return;
#pragma unroll
    for (int it = 0; it < Plan::kIters; ++it) {
      const int row = plan.row0 + it * Plan::kRowStep;
      const bool valid = row < valid_rows;
      const Elem* src =
          valid && plan.src_bytes > 0
              ? base + kv_row_offset(s, first_key + row, page_stride, row_stride) + plan.col
              : base;
      cp_async_16(smem_base + plan.chunk_offset(it), src, valid ? plan.src_bytes : 0);
    }
  }
}

}  // namespace flashmod::cuda_kernels
