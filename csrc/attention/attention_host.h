// Host-side preparation shared by every backend: argument checks, output allocation and the
// translation of tensors into an AttentionParams. Written once; flashmod/ops.py's register_fake
// mirrors each check so that they also fire under torch.compile.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "attention_params.h"

namespace flashmod {

struct PreparedAttention {
  at::Tensor out;  // (B, Hq, Nq, D) in q's dtype; same memory layout as q when q is dense
  at::Tensor lse;  // (B, Hq, Nq) fp32, contiguous
  // Inputs after any fix-up (stride(-1) == 1, mask expanded by strides); they keep the
  // storage that params points into alive.
  at::Tensor q, k, v, mask;
  AttentionParams params;
};

// The options every attention op shares (window sides >= -1, a finite softcap >= 0, a finite
// scale), with errors prefixed by `prefix` ("flashmod.<op>: ").
void check_attention_options(const char* prefix, std::optional<double> scale, int64_t window_left,
                             int64_t window_right, double softcap);

// The window sides into p (after its seqlen_q / seqlen_k: for packed or cached calls their
// maxima): a side reaching past every key of every query (>= seqlen_q + seqlen_k, whatever the
// diagonal's offset) is unbounded (-1), so the kernels' index arithmetic (row + offset + side)
// stays far from int64's end. Causal: nothing right of the diagonal.
void set_window(AttentionParams& p, bool is_causal, int64_t window_left, int64_t window_right);

PreparedAttention prepare_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& attn_mask,
                                    std::optional<double> scale, bool is_causal, bool bottom_right,
                                    int64_t window_left, int64_t window_right, double softcap);

// True when no output element needs a kernel: every output row is then 0 with lse = -inf
// (Nk == 0), or there is nothing to write at all. prepare_attention already filled them.
bool nothing_to_compute(const PreparedAttention& prepared);

struct PreparedAttentionBackward {
  // Gradients in the layouts of q, k, v (empty_like of the fixed-up inputs); grad_mask: zeroed
  // fp32 (B, Hq, Nq, Nk) when compute_grad_mask, else an empty fp32 (0,) tensor.
  at::Tensor grad_q, grad_k, grad_v, grad_mask;
  // Inputs after any fix-up (stride(-1) == 1, mask expanded by strides, grad_lse contiguous
  // fp32); they keep the storage that params points into alive.
  at::Tensor q, k, v, out, lse, grad_out, grad_lse, mask;
  AttentionBwdParams params;
};

// The forward's checks plus those of out, lse, grad_out and grad_lse (shapes, dtypes, devices),
// then the gradients allocated and params filled. Shared by every backend; flashmod/ops.py's
// fake implementation of attention_backward mirrors it.
PreparedAttentionBackward prepare_attention_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap,
    bool compute_grad_mask);

// Dropout's arguments into p (dropout_draws.h) after the shared checks (on CUDA through
// set_cuda_dropout, after its dtype rule): dropout_p in [0, 1], rng_state a contiguous (2,) int64
// tensor on q's device, which the kernels read. flashmod/ops.py's _check_dropout_args mirrors it.
void set_dropout(AttentionParams& p, const char* op, const at::Tensor& q, double dropout_p,
                 const at::Tensor& rng_state);

}  // namespace flashmod
