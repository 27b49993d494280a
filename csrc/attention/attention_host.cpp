#include "attention_host.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "../common/error_message.h"
#include "../common/mask_check.h"

namespace flashmod {
namespace {

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    TORCH_CHECK(t->dim() == 4, flashmod::error_message(
                                   "flashmod.attention: ", name,
                                   " must be a 4-D tensor (batch, heads, seqlen, head_dim), got a ",
                                   t->dim(), "-D tensor of shape ", t->sizes()));
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      flashmod::error_message(
          "flashmod.attention: q must be float32, float16, bfloat16 or float64, got ", (dtype)));
  TORCH_CHECK(k.scalar_type() == dtype,
              flashmod::error_message("flashmod.attention: k must have q's dtype ", (dtype),
                                      ", got ", (k.scalar_type())));
  TORCH_CHECK(v.scalar_type() == dtype,
              flashmod::error_message("flashmod.attention: v must have q's dtype ", (dtype),
                                      ", got ", (v.scalar_type())));
  TORCH_CHECK(k.device() == q.device(),
              flashmod::error_message("flashmod.attention: k must be on q's device ", q.device(),
                                      ", got ", k.device()));
  TORCH_CHECK(v.device() == q.device(),
              flashmod::error_message("flashmod.attention: v must be on q's device ", q.device(),
                                      ", got ", v.device()));
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0),
              flashmod::error_message("flashmod.attention: k and v must have q's batch size ",
                                      q.size(0), ", got k ", k.size(0), " and v ", v.size(0)));
  TORCH_CHECK(
      q.size(3) > 0,
      flashmod::error_message(
          "flashmod.attention: q's head_dim (last dimension) must be positive, got ", q.size(3)));
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3),
              flashmod::error_message("flashmod.attention: k and v must have q's head_dim ",
                                      q.size(3), ", got k ", k.size(3), " and v ", v.size(3)));
  TORCH_CHECK(v.size(1) == k.size(1),
              flashmod::error_message("flashmod.attention: v must have k's number of heads ",
                                      k.size(1), ", got ", v.size(1)));
  TORCH_CHECK(v.size(2) == k.size(2),
              flashmod::error_message("flashmod.attention: v must have k's sequence length ",
                                      k.size(2), ", got ", v.size(2)));
  TORCH_CHECK(
      k.size(1) > 0 && q.size(1) % k.size(1) == 0,
      flashmod::error_message(
          "flashmod.attention: q's heads must be a multiple of k's heads (GQA/MQA), got q heads ",
          q.size(1), " and k/v heads ", k.size(1)));
}

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default: return ScalarKind::kFloat64;
  }
}

// The checks and the params shared by the forward and the backward: inputs fixed up into r's
// q/k/v/mask, every field of p but the output pointers and strides.
void prepare_inputs(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale,
                    bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right,
                    double softcap, at::Tensor& q_out, at::Tensor& k_out, at::Tensor& v_out,
                    at::Tensor& mask_out, AttentionParams& p) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK(
      window_left >= -1,
      flashmod::error_message(
          "flashmod.attention: window_left must be >= -1 (-1 = unbounded), got ", window_left));
  TORCH_CHECK(
      window_right >= -1,
      flashmod::error_message(
          "flashmod.attention: window_right must be >= -1 (-1 = unbounded), got ", window_right));
  TORCH_CHECK(
      softcap >= 0.0 && std::isfinite(softcap),
      flashmod::error_message(
          "flashmod.attention: softcap must be a finite number >= 0 (0 = off), got ", softcap));
  TORCH_CHECK(!scale.has_value() || std::isfinite(*scale),
              flashmod::error_message("flashmod.attention: scale must be finite, got ",
                                      scale.value_or(0.0)));

  // The kernels read rows as contiguous vectors; any other layout is copied once here.
  q_out = q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  k_out = k_in.stride(-1) == 1 ? k_in : k_in.contiguous();
  v_out = v_in.stride(-1) == 1 ? v_in : v_in.contiguous();
  const at::Tensor &q = q_out, &k = k_out, &v = v_out;

  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.heads_kv = k.size(1);
  p.seqlen_q = q.size(2);
  p.seqlen_k = k.size(2);
  p.head_dim = q.size(3);
  p.mask = nullptr;
  CheckedMask mask = check_and_expand_mask("flashmod.attention", attn_mask, q, "q",
                                           {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k},
                                           "(batch, q_heads, seqlen_q, seqlen_k)");
  mask_out = mask.expanded;
  p.mask_kind = mask.kind;

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  if (mask_out.defined()) {
    p.mask = mask_out.data_ptr();
    p.mask_batch_stride = mask_out.stride(0), p.mask_head_stride = mask_out.stride(1);
    p.mask_row_stride = mask_out.stride(2), p.mask_col_stride = mask_out.stride(3);
  }

  p.window_left = window_left;
  p.window_right = is_causal ? 0 : window_right;  // causal: nothing right of the diagonal
  p.diag_offset = bottom_right ? p.seqlen_k - p.seqlen_q : 0;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.softcap = softcap;
  p.dtype = scalar_kind(q.scalar_type());
}

