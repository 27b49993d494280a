// CPU matmul_softmax: softmax(scale * a @ b^T + mask) with the output buffer as the only
// (B, Ha, M, N) allocation. fp32 / fp64 / bf16: one batched GEMM (MKL/oneDNN through at::bmm_out)
// writes the raw logits straight into the output; then each row is scaled, masked and normalized
// in place by the same vectorized online-softmax row kernel as flashmod::softmax, while it is hot
// in cache. fp16, and bf16 on CPUs without AVX512-BF16: fp32 logits by row blocks
// (matmul_softmax_f32_logits and bf16_logits_by_bf16_gemm say why).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../common/additive_mask.h"
#include "../../common/cpu_blas.h"
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

// Row i of (b, h): logits[0:visible] (in acc_t, already a @ b^T) scaled, masked and normalized
// in place; the caller stores them.
template <typename acc_t>
void softmax_logits_row(const RowKernels& k, acc_t* logits, int64_t visible,
                        const MatmulSoftmaxParams& p, int64_t b, int64_t h, int64_t i,
                        float* chunk_max) {
  acc_t scale = static_cast<acc_t>(p.scale);
  if (p.mask_kind != MaskKind::kNone) {
    apply_mask<acc_t>(logits, visible, scale, p, b, h, i);
    scale = acc_t(1);
  }
  if constexpr (std::is_same_v<acc_t, double>) {
    softmax_row_f64(logits, logits, visible, scale);
  } else {
    k.softmax_f32(logits, logits, visible, scale, chunk_max);
  }
}

// Top-left causal: row i sees columns 0..i; the rest are written as exact zeros.
inline int64_t visible_columns(const MatmulSoftmaxParams& p, int64_t i) {
  return p.causal ? std::min(i + 1, p.cols) : p.cols;
}

// fp32/fp64 (and bf16): the logits a @ b^T were written into `out` by one batched GEMM
// (logits_into_output); each row is normalized where it lies, while it is hot in cache.
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
      const int64_t visible = visible_columns(p, i);
      acc_t* logits;
      if constexpr (kInPlace) {
        logits = row;
      } else {
        logits = buf.data();
        to_f32(k, row, logits, visible);
      }
      softmax_logits_row<acc_t>(k, logits, visible, p, b, h, i, chunk_max.data());
      if constexpr (!kInPlace) from_f32(k, logits, row, visible);
      std::fill(row + visible, row + N, T(0));
    }
  });
}

