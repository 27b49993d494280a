// The online softmax (FlashAttention's running max m and sum l per row) of every CUDA attention
// kernel. Scores arrive in "logit units" x with p = exp2(c * x - c * m): the plain fp16/bf16 path
// passes raw q.k and c = scale * log2(e), so the scale costs nothing (it rides in the exp2's
// FFMA); the other paths pass finished scores and c = log2(e).
//
// online_softmax_rescale is the step every kernel takes per row and key block. Around it:
// OnlineSoftmax runs it over the mma accumulator layout with fp32 sums (sm80 and sm90 kernels);
// OnlineSoftmaxRowF64 keeps one row's sum in double for the fp32 kernels, whose lse must stay at
// fp32 accuracy. The fp32 kernels form and consume P in their own layouts (a quad per row in
// shared memory; tf32 halves), so only the per-row state and step are shared with them.
#pragma once

#include <math_constants.h>

#include "../../common/cuda/ptx_ops.h"

namespace flashmod::cuda_kernels {

// A row's block max (over the whole row: quad-reduced) joins its running max m. Sets cm, the
// exp2 offset of this block's p = exp2(c x - cm), and returns alpha = exp2(cm_old - cm), the
// factor that rescales what was summed under the old offset cm_old = c m_old (0 on the first
// visible block). Sum: float, or double for the fp32 kernels (lse = log(l) + m keeps alpha's
// error; O / l cancels it).
template <typename Sum>
__device__ __forceinline__ Sum online_softmax_rescale(float& m, float block_max, float c,
                                                      float cm_old, float& cm) {
  const float m_new = fmaxf(m, block_max);
  // A row with nothing visible yet keeps m = -inf; subtracting 0 instead of -inf keeps
  // exp2(-inf - m) at 0 rather than NaN.
  cm = m_new == -CUDART_INF_F ? 0.f : c * m_new;
  Sum alpha;
  if constexpr (sizeof(Sum) == sizeof(float)) {
    alpha = exp2f(cm_old - cm);  // cm_old = c * (-inf) before the first visible block
  } else {
    alpha = m == -CUDART_INF_F ? 0.0 : exp2(static_cast<double>(cm_old) - static_cast<double>(cm));
  }
  m = m_new;
  return alpha;
}

// One row of an fp32 kernel: running max, sum in double.
struct OnlineSoftmaxRowF64 {
  float m;   // running row max of x (-inf while no key was visible)
  double l;  // this thread's part of the row sum; the quad's parts are added in finish
  // The previous block's cm, kept rather than recomputed as c m: that kept the 3xTF32 kernel's
  // registers and spills as they were (recomputing it added 8-12 bytes of spills on sm_90a).
  float cm_prev;

  __device__ __forceinline__ void init() { m = -CUDART_INF_F, l = 0.0, cm_prev = 0.f; }

  // Rescales l for a new block; returns alpha (for O) and sets cm (see online_softmax_rescale).
  // The caller adds the block's p's with add().
  __device__ __forceinline__ float rescale(float block_max, float c, float& cm) {
    const double alpha = online_softmax_rescale<double>(m, block_max, c, cm_prev, cm);
    cm_prev = cm;
    l *= alpha;
    return static_cast<float>(alpha);
  }
  __device__ __forceinline__ void add(float sum) { l += sum; }

  // Row normalizer 1/l (0 for a row that never saw a visible key) and the row's lse in natural-log
  // units (-inf for such a row), from the quad's four partial sums: all four lanes must call it.
  // A NaN or +inf among the visible scores leaves the sum NaN: out and lse NaN, as the mma
  // layout's finish below.
  __device__ __forceinline__ void finish(float c, float& inv_l, float& lse) const {
    double sum = l;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const bool empty = sum == 0.0;
    inv_l = empty ? 0.f : static_cast<float>(1.0 / sum);
    // In double, once per row: the p's were exp2(c x - cm) with this same cm = c m, so
    // lse = ln(sum) + cm ln(2) exactly; fp32 logf (approximate under fast math) costs ~1e-6.
    lse = empty ? -CUDART_INF_F
                : static_cast<float>(log(sum) + static_cast<double>(c * m) * 0.6931471805599453);
  }
};

// Over the mma accumulator layout: a thread holds, for each of its m16 tiles, two rows (lane/4 and
// lane/4 + 8) and in each n8 tile two adjacent columns of each: element e of an accumulator quad
// belongs to row half e/2.
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
        const float alpha = row_to_p(S, mi, h, c);
#pragma unroll
        for (int di = 0; di < kDTiles; ++di) {
          O[mi][di][2 * h] *= alpha;
          O[mi][di][2 * h + 1] *= alpha;
        }
      }
    }
  }

  // update's two halves, for kernels whose O is still being accumulated by an asynchronous matmul
  // while the next block's softmax runs: S -> P (and m, l) now, O *= alpha once that matmul is
  // done.
  template <int kNTiles>
  __device__ __forceinline__ void scores_to_p(float (&S)[kMTiles][kNTiles][4], float c,
                                              float (&alpha)[kMTiles][2]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) alpha[mi][h] = row_to_p(S, mi, h, c);
  }
  template <int kDTiles>
  __device__ __forceinline__ static void rescale(float (&O)[kMTiles][kDTiles][4],
                                                 const float (&alpha)[kMTiles][2]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int di = 0; di < kDTiles; ++di) {
          O[mi][di][2 * h] *= alpha[mi][h];
          O[mi][di][2 * h + 1] *= alpha[mi][h];
        }
  }

  // One row (m16 tile mi, half h) of S -> P, its m and l updated; returns its alpha.
  template <int kNTiles>
  __device__ __forceinline__ float row_to_p(float (&S)[kMTiles][kNTiles][4], int mi, int h,
                                            float c) {
    float block_max = -CUDART_INF_F;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
      block_max = fmaxf(block_max, fmaxf(S[mi][ni][2 * h], S[mi][ni][2 * h + 1]));
    float cm;
    const float alpha =
        online_softmax_rescale<float>(m[mi][h], quad_max(block_max), c, c * m[mi][h], cm);
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
    return alpha;
  }

  // Row normalizer 1/l (0 for a row that never saw a visible key, so its output is 0) and the
  // row's log-sum-exp in natural-log units (-inf for such a row). A NaN or +inf among the row's
  // visible scores leaves the sum NaN (fmaxf skips a NaN in m, but its p = exp2(NaN) is NaN, and a
  // +inf score gives exp2(inf - inf)): then out and lse are NaN, as in SDPA's math, not empty.
  __device__ __forceinline__ void finish(int mi, int h, float c, float& inv_l, float& lse) {
    const float sum = quad_sum(l[mi][h]);
    const bool empty = sum == 0.f;
    inv_l = empty ? 0.f : 1.f / sum;
    // lse = ln(sum) + cm * ln(2) = ln(2) * (log2(sum) + cm), with cm rounded exactly as update()
    // rounded it (the p's were exp2(c x - cm), so cm cancels). In fp32: lg2.approx is within
    // 2^-22 of log2, so lse is within ~2 ulp of the exact value (1-2e-6 at |lse| ~ 10), far
    // below what the 16-bit P and O carry. The double-precision log it replaces sat on every
    // tile's epilogue (its DFMA chain showed in the N = 1k stall samples).
    const float cm = c * m[mi][h];
    lse = empty ? -CUDART_INF_F : (__log2f(sum) + cm) * 0.6931471805599453f;
  }
};

