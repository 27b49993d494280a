// The visibility rule of attention_params.h, split into what a kernel needs at three grains:
//   * per CTA: which key blocks can hold a visible key at all (the rest are never loaded);
//   * per key block: whether every (query, key) pair in it is visible, so it can skip masking;
//   * per query row: the inclusive range of visible key columns, plus the optional mask tensor.
// Shared by the tensor-core and the fp32 kernels.
#pragma once

#include <cstdint>

#include "../../common/additive_mask.h"
#include "../../common/cuda/ptx_ops.h"
#include "../attention_params.h"

namespace flashmod::cuda_kernels {

__host__ __device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Whether p's mask is a bool key-padding mask: one bit per (batch, key), broadcast over heads and
// queries ((B, 1, 1, Nk) or (1, 1, 1, Nk) seen through strides).
__host__ __device__ inline bool key_padding_mask(const AttentionParams& p) {
  return p.mask_kind == MaskKind::kBool && p.mask_head_stride == 0 && p.mask_row_stride == 0;
}

struct KeyBlockRange {
  int lo, hi;  // key blocks [lo, hi); empty when lo >= hi
};

// Key blocks of width Bc that rows [row_first, row_last] (both < seqlen_q) may see.
__device__ __forceinline__ KeyBlockRange key_block_range(const AttentionParams& p,
                                                         int64_t row_first, int64_t row_last,
                                                         int Bc) {
  int64_t lo = 0, hi = (p.seqlen_k + Bc - 1) / Bc;
  if (p.window_left >= 0) {
    const int64_t first_key = row_first + p.diag_offset - p.window_left;
    lo = first_key > 0 ? first_key / Bc : 0;
  }
  if (p.window_right >= 0) {
    const int64_t last_key = row_last + p.diag_offset + p.window_right;
    hi = last_key < 0 ? 0 : (last_key / Bc + 1 < hi ? last_key / Bc + 1 : hi);
  }
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

// True when every key of block n is in range and inside the window of every row in
// [row_first, row_last]; such blocks need no per-element checks (unless a mask tensor exists).
__device__ __forceinline__ bool key_block_unmasked(const AttentionParams& p, int64_t row_first,
                                                   int64_t row_last, int n, int Bc) {
  const int64_t k0 = static_cast<int64_t>(n) * Bc, k1 = k0 + Bc - 1;
  if (k1 >= p.seqlen_k) return false;
  if (p.window_left >= 0 && k0 < row_last + p.diag_offset - p.window_left) return false;
  if (p.window_right >= 0 && k1 > row_first + p.diag_offset + p.window_right) return false;
  return true;
}

// Visible key columns [lo, hi] of query row i from the window rule and seqlen_k (lo > hi when
// none). Clamped to int range so the per-element tests are 32-bit compares.
struct RowWindow {
  int lo, hi;
  __device__ __forceinline__ bool contains(int j) const { return j >= lo && j <= hi; }
};

__device__ __forceinline__ RowWindow row_window(const AttentionParams& p, int64_t i) {
  int64_t lo = 0, hi = p.seqlen_k - 1;
  if (p.window_left >= 0) {
    const int64_t w = i + p.diag_offset - p.window_left;
    lo = w > lo ? w : lo;
  }
  if (p.window_right >= 0) {
    const int64_t w = i + p.diag_offset + p.window_right;
    hi = w < hi ? w : hi;
  }
  if (lo > p.seqlen_k) lo = p.seqlen_k;
  if (hi < -1) hi = -1;
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

// Reads the mask tensor at element offset off: applies it to the score x (already scaled and
// soft-capped) and returns false when the entry hides the key (a bool False, or an additive value
// at or below kHidingMaskValue: additive_mask.h).
template <typename Elem>
__device__ __forceinline__ bool apply_mask(const AttentionParams& p, int64_t off, float& x) {
  float value;
  switch (p.mask_kind) {
    case MaskKind::kBool: return static_cast<const uint8_t*>(p.mask)[off] != 0;
    case MaskKind::kAdditive: value = to_float(static_cast<const Elem*>(p.mask)[off]); break;
    case MaskKind::kAdditiveF32: value = static_cast<const float*>(p.mask)[off]; break;
    default: return true;
  }
  x += value;
  return !mask_value_hides(value);
}

// softcap * tanh(x / softcap) with x / softcap = x * inv_softcap. tanh through exp2 keeps
// fp32 accuracy under --use_fast_math (which has no accurate tanhf) and saturates to +-1
// cleanly: exp2 -> inf gives 1, exp2 -> 0 gives -1.
__device__ __forceinline__ float soft_cap(float x, float softcap, float inv_softcap) {
  const float e = exp2f(2.8853900817779268f * x * inv_softcap);  // exp(2 x / softcap)
  return softcap * (1.0f - 2.0f / (e + 1.0f));
}

}  // namespace flashmod::cuda_kernels
