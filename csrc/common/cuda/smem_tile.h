// Shared-memory layout of a (rows x kHeadDim) tile and its global -> shared copy.
//
// Rows are split into 16-byte chunks. ldmatrix reads one chunk column from 8 consecutive rows;
// unswizzled, with rows of 64..512 bytes those 8 chunks sit in the same 4 banks (8-way
// conflict). XOR-ing the chunk index with a few row bits spreads them over all 32 banks, and
// since XOR stays within an aligned group of 4 or 8 chunks, no padding is needed.
#pragma once

#include <cstdint>

#include "ptx_ops.h"

namespace flashmod::cuda_kernels {

// Element offset of (row, chunk) in a tile with kHeadDim columns. Two layouts: rows side by side
// (kColBlockRows = 0), or, for the copy engine (tma_ops.h: its 128-byte swizzle writes whole boxes
// of 64 columns), column blocks of 64 one after the other, each kColBlockRows rows of 128 bytes.
// Both put chunk c of row r at c ^ (r % 8) within its 128-byte group.
template <int kHeadDim, int kColBlockRows = 0>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  constexpr int kChunks = kHeadDim / 8;
  if constexpr (kColBlockRows > 0) {
    static_assert(kChunks % 8 == 0, "whole 64-column blocks");
    return (chunk >> 3) * kColBlockRows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  } else if constexpr (kChunks % 8 == 0) {
    // Row starts are 128-byte aligned: 8 consecutive rows differ in their low 3 bits.
    return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
  } else {
    // kChunks = 4 mod 8: consecutive row pairs alternate between the two 64-byte halves of a
    // 128-byte line, so bits 1..2 of the row pick the permutation within the half.
    return row * kHeadDim + ((chunk ^ ((row >> 1) & 3)) << 3);
  }
}

// Per-lane ldmatrix offsets into a swizzled tile. A lane addresses row lane_row + row_add and
// chunk 2 * pair + lane_bit, where row_add is a multiple of 16 and pair a compile-time loop
// index. The XOR only touches the chunk's position inside its group, so all such offsets are
// one of kGroup/2 lane-dependent values plus a compile-time constant: keeping just those few in
// registers stops the compiler from hoisting one address register per (row_add, pair) out of
// the key loop (that alone cost ~60 registers and spills at D = 128).
template <int kHeadDim, int kColBlockRows = 0>
struct LaneTileOffsets {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kGroup = kChunks % 8 == 0 ? 8 : 4;
  // Elements between rows and between 8-chunk groups (tile_offset's two layouts).
  static constexpr int kRowPitch = kColBlockRows > 0 ? 64 : kHeadDim;
  static constexpr int kGroupPitch = kColBlockRows > 0 ? kColBlockRows * 64 : kGroup * 8;
  int sw[kGroup / 2];

  __device__ __forceinline__ LaneTileOffsets(int lane_row, int lane_bit) {
    const int f = kGroup == 8 ? (lane_row & 7) : ((lane_row >> 1) & 3);
#pragma unroll
    for (int s = 0; s < kGroup / 2; ++s)
      sw[s] = lane_row * kRowPitch + (((2 * s) ^ (lane_bit ^ f)) << 3);
  }
  // Element offset; equals tile_offset<kHeadDim, kColBlockRows>(lane_row + row_add,
  // 2 * pair + lane_bit).
  __device__ __forceinline__ int at(int row_add, int pair) const {
    return row_add * kRowPitch + (2 * pair / kGroup) * kGroupPitch + sw[pair % (kGroup / 2)];
  }
};

// Copies a warp's kRows staged rows (rows row0.. of a D-wide tile_offset tile at shared byte
// address tile) to dst (row r at dst + r * row_stride) as 16-byte chunks, each warp store whole
// rows; rows from valid_rows on and chunks from head_dim on are not written. dst's rows must start
// 16-byte aligned and head_dim be a multiple of 8. All loads first: one shared-memory latency.
template <int D, int kRows, typename Elem>
__device__ __forceinline__ void copy_staged_rows16(uint32_t tile, int row0, Elem* dst,
                                                   int64_t row_stride, int valid_rows, int head_dim,
                                                   int lane) {
  constexpr int kChunks = D / 8, kIters = kRows * kChunks / 32;
  static_assert(kIters * 32 == kRows * kChunks, "whole warp loads");
  uint32_t v[kIters][4];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int id = lane + 32 * i;
    lds_128(v[i], tile + 2 * tile_offset<D>(row0 + id / kChunks, id % kChunks));
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int id = lane + 32 * i, r = id / kChunks, chunk = id % kChunks;
    if (r < valid_rows && chunk * 8 < head_dim) stg_128(dst + r * row_stride + chunk * 8, v[i]);
  }
}

