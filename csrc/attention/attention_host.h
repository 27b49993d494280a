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

PreparedAttention prepare_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& attn_mask,
                                    std::optional<double> scale, bool is_causal, bool bottom_right,
                                    int64_t window_left, int64_t window_right, double softcap);

// True when no output element needs a kernel: every output row is then 0 with lse = -inf
// (Nk == 0), or there is nothing to write at all. prepare_attention already filled them.
bool nothing_to_compute(const PreparedAttention& prepared);

}  // namespace flashmod
