// The CUDA-only checks of the serving ops (serve_cuda.cpp, serve_backward_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../../common/error_message.h"

namespace flashmod {

constexpr int64_t kServeCudaMaxHeadDim = 256;

// fp16/bf16 only (flash-attn's dtypes; the fp32 kernels have no per-sequence variant) and
// head_dim <= 256, checked first. Same order and wording as flashmod/serve_ops.py's
// _check_cuda.
inline void check_cuda_inputs(const char* op, const at::Tensor& q) {
  TORCH_CHECK(
      q.scalar_type() != at::kDouble,
      error_message(op, ": q's dtype float64 is supported on CPU only, got it on ", q.device()));
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              error_message(op, ": q must be float16 or bfloat16 on CUDA, got ", q.scalar_type()));
  TORCH_CHECK(q.size(-1) <= kServeCudaMaxHeadDim,
              error_message(op, ": q's head_dim must be <= ", kServeCudaMaxHeadDim,
                            " on CUDA, got ", q.size(-1)));
}

}  // namespace flashmod
