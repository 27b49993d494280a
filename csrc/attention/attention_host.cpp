#include "attention_host.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../common/error_message.h"
#include "../common/mask_check.h"
#include "../common/scalar_kind_of.h"

namespace flashmod {
namespace {

// prefix names the op in every message: prefix, "" or "flashmod.attention_backward: ".
void check_qkv(const char* prefix, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    TORCH_CHECK(t->dim() == 4, flashmod::error_message(
                                   prefix, "", name,
                                   " must be a 4-D tensor (batch, heads, seqlen, head_dim), got a ",
                                   t->dim(), "-D tensor of shape ", t->sizes()));
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      flashmod::error_message(prefix, "q must be float32, float16, bfloat16 or float64, got ",
                              (dtype)));
  TORCH_CHECK(k.scalar_type() == dtype,
              flashmod::error_message(prefix, "k must have q's dtype ", (dtype), ", got ",
                                      (k.scalar_type())));
  TORCH_CHECK(v.scalar_type() == dtype,
              flashmod::error_message(prefix, "v must have q's dtype ", (dtype), ", got ",
                                      (v.scalar_type())));
  TORCH_CHECK(k.device() == q.device(), flashmod::error_message(prefix, "k must be on q's device ",
                                                                q.device(), ", got ", k.device()));
  TORCH_CHECK(v.device() == q.device(), flashmod::error_message(prefix, "v must be on q's device ",
                                                                q.device(), ", got ", v.device()));
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0),
              flashmod::error_message(prefix, "k and v must have q's batch size ", q.size(0),
                                      ", got k ", k.size(0), " and v ", v.size(0)));
  TORCH_CHECK(q.size(3) > 0,
              flashmod::error_message(
                  prefix, "q's head_dim (last dimension) must be positive, got ", q.size(3)));
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3),
              flashmod::error_message(prefix, "k and v must have q's head_dim ", q.size(3),
                                      ", got k ", k.size(3), " and v ", v.size(3)));
  TORCH_CHECK(v.size(1) == k.size(1),
              flashmod::error_message(prefix, "v must have k's number of heads ", k.size(1),
                                      ", got ", v.size(1)));
  TORCH_CHECK(v.size(2) == k.size(2),
              flashmod::error_message(prefix, "v must have k's sequence length ", k.size(2),
                                      ", got ", v.size(2)));
  // No query heads at all is an empty problem (SDPA returns an empty result), whatever k has.
  TORCH_CHECK((k.size(1) > 0 && q.size(1) % k.size(1) == 0) || q.size(1) == 0,
              flashmod::error_message(
                  prefix, "q's heads must be a multiple of k's heads (GQA/MQA), got q heads ",
                  q.size(1), " and k/v heads ", k.size(1)));
}

}  // namespace

void check_attention_options(const char* prefix, std::optional<double> scale, int64_t window_left,
                             int64_t window_right, double softcap) {
  TORCH_CHECK(window_left >= -1,
              flashmod::error_message(prefix, "window_left must be >= -1 (-1 = unbounded), got ",
                                      window_left));
  TORCH_CHECK(window_right >= -1,
              flashmod::error_message(prefix, "window_right must be >= -1 (-1 = unbounded), got ",
                                      window_right));
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap),
              flashmod::error_message(
                  prefix, "softcap must be a finite number >= 0 (0 = off), got ", softcap));
  TORCH_CHECK(!scale.has_value() || std::isfinite(*scale),
              flashmod::error_message(prefix, "scale must be finite, got ", scale.value_or(0.0)));
}

void set_window(AttentionParams& p, bool is_causal, int64_t window_left, int64_t window_right) {
  const int64_t reach = p.seqlen_q + p.seqlen_k;
  p.window_left = window_left >= reach ? -1 : window_left;
  p.window_right = is_causal ? 0 : window_right >= reach ? -1 : window_right;
}

