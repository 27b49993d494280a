// CUDA registration of flashmod::attention_varlen_backward: the shared checks (serve_host.cpp),
// the CUDA-only ones, and the fused backward's per-sequence variants (kExtents of the Hopper and
// the portable kernels, on Hopper also of the fused dQ variant, backward_dispatch.h; the row
// statistics likewise), fp16/bf16 as the forward. Each CTA finds its sequence from cu_seqlens on
// the device (no host sync); nothing is padded.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "../../common/error_message.h"
#include "../serve_host.h"
#include "backward_dispatch.h"
#include "entry_points.h"
#include "host_alignment.h"
#include "serve_cuda_checks.h"

namespace flashmod {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool is_causal, int64_t window_left,
    int64_t window_right, double softcap, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  const c10::cuda::CUDAGuard guard(q.device());
  // The forward's checks in its order (serve_ops.py's fake mirrors both), then the backward's.
  check_cuda_inputs("flashmod.attention_varlen", q);
  PreparedServe r = prepare_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, scale, is_causal, window_left,
                                             window_right, softcap, /*allocate_outputs=*/false);
  constexpr const char* op = "flashmod.attention_varlen_backward";
  set_varlen_dropout(r.params, op, q, dropout_p, rng_state);
  check_varlen_backward_inputs(grad_out, grad_lse, q, out, lse);

  // Zeroed: rows outside every sequence (a cu_seqlens whose last entry is short of the packed
  // total, which CUDA cannot check without a sync) read 0 rather than garbage.
  at::Tensor grad_q = at::zeros_like(r.q), grad_k = at::zeros_like(r.k),
             grad_v = at::zeros_like(r.v);
  AttentionBwdParams p;
  static_cast<AttentionParams&>(p) = r.params;
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0 || q.numel() == 0) {
    return {grad_q, grad_k, grad_v};
  }
  // Read-only inputs without 16-byte aligned rows are copied once (head_dim = 59, odd slices).
  at::Tensor qa = with_aligned_rows16(r.q), ka = with_aligned_rows16(r.k),
             va = with_aligned_rows16(r.v);
  at::Tensor out_rows = out.stride(-1) == 1 ? out : out.contiguous();
  at::Tensor grad_out_rows =
      with_aligned_rows16(grad_out.stride(-1) == 1 ? grad_out : grad_out.contiguous());
  at::Tensor lse_rows = lse.contiguous();
  at::Tensor grad_lse_rows;
  if (grad_lse.has_value()) grad_lse_rows = grad_lse->to(at::kFloat).contiguous();

  p.q = qa.data_ptr(), p.k = ka.data_ptr(), p.v = va.data_ptr();
  p.q_head_stride = qa.stride(1), p.q_row_stride = qa.stride(0);
  p.k_head_stride = ka.stride(1), p.k_row_stride = ka.stride(0);
  p.v_head_stride = va.stride(1), p.v_row_stride = va.stride(0);
  p.out = out_rows.data_ptr();
  p.out_head_stride = out_rows.stride(1), p.out_row_stride = out_rows.stride(0);
  p.lse = lse_rows.data_ptr<float>();  // (Hq, total_q): the strides prepare_attention_varlen set
  p.grad_out = grad_out_rows.data_ptr();
  p.grad_out_head_stride = grad_out_rows.stride(1), p.grad_out_row_stride = grad_out_rows.stride(0);
  p.grad_lse = grad_lse_rows.defined() ? grad_lse_rows.data_ptr<float>() : nullptr;
  p.grad_q = grad_q.data_ptr(), p.grad_k = grad_k.data_ptr(), p.grad_v = grad_v.data_ptr();
  p.grad_q_head_stride = grad_q.stride(1), p.grad_q_row_stride = grad_q.stride(0);
  p.grad_k_head_stride = grad_k.stride(1), p.grad_k_row_stride = grad_k.stride(0);
  p.grad_v_head_stride = grad_v.stride(1), p.grad_v_row_stride = grad_v.stride(0);

  at::Tensor stats;
  cuda_kernels::BwdRowStats st = allocate_bwd_row_stats(p, q.options(), stats);
  st.vec_store = grad_store_kind(grad_q, grad_k, grad_v, p.head_dim);
  st.vec_rows = rows_aligned16(out_rows) && rows_aligned16(grad_out_rows) && p.head_dim % 8 == 0;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = run_fused_backward(op, p, st, q.options(), stream);
  TORCH_CHECK(err != cudaErrorInvalidConfiguration,
              error_message(op,
                            ": too many blocks for one launch (batch * heads * blocks of "
                            "max_seqlen must be < 2^31)"));
  C10_CUDA_CHECK(err);
  return {grad_q, grad_k, grad_v};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("attention_varlen_backward", &flashmod::attention_varlen_backward_cuda);
}
