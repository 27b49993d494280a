// The merge_attention kernel: one warp per row. Lane i holds partial i's lse, the warp reduces the
// max and the sum of exponentials with shuffles, then every lane walks its columns of each partial
// with the broadcast weight. Memory-bound: each partial row is read once, the result written once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../../common/cuda/ptx_ops.h"
#include "merge_launch.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
static_assert(kMaxMergeParts <= 32, "one lane holds each partial's lse");

template <typename Elem, int kVec>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) merge_attention_kernel(const MergeParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;
  const float lse_lane = lane < p.parts ? p.lses[lane][row] : -CUDART_INF_F;
  float m = lse_lane;
  bool nan = isnan(lse_lane);
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    nan = __any_sync(0xffffffffu, nan);
  }
  Elem* out = static_cast<Elem*>(p.out) + row * p.head_dim;
  if (nan || m == -CUDART_INF_F) {
    // No partial saw a visible key: the row is empty (0, -inf); a NaN lse stays NaN.
    const Elem fill = from_float<Elem>(nan ? CUDART_NAN_F : 0.f);
    for (int64_t c = lane; c < p.head_dim; c += 32) out[c] = fill;
    if (lane == 0) p.lse[row] = nan ? CUDART_NAN_F : -CUDART_INF_F;
    return;
  }
  float sum = lane < p.parts ? expf(lse_lane - m) : 0.f;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float lse = m + logf(sum);
  const float weight_lane = expf(lse_lane - lse);  // 0 for lanes without a partial

  for (int64_t c0 = static_cast<int64_t>(lane) * kVec; c0 < p.head_dim; c0 += 32 * kVec) {
    float acc[kVec] = {};
    for (int i = 0; i < p.parts; ++i) {
      const float w = __shfl_sync(0xffffffffu, weight_lane, i);
      if (w == 0.f) continue;  // a partial without visible keys is never read (its out may be 0)
      const Elem* o = static_cast<const Elem*>(p.outs[i]) + row * p.head_dim + c0;
      if constexpr (kVec > 1) {
        // 16-byte loads: the host checked the alignment of every row start.
        Elem v[kVec];
        *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(o));
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w, to_float(v[e]), acc[e]);
      } else {
        acc[0] = fmaf(w, to_float(__ldg(o)), acc[0]);
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

template <typename Elem>
cudaError_t launch_for(const MergeParams& p, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(Elem);
  bool vec16 = p.head_dim % kVec16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  for (int i = 0; i < p.parts; ++i) vec16 &= reinterpret_cast<uintptr_t>(p.outs[i]) % 16 == 0;
  const int64_t blocks = (p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kWarpsPerBlock);
  if (vec16)
    merge_attention_kernel<Elem, kVec16><<<grid, block, 0, stream>>>(p);
  else
    merge_attention_kernel<Elem, 1><<<grid, block, 0, stream>>>(p);
  return cudaPeekAtLastError();
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