namespace {

// The checks and fix-ups the forward and the backward share: q, k, v, the mask and the options.
// Fills every field of p but the output pointers and strides.
struct PreparedInputs {
  at::Tensor q, k, v, mask;
};

PreparedInputs prepare_inputs(const char* op, const char* prefix, const at::Tensor& q_in,
                              const at::Tensor& k_in, const at::Tensor& v_in,
                              const std::optional<at::Tensor>& attn_mask,
                              std::optional<double> scale, bool is_causal, bool bottom_right,
                              int64_t window_left, int64_t window_right, double softcap,
                              AttentionParams& p) {
  check_qkv(prefix, q_in, k_in, v_in);
  check_attention_options(prefix, scale, window_left, window_right, softcap);

  PreparedInputs r;
  // The kernels read rows as contiguous vectors; any other layout is copied once here.
  r.q = q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  r.k = k_in.stride(-1) == 1 ? k_in : k_in.contiguous();
  r.v = v_in.stride(-1) == 1 ? v_in : v_in.contiguous();
  const at::Tensor &q = r.q, &k = r.k, &v = r.v;

  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.heads_kv = k.size(1);
  p.seqlen_q = q.size(2);
  p.seqlen_k = k.size(2);
  p.head_dim = q.size(3);
  p.mask = nullptr;
  CheckedMask mask =
      check_and_expand_mask(op, attn_mask, q, "q", {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k},
                            "(batch, q_heads, seqlen_q, seqlen_k)");
  r.mask = mask.expanded;
  p.mask_kind = mask.kind;

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  if (r.mask.defined()) {
    p.mask = r.mask.data_ptr();
    p.mask_batch_stride = r.mask.stride(0), p.mask_head_stride = r.mask.stride(1);
    p.mask_row_stride = r.mask.stride(2), p.mask_col_stride = r.mask.stride(3);
  }

  set_window(p, is_causal, window_left, window_right);
  p.diag_offset = bottom_right ? p.seqlen_k - p.seqlen_q : 0;
  p.bottom_right = bottom_right;
  p.lse_batch_stride = p.heads_q * p.seqlen_q, p.lse_head_stride = p.seqlen_q;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.softcap = softcap;
  p.dtype = scalar_kind_of(q.scalar_type());
  return r;
}

// t must have ref's shape, dtype and device; name and ref_name shape the message.
void check_like(const char* prefix, const char* name, const at::Tensor& t, const char* ref_name,
                const at::Tensor& ref) {
  TORCH_CHECK(t.sizes() == ref.sizes(),
              flashmod::error_message(prefix, name, " must have ", ref_name, "'s shape ",
                                      ref.sizes(), ", got ", t.sizes()));
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(),
              flashmod::error_message(prefix, name, " must have ", ref_name, "'s dtype ",
                                      ref.scalar_type(), ", got ", t.scalar_type()));
  TORCH_CHECK(t.device() == ref.device(),
              flashmod::error_message(prefix, name, " must be on ", ref_name, "'s device ",
                                      ref.device(), ", got ", t.device()));
}

// lse and grad_lse: (B, Hq, Nq) on q's device; lse exactly fp32, grad_lse any floating dtype.
void check_row_stat(const char* prefix, const char* name, const at::Tensor& t, const at::Tensor& q,
                    bool fp32_only) {
  const std::vector<int64_t> want{q.size(0), q.size(1), q.size(2)};
  TORCH_CHECK(
      t.sizes() == c10::IntArrayRef(want),
      flashmod::error_message(prefix, name, " must have shape (batch, q_heads, seqlen_q) = ",
                              c10::IntArrayRef(want), ", got ", t.sizes()));
  if (fp32_only) {
    TORCH_CHECK(t.scalar_type() == at::kFloat,
                flashmod::error_message(prefix, name, " must be float32, got ", t.scalar_type()));
  } else {
    TORCH_CHECK(
        at::isFloatingType(t.scalar_type()),
        flashmod::error_message(prefix, name, " must be a floating dtype, got ", t.scalar_type()));
  }
  TORCH_CHECK(t.device() == q.device(),
              flashmod::error_message(prefix, name, " must be on q's device ", q.device(), ", got ",
                                      t.device()));
}

// A row-major (B, H, N, D) view's element strides, for the params' *_stride fields.
void row_strides(const at::Tensor& t, int64_t& batch, int64_t& head, int64_t& row) {
  batch = t.stride(0), head = t.stride(1), row = t.stride(2);
}

}  // namespace

PreparedAttention prepare_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                    const at::Tensor& v_in,
                                    const std::optional<at::Tensor>& attn_mask,
                                    std::optional<double> scale, bool is_causal, bool bottom_right,
                                    int64_t window_left, int64_t window_right, double softcap) {
  PreparedAttention r;
  AttentionParams& p = r.params;
  PreparedInputs in =
      prepare_inputs("flashmod.attention", "flashmod.attention: ", q_in, k_in, v_in, attn_mask,
                     scale, is_causal, bottom_right, window_left, window_right, softcap, p);
  r.q = in.q, r.k = in.k, r.v = in.v, r.mask = in.mask;

  // Preserves q's layout when q is dense, so (B, S, H, D) inputs give (B, S, H, D) outputs.
  r.out = at::empty_like(r.q);
  r.lse = at::empty({p.batch, p.heads_q, p.seqlen_q}, r.q.options().dtype(at::kFloat));
  p.out = r.out.data_ptr();
  p.lse = r.lse.data_ptr<float>();
  row_strides(r.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride);

  if (p.seqlen_k == 0 && r.out.numel() > 0) {
    r.out.zero_();
    r.lse.fill_(-std::numeric_limits<float>::infinity());
  }
  return r;
}

