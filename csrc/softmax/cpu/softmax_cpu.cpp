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
#include <type_traits>
#include <vector>

#include "../softmax_host.h"
#include "softmax_cpu_kernels.h"

// Vector-extension types are passed between always-inlined helpers only; the ABI note GCC emits
// for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace flashmod::cpu {
namespace {

#define FM_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;                       // one AVX-512 register of fp32
constexpr int kChunkVecs = 16;                   // vectors per online-normalizer chunk
constexpr int64_t kChunk = kLanes * kChunkVecs;  // 256 elements share one rescale
constexpr float kInf = std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

FM_INLINE vf splat(float v) {
  return vf{} + v;
}
FM_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
FM_INLINE void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
FM_INLINE vf vmax(vf a, vf b) {
  return a > b ? a : b;
}

FM_INLINE vf load_partial(const float* p, int64_t count, float fill) {
  alignas(64) float buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < count ? p[i] : fill;
  return load(buf);
}
FM_INLINE void store_partial(float* p, vf v, int64_t count) {
  alignas(64) float buf[kLanes];
  store(buf, v);
  for (int64_t i = 0; i < count; ++i) p[i] = buf[i];
}

// exp for the arguments softmax produces (x <= 0, or NaN): Cody-Waite reduction to
// r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial (truncation error 5e-9 relative, below
// fp32 rounding).
// Exactly 0 below -87 (so masked -inf elements contribute nothing), NaN in -> NaN out.
FM_INLINE vf vexp(vf x) {
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi bits = ((vi)t - (vi)magic + 127) << 23;  // 2^n built in the exponent field
  const vf res = p * (vf)bits;
  return x < -87.0f ? splat(0.0f) : res;
}

// Loads lanes [0, count) of x * scale; the other lanes read -inf (after scaling, so a negative
// scale cannot turn the padding into +inf).
template <bool kFull>
FM_INLINE vf load_scaled(const float* x, int64_t count, vf scale) {
  if constexpr (kFull) {
    return load(x) * scale;
  } else {
    const vf v = load_partial(x, count, 0.0f) * scale;
    alignas(64) float lane[kLanes];
    for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
    return load(lane) < static_cast<float>(count) ? v : splat(-kInf);
  }
}

// Pass 1 over one chunk of `len` elements (len == kChunk when kFull).
template <bool kFull>
FM_INLINE void online_chunk(const float* x, float* y, int64_t len, vf scale, vf& m, vf& sum,
                            float* chunk_max) {
  const int nvec = kFull ? kChunkVecs : static_cast<int>((len + kLanes - 1) / kLanes);
  vf cmax = splat(-kInf);
  for (int j = 0; j < nvec; ++j)
    cmax = vmax(cmax, load_scaled<kFull>(x + j * kLanes, len - j * kLanes, scale));
  const vf m_new = vmax(m, cmax);
  // Lanes that have seen only -inf keep base 0, so exp(-inf - base) is 0 rather than NaN.
  const vf base = m_new == -kInf ? splat(0.0f) : m_new;
  vf acc = sum * vexp(m - base);
  for (int j = 0; j < nvec; ++j) {
    const vf e = vexp(load_scaled<kFull>(x + j * kLanes, len - j * kLanes, scale) - base);
    if (kFull || (j + 1) * kLanes <= len) {
      store(y + j * kLanes, e);
    } else {
      store_partial(y + j * kLanes, e, len - j * kLanes);
    }
    acc += e;
  }
  sum = acc;
  m = m_new;
  store(chunk_max, m_new);
}

FM_INLINE void softmax_row_impl(const float* x, float* y, int64_t n, float scale_s,
                                float* chunk_max) {
  const vf scale = splat(scale_s);
  vf m = splat(-kInf), sum = splat(0.0f);
  int64_t c = 0, k0 = 0;
  for (; k0 + kChunk <= n; k0 += kChunk, ++c)
    online_chunk<true>(x + k0, y + k0, kChunk, scale, m, sum, chunk_max + c * kLanes);
  if (k0 < n) online_chunk<false>(x + k0, y + k0, n - k0, scale, m, sum, chunk_max + c * kLanes);

  // Merge the 16 lane summaries: S = sum over lanes of sum_l * exp(m_l - M).
  alignas(64) float lane[kLanes];
  store(lane, m);
  float M = -kInf;
  for (float v : lane) M = std::max(M, v);
  store(lane, M == -kInf ? sum : sum * vexp(m - M));
  float S = 0.0f;
  for (float v : lane) S += v;
  if (M == -kInf && S == 0.0f) {  // every element is -inf: documented to give zeros
    std::memset(y, 0, sizeof(float) * n);
    return;
  }
  // NaN anywhere has made S NaN, so the whole row comes out NaN below.
  const vf vM = splat(M), inv = splat(1.0f / S);
  for (int64_t k = 0, ci = 0; k < n; k += kChunk, ++ci) {
    const vf f = vexp(load(chunk_max + ci * kLanes) - vM) * inv;
    const int64_t len = std::min(kChunk, n - k);
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes) store(y + k + j, load(y + k + j) * f);
    if (j < len) store_partial(y + k + j, load_partial(y + k + j, len - j, 0.0f) * f, len - j);
  }
}

