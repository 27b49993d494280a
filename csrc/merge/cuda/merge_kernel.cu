// The merge_attention kernel. Memory-bound: each partial row is read once, the result written
// once; the weights exp(lse_i - lse) = exp(lse_i - max lse) / sum come from the P lses of the row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../../common/alignment.h"
#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "merge_launch.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kThreadsPerBlock = 256;

// kLanes threads share one row, each loading kVec elements (16 bytes where aligned) per partial:
// at D = 128 in bf16 that is 16 lanes, so a warp streams two rows and no lane idles. Every lane
// computes the row's weights itself from the P lses (P <= kMaxMergeParts loads, served by L1):
// cheaper than shuffles, and it keeps the weights in registers for the column loop.
template <typename Elem, int kVec, int kLanes>
__global__ void __launch_bounds__(kThreadsPerBlock) merge_attention_kernel(const MergeParams p) {
  constexpr int kRowsPerBlock = kThreadsPerBlock / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (row >= p.rows) return;
  float lse_of[kMaxMergeParts];
  float m = -CUDART_INF_F;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kMaxMergeParts; ++i) {
    lse_of[i] = i < p.parts ? __ldg(p.lses[i] + row) : -CUDART_INF_F;
    nan |= isnan(lse_of[i]);
    m = fmaxf(m, lse_of[i]);
  }
  Elem* out = static_cast<Elem*>(p.out) + row * p.head_dim;
  if (nan || m == -CUDART_INF_F) {
    // No partial saw a visible key: the row is empty (0, -inf); a NaN lse stays NaN.
    const Elem fill = from_float<Elem>(nan ? CUDART_NAN_F : 0.f);
    for (int64_t c = lane; c < p.head_dim; c += kLanes) out[c] = fill;
    if (lane == 0) p.lse[row] = nan ? CUDART_NAN_F : -CUDART_INF_F;
    return;
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxMergeParts; ++i) sum += expf(lse_of[i] - m);  // exp(-inf) = 0
  const float lse = m + logf(sum);
  // Relative to the largest lse (merge_cpu.cpp says why): exp(lse_i - m) / sum.
  const float inv_sum = 1.f / sum;
  float weight[kMaxMergeParts];
#pragma unroll
  for (int i = 0; i < kMaxMergeParts; ++i) weight[i] = expf(lse_of[i] - m) * inv_sum;

  for (int64_t c0 = static_cast<int64_t>(lane) * kVec; c0 < p.head_dim; c0 += kLanes * kVec) {
    float acc[kVec] = {};
#pragma unroll
    for (int i = 0; i < kMaxMergeParts; ++i) {
      // A partial without visible keys (or past p.parts) has weight 0 and is never read.
      if (weight[i] == 0.f) continue;
      const Elem* o = static_cast<const Elem*>(p.outs[i]) + row * p.head_dim + c0;
      if constexpr (kVec > 1) {
        // 16-byte loads: the host side checked the alignment of every row start.
        Elem v[kVec];
        *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(o));
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = fmaf(weight[i], to_float(v[e]), acc[e]);
      } else {
        acc[0] = fmaf(weight[i], to_float(__ldg(o)), acc[0]);
      }
    }
    if constexpr (kVec > 1) {
      Elem v[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = from_float<Elem>(acc[e]);
      *reinterpret_cast<uint4*>(out + c0) = *reinterpret_cast<const uint4*>(v);
    } else {
      out[c0] = from_float<Elem>(acc[0]);
    }
  }
  if (lane == 0) p.lse[row] = lse;
}

template <typename Elem, int kVec, int kLanes>
cudaError_t launch_with(const MergeParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kThreadsPerBlock / kLanes;
  return cuda::launch_kernel(merge_attention_kernel<Elem, kVec, kLanes>,
                             (p.rows + kRowsPerBlock - 1) / kRowsPerBlock, kThreadsPerBlock, 0,
                             stream, p);
}

// Lanes per row: two 16-byte chunks per lane where the row has them, so each lane keeps two
// independent loads per partial in flight (one chunk per lane left 2-partial merges at 0.83 of copy
// bandwidth on the H100; v2 in benchmarks/results/design/merge-and-ring.md).
template <typename Elem, int kVec>
cudaError_t launch_for_width(const MergeParams& p, cudaStream_t stream) {
  const int64_t chunks = (p.head_dim + kVec - 1) / kVec;
  if (chunks <= 8) return launch_with<Elem, kVec, 4>(p, stream);
  if (chunks <= 16) return launch_with<Elem, kVec, 8>(p, stream);
  if (chunks <= 32) return launch_with<Elem, kVec, 16>(p, stream);
  return launch_with<Elem, kVec, 32>(p, stream);
}

template <typename Elem>
cudaError_t launch_for(const MergeParams& p, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(Elem);
  bool vec16 = p.head_dim % kVec16 == 0 && aligned16(p.out);
  for (int i = 0; i < p.parts; ++i) vec16 &= aligned16(p.outs[i]);
  return vec16 ? launch_for_width<Elem, kVec16>(p, stream) : launch_for_width<Elem, 1>(p, stream);
}

}  // namespace

cudaError_t launch_merge_attention(const MergeParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarKind::kFloat16: return launch_for<__half>(p, stream);
    case ScalarKind::kBFloat16: return launch_for<__nv_bfloat16>(p, stream);
    case ScalarKind::kFloat32: return launch_for<float>(p, stream);
    default: return cudaErrorInvalidValue;  // fp64 is CPU-only (checked on the host)
  }
}

}  // namespace flashmod::cuda_kernels
