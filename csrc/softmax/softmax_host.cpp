#include "softmax_host.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <vector>

#include "../common/error_message.h"
#include "../common/mask_check.h"
#include "../common/scalar_kind_of.h"

namespace flashmod {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// float64 exists for gradcheck on CPU; the CUDA kernels are written for fp32/fp16/bf16.
void check_fp64_device(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(
      !(t.scalar_type() == at::kDouble && t.is_cuda()),
      flashmod::error_message(op, ": ", name,
                              "'s dtype float64 is supported on CPU only, got it on ", t.device()));
}

}  // namespace

PreparedSoftmax prepare_softmax(const at::Tensor& x, int64_t dim) {
  TORCH_CHECK(is_supported_float(x.scalar_type()),
              flashmod::error_message(
                  "flashmod.softmax: x must be float32, float16, bfloat16 or float64, got ",
                  (x.scalar_type())));
  check_fp64_device("flashmod.softmax", "x", x);
  // A 0-d tensor is a single row of one element, as in torch.softmax.
  const int64_t ndim = std::max<int64_t>(x.dim(), 1);
  TORCH_CHECK(dim >= -ndim && dim < ndim,
              flashmod::error_message("flashmod.softmax: dim must be in [", -ndim, ", ", ndim - 1,
                                      "] for a ", x.dim(), "-D tensor, got ", dim));
  const int64_t d = dim < 0 ? dim + ndim : dim;

  PreparedSoftmax r;
  r.x = x.contiguous();
  r.y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  SoftmaxParams& p = r.params;
  p.x = r.x.data_ptr();
  p.y = r.y.data_ptr();
  p.outer = 1;
  p.inner = 1;
  p.dim_size = x.dim() == 0 ? 1 : x.size(d);
  for (int64_t i = 0; i < d && i < x.dim(); ++i) p.outer *= x.size(i);
  for (int64_t i = d + 1; i < x.dim(); ++i) p.inner *= x.size(i);
  p.dtype = scalar_kind_of(x.scalar_type());
  return r;
}

PreparedMatmulSoftmax prepare_matmul_softmax(const at::Tensor& a_in, const at::Tensor& b_in,
                                             std::optional<double> scale, bool is_causal,
                                             const std::optional<at::Tensor>& attn_mask) {
  constexpr const char* op = "flashmod.matmul_softmax";
  for (auto [name, t] : {std::pair{"a", &a_in}, std::pair{"b", &b_in}}) {
    TORCH_CHECK(t->dim() == 4,
                flashmod::error_message(
                    op, ": ", name, " must be a 4-D tensor (batch, heads, seqlen, depth), got a ",
                    t->dim(), "-D tensor of shape ", t->sizes()));
  }
  const auto dtype = a_in.scalar_type();
  TORCH_CHECK(is_supported_float(dtype),
              flashmod::error_message(op, ": a must be float32, float16, bfloat16 or float64, got ",
                                      (dtype)));
  TORCH_CHECK(b_in.scalar_type() == dtype,
              flashmod::error_message(op, ": b must have a's dtype ", (dtype), ", got ",
                                      (b_in.scalar_type())));
  TORCH_CHECK(b_in.device() == a_in.device(),
              flashmod::error_message(op, ": b must be on a's device ", a_in.device(), ", got ",
                                      b_in.device()));
  check_fp64_device(op, "a", a_in);
  TORCH_CHECK(b_in.size(0) == a_in.size(0),
              flashmod::error_message(op, ": b must have a's batch size ", a_in.size(0), ", got ",
                                      b_in.size(0)));
  TORCH_CHECK(a_in.size(3) > 0,
              flashmod::error_message(op, ": a's depth (last dimension) must be positive, got ",
                                      a_in.size(3)));
  TORCH_CHECK(b_in.size(3) == a_in.size(3),
              flashmod::error_message(op, ": b must have a's depth (last dimension) ", a_in.size(3),
                                      ", got ", b_in.size(3)));
  TORCH_CHECK((b_in.size(1) > 0 && a_in.size(1) % b_in.size(1) == 0) || a_in.size(1) == 0,
              flashmod::error_message(
                  op, ": a's heads must be a multiple of b's heads (GQA/MQA), got a heads ",
                  a_in.size(1), " and b heads ", b_in.size(1)));
  TORCH_CHECK(!scale.has_value() || std::isfinite(*scale),
              flashmod::error_message(op, ": scale must be finite, got ", scale.value_or(0.0)));

  PreparedMatmulSoftmax r;
  MatmulSoftmaxParams& p = r.params;
  p.batch = a_in.size(0);
  p.heads_a = a_in.size(1);
  p.heads_b = b_in.size(1);
  p.rows = a_in.size(2);
  p.cols = b_in.size(2);
  p.depth = a_in.size(3);
  const std::vector<int64_t> target = {p.batch, p.heads_a, p.rows, p.cols};

  const CheckedMask mask =
      check_and_expand_mask(op, attn_mask, a_in, "a", target, "(batch, a_heads, M, N)");
  p.mask_kind = mask.kind;
  r.mask = mask.expanded;
  if (r.mask.defined()) {
    p.mask = r.mask.data_ptr();
    p.mask_batch_stride = r.mask.stride(0), p.mask_head_stride = r.mask.stride(1);
    p.mask_row_stride = r.mask.stride(2), p.mask_col_stride = r.mask.stride(3);
  }

  // The kernels read a's and b's rows as contiguous vectors; other layouts are copied once here.
  r.a = a_in.stride(-1) == 1 ? a_in : a_in.contiguous();
  r.b = b_in.stride(-1) == 1 ? b_in : b_in.contiguous();
  r.out = at::empty(target, a_in.options().memory_format(at::MemoryFormat::Contiguous));
  p.a = r.a.data_ptr();
  p.b = r.b.data_ptr();
  p.out = r.out.data_ptr();
  p.a_batch_stride = r.a.stride(0), p.a_head_stride = r.a.stride(1), p.a_row_stride = r.a.stride(2);
  p.b_batch_stride = r.b.stride(0), p.b_head_stride = r.b.stride(1), p.b_row_stride = r.b.stride(2);
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.depth));
  p.causal = is_causal;
  p.dtype = scalar_kind_of(dtype);
  return r;
}

void logits_into_output(PreparedMatmulSoftmax& r) {
  const MatmulSoftmaxParams& p = r.params;
  if (r.out.numel() == 0) return;
  const int64_t group = p.heads_a / p.heads_b;
  // (B, Ha, M, K) -> (B*Hb, G*M, K): a copy only when a's heads and rows do not merge by strides.
  const at::Tensor a = r.a.reshape({p.batch * p.heads_b, group * p.rows, p.depth});
  const at::Tensor b = r.b.reshape({p.batch * p.heads_b, p.cols, p.depth});
  at::Tensor out = r.out.view({p.batch * p.heads_b, group * p.rows, p.cols});
  // fp16 logits are written scaled (the GEMM's alpha; the normalizers then scale by 1): a raw
  // logit past 65504 would be inf before the scale shrinks it, a NaN row where the fused kernels
  // are exact. A scale of 0 keeps the raw logits, so that a NaN or inf product still shows.
  if (p.dtype == ScalarKind::kFloat16 && p.scale != 0.0) {
    out.baddbmm_(a, b.transpose(1, 2), /*beta=*/0.0, /*alpha=*/p.scale);
    r.params.scale = 1.0;
    return;
  }
  at::bmm_out(out, a, b.transpose(1, 2));
}

}  // namespace flashmod
