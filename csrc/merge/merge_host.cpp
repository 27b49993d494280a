#include "merge_host.h"

#include <c10/util/Exception.h>

#include "../common/error_message.h"
#include "../common/scalar_kind_of.h"

namespace flashmod {
namespace {

constexpr const char* kOp = "flashmod.merge_attention: ";

void check_inputs(at::TensorList outs, at::TensorList lses) {
  TORCH_CHECK(!outs.empty(), error_message(kOp, "outs must hold at least one partial output"));
  TORCH_CHECK(outs.size() == lses.size(),
              error_message(kOp, "outs and lses must have the same length, got ",
                            static_cast<int64_t>(outs.size()), " outs and ",
                            static_cast<int64_t>(lses.size()), " lses"));
  const at::Tensor& first = outs[0];
  const auto dtype = first.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      error_message(kOp, "outs must be float32, float16, bfloat16 or float64, got ", dtype));
  TORCH_CHECK(
      first.dim() >= 1,
      error_message(kOp, "outs[0] must have a head_dim (last) dimension, got a 0-D tensor"));
  TORCH_CHECK(!(dtype == at::kDouble && first.is_cuda()),
              error_message(kOp, "outs' dtype float64 is supported on CPU only, got it on ",
                            first.device()));
  const auto row_shape = first.sizes().slice(0, first.dim() - 1);
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string idx = std::to_string(i);
    TORCH_CHECK(outs[i].scalar_type() == dtype,
                error_message(kOp, "outs[", idx, "] must have outs[0]'s dtype ", dtype, ", got ",
                              outs[i].scalar_type()));
    TORCH_CHECK(outs[i].device() == first.device(),
                error_message(kOp, "outs[", idx, "] must be on outs[0]'s device ", first.device(),
                              ", got ", outs[i].device()));
    TORCH_CHECK(outs[i].sizes() == first.sizes(),
                error_message(kOp, "outs[", idx, "] must have outs[0]'s shape ", first.sizes(),
                              ", got ", outs[i].sizes()));
    TORCH_CHECK(lses[i].scalar_type() == at::kFloat,
                error_message(kOp, "lses[", idx, "] must be float32, got ", lses[i].scalar_type()));
    TORCH_CHECK(lses[i].device() == first.device(),
                error_message(kOp, "lses[", idx, "] must be on outs[0]'s device ", first.device(),
                              ", got ", lses[i].device()));
    TORCH_CHECK(lses[i].sizes() == row_shape,
                error_message(kOp, "lses[", idx, "] must have outs[0]'s shape without head_dim ",
                              row_shape, ", got ", lses[i].sizes()));
  }
}

}  // namespace

std::pair<at::Tensor, at::Tensor> merge_attention_passes(
    at::TensorList outs, at::TensorList lses,
    const std::function<void(const MergeParams&)>& run_pass) {
  check_inputs(outs, lses);
  // Partials are read as contiguous rows; other layouts are copied once here.
  std::vector<at::Tensor> pending_outs, pending_lses;
  for (size_t i = 0; i < outs.size(); ++i) {
    pending_outs.push_back(outs[i].contiguous());
    pending_lses.push_back(lses[i].contiguous());
  }
  const int64_t head_dim = outs[0].size(-1);
  while (true) {
    const size_t take = std::min<size_t>(pending_outs.size(), kMaxMergeParts);
    at::Tensor out = at::empty_like(pending_outs[0], at::MemoryFormat::Contiguous);
    at::Tensor lse = at::empty_like(pending_lses[0], at::MemoryFormat::Contiguous);
    MergeParams p;
    p.parts = static_cast<int>(take);
    for (size_t i = 0; i < take; ++i) {
      p.outs[i] = pending_outs[i].data_ptr();
      p.lses[i] = pending_lses[i].data_ptr<float>();
    }
    p.out = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.head_dim = head_dim;
    p.rows = head_dim > 0 ? out.numel() / head_dim : lse.numel();
    p.dtype = scalar_kind_of(out.scalar_type());
    if (p.rows > 0) run_pass(p);
    if (take == pending_outs.size()) return {out, lse};
    // The merged result stands in for the partials it covered.
    pending_outs.erase(pending_outs.begin(), pending_outs.begin() + take);
    pending_lses.erase(pending_lses.begin(), pending_lses.begin() + take);
    pending_outs.insert(pending_outs.begin(), out);
    pending_lses.insert(pending_lses.begin(), lse);
  }
}

}  // namespace flashmod