// The key-split decode kernel (kernel_traits.h: KeySplitTraits): its kWarps warps ran the online
// softmax of the same 16 rows over disjoint keys; their states fold into warp 0's. Per row, M is
// the warps' largest m; each warp's O and l (summed under its offset c m_w) are scaled by
// exp2(c m_w - c M) (0 for a warp that saw no visible key) and warp 0 adds the others' in warp
// order, so the result does not depend on timing. scratch: shared memory of at least
// key_split_merge_bytes, which nothing else reads now (the caller synchronized the CTA after its
// last read of it); the other warps' states are meaningless afterwards.
template <int kWarps, int kDTiles>
constexpr int key_split_merge_bytes() {
  return 4 * (kWarps * 16 + (kWarps - 1) * 32 * (2 + 4 * kDTiles));
}
template <int kWarps, int kDTiles>
__device__ __forceinline__ void merge_key_split_warps(OnlineSoftmax<1>& softmax,
                                                      float (&O)[1][kDTiles][4], float c,
                                                      float* scratch, int warp, int lane) {
  float* m_of = scratch;                   // [warp][row]
  float* l_of = m_of + kWarps * 16;        // [warp - 1][lane][half]
  float* o_of = l_of + (kWarps - 1) * 64;  // [warp - 1][di][lane][4]
  const int g = lane >> 2;
  if ((lane & 3) == 0) {  // a quad's four lanes hold the same m
    m_of[warp * 16 + g] = softmax.m[0][0];
    m_of[warp * 16 + g + 8] = softmax.m[0][1];
  }
  // Every warp's m is written before any warp reads them.
  __syncthreads();
  float scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, m_of[w * 16 + g + 8 * h]);
    const float m = softmax.m[0][h];
    scale[h] = m == -CUDART_INF_F ? 0.f : exp2f(c * m - c * row_max);
    softmax.m[0][h] = row_max;
    softmax.l[0][h] *= scale[h];
#pragma unroll
    for (int di = 0; di < kDTiles; ++di) {
      O[0][di][2 * h] *= scale[h];
      O[0][di][2 * h + 1] *= scale[h];
    }
  }
  if (warp > 0) {
    float* l_mine = l_of + ((warp - 1) * 32 + lane) * 2;
    l_mine[0] = softmax.l[0][0];
    l_mine[1] = softmax.l[0][1];
#pragma unroll
    for (int di = 0; di < kDTiles; ++di)
      *reinterpret_cast<float4*>(o_of + (((warp - 1) * kDTiles + di) * 32 + lane) * 4) =
          make_float4(O[0][di][0], O[0][di][1], O[0][di][2], O[0][di][3]);
  }
  // The other warps' scaled states are written before warp 0 reads them.
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    const float* l_w = l_of + ((w - 1) * 32 + lane) * 2;
    softmax.l[0][0] += l_w[0];
    softmax.l[0][1] += l_w[1];
#pragma unroll
    for (int di = 0; di < kDTiles; ++di) {
      const float4 o =
          *reinterpret_cast<const float4*>(o_of + (((w - 1) * kDTiles + di) * 32 + lane) * 4);
      O[0][di][0] += o.x;
      O[0][di][1] += o.y;
      O[0][di][2] += o.z;
      O[0][di][3] += o.w;
    }
  }
}

}  // namespace flashmod::cuda_kernels
