// Device helpers shared by the softmax and matmul_softmax kernels: the vector pack and the
// online-normalizer algebra on (max, sum) pairs. No torch headers (see softmax_params.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"

namespace flashmod::cuda {

// kVec elements moved as one aligned vector (16 bytes for kVec = 16 / sizeof(T)).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// The 16-bit <-> fp32 conversions are the attention kernels' (ptx_ops.h).
using cuda_kernels::from_float;
using cuda_kernels::to_float;

// exp(x - m) where a max of -inf (nothing seen yet) counts as 0, so -inf - -inf never makes NaN.
__device__ __forceinline__ float exp_from(float x, float m) {
  return __expf(x - (m == -INFINITY ? 0.0f : m));
}

// Online normalizer: (m, s) summarises a set of logits as their max m and s = sum(exp(x - m)).
// Merging two summaries rescales both sums to the larger max. NaN in s propagates.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  s = s * exp_from(m, mn) + s2 * exp_from(m2, mn);
  m = mn;
}

__device__ __forceinline__ void warp_merge(float& m, float& s, int width = 32) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset, width);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset, width);
    merge(m, s, m2, s2);
  }
}

// The factor that turns exp(x - m) into a probability; 0 for a row with nothing visible (all
// -inf: documented to give zeros), NaN when a NaN reached the sum.
__device__ __forceinline__ float inv_sum(float m, float s) {
  return (m == -INFINITY && s == 0.0f) ? 0.0f : 1.0f / s;
}

}  // namespace flashmod::cuda
