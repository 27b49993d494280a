// CPU softmax: the online normalizer over rows, vectorized with GCC/Clang vector extensions and
// dispatched at run time between AVX-512, AVX2 and baseline builds of the same code.
//
// Last-dimension rows (the hot case) take two passes:
//   1. read x once: per 256-element chunk, find the chunk's per-lane max, rescale the running
//      per-lane sum to the new max (online normalizer), and store e = exp(x - m_chunk) into y
//      together with m_chunk; max and sum are complete at the end of this single read pass;
//   2. write y = e * exp(m_chunk - M) / S, one exp per 256 elements.
// That is one exp per element and three sweeps over the row (read x, write e, rewrite y) where the
// classic safe softmax needs four (max, exp+sum, write, scale); the row stays in cache in between.
//
// Other dimensions (rows with stride `inner`) are processed 16 rows at a time, one per vector
// lane, with the online update once per group of 8 elements; fp64 (for gradcheck) is scalar.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../common/knobs.h"
#include "../softmax_host.h"
#include "softmax_cpu_kernels.h"

// Vector-extension types are passed between always-inlined helpers only; the ABI note GCC emits
// for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace flashmod::cpu {
namespace {

#define FM_INLINE inline __attribute__((always_inline))

// Floats per chunk in chunk_max (the widest ISA's lanes) and rows per strided block.
constexpr int kMaxLanes = 16;
constexpr int64_t kChunk = 256;  // elements that share one rescale of the online normalizer

namespace w16 {  // AVX-512, and the baseline (16 lanes in a sum keep its rounding error within
                 // the tests' bound at 64k elements, where 4 lanes did not)
constexpr int kLanes = 16;
#include "softmax_rows_impl.h"
}  // namespace w16
namespace w8 {  // AVX2
constexpr int kLanes = 8;
#include "softmax_rows_impl.h"
}  // namespace w8

#define FLASHMOD_SHARED_ROW_KERNELS(SUFFIX, TARGET, NS)                                            \
  TARGET void softmax_f32_##SUFFIX(const float* x, float* y, int64_t n, float s, float* cm) {      \
    NS::softmax_row_impl(x, y, n, s, cm);                                                          \
  }                                                                                                \
  TARGET void softmax_bf16_##SUFFIX(const c10::BFloat16* x, float* e, c10::BFloat16* y, int64_t n, \
                                    float s, float* cm) {                                          \
    NS::softmax_row_impl(x, e, n, s, cm, y);                                                       \
  }                                                                                                \
  TARGET void softmax_strided_f32_##SUFFIX(const float* x, float* y, int64_t n, int64_t stride,    \
                                           int64_t lanes) {                                        \
    NS::softmax_strided_groups(x, y, n, stride, lanes);                                            \
  }                                                                                                \
  TARGET void bf16_to_f32_##SUFFIX(const c10::BFloat16* s, float* d, int64_t n) {                  \
    NS::bf16_to_f32_impl(s, d, n);                                                                 \
  }                                                                                                \
  TARGET void f32_to_bf16_##SUFFIX(const float* s, c10::BFloat16* d, int64_t n) {                  \
    NS::f32_to_bf16_impl(s, d, n);                                                                 \
  }

#define FLASHMOD_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define FLASHMOD_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

FLASHMOD_SHARED_ROW_KERNELS(avx512, FLASHMOD_TARGET_AVX512, w16)
FLASHMOD_SHARED_ROW_KERNELS(avx2, FLASHMOD_TARGET_AVX2, w8)
FLASHMOD_SHARED_ROW_KERNELS(baseline, , w16)

