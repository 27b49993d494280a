// The attn_mask rules shared by every op that takes one (attention, matmul_softmax): the mask is on
// the reference tensor's device, bool or an additive float (the reference's dtype, or fp32 beside
// fp16/bf16), and broadcastable to the op's (B, H, rows, cols). flashmod/ops.py's check_mask
// mirrors it for register_fake.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "scalar_kinds.h"

namespace flashmod {

struct CheckedMask {
  at::Tensor
      expanded;  // (B, H, rows, cols) by strides only (bool viewed as uint8); undefined if none
  MaskKind kind = MaskKind::kNone;
};

// op, ref_name and target_names only shape the error messages, e.g. "flashmod.attention", "q",
// "(batch, q_heads, seqlen_q, seqlen_k)".
CheckedMask check_and_expand_mask(const char* op, const std::optional<at::Tensor>& attn_mask,
                                  const at::Tensor& ref, const char* ref_name,
                                  c10::IntArrayRef target, const char* target_names);

}  // namespace flashmod
