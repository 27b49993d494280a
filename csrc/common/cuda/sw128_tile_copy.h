// The global -> shared copy of a (rows x head dim) tile into the 128-byte-swizzled layout that
// wgmma reads (wgmma_ops.h), with cp.async. Shared by the Hopper forward and backward kernels.
#pragma once

#include <cstdint>

#include "ptx_ops.h"
#include "wgmma_ops.h"

namespace flashmod::cuda_kernels::sm90 {

// How one thread copies its share of a (kRows x kHeadDim) tile into the 128-byte-swizzled
// layout: a fixed 16-byte chunk column and a constant row step. The swizzle repeats every 8 rows,
// so the shared offsets repeat every kPeriod steps (1 when the step is a multiple of 8; 2 for the
// step of 4 that 128 threads take through 256-column rows): kPeriod bases plus a constant per step.
template <int kRows, int kHeadDim, int kThreads, bool kWholeRows = kThreads % (kHeadDim / 8) == 0>
struct Sw128TileCopy {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kIters = kRows / kRowStep;
  static constexpr int kPeriod = kRowStep % 8 == 0 ? 1 : 8 / kRowStep;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "even split");
  static_assert(8 % kRowStep == 0 || kRowStep % 8 == 0, "the swizzle period divides the steps");
  static_assert(kIters % kPeriod == 0, "whole swizzle periods");
  // Bytes between the chunks of consecutive copy steps, past the swizzle (chunk_offset).
  static constexpr uint32_t kStepBytes = kRowStep * 128;

  // Every thread takes part (paged_kv.h's per-row loads ask).
  static constexpr bool active = true;
  int row0, col, src_bytes;
  uint32_t soff[kPeriod];

  __device__ __forceinline__ Sw128TileCopy(int tid, int head_dim) {
    const int chunk = tid % kChunks;
    row0 = tid / kChunks;
    col = chunk * 8;
    src_bytes = 2 * max(0, min(8, head_dim - col));
#pragma unroll
    for (int it = 0; it < kPeriod; ++it)
      soff[it] = sw128_offset<kRows>(row0 + it * kRowStep, chunk) - it * kRowStep * 128;
  }

  // Shared-memory offset (from the tile's base) of this thread's chunk in copy step it.
  __device__ __forceinline__ uint32_t chunk_offset(int it) const {
    return soff[it % kPeriod] + it * kStepBytes;
  }

  // Rows [0, valid_rows) x columns [0, head_dim) from gmem; the rest of the tile is zero-filled
  // (zero keys/values past seqlen_k keep NaN-free products; their scores are masked anyway).
  template <typename Elem>
  __device__ __forceinline__ void load(uint32_t smem_base, const Elem* gmem, int64_t row_stride,
                                       int valid_rows) const {
    const Elem* src = gmem + row0 * row_stride + col;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool valid = row0 + it * kRowStep < valid_rows && src_bytes > 0;
      cp_async_16(smem_base + chunk_offset(it), valid ? src : gmem, valid ? src_bytes : 0);
      src += kRowStep * row_stride;
    }
  }
};

// Where the threads do not split a row's chunks evenly (D = 192: 24 chunks, 128 or 256 threads),
// the copy goes by 64-column block instead: each thread keeps one chunk of a block (tid % 8) and
// walks the rows by kThreads / 8 (a multiple of the swizzle's 8 rows, so one shared offset per
// thread plus constants), block after block.
template <int kRows, int kHeadDim, int kThreads>
struct Sw128TileCopy<kRows, kHeadDim, kThreads, false> {
  static constexpr int kBlocks = kHeadDim / 64;
  static constexpr int kRowStep = kThreads / 8;
  static constexpr int kIters = kRows / kRowStep;  // per column block
  static_assert(kHeadDim % 64 == 0 && kThreads % 64 == 0 && kRows % kRowStep == 0,
                "whole column blocks, row steps of whole swizzle atoms");
  int row0, chunk, head_dim;
  uint32_t soff;

  __device__ __forceinline__ Sw128TileCopy(int tid, int head_dim_)
      : row0(tid / 8),
        chunk(tid % 8),
        head_dim(head_dim_),
        soff(sw128_offset<kRows>(row0, chunk)) {}

  template <typename Elem>
  __device__ __forceinline__ void load(uint32_t smem_base, const Elem* gmem, int64_t row_stride,
                                       int valid_rows) const {
#pragma unroll
    for (int cb = 0; cb < kBlocks; ++cb) {
      const int col = cb * 64 + chunk * 8;
      const int src_bytes = 2 * max(0, min(8, head_dim - col));
      const Elem* src = gmem + row0 * row_stride + col;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const bool valid = row0 + it * kRowStep < valid_rows && src_bytes > 0;
        cp_async_16(smem_base + soff + cb * kRows * 128 + it * kRowStep * 128, valid ? src : gmem,
                    valid ? src_bytes : 0);
        src += kRowStep * row_stride;
      }
    }
  }
};

// The threads of the whole-rows copy where kThreads do not split a row's 16-byte chunks evenly:
// the most that do with a row step the swizzle's 8-row period takes (8, 4, 2 or 1 rows a step).
template <int kRows, int kHeadDim, int kThreads>
constexpr int sw128_copy_threads() {
  constexpr int kChunks = kHeadDim / 8;
  for (int step = 8; step > 1; step /= 2)
    if (step * kChunks <= kThreads && kRows % step == 0) return step * kChunks;
  return kChunks;
}

// The whole-rows copy on the first sw128_copy_threads() of kThreads threads, the others idle
// (D = 192 on 256 threads: 192 copy, 8 rows a step). Unlike the column-block copy above, each
// thread keeps one row per step and one chunk column, which paged_kv.h's per-row page walks need
// (they skip the idle threads through `active`).
template <int kRows, int kHeadDim, int kThreads>
struct Sw128TileCopyOnSome
    : Sw128TileCopy<kRows, kHeadDim, sw128_copy_threads<kRows, kHeadDim, kThreads>(), true> {
  static constexpr int kCopyThreads = sw128_copy_threads<kRows, kHeadDim, kThreads>();
  using Base = Sw128TileCopy<kRows, kHeadDim, kCopyThreads, true>;
  bool active;

  // An idle thread's plan is a copying thread's (never used: every load checks `active`).
  __device__ __forceinline__ Sw128TileCopyOnSome(int tid, int head_dim)
      : Base(tid % kCopyThreads, head_dim), active(tid < kCopyThreads) {}

  template <typename Elem>
  __device__ __forceinline__ void load(uint32_t smem_base, const Elem* gmem, int64_t row_stride,
                                       int valid_rows) const {
    if (active) Base::load(smem_base, gmem, row_stride, valid_rows);
  }
};

}  // namespace flashmod::cuda_kernels::sm90