// Rows along a non-last dimension: up to 16 neighbouring rows (consecutive `inner` positions) ride
// in the vector lanes, so each load is one contiguous run; element d of the rows is at
// x + d * stride. Online normalizer over groups of 8 elements (one rescale per group), then a
// second pass writes.
FM_INLINE void softmax_strided_impl(const float* x, float* y, int64_t n, int64_t stride,
                                    int64_t lanes) {
  constexpr int64_t kGroup = 8;
  auto get = [&](int64_t d) {
    return lanes == kLanes ? load(x + d * stride) : load_partial(x + d * stride, lanes, 0.0f);
  };
  vf m = splat(-kInf), sum = splat(0.0f);
  for (int64_t d0 = 0; d0 < n; d0 += kGroup) {
    const int64_t d1 = std::min(n, d0 + kGroup);
    vf gmax = splat(-kInf);
    for (int64_t d = d0; d < d1; ++d) gmax = vmax(gmax, get(d));
    const vf m_new = vmax(m, gmax);
    const vf base = m_new == -kInf ? splat(0.0f) : m_new;
    vf acc = sum * vexp(m - base);
    for (int64_t d = d0; d < d1; ++d) acc += vexp(get(d) - base);
    sum = acc;
    m = m_new;
  }
  // Lanes of only -inf have sum 0 and write exp(-inf - 0) * 1 = 0; a NaN sum makes its lane NaN.
  const vf base = m == -kInf ? splat(0.0f) : m;
  const vf inv = splat(1.0f) / (sum == 0.0f ? splat(1.0f) : sum);
  for (int64_t d = 0; d < n; ++d) {
    const vf e = vexp(get(d) - base) * inv;
    if (lanes == kLanes) {
      store(y + d * stride, e);
    } else {
      store_partial(y + d * stride, e, lanes);
    }
  }
}

FM_INLINE void bf16_to_f32_impl(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vh h;
    std::memcpy(&h, src + i, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    store(dst + i, (vf)u);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

FM_INLINE void f32_to_bf16_impl(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(src + i);
    vu u = (vu)v;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    u = v != v ? vu{} + 0x7fc0u : u;             // the rounding carry must not turn NaN into -0
    const vh h = __builtin_convertvector(u, vh);
    std::memcpy(dst + i, &h, sizeof h);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

#define FLASHMOD_SHARED_ROW_KERNELS(SUFFIX, TARGET)                                             \
  TARGET void softmax_f32_##SUFFIX(const float* x, float* y, int64_t n, float s, float* cm) {   \
    softmax_row_impl(x, y, n, s, cm);                                                           \
  }                                                                                             \
  TARGET void softmax_strided_f32_##SUFFIX(const float* x, float* y, int64_t n, int64_t stride, \
                                           int64_t lanes) {                                     \
    softmax_strided_impl(x, y, n, stride, lanes);                                               \
  }                                                                                             \
  TARGET void bf16_to_f32_##SUFFIX(const c10::BFloat16* s, float* d, int64_t n) {               \
    bf16_to_f32_impl(s, d, n);                                                                  \
  }                                                                                             \
  TARGET void f32_to_bf16_##SUFFIX(const float* s, c10::BFloat16* d, int64_t n) {               \
    f32_to_bf16_impl(s, d, n);                                                                  \
  }

#define FLASHMOD_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define FLASHMOD_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

FLASHMOD_SHARED_ROW_KERNELS(avx512, FLASHMOD_TARGET_AVX512)
FLASHMOD_SHARED_ROW_KERNELS(avx2, FLASHMOD_TARGET_AVX2)
FLASHMOD_SHARED_ROW_KERNELS(baseline, )

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
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return {softmax_f32_avx512,
            softmax_strided_f32_avx512,
            bf16_to_f32_avx512,
            f32_to_bf16_avx512,
            f16_to_f32_avx512,
            f32_to_f16_avx512,
            "avx512"};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return {softmax_f32_avx2,
            softmax_strided_f32_avx2,
            bf16_to_f32_avx2,
            f32_to_bf16_avx2,
            f16_to_f32_avx2,
            f32_to_f16_avx2,
            "avx2"};
  }
  return {softmax_f32_baseline,
          softmax_strided_f32_baseline,
          bf16_to_f32_baseline,
          f32_to_bf16_baseline,
          f16_to_f32_baseline,
          f32_to_f16_baseline,
          "baseline"};
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
            } else {
              to_f32(k, x + r * n, row.data(), n);
              k.softmax_f32(row.data(), row.data(), n, 1.0f, chunk_max.data());
              from_f32(k, row.data(), y + r * n, n);
            }
          }
        });
    return;
  }
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
  return ((n + kChunk - 1) / kChunk) * kLanes;
}

void softmax_row_f64(const double* x, double* y, int64_t n, double scale) {
  const double inf = std::numeric_limits<double>::infinity();
  double m = -inf, s = 0.0;
  for (int64_t j = 0; j < n; ++j) {  // the online normalizer, one element at a time
    const double v = x[j] * scale;
    const double m_new = std::max(m, v);
    if (m_new == -inf) continue;
    s = s * std::exp(m - m_new) + std::exp(v - m_new);
    m = std::isnan(v) ? v : m_new;
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
