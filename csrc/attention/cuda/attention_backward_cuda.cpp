// CUDA registration of flashmod::attention_backward: the shared checks
// (prepare_attention_backward), the CUDA-only ones, alignment fix-ups, the row statistics
// workspace, and the dispatch to the fused kernels by dtype and padded head dim: fp32 to the 3xTF32
// kernels (bwd_tf32_kernel.h), fp16/bf16 to the wgmma ones on sm_90 where built, else mma.sync.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

#include "../../common/error_message.h"
#include "../attention_host.h"
#include "backward_dispatch.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "host_alignment.h"

namespace flashmod {
namespace {

using Gradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Gradients run_attention_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap,
    bool compute_grad_mask, const DropoutArgs* dropout) {
  const c10::cuda::CUDAGuard guard(q.device());
  PreparedAttentionBackward r = prepare_attention_backward(
      grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale, is_causal, bottom_right, window_left,
      window_right, softcap, compute_grad_mask);
  check_cuda_attention_inputs("flashmod.attention_backward", q);
  AttentionBwdParams& p = r.params;
  if (dropout != nullptr) set_cuda_dropout(p, "flashmod.attention_backward", q, *dropout);
  if (r.grad_q.numel() == 0 && r.grad_k.numel() == 0)
    return {r.grad_q, r.grad_k, r.grad_v, r.grad_mask};
  if (p.seqlen_q == 0 || p.seqlen_k == 0 || p.heads_q == 0) {
    // No (query, key) pair: every gradient is 0.
    return {r.grad_q.zero_(), r.grad_k.zero_(), r.grad_v.zero_(), r.grad_mask};
  }

  // Alignment fix-ups (see aligned_copy); the copies are kept alive by r.
  align_rows16(r.q, p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  align_rows16(r.k, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  align_rows16(r.v, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  align_rows16(r.grad_out, p.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride,
               p.grad_out_row_stride);

  at::Tensor stats;
  cuda_kernels::BwdRowStats st = allocate_bwd_row_stats(p, q.options(), stats);
  st.vec_store = grad_store_kind(r.grad_q, r.grad_k, r.grad_v, p.head_dim);
  st.vec_rows = rows_aligned16(r.out) && rows_aligned16(r.grad_out) && p.head_dim % 8 == 0;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  if (p.dtype != ScalarKind::kFloat32) {
    err = run_fused_backward("flashmod.attention_backward", p, st, q.options(), stream);
  } else if ((err = cuda_kernels::run_attention_bwd_rowstats(p, st, stream)) == cudaSuccess) {
    const int padded32 = cuda_kernels::padded_head_dim(cuda_kernels::kBwdTf32HeadDims, p.head_dim);
    st.tf32_fused_dq = tf32_fused_dq_wanted();
    choose_tf32_tiles(st);
    if (st.tf32_fused_dq)
      r.grad_q.zero_();  // the dK/dV kernel adds dQ into it
    else
      st.dq_stream = dq_beside_stream(q.options());
    switch (cuda_kernels::variant_key(p.dtype, padded32)) {
#define FLASHMOD_BWD_TF32_CASE(Elem, kind, D)                           \
  case cuda_kernels::variant_key(ScalarKind::kind, D):                  \
    err = cuda_kernels::run_attention_bwd_tf32<Elem, D>(p, st, stream); \
    break;
      FLASHMOD_BWD_TF32_VARIANTS(FLASHMOD_BWD_TF32_CASE)
#undef FLASHMOD_BWD_TF32_CASE
      default:
        TORCH_CHECK(false, flashmod::error_message(
                               "flashmod.attention_backward: unsupported head_dim ", p.head_dim));
    }
  }
  TORCH_CHECK(err != cudaErrorInvalidConfiguration,
              flashmod::error_message("flashmod.attention_backward: too many blocks for one launch "
                                      "(batch * heads * blocks of the sequence must be < 2^31)"));
  C10_CUDA_CHECK(err);
  return {r.grad_q, r.grad_k, r.grad_v, r.grad_mask};
}

Gradients attention_backward_cuda(const at::Tensor& grad_out,
                                  const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                                  std::optional<double> scale, bool is_causal, bool bottom_right,
                                  int64_t window_left, int64_t window_right, double softcap,
                                  bool compute_grad_mask) {
  return run_attention_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale,
                                     is_causal, bottom_right, window_left, window_right, softcap,
                                     compute_grad_mask, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_dropout_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const at::Tensor& rng_state) {
  const DropoutArgs dropout{dropout_p, rng_state};
  auto [grad_q, grad_k, grad_v, grad_mask] = run_attention_backward_cuda(
      grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale, is_causal, bottom_right, window_left,
      window_right, softcap, false, &dropout);
  return {grad_q, grad_k, grad_v};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("attention_backward", &flashmod::attention_backward_cuda);
  m.impl("attention_dropout_backward", &flashmod::attention_dropout_backward_cuda);
}
