// The backward's row statistics (entry_points.h: BwdRowStats): one warp per query row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kWarps = 4;

template <typename Elem>
__global__ void __launch_bounds__(32 * kWarps)
    attention_bwd_rowstats_kernel(const AttentionBwdParams p, const BwdRowStats st) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t bh = row / st.rows_padded, i = row % st.rows_padded;
  if (bh >= p.batch * p.heads_q) return;
  if (i >= p.seqlen_q) {  // pad rows: P = 0, nothing subtracted
    if (lane == 0) st.lse2[row] = CUDART_INF_F, st.delta[row] = 0.f;
    return;
  }
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const Elem* o = static_cast<const Elem*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
                  i * p.out_row_stride;
  const Elem* dout = static_cast<const Elem*>(p.grad_out) + b * p.grad_out_batch_stride +
                     h * p.grad_out_head_stride + i * p.grad_out_row_stride;
  float sum = 0.f;
  for (int64_t d = lane; d < p.head_dim; d += 32)
    sum = fmaf(to_float(o[d]), to_float(dout[d]), sum);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const int64_t flat = bh * p.seqlen_q + i;  // lse and grad_lse are contiguous (B, Hq, Nq)
    const float lse = p.lse[flat];
    // A row that saw no key (lse = -inf) gets +inf, so exp2(s - lse2) is exactly 0 for it.
    st.lse2[row] = lse == -CUDART_INF_F ? CUDART_INF_F : lse * 1.4426950408889634f;
    st.delta[row] = sum - (p.grad_lse != nullptr ? p.grad_lse[flat] : 0.f);
  }
}

}  // namespace

cudaError_t run_attention_bwd_rowstats(const AttentionBwdParams& p, const BwdRowStats& st,
                                       cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * st.rows_padded;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  return p.dtype == ScalarKind::kBFloat16
             ? cuda::launch_kernel(attention_bwd_rowstats_kernel<__nv_bfloat16>, blocks,
                                   32 * kWarps, 0, stream, p, st)
             : cuda::launch_kernel(attention_bwd_rowstats_kernel<__half>, blocks, 32 * kWarps, 0,
                                   stream, p, st);
}

}  // namespace flashmod::cuda_kernels
