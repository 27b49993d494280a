// Online softmax over the mma accumulator layout (FlashAttention's m and l per row).
//
// A thread holds, for each of its m16 tiles, two rows (lane/4 and lane/4 + 8) and in each n8
// tile two adjacent columns of each: element e of an accumulator quad belongs to row half e/2.
// Scores arrive in "logit units" x with p = exp2(c * x - c * m): the plain path passes raw q.k
// and c = scale * log2(e), so the scale costs nothing (it rides in the exp2's FFMA); the general
// path passes finished scores and c = log2(e).
#pragma once

#include <math_constants.h>

#include "../../common/cuda/ptx_ops.h"

namespace flashmod::cuda_kernels {

template <int kMTiles>
struct OnlineSoftmax {
  float m[kMTiles][2];  // running row max of x (-inf while no key was visible)
  float l[kMTiles][2];  // this thread's partial row sum of p; quad-reduced once, at the end

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) m[mi][h] = -CUDART_INF_F, l[mi][h] = 0.f;
  }

  // Turns S (x values, -inf where hidden) into unnormalized P in place and rescales O by
  // exp2(c * (m_old - m_new)).
  template <int kNTiles, int kDTiles>
  __device__ __forceinline__ void update(float (&S)[kMTiles][kNTiles][4],
                                         float (&O)[kMTiles][kDTiles][4], float c) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float block_max = -CUDART_INF_F;
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
          block_max = fmaxf(block_max, fmaxf(S[mi][ni][2 * h], S[mi][ni][2 * h + 1]));
        block_max = quad_max(block_max);
        const float m_new = fmaxf(m[mi][h], block_max);
        // A row with nothing visible yet keeps m = -inf; subtracting 0 instead of -inf keeps
        // exp2(-inf - m) at 0 rather than NaN.
        const float cm = m_new == -CUDART_INF_F ? 0.f : c * m_new;
        const float alpha = exp2f(c * m[mi][h] - cm);  // 0 on the first visible block
        m[mi][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pij = exp2f(fmaf(c, S[mi][ni][2 * h + e], -cm));
            S[mi][ni][2 * h + e] = pij;
            sum += pij;
          }
        }
        l[mi][h] = l[mi][h] * alpha + sum;
#pragma unroll
        for (int di = 0; di < kDTiles; ++di) {
          O[mi][di][2 * h] *= alpha;
          O[mi][di][2 * h + 1] *= alpha;
        }
      }
    }
  }

  // Row normalizer 1/l (0 for a row that never saw a visible key, so its output is 0) and the
  // row's log-sum-exp in natural-log units (-inf for such a row). A NaN or +inf among the row's
  // visible scores leaves the sum NaN (fmaxf skips a NaN in m, but its p = exp2(NaN) is NaN, and a
  // +inf score gives exp2(inf - inf)): then out and lse are NaN, as in SDPA's math, not empty.
  __device__ __forceinline__ void finish(int mi, int h, float c, float& inv_l, float& lse) {
    const float sum = quad_sum(l[mi][h]);
    const bool empty = sum == 0.f;
    inv_l = empty ? 0.f : 1.f / sum;
    // lse = ln(sum) + cm * ln(2), with cm rounded exactly as update() rounded it (the p's were
    // exp2(c x - cm), so cm cancels). Combined in double, once per row: fp32's log2 approximation
    // and the final rounding cost ~3e-6 at sums of ~1000 keys, several times a plain fp32 lse.
    const float cm = c * m[mi][h];
    lse = empty ? -CUDART_INF_F
                : static_cast<float>(log(static_cast<double>(sum)) +
                                     static_cast<double>(cm) * 0.6931471805599453);
  }
};

}  // namespace flashmod::cuda_kernels
