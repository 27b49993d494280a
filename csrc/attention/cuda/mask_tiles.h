// Which tiles of a mask tensor matter. A pre-pass reads the mask once and classifies every
// (query block, key block) tile at the attention kernel's Br x Bc: hidden (every entry hides its
// key: bool false, additive at or below kHidingMaskValue), clear (every entry shows its key and
// adds nothing: bool true, additive 0) or mixed. The kernel then narrows its key range to the
// first and last tile that is not hidden, and reads the mask only in mixed tiles. transformers
// hands an attention function causal and padding as one (B, 1, Nq, Nk) mask: the causal half is
// hidden tiles, most of the rest clear, and only the diagonal and the padding edge are mixed;
// without the pre-pass every tile of it was computed and masked element by element (H100, bf16,
// D 128, N 1k: 83 TFLOP/s against CUDNN's 147).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/additive_mask.h"
#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "entry_points.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// kTileShownAdded: a mixed tile none of whose entries hides its key (an additive mask's finite
// values above kHidingMaskValue: a dense bias), where a kernel may add the values without testing
// each for hiding. Kernels that do not tell it apart take it as mixed (tile_needs_mask, and the
// backward's class of merged tiles).
enum MaskTileClass : uint8_t {
  kTileHidden = 0,
  kTileClear = 1,
  kTileMixed = 2,
  kTileShownAdded = 3
};

// The classes of query block m_block's tiles, or nullptr where the call has none at this kernel's
// tile shape (every tile is then mixed).
__device__ __forceinline__ const uint8_t* mask_tile_row(const AttentionParams& p, int64_t b,
                                                        int64_t h, int m_block, int Br, int Bc) {
  if (p.mask_tiles == nullptr || p.mask_tiles_br != Br || p.mask_tiles_bc != Bc) return nullptr;
  return p.mask_tiles + b * p.mask_tiles_batch_stride + h * p.mask_tiles_head_stride +
         static_cast<int64_t>(m_block) * p.mask_tiles_k_blocks;
}

// Drops the hidden tiles at both ends of range (they would add exp(-inf) = 0 to every row).
__device__ __forceinline__ void skip_hidden_tiles(const uint8_t* classes, KeyBlockRange& range) {
  if (classes == nullptr) return;
  while (range.lo < range.hi && classes[range.lo] == kTileHidden) ++range.lo;
  while (range.hi > range.lo && classes[range.hi - 1] == kTileHidden) --range.hi;
}

// Whether key block n needs the mask applied.
__device__ __forceinline__ bool tile_needs_mask(const uint8_t* classes, int n) {
  return classes == nullptr || classes[n] != kTileClear;
}

// Whether key block n's entries all show their key (kTileShownAdded; false where unclassified).
__device__ __forceinline__ bool tile_hides_no_key(const uint8_t* classes, int n) {
  return classes != nullptr && classes[n] == kTileShownAdded;
}

