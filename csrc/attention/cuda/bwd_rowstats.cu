// The backward's pre-passes: its row statistics (entry_points.h: BwdRowStats) and a mask
// tensor's tile classes (classify_bwd_mask_tiles).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../sequence_view.h"
#include "entry_points.h"
#include "mask_tiles.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {
namespace {

// A row is read by kLanesPerRow lanes, 16 bytes (8 elements, 4 in fp32) each per step where the
// rows are 16-byte aligned, so a warp streams 4 rows with full-width loads (one warp per row with
// 2-byte loads ran at ~30% of the copy rate: 155 us for 134 MB at D = 64 on an H100).
constexpr int kThreads = 256, kLanesPerRow = 8, kRowsPerBlock = kThreads / kLanesPerRow;

// kExtents: a variable-length call; row i of (b, h) is row i of sequence b (sequence_view_bwd), and
// rows past that sequence's end are padding like those past seqlen_q.
template <typename Elem, bool kExtents>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_rowstats_kernel(const AttentionBwdParams params, const BwdRowStats st) {
  const int sub = threadIdx.x % kLanesPerRow;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int64_t bh = row / st.rows_padded, i = row % st.rows_padded;
  const bool in_range = bh < params.batch * params.heads_q;
  const int64_t b = in_range ? bh / params.heads_q : 0, h = bh % params.heads_q;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  float sum = 0.f;
  if (in_range && i < p.seqlen_q) {
    const Elem* o = static_cast<const Elem*>(p.out) + b * p.out_batch_stride +
                    h * p.out_head_stride + i * p.out_row_stride;
    const Elem* dout = static_cast<const Elem*>(p.grad_out) + b * p.grad_out_batch_stride +
                       h * p.grad_out_head_stride + i * p.grad_out_row_stride;
    if (st.vec_rows) {
      constexpr int kVec = 16 / sizeof(Elem);
      for (int64_t c = kVec * sub; c < p.head_dim; c += kVec * kLanesPerRow) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
        const Elem* oe = reinterpret_cast<const Elem*>(&ov);
        const Elem* de = reinterpret_cast<const Elem*>(&dv);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum = fmaf(to_float(oe[e]), to_float(de[e]), sum);
      }
    } else {
      for (int64_t d = sub; d < p.head_dim; d += kLanesPerRow)
        sum = fmaf(to_float(o[d]), to_float(dout[d]), sum);
    }
  }
  // Every lane of the warp reaches the shuffles (no return above): groups of 8 lanes sum.
#pragma unroll
  for (int off = kLanesPerRow / 2; off > 0; off >>= 1)
    sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sub != 0 || !in_range) return;
  if (i >= p.seqlen_q) {  // pad rows: P = 0, nothing subtracted
    st.lse2[row] = CUDART_INF_F, st.delta[row] = 0.f;
    return;
  }
  // grad_lse has lse's layout: (B, Hq, Nq) contiguous, or (Hq, total_q) for varlen.
  const int64_t flat = b * p.lse_batch_stride + h * p.lse_head_stride + i;
  const float lse = p.lse[flat];
  // A row that saw no key (lse = -inf) gets +inf, so exp2(s - lse2) is exactly 0 for it.
  st.lse2[row] = lse == -CUDART_INF_F ? CUDART_INF_F : lse * 1.4426950408889634f;
  st.delta[row] = sum - (p.grad_lse != nullptr ? p.grad_lse[flat] : 0.f);
}

}  // namespace

cudaError_t run_attention_bwd_rowstats(const AttentionBwdParams& p, const BwdRowStats& st,
                                       cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * st.rows_padded;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  // Variable-length calls are fp16/bf16 only (flash-attn's dtypes): fp32 has no extents variant.
  const bool extents = has_sequence_extents(p);
  switch (p.dtype) {
    case ScalarKind::kBFloat16:
      return cuda::launch_kernel(extents ? attention_bwd_rowstats_kernel<__nv_bfloat16, true>
                                         : attention_bwd_rowstats_kernel<__nv_bfloat16, false>,
                                 blocks, kThreads, 0, stream, p, st);
    case ScalarKind::kFloat32:
      if (extents) return cudaErrorInvalidValue;
      return cuda::launch_kernel(attention_bwd_rowstats_kernel<float, false>, blocks, kThreads, 0,
                                 stream, p, st);
    default:
      return cuda::launch_kernel(extents ? attention_bwd_rowstats_kernel<__half, true>
                                         : attention_bwd_rowstats_kernel<__half, false>,
                                 blocks, kThreads, 0, stream, p, st);
  }
}

cudaError_t classify_bwd_mask_tiles(AttentionBwdParams& p, const DeviceWorkspace& ws,
                                    cudaStream_t stream) {
  if (key_padding_mask(p)) return cudaSuccess;
  switch (p.dtype) {
    case ScalarKind::kBFloat16:
      return classify_mask_tiles<__nv_bfloat16>(p, kBwdMaskTile, kBwdMaskTile, ws, stream);
    case ScalarKind::kFloat16:
      return classify_mask_tiles<__half>(p, kBwdMaskTile, kBwdMaskTile, ws, stream);
    default: return cudaSuccess;
  }
}

}  // namespace flashmod::cuda_kernels
