// Shared-memory fp32 tiles of the 3xTF32 kernels (fwd_fp32_3xtf32.cu, bwd_tf32_kernel.h): rows
// padded to kHeadDim + 4 floats, a pitch of 4 (mod 32) words for kHeadDim % 32 == 0, so that the
// mma fragment reads (8 rows x 4 columns, or 4 row pairs x 8 columns) hit 32 different banks; and
// the forward's split of a whole tile into tf32 halves.
#pragma once

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"

namespace flashmod::cuda_kernels {

template <int kHeadDim>
constexpr int tf32_tile_pitch() {
  static_assert(kHeadDim % 32 == 0, "the bank-conflict-free pitch needs kHeadDim % 32 == 0");
  return kHeadDim + 4;
}

// split_tf32 for the attention kernels' products, in 2 instructions on sm_90 (round_tf32's one
// and a subtraction) where split_tf32 takes ~6: the splits of fragments as they are read are
// most of the fp32 backward's instructions.
// - lo is not rounded to tf32: the tensor cores read a tf32 operand's top 19 bits (the low 13 are
//   ignored), so lo enters truncated, with at most 2^-21 of x's error where rounding leaves 2^-22.
//   In a model of the products (normal rows, D = 64 .. 256, sums exact) the dot products' mean
//   error against fp64 moved by < 1 %; the fp32 tests' 2x / 3x rule holds (H200, session 55).
// - No guard for infinite x: lo is then NaN (or -inf where a finite x rounds to infinity), and
//   every product it enters has an infinite or NaN big term (x's hi times the other hi), which
//   add_small_terms keeps, as it kept it when lo was 0. Every caller's result passes through it.
__device__ __forceinline__ void split_tf32_fast(uint32_t x, uint32_t& hi, uint32_t& lo) {
  hi = round_tf32(__uint_as_float(x));
  lo = __float_as_uint(__uint_as_float(x) - __uint_as_float(hi));
}

// x -> its tf32 hi halves in place; returns the lo halves.
__device__ __forceinline__ float4 split_tf32_float4(float4& x) {
  float4 y;
  uint32_t h, l;
  split_tf32_fast(__float_as_uint(x.x), h, l), x.x = __uint_as_float(h), y.x = __uint_as_float(l);
  split_tf32_fast(__float_as_uint(x.y), h, l), x.y = __uint_as_float(h), y.y = __uint_as_float(l);
  split_tf32_fast(__float_as_uint(x.z), h, l), x.z = __uint_as_float(h), y.z = __uint_as_float(l);
  split_tf32_fast(__float_as_uint(x.w), h, l), x.w = __uint_as_float(h), y.w = __uint_as_float(l);
  return y;
}

// Replaces a landed kRows x kHeadDim fp32 tile by its tf32 hi halves and writes the lo halves to
// `lo` (same pitch), all kThreads threads of the CTA sharing the work. Splitting once per tile
// replaces every warp splitting every fragment again (counted per warp and block in the forward,
// the splits' cvt/fsub outnumbered the mma instructions 2:1 that way).
template <int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void split_tf32_tile(float* hi, float* lo, int tid) {
  constexpr int kLd = tf32_tile_pitch<kHeadDim>(), kChunks = kHeadDim / 4;
  for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
    const int off = idx / kChunks * kLd + idx % kChunks * 4;
    float4 x = *reinterpret_cast<float4*>(hi + off);
    const float4 y = split_tf32_float4(x);
    *reinterpret_cast<float4*>(hi + off) = x;
    *reinterpret_cast<float4*>(lo + off) = y;
  }
}

// split_tf32_tile over a tile stored without row padding (kFloats contiguous floats, e.g. a
// 128-byte-swizzled wgmma tile, which an element-wise split leaves in its layout).
template <int kFloats, int kThreads>
__device__ __forceinline__ void split_tf32_flat(float* hi, float* lo, int tid) {
  static_assert(kFloats % (4 * kThreads) == 0, "whole float4s per thread");
#pragma unroll
  for (int i = tid; i < kFloats / 4; i += kThreads) {
    float4 x = reinterpret_cast<const float4*>(hi)[i];
    const float4 y = split_tf32_float4(x);
    reinterpret_cast<float4*>(hi)[i] = x;
    reinterpret_cast<float4*>(lo)[i] = y;
  }
}

}  // namespace flashmod::cuda_kernels