// One CTA per tile (grid.x = tiles, flattened (mask batch, mask head, m, n)); entries of rows past
// seqlen_q and keys past seqlen_k do not count (the kernels never show them).
template <typename Stored, bool kBool>
__global__ void __launch_bounds__(256)
    attention_fwd_mask_tiles_kernel(const AttentionParams p, uint8_t* classes, int Br, int Bc,
                                    int64_t q_blocks, int64_t k_blocks, int64_t mask_heads) {
  const int64_t tile = blockIdx.x;
  const int64_t n = tile % k_blocks, m = tile / k_blocks % q_blocks;
  const int64_t hm = tile / (k_blocks * q_blocks) % mask_heads;
  const int64_t bm = tile / (k_blocks * q_blocks * mask_heads);
  const int64_t row0 = m * Br, col0 = n * Bc;
  const int rows = static_cast<int>(min(static_cast<int64_t>(Br), p.seqlen_q - row0));
  const int cols = static_cast<int>(min(static_cast<int64_t>(Bc), p.seqlen_k - col0));
  const Stored* base = static_cast<const Stored*>(p.mask) + bm * p.mask_batch_stride +
                       hm * p.mask_head_stride + row0 * p.mask_row_stride +
                       col0 * p.mask_col_stride;
  bool any_visible = false, all_clear = true, any_hidden = false;
  // Consecutive threads take consecutive keys of a row: coalesced where the keys are contiguous.
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int r = idx / cols, c = idx - r * cols;
    const Stored v = base[r * p.mask_row_stride + c * p.mask_col_stride];
    if constexpr (kBool) {
      any_visible |= v != 0;
      all_clear &= v != 0;
      any_hidden |= v == 0;
    } else {
      const float x = to_float(v);
      const bool hides = mask_value_hides(x);
      any_visible |= !hides;
      all_clear &= x == 0.f;
      any_hidden |= hides;
    }
  }
  // The reductions are barriers every thread reaches.
  any_visible = __syncthreads_or(any_visible);
  all_clear = __syncthreads_and(all_clear);
  any_hidden = __syncthreads_or(any_hidden);
  if (threadIdx.x == 0)
    classes[tile] = !any_visible ? kTileHidden
                    : all_clear  ? kTileClear
                    : any_hidden ? kTileMixed
                                 : kTileShownAdded;
}

// Classifies p's mask at Br x Bc into workspace memory and points p.mask_tiles at it (no-op
// without a mask tensor, for per-sequence extents, which take none, or on an empty call). Elem:
// the additive mask's storage when kAdditive. One read of the mask per call, in the launch's
// stream order.
template <typename Elem>
cudaError_t classify_mask_tiles(AttentionParams& p, int Br, int Bc, const DeviceWorkspace& ws,
                                cudaStream_t stream) {
  if (p.mask_kind == MaskKind::kNone || has_sequence_extents(p) || p.seqlen_q == 0 ||
      p.seqlen_k == 0 || p.batch == 0 || p.heads_q == 0 || ws.alloc == nullptr)
    return cudaSuccess;
  const int64_t q_blocks = (p.seqlen_q + Br - 1) / Br, k_blocks = (p.seqlen_k + Bc - 1) / Bc;
  const int64_t mask_batches = p.mask_batch_stride != 0 ? p.batch : 1;
  const int64_t mask_heads = p.mask_head_stride != 0 ? p.heads_q : 1;
  const int64_t tiles = mask_batches * mask_heads * q_blocks * k_blocks;
  if (tiles > cuda::kMaxGridBlocks) return cudaSuccess;  // left unclassified: every tile mixed
  auto* classes = static_cast<uint8_t*>(ws.alloc(ws.ctx, static_cast<size_t>(tiles)));
  if (classes == nullptr) return cudaErrorMemoryAllocation;
  const dim3 grid(static_cast<unsigned>(tiles));
  switch (p.mask_kind) {
    case MaskKind::kBool:
      attention_fwd_mask_tiles_kernel<uint8_t, true>
          <<<grid, 256, 0, stream>>>(p, classes, Br, Bc, q_blocks, k_blocks, mask_heads);
      break;
    case MaskKind::kAdditive:
      attention_fwd_mask_tiles_kernel<Elem, false>
          <<<grid, 256, 0, stream>>>(p, classes, Br, Bc, q_blocks, k_blocks, mask_heads);
      break;
    default:
      attention_fwd_mask_tiles_kernel<float, false>
          <<<grid, 256, 0, stream>>>(p, classes, Br, Bc, q_blocks, k_blocks, mask_heads);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  p.mask_tiles = classes;
  p.mask_tiles_k_blocks = k_blocks;
  p.mask_tiles_head_stride = p.mask_head_stride != 0 ? q_blocks * k_blocks : 0;
  p.mask_tiles_batch_stride = p.mask_batch_stride != 0 ? mask_heads * q_blocks * k_blocks : 0;
  p.mask_tiles_br = Br;
  p.mask_tiles_bc = Bc;
  return cudaSuccess;
}

}  // namespace flashmod::cuda_kernels