PreparedAttentionBackward prepare_attention_backward(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_lse_in,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale, bool is_causal, bool bottom_right, int64_t window_left,
    int64_t window_right, double softcap, bool compute_grad_mask) {
  constexpr const char* prefix = "flashmod.attention_backward: ";
  PreparedAttentionBackward r;
  AttentionBwdParams& p = r.params;
  PreparedInputs in =
      prepare_inputs("flashmod.attention_backward", prefix, q_in, k_in, v_in, attn_mask, scale,
                     is_causal, bottom_right, window_left, window_right, softcap, p);
  r.q = in.q, r.k = in.k, r.v = in.v, r.mask = in.mask;

  check_like(prefix, "out", out_in, "q", q_in);
  check_row_stat(prefix, "lse", lse_in, q_in, /*fp32_only=*/true);
  check_like(prefix, "grad_out", grad_out_in, "out", out_in);
  if (grad_lse_in.has_value()) {
    check_row_stat(prefix, "grad_lse", *grad_lse_in, q_in, /*fp32_only=*/false);
  }

  r.out = out_in.stride(-1) == 1 ? out_in : out_in.contiguous();
  r.grad_out = grad_out_in.stride(-1) == 1 ? grad_out_in : grad_out_in.contiguous();
  r.lse = lse_in.contiguous();
  if (grad_lse_in.has_value()) r.grad_lse = grad_lse_in->to(at::kFloat).contiguous();

  if (compute_grad_mask) {
    const bool additive =
        p.mask_kind == MaskKind::kAdditive || p.mask_kind == MaskKind::kAdditiveF32;
    TORCH_CHECK(additive, flashmod::error_message(
                              prefix, "compute_grad_mask needs an additive float attn_mask, got ",
                              attn_mask.has_value() ? "a bool attn_mask" : "no attn_mask"));
  }

  r.grad_q = at::empty_like(r.q);
  r.grad_k = at::empty_like(r.k);
  r.grad_v = at::empty_like(r.v);
  // Zeroed: the kernels write the visible pairs only.
  r.grad_mask = compute_grad_mask ? at::zeros({p.batch, p.heads_q, p.seqlen_q, p.seqlen_k},
                                              r.q.options().dtype(at::kFloat))
                                  : at::empty({0}, r.q.options().dtype(at::kFloat));
  p.grad_mask = compute_grad_mask ? r.grad_mask.data_ptr<float>() : nullptr;

  p.out = const_cast<void*>(r.out.const_data_ptr());  // read only: the backward never writes it
  p.lse = const_cast<float*>(r.lse.const_data_ptr<float>());
  row_strides(r.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride);
  p.grad_out = r.grad_out.const_data_ptr();
  p.grad_lse = r.grad_lse.defined() ? r.grad_lse.const_data_ptr<float>() : nullptr;
  p.grad_q = r.grad_q.data_ptr();
  p.grad_k = r.grad_k.data_ptr();
  p.grad_v = r.grad_v.data_ptr();
  row_strides(r.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride);
  row_strides(r.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride, p.grad_q_row_stride);
  row_strides(r.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride, p.grad_k_row_stride);
  row_strides(r.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride, p.grad_v_row_stride);
  return r;
}

bool nothing_to_compute(const PreparedAttention& prepared) {
  return prepared.out.numel() == 0 || prepared.params.seqlen_k == 0;
}

void set_dropout(AttentionParams& p, const char* op, const at::Tensor& q, double dropout_p,
                 const at::Tensor& rng_state) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0,
              error_message(op, ": dropout_p must be a probability in [0, 1], got ", dropout_p));
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 &&
                  rng_state.size(0) == 2 && rng_state.is_contiguous() &&
                  rng_state.device() == q.device(),
              error_message(op, ": rng_state must be a contiguous (2,) int64 tensor on ",
                            q.device(), ", got ", rng_state.scalar_type(), " of shape ",
                            rng_state.sizes(), " on ", rng_state.device()));
  p.dropout_rng = rng_state.data_ptr<int64_t>();
  p.dropout_threshold = static_cast<uint32_t>(std::llround(dropout_p * 65536.0));
  p.dropout_scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
}

}  // namespace flashmod