// How one thread copies its share of a (kRows x kHeadDim) tile, worked out once per kernel.
// Each thread keeps a fixed chunk column and walks rows with a constant step, so the per-tile
// work is one predicate and one cp.async per chunk: computing (row, chunk) per copy and per key
// block made the compiler hoist dozens of 64-bit addresses out of the key loop (spills). Rows are
// padded to a power-of-two number of lanes; lanes past the last chunk idle.
template <int kRows, int kHeadDim, int kThreads, bool kColBlocks = false>
struct TileCopyPlan {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowStep = kThreads / kLanesPerRow;
  static constexpr int kIters = kRows / kRowStep;
  // The swizzle repeats every 8 rows, so smem offsets repeat every kPeriod iterations.
  static constexpr int kPeriod = kRowStep % 8 == 0 ? 1 : 8 / kRowStep;
  static_assert(kThreads % kLanesPerRow == 0 && kRows % kRowStep == 0, "even split");
  static_assert(kIters % kPeriod == 0, "whole swizzle periods");
  // Bytes between the chunks of consecutive copy steps, past the swizzle (chunk_offset).
  // (Column blocks: each thread's chunk stays in one block, whose rows are 128 bytes.)
  static constexpr int kRowPitch = kColBlocks ? 64 : kHeadDim;
  static constexpr uint32_t kStepBytes = 2 * kRowStep * kRowPitch;
  static constexpr int kColBlockRows = kColBlocks ? kRows : 0;

  int row0;                // first row this thread copies
  int col;                 // first element of its chunk
  int src_bytes;           // bytes of a valid row's chunk inside head_dim (0..16)
  bool active;             // lanes past the last chunk copy nothing
  uint32_t soff[kPeriod];  // byte offsets in the tile for iterations 0..kPeriod-1

  __device__ __forceinline__ TileCopyPlan(int tid, int head_dim) {
    const int chunk = tid % kLanesPerRow;
    row0 = tid / kLanesPerRow;
    col = chunk * 8;
    active = chunk < kChunks;
    src_bytes = 2 * max(0, min(8, head_dim - col));
#pragma unroll
    for (int it = 0; it < kPeriod; ++it)
      soff[it] = active ? 2 * (tile_offset<kHeadDim, kColBlockRows>(row0 + it * kRowStep, chunk) -
                               it * kRowStep * kRowPitch)
                        : 0;
  }

  // Byte offset in the tile of the chunk that copy iteration `it` (0..kIters-1) writes.
  __device__ __forceinline__ uint32_t chunk_offset(int it) const {
    return soff[it % kPeriod] + it * kStepBytes;
  }

  // Copies rows [0, valid_rows) x columns [0, head_dim) of the global tile at gmem into the smem
  // tile at smem_base; everything else of the tile is zero-filled. The caller commits the group.
  // Needs 16-byte aligned row starts (the host launcher guarantees it).
  template <typename Elem>
  __device__ __forceinline__ void load(uint32_t smem_base, const Elem* gmem, int64_t row_stride,
                                       int valid_rows) const {
    if (!active) return;
    const Elem* src = gmem + row0 * row_stride + col;
    const int64_t step = kRowStep * row_stride;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool valid = row0 + it * kRowStep < valid_rows;
      cp_async_16(smem_base + chunk_offset(it), valid && src_bytes > 0 ? src : gmem,
                  valid ? src_bytes : 0);
      src += step;
    }
  }

  // load with two sources: rows [0, split_row) from gmem, rows [split_row, valid_rows) from
  // tail, whose row r (the tile's row numbering) is at tail + r * tail_stride. The fused KV-cache
  // append's tiles end in the new keys. A select per row rather than a second copy loop: the
  // decode kernel's code has to fit the instruction cache (paged_kv.h: append_new_rows).
  template <typename Elem>
  __device__ __forceinline__ void load_two_sources(uint32_t smem_base, const Elem* gmem,
                                                   int64_t row_stride, const Elem* tail,
                                                   int64_t tail_stride, int split_row,
                                                   int valid_rows) const {
    if (!active) return;
    const Elem* src = gmem + row0 * row_stride + col;
    const Elem* tail_src = tail + row0 * tail_stride + col;
    const int64_t step = kRowStep * row_stride, tail_step = kRowStep * tail_stride;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int row = row0 + it * kRowStep;
      const bool valid = row < valid_rows && src_bytes > 0;
      const Elem* from = row < split_row ? src : tail_src;
      cp_async_16(smem_base + chunk_offset(it), valid ? from : gmem, valid ? src_bytes : 0);
      src += step;
      tail_src += tail_step;
    }
  }
};

}  // namespace flashmod::cuda_kernels
