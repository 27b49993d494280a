// CPU matmul_softmax: softmax(scale * a @ b^T + mask) with the output buffer as the only
// (B, Ha, M, N) allocation. One batched GEMM (MKL/oneDNN through at::bmm_out) writes the raw
// logits straight into the output; then each row is scaled, masked and normalized in place by the
// same vectorized online-softmax row kernel as flashmod::softmax, while it is hot in cache.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../common/additive_mask.h"
#include "../softmax_host.h"
#include "softmax_cpu_kernels.h"

namespace flashmod::cpu {
namespace {

template <typename T>
struct Working {
  using type = float;
};
template <>
struct Working<double> {
  using type = double;
};

// Overwrites logits[0:n] with scale * logit + mask (additive), or -inf where a bool mask is false
// or an additive value hides the key (additive_mask.h).
template <typename acc_t>
void apply_mask(acc_t* logits, int64_t n, acc_t scale, const MatmulSoftmaxParams& p, int64_t b,
                int64_t h, int64_t i) {
  const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_row_stride;
  const int64_t cs = p.mask_col_stride;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const auto add = [&](const auto* mask) {
    for (int64_t j = 0; j < n; ++j) {
      logits[j] *= scale;
      add_mask_value(logits[j], acc_t(mask[j * cs]));
    }
  };
  switch (p.mask_kind) {
    case MaskKind::kBool: {
      const auto* mask = static_cast<const uint8_t*>(p.mask) + off;
      for (int64_t j = 0; j < n; ++j) logits[j] = mask[j * cs] ? logits[j] * scale : neg_inf;
      break;
    }
    case MaskKind::kAdditiveF32: add(static_cast<const float*>(p.mask) + off); break;
    case MaskKind::kAdditive:
      switch (p.dtype) {  // the mask has the inputs' dtype
        case ScalarKind::kFloat32: add(static_cast<const float*>(p.mask) + off); break;
        case ScalarKind::kFloat64: add(static_cast<const double*>(p.mask) + off); break;
        case ScalarKind::kFloat16: add(static_cast<const c10::Half*>(p.mask) + off); break;
        case ScalarKind::kBFloat16: add(static_cast<const c10::BFloat16*>(p.mask) + off); break;
      }
      break;
    case MaskKind::kNone: break;
  }
}

template <typename T>
void normalize_rows_in_place(const MatmulSoftmaxParams& p) {
  using acc_t = typename Working<T>::type;
  constexpr bool kInPlace = std::is_same_v<T, acc_t>;  // fp32/fp64 rows need no conversion buffer
  const int64_t N = p.cols, M = p.rows;
  auto* out = static_cast<T*>(p.out);
  const RowKernels& k = row_kernels();
  const int64_t grain = std::max<int64_t>(1, kParallelGrainElements / N);
  at::parallel_for(0, p.batch * p.heads_a * M, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max(std::is_same_v<acc_t, double> ? 0 : chunk_max_floats(N));
    std::vector<acc_t> buf(kInPlace ? 0 : N);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % M, h = (r / M) % p.heads_a, b = r / (M * p.heads_a);
      T* row = out + r * N;
      // Top-left causal: row i sees columns 0..i; the rest are written as exact zeros.
      const int64_t visible = p.causal ? std::min(i + 1, N) : N;
      acc_t* logits;
      if constexpr (kInPlace) {
        logits = row;
      } else {
        logits = buf.data();
        to_f32(k, row, logits, visible);
      }
      acc_t scale = static_cast<acc_t>(p.scale);
      if (p.mask_kind != MaskKind::kNone) {
        apply_mask<acc_t>(logits, visible, scale, p, b, h, i);
        scale = acc_t(1);
      }
      if constexpr (std::is_same_v<acc_t, double>) {
        softmax_row_f64(logits, logits, visible, scale);
      } else {
        k.softmax_f32(logits, logits, visible, scale, chunk_max.data());
      }
      if constexpr (!kInPlace) from_f32(k, logits, row, visible);
      std::fill(row + visible, row + N, T(0));
    }
  });
}

at::Tensor matmul_softmax_cpu(const at::Tensor& a, const at::Tensor& b, std::optional<double> scale,
                              bool is_causal, const std::optional<at::Tensor>& attn_mask) {
  PreparedMatmulSoftmax prepared = prepare_matmul_softmax(a, b, scale, is_causal, attn_mask);
  if (prepared.out.numel() == 0) return prepared.out;
  logits_into_output(prepared);
  const MatmulSoftmaxParams& p = prepared.params;
  switch (p.dtype) {
    case ScalarKind::kFloat32: normalize_rows_in_place<float>(p); break;
    case ScalarKind::kFloat64: normalize_rows_in_place<double>(p); break;
    case ScalarKind::kFloat16: normalize_rows_in_place<c10::Half>(p); break;
    case ScalarKind::kBFloat16: normalize_rows_in_place<c10::BFloat16>(p); break;
  }
  return prepared.out;
}

}  // namespace
}  // namespace flashmod::cpu

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("matmul_softmax", &flashmod::cpu::matmul_softmax_cpu);
}