// A (B, Hq, Nq, D)-shaped tensor of the backward (out, grad_out): q's shape, dtype and device,
// with stride(-1) == 1 (copied otherwise).
at::Tensor checked_like_q(const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.sizes() == q.sizes(),
              flashmod::error_message("flashmod.attention_backward: ", name,
                                      " must have q's shape ", q.sizes(), ", got ", t.sizes()));
  TORCH_CHECK(
      t.scalar_type() == q.scalar_type(),
      flashmod::error_message("flashmod.attention_backward: ", name, " must have q's dtype ",
                              q.scalar_type(), ", got ", t.scalar_type()));
  TORCH_CHECK(t.device() == q.device(),
              flashmod::error_message("flashmod.attention_backward: ", name,
                                      " must be on q's device ", q.device(), ", got ", t.device()));
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// A (B, Hq, Nq) per-row tensor of the backward (lse, grad_lse), as contiguous fp32.
at::Tensor checked_rows(const char* name, const at::Tensor& t, const at::Tensor& q,
                        bool any_float) {
  const std::vector<int64_t> rows{q.size(0), q.size(1), q.size(2)};
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(rows),
              flashmod::error_message("flashmod.attention_backward: ", name,
                                      " must have shape (batch, q_heads, seqlen_q) = ",
                                      c10::IntArrayRef(rows), ", got ", t.sizes()));
  TORCH_CHECK(any_float ? at::isFloatingType(t.scalar_type()) : t.scalar_type() == at::kFloat,
              flashmod::error_message("flashmod.attention_backward: ", name, " must be ",
                                      any_float ? "a floating tensor" : "float32", ", got ",
                                      t.scalar_type()));
  TORCH_CHECK(t.device() == q.device(),
              flashmod::error_message("flashmod.attention_backward: ", name,
                                      " must be on q's device ", q.device(), ", got ", t.device()));
  return t.to(at::kFloat).contiguous();
}

}  // namespace

PreparedAttention prepare_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                    const at::Tensor& v_in,
                                    const std::optional<at::Tensor>& attn_mask,
                                    std::optional<double> scale, bool is_causal, bool bottom_right,
                                    int64_t window_left, int64_t window_right, double softcap) {
  PreparedAttention r;
  AttentionParams& p = r.params;
  prepare_inputs(q_in, k_in, v_in, attn_mask, scale, is_causal, bottom_right, window_left,
                 window_right, softcap, r.q, r.k, r.v, r.mask, p);
  // Preserves q's layout when q is dense, so (B, S, H, D) inputs give (B, S, H, D) outputs.
  r.out = at::empty_like(r.q);
  r.lse = at::empty({p.batch, p.heads_q, p.seqlen_q}, r.q.options().dtype(at::kFloat));
  p.out = r.out.data_ptr();
  p.lse = r.lse.data_ptr<float>();
  p.out_batch_stride = r.out.stride(0), p.out_head_stride = r.out.stride(1),
  p.out_row_stride = r.out.stride(2);
  if (p.seqlen_k == 0 && r.out.numel() > 0) {
    r.out.zero_();
    r.lse.fill_(-std::numeric_limits<float>::infinity());
  }
  return r;
}

PreparedAttentionBackward prepare_attention_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap) {
  PreparedAttentionBackward r;
  AttentionBwdParams& p = r.params;
  prepare_inputs(q_in, k_in, v_in, attn_mask, scale, is_causal, bottom_right, window_left,
                 window_right, softcap, r.q, r.k, r.v, r.mask, p);
  r.out = checked_like_q("out", out, r.q);
  r.grad_out = checked_like_q("grad_out", grad_out, r.q);
  r.lse = checked_rows("lse", lse, r.q, /*any_float=*/false);
  if (grad_lse.has_value()) r.grad_lse = checked_rows("grad_lse", *grad_lse, r.q, true);

  // Gradients in the layouts of the (fixed-up) inputs, as the fake implementation promises.
  r.grad_q = at::empty_like(r.q);
  r.grad_k = at::empty_like(r.k);
  r.grad_v = at::empty_like(r.v);
  p.out = const_cast<void*>(r.out.const_data_ptr());  // read only in the backward
  p.out_batch_stride = r.out.stride(0), p.out_head_stride = r.out.stride(1),
  p.out_row_stride = r.out.stride(2);
  p.lse = r.lse.data_ptr<float>();
  p.grad_out = r.grad_out.const_data_ptr();
  p.grad_out_batch_stride = r.grad_out.stride(0), p.grad_out_head_stride = r.grad_out.stride(1),
  p.grad_out_row_stride = r.grad_out.stride(2);
  p.grad_lse = r.grad_lse.defined() ? r.grad_lse.const_data_ptr<float>() : nullptr;
  p.grad_q = r.grad_q.data_ptr();
  p.grad_q_batch_stride = r.grad_q.stride(0), p.grad_q_head_stride = r.grad_q.stride(1),
  p.grad_q_row_stride = r.grad_q.stride(2);
  p.grad_k = r.grad_k.data_ptr();
  p.grad_k_batch_stride = r.grad_k.stride(0), p.grad_k_head_stride = r.grad_k.stride(1),
  p.grad_k_row_stride = r.grad_k.stride(2);
  p.grad_v = r.grad_v.data_ptr();
  p.grad_v_batch_stride = r.grad_v.stride(0), p.grad_v_head_stride = r.grad_v.stride(1),
  p.grad_v_row_stride = r.grad_v.stride(2);
  return r;
}

bool nothing_to_compute(const PreparedAttention& prepared) {
  return prepared.out.numel() == 0 || prepared.params.seqlen_k == 0;
}

}  // namespace flashmod
