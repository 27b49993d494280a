// Host-side preparation shared by every backend of flashmod::softmax and flashmod::matmul_softmax:
// argument checks, output allocation, and the translation of tensors into the params structs.
// Written once; flashmod/softmax_ops.py's register_fake mirrors each check with torch._check so
// they also fire under torch.compile.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "softmax_params.h"

namespace flashmod {

struct PreparedSoftmax {
  at::Tensor x;  // the input, made contiguous when it was not (params.x points into it)
  at::Tensor y;  // contiguous output, same shape and dtype as x
  SoftmaxParams params;
};

PreparedSoftmax prepare_softmax(const at::Tensor& x, int64_t dim);

struct PreparedMatmulSoftmax {
  at::Tensor a, b;  // inputs after any fix-up (last dimension with stride 1)
  at::Tensor mask;  // mask expanded by strides to (B, Ha, M, N); bool viewed as uint8; or undefined
  at::Tensor out;   // contiguous (B, Ha, M, N) in a's dtype
  MatmulSoftmaxParams params;
};

PreparedMatmulSoftmax prepare_matmul_softmax(const at::Tensor& a, const at::Tensor& b,
                                             std::optional<double> scale, bool is_causal,
                                             const std::optional<at::Tensor>& attn_mask);

// Writes the raw logits a @ b^T (b's heads broadcast over a's head groups) into prepared.out with
// one batched GEMM of the backend's BLAS: the output buffer doubles as the logits buffer, so no
// (B, Ha, M, N) temporary exists. The backend then scales, masks and normalizes it in place. fp16
// logits come already scaled, and prepared.params.scale is then 1.
void logits_into_output(PreparedMatmulSoftmax& prepared);

}  // namespace flashmod