// fp16 <-> fp32 needs the F16C/AVX-512 conversion instructions; the baseline converts per element.
FLASHMOD_TARGET_AVX512 void f16_to_f32_avx512(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
FLASHMOD_TARGET_AVX512 void f32_to_f16_avx512(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
FLASHMOD_TARGET_AVX2 void f16_to_f32_avx2(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
FLASHMOD_TARGET_AVX2 void f32_to_f16_avx2(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
void f16_to_f32_baseline(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
void f32_to_f16_baseline(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

RowKernels pick_row_kernels() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  // FLASHMOD_CPU_ISA forces the attention kernel's instruction set and these rows' alike (amx
  // has no softmax of its own: it means AVX-512 here).
  const std::string want = env_text("FLASHMOD_CPU_ISA");
  const bool use_avx512 = avx512 && (want.empty() || want == "avx512" || want == "amx");
  const bool use_avx2 = avx2 && (use_avx512 || want.empty() || want == "avx2");
  TORCH_CHECK(
      want.empty() || want == "baseline" || use_avx2, "FLASHMOD_CPU_ISA='", want,
      "' is not a known ISA or not supported by this CPU; allowed: amx, avx512, avx2, baseline");
  if (use_avx512) {
    return {softmax_f32_avx512, softmax_bf16_avx512, softmax_strided_f32_avx512, bf16_to_f32_avx512,
            f32_to_bf16_avx512, f16_to_f32_avx512,   f32_to_f16_avx512,          "avx512"};
  }
  if (use_avx2) {
    return {softmax_f32_avx2, softmax_bf16_avx2, softmax_strided_f32_avx2, bf16_to_f32_avx2,
            f32_to_bf16_avx2, f16_to_f32_avx2,   f32_to_f16_avx2,          "avx2"};
  }
  return {softmax_f32_baseline,         softmax_bf16_baseline,
          softmax_strided_f32_baseline, bf16_to_f32_baseline,
          f32_to_bf16_baseline,         f16_to_f32_baseline,
          f32_to_f16_baseline,          "baseline"};
}

// fp64 exists for gradcheck: a scalar loop per row, strided rows gathered into a contiguous buffer.
void softmax_cpu_f64(const SoftmaxParams& p) {
  const auto* x = static_cast<const double*>(p.x);
  auto* y = static_cast<double*>(p.y);
  const int64_t n = p.dim_size, inner = p.inner;
  at::parallel_for(0, p.outer * inner, std::max<int64_t>(1, kParallelGrainElements / n),
                   [&](int64_t begin, int64_t end) {
                     std::vector<double> row(inner == 1 ? 0 : n);
                     for (int64_t t = begin; t < end; ++t) {
                       const int64_t base = (t / inner) * n * inner + t % inner;
                       if (inner == 1) {
                         softmax_row_f64(x + base, y + base, n, 1.0);
                         continue;
                       }
                       for (int64_t d = 0; d < n; ++d) row[d] = x[base + d * inner];
                       softmax_row_f64(row.data(), row.data(), n, 1.0);
                       for (int64_t d = 0; d < n; ++d) y[base + d * inner] = row[d];
                     }
                   });
}

template <typename T>
void softmax_cpu_typed(const SoftmaxParams& p) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const auto* x = static_cast<const T*>(p.x);
  auto* y = static_cast<T*>(p.y);
  const int64_t n = p.dim_size;
  const RowKernels& k = row_kernels();
  if (p.inner == 1) {
    at::parallel_for(
        0, p.outer, std::max<int64_t>(1, kParallelGrainElements / n),
        [&](int64_t begin, int64_t end) {
          std::vector<float> chunk_max(chunk_max_floats(n));
          std::vector<float> row(kF32 ? 0 : n);  // 16-bit rows are widened to fp32 here
          for (int64_t r = begin; r < end; ++r) {
            if constexpr (kF32) {
              k.softmax_f32(x + r * n, y + r * n, n, 1.0f, chunk_max.data());
            } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
              k.softmax_bf16(x + r * n, row.data(), y + r * n, n, 1.0f, chunk_max.data());
            } else {
              to_f32(k, x + r * n, row.data(), n);
              k.softmax_f32(row.data(), row.data(), n, 1.0f, chunk_max.data());
              from_f32(k, row.data(), y + r * n, n);
            }
          }
        });
    return;
  }
  constexpr int64_t kLanes = kMaxLanes;
  const int64_t blocks = (p.inner + kLanes - 1) / kLanes;
  const int64_t grain = std::max<int64_t>(1, kParallelGrainElements / (n * kLanes));
  at::parallel_for(0, p.outer * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> strip(kF32 ? 0 : n * kLanes);  // 16-bit: the (n x 16) block widened to fp32
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i0 = (t % blocks) * kLanes, off = (t / blocks) * n * p.inner + i0;
      const int64_t lanes = std::min<int64_t>(kLanes, p.inner - i0);
      if constexpr (kF32) {
        k.softmax_strided_f32(x + off, y + off, n, p.inner, lanes);
      } else {
        for (int64_t d = 0; d < n; ++d)
          to_f32(k, x + off + d * p.inner, strip.data() + d * kLanes, lanes);
        k.softmax_strided_f32(strip.data(), strip.data(), n, kLanes, lanes);
        for (int64_t d = 0; d < n; ++d)
          from_f32(k, strip.data() + d * kLanes, y + off + d * p.inner, lanes);
      }
    }
  });
}

at::Tensor softmax_cpu(const at::Tensor& x, int64_t dim) {
  PreparedSoftmax prepared = prepare_softmax(x, dim);
  if (prepared.y.numel() == 0) return prepared.y;
  const SoftmaxParams& p = prepared.params;
  switch (p.dtype) {
    case ScalarKind::kFloat32: softmax_cpu_typed<float>(p); break;
    case ScalarKind::kFloat64: softmax_cpu_f64(p); break;
    case ScalarKind::kFloat16: softmax_cpu_typed<c10::Half>(p); break;
    case ScalarKind::kBFloat16: softmax_cpu_typed<c10::BFloat16>(p); break;
  }
  return prepared.y;
}

}  // namespace

const RowKernels& row_kernels() {
  static const RowKernels kernels = pick_row_kernels();
  return kernels;
}

int64_t chunk_max_floats(int64_t n) {
  return ((n + kChunk - 1) / kChunk) * kMaxLanes;
}

void softmax_row_f64(const double* x, double* y, int64_t n, double scale) {
  const double inf = std::numeric_limits<double>::infinity();
  double m = -inf, s = 0.0;
  for (int64_t j = 0; j < n; ++j) {  // the online normalizer, one element at a time
    const double v = x[j] * scale;
    // A NaN anywhere makes the whole row NaN (as torch.softmax); std::max would drop one that
    // comes before any finite value, and the -inf skip below one after only -infs.
    if (std::isnan(v)) {
      std::fill(y, y + n, std::numeric_limits<double>::quiet_NaN());
      return;
    }
    const double m_new = std::max(m, v);
    if (m_new == -inf) continue;
    s = s * std::exp(m - m_new) + std::exp(v - m_new);
    m = m_new;
  }
  if (m == -inf) {
    std::fill(y, y + n, 0.0);
    return;
  }
  const double inv = 1.0 / s;
  for (int64_t j = 0; j < n; ++j) y[j] = std::exp(x[j] * scale - m) * inv;
}

}  // namespace flashmod::cpu

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("softmax", &flashmod::cpu::softmax_cpu);
}
