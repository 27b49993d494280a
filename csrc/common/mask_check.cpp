#include "mask_check.h"

#include <c10/util/Exception.h>

#include "error_message.h"

namespace flashmod {

CheckedMask check_and_expand_mask(const char* op, const std::optional<at::Tensor>& attn_mask,
                                  const at::Tensor& ref, const char* ref_name,
                                  c10::IntArrayRef target, const char* target_names) {
  CheckedMask r;
  if (!attn_mask.has_value() || !attn_mask->defined()) return r;
  const at::Tensor& mask = *attn_mask;
  TORCH_CHECK(mask.device() == ref.device(),
              error_message(op, ": attn_mask must be on ", ref_name, "'s device ", ref.device(),
                            ", got ", mask.device()));
  const auto dtype = mask.scalar_type();
  const bool half = ref.scalar_type() == at::kHalf || ref.scalar_type() == at::kBFloat16;
  if (dtype == at::kBool) {
    r.kind = MaskKind::kBool;
  } else if (dtype == ref.scalar_type()) {
    r.kind = MaskKind::kAdditive;
  } else if (half && dtype == at::kFloat) {
    r.kind = MaskKind::kAdditiveF32;
  } else {
    TORCH_CHECK(false,
                error_message(op, ": attn_mask must be bool or ", ref_name, "'s dtype ",
                              ref.scalar_type(), half ? " (or float32)" : "", ", got ", dtype));
  }
  bool ok = mask.dim() >= 1 && mask.dim() <= static_cast<int64_t>(target.size());
  for (int64_t i = 1; ok && i <= mask.dim(); ++i) {
    const int64_t have = mask.size(-i), want = target[target.size() - i];
    ok = have == want || have == 1;
  }
  TORCH_CHECK(ok, error_message(op, ": attn_mask must be broadcastable to ", target_names, " = ",
                                target, ", got shape ", mask.sizes()));
  r.expanded = mask.expand(target);
  if (dtype == at::kBool) r.expanded = r.expanded.view(at::kByte);  // same storage, 1 byte each
  return r;
}

}  // namespace flashmod
