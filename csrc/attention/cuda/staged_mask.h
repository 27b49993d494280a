// An additive mask's Br x Bc tile staged in shared memory beside the tiles a Hopper kernel streams
// (K_j / V_j in the forward, fwd_sm90_kernel.h, and the dQ kernel; Q_i / dO_i in the dK/dV kernel,
// bwd_sm90_kernel.h). Read per score from global memory, a dense bias (every tile mixed)
// cost each warp a dependent 2-byte load per score pair after S = Q K^T had landed: 75-83
// TFLOP/s at D = 128 (H100, bf16), 0.22-0.26x CUDNN. Staged, the tile rides in the K/V copy's
// commit group, so its latency hides behind the previous block's matmuls, and the softmax reads
// each lane's two columns as one 32-bit shared-memory word.
//
// Layout: row r of the tile is Bc * 2 bytes; its 16-byte chunk c (8 keys) sits at chunk
// c ^ (r % 8). A warp's lanes read rows g = lane / 4 (+ 8) and word lane % 4 of chunk ni: without
// the swizzle all eight rows hit the same four banks (row pitch 128 or 256 bytes); with it each
// row's chunk lands in its own 16 bytes of the 128-byte bank line.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/host_device.h"
#include "../attention_params.h"

namespace flashmod::cuda_kernels {

// Whether p's mask can be staged: additive in the inputs' 16-bit type, keys contiguous, and every
// row start 16-byte aligned (cp.async's 16-byte copies read whole aligned chunks). Other masks
// (fp32 additive, bool, key-strided, odd row strides) keep the per-score global loads.
FLASHMOD_HD bool additive_mask_stageable(const AttentionParams& p) {
  return p.mask_kind == MaskKind::kAdditive && p.mask_col_stride == 1 &&
         reinterpret_cast<uintptr_t>(p.mask) % 16 == 0 && p.mask_row_stride % 8 == 0 &&
         p.mask_head_stride % 8 == 0 && p.mask_batch_stride % 8 == 0;
}

// Where mask_scores finds the mask tile of a key block (see score_mask.h's GlobalMaskValues).
template <typename Elem, int Br, int Bc, int kThreads>
struct StagedMaskTile {
  static constexpr bool kStaged = true;
  uint32_t tile;      // shared-memory address of the current block's tile
  int64_t row_first;  // the query position of tile row 0

  static_assert(sizeof(Elem) == 2, "16-bit additive masks only");
  static constexpr int kChunksPerRow = Bc * 2 / 16;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kChunksPerRow % 8 == 0, "the swizzle permutes chunks within groups of 8");
  static_assert(kThreads % kChunksPerRow == 0 && Br % kRowsPerPass == 0,
                "every thread copies the same number of whole chunks");
  static constexpr int kBytes = Br * Bc * 2;

  // Copies rows r0 .. r0 + Br - 1, keys n * Bc .. of (b, h)'s mask into the tile at dst (one
  // cp.async per 16-byte chunk, in the caller's commit group). Rows past seqlen_q and keys past
  // seqlen_k are zero-filled: those rows are never stored and the window test hides those keys.
  __device__ __forceinline__ static void load(uint32_t dst, const AttentionParams& p, int64_t b,
                                              int64_t h, int r0, int n, int tid) {
    const int chunk = tid % kChunksPerRow, row0 = tid / kChunksPerRow;
    const int64_t key0 = static_cast<int64_t>(n) * Bc + chunk * 8;
    const int64_t keys_left = p.seqlen_k - key0;
    const int bytes = keys_left >= 8 ? 16 : keys_left > 0 ? static_cast<int>(keys_left) * 2 : 0;
    const Elem* tile =
        static_cast<const Elem*>(p.mask) + b * p.mask_batch_stride + h * p.mask_head_stride + key0;
#pragma unroll
    for (int k = 0; k < Br / kRowsPerPass; ++k) {
      const int r = row0 + k * kRowsPerPass;
      const bool live = r0 + r < p.seqlen_q && bytes > 0;
      const void* src =
          live ? static_cast<const void*>(tile + (r0 + r) * p.mask_row_stride) : p.mask;
      cp_async_16(dst + r * (Bc * 2) + ((chunk ^ (r % 8)) * 16), src, live ? bytes : 0);
    }
  }

  // A lane's place in the tile row of query position i: the address of its word (keys
  // 2 * (lane % 4), + 1) in the row's chunk 0, and the row's swizzle. Only lane % 4 matters.
  struct Row {
    uint32_t addr, swizzle;
  };
  __device__ __forceinline__ Row row(int64_t i, int lane) const {
    const int r = static_cast<int>(i - row_first);
    return {tile + r * (Bc * 2) + (lane % 4) * 4, static_cast<uint32_t>(r % 8) * 16};
  }

  // The value at tile row r, key col (the dK/dV kernels read the tile transposed: a lane's
  // scores there are two keys of eight query rows, no two of them adjacent in a row).
  __device__ __forceinline__ float at(int r, int col) const {
    const uint16_t bits =
        lds_16(tile + r * (Bc * 2) + (((col / 8) ^ (r % 8)) * 16) + (col % 8) * 2);
    if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
      return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&bits));
    } else {
      return __half2float(*reinterpret_cast<const __half*>(&bits));
    }
  }

  // The lane's two values in chunk ni (keys 8 ni + 2 (lane % 4), + 1) of a row, as floats; zeros
  // where !staged (a clear tile, not copied: the load runs anyway and its word is dropped, since a
  // load under a branch compiled to a branch per load). With ni a compile-time constant, one xor
  // and one add per load.
  __device__ __forceinline__ static float2 pair(const Row& row, int ni, bool staged) {
    uint32_t word = lds_32(row.addr + (ni / 8) * 128 + (((ni % 8) * 16) ^ row.swizzle));
    word = staged ? word : 0u;
    if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
      return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
    } else {
      return __half22float2(*reinterpret_cast<const __half2*>(&word));
    }
  }
};

}  // namespace flashmod::cuda_kernels
