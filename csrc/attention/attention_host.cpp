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

}  // namespace

PreparedAttention prepare_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                    const at::Tensor& v_in,
                                    const std::optional<at::Tensor>& attn_mask,
                                    std::optional<double> scale, bool is_causal, bool bottom_right,
                                    int64_t window_left, int64_t window_right, double softcap) {
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

  PreparedAttention r;
  // The kernels read rows as contiguous vectors; any other layout is copied once here.
  r.q = q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  r.k = k_in.stride(-1) == 1 ? k_in : k_in.contiguous();
  r.v = v_in.stride(-1) == 1 ? v_in : v_in.contiguous();
  const at::Tensor &q = r.q, &k = r.k, &v = r.v;

  AttentionParams& p = r.params;
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
  r.mask = mask.expanded;
  p.mask_kind = mask.kind;

  // Preserves q's layout when q is dense, so (B, S, H, D) inputs give (B, S, H, D) outputs.
  r.out = at::empty_like(q);
  r.lse = at::empty({p.batch, p.heads_q, p.seqlen_q}, q.options().dtype(at::kFloat));

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = r.out.data_ptr();
  p.lse = r.lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.out_batch_stride = r.out.stride(0), p.out_head_stride = r.out.stride(1),
  p.out_row_stride = r.out.stride(2);
  if (r.mask.defined()) {
    p.mask = r.mask.data_ptr();
    p.mask_batch_stride = r.mask.stride(0), p.mask_head_stride = r.mask.stride(1);
    p.mask_row_stride = r.mask.stride(2), p.mask_col_stride = r.mask.stride(3);
  }

  p.window_left = window_left;
  p.window_right = is_causal ? 0 : window_right;  // causal: nothing right of the diagonal
  p.diag_offset = bottom_right ? p.seqlen_k - p.seqlen_q : 0;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.softcap = softcap;
  p.dtype = scalar_kind(q.scalar_type());

  if (p.seqlen_k == 0 && r.out.numel() > 0) {
    r.out.zero_();
    r.lse.fill_(-std::numeric_limits<float>::infinity());
  }
  return r;
}

bool nothing_to_compute(const PreparedAttention& prepared) {
  return prepared.out.numel() == 0 || prepared.params.seqlen_k == 0;
}

}  // namespace flashmod