// fp16 (and bf16 where the CPU has no fast bf16 GEMM: bf16_logits_by_bf16_gemm): the logits in
// fp32, never rounded to the inputs' dtype. Written into fp16 `out` they would round once more
// than the fused CUDA kernel's (and plain torch's extra rounding after the scale then sometimes
// cancels part of it: 1 seed in 3000 of one test shape failed the 2x rule, session 41), and a raw
// logit past 65504 would become inf before the scale shrinks it (a NaN row where the fused CUDA
// kernel is exact). CPUs without fp16 arithmetic also run torch's fp16 GEMM far slower than
// sgemm (a (8, 512, 128) x (8, 128, 512) bmm: 211 ms against 2.7 ms on a Zen 5). So a and b are
// widened once (O(inputs) memory), and each task, rows_per_task rows of one (batch, head), runs
// sgemm into a per-thread fp32 buffer (the output stays the only (B, Ha, M, N) allocation) and
// normalizes its rows from there; causal tasks stop the product at their last row's diagonal.
template <typename T>
void matmul_softmax_f32_logits(const PreparedMatmulSoftmax& r) {
  const MatmulSoftmaxParams& p = r.params;
  const int64_t N = p.cols, M = p.rows, K = p.depth, group = p.heads_a / p.heads_b;
  const at::Tensor a32 = r.a.to(at::kFloat).contiguous();  // (B, Ha, M, K)
  const at::Tensor b32 = r.b.to(at::kFloat).contiguous();  // (B, Hb, N, K)
  const float* a_base = a32.data_ptr<float>();
  const float* b_base = b32.data_ptr<float>();
  auto* out = static_cast<T*>(p.out);
  const RowKernels& k = row_kernels();
  // 64 K floats of logits a task (L2-sized), and at least 16 rows, so that each pass over b's
  // head feeds 16 rows' products.
  const int64_t rows_per_task = std::min(M, std::max<int64_t>(16, (int64_t{1} << 16) / N));
  const int64_t chunks = (M + rows_per_task - 1) / rows_per_task;
  at::parallel_for(0, p.batch * p.heads_a * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max(chunk_max_floats(N));
    std::vector<float> logits(static_cast<size_t>(rows_per_task * N));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t % chunks, h = (t / chunks) % p.heads_a, b = t / (chunks * p.heads_a);
      const int64_t i0 = c * rows_per_task, i1 = std::min(M, i0 + rows_per_task);
      const int64_t cols = visible_columns(p, i1 - 1);  // the widest row of the task
      const float* a_rows = a_base + ((b * p.heads_a + h) * M + i0) * K;  // K > 0 (checked)
      const float* b_head = b_base + (b * p.heads_b + h / group) * N * K;
      matmul_rows<float>(false, true, i1 - i0, cols, K, 1.f, a_rows, K, b_head, K, 0.f,
                         logits.data(), cols);
      for (int64_t i = i0; i < i1; ++i) {
        float* row_logits = logits.data() + (i - i0) * cols;
        T* row = out + ((b * p.heads_a + h) * M + i) * N;
        const int64_t visible = visible_columns(p, i);
        softmax_logits_row<float>(k, row_logits, visible, p, b, h, i, chunk_max.data());
        from_f32(k, row_logits, row, visible);
        std::fill(row + visible, row + N, T(0));
      }
    }
  });
}

// Whether bf16 logits come from oneDNN's bf16 GEMM into the output (the row kernels on AVX-512 and
// the CPU with AVX512-BF16 or AMX). Without those instructions torch's bf16 GEMM is a scalar loop:
// (8, 512, 128) x (8, 128, 512), 2 threads on a Zen 5 with oneDNN held to AVX2, 193 ms against
// sgemm's 2.7 ms (held to AVX-512 without BF16: 3.5 ms; with it: 0.66 ms), so bf16 then takes
// the fp32-logit path, as fp16 does. FLASHMOD_CPU_ISA=avx2 (or baseline) selects it too.
bool bf16_logits_by_bf16_gemm() {
  return std::string(row_kernels().isa) == "avx512" && __builtin_cpu_supports("avx512bf16");
}

at::Tensor matmul_softmax_cpu(const at::Tensor& a, const at::Tensor& b, std::optional<double> scale,
                              bool is_causal, const std::optional<at::Tensor>& attn_mask) {
  PreparedMatmulSoftmax prepared = prepare_matmul_softmax(a, b, scale, is_causal, attn_mask);
  if (prepared.out.numel() == 0) return prepared.out;
  const MatmulSoftmaxParams& p = prepared.params;
  if (p.dtype == ScalarKind::kFloat16) {
    matmul_softmax_f32_logits<c10::Half>(prepared);
    return prepared.out;
  }
  if (p.dtype == ScalarKind::kBFloat16 && !bf16_logits_by_bf16_gemm()) {
    matmul_softmax_f32_logits<c10::BFloat16>(prepared);
    return prepared.out;
  }
  logits_into_output(prepared);
  switch (p.dtype) {
    case ScalarKind::kFloat32: normalize_rows_in_place<float>(p); break;
    case ScalarKind::kFloat64: normalize_rows_in_place<double>(p); break;
    case ScalarKind::kBFloat16: normalize_rows_in_place<c10::BFloat16>(p); break;
    case ScalarKind::kFloat16: break;  // above
  }
  return prepared.out;
}

}  // namespace
}  // namespace flashmod::cpu

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("matmul_softmax", &flashmod::cpu::matmul_softmax_cpu);
}
