// Row kernels shared by the CPU softmax and matmul_softmax ops (defined in softmax_cpu.cpp).
//
// The fp32 row kernel is compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and the best
// one for the running CPU is picked once at run time: the build bakes in no -march flags, so the
// same wheel runs everywhere and still uses the wide vectors where they exist.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace flashmod::cpu {

struct RowKernels {
  // y[0:n] = softmax(scale * x[0:n]); x and y may be the same buffer. A row whose elements are
  // all -inf becomes all zeros; a NaN anywhere makes the whole row NaN. chunk_max needs
  // chunk_max_floats(n) floats of scratch.
  void (*softmax_f32)(const float* x, float* y, int64_t n, float scale, float* chunk_max);
  // The same for bf16 rows; e is n floats of scratch.
  void (*softmax_bf16)(const c10::BFloat16* x, float* e, c10::BFloat16* y, int64_t n, float scale,
                       float* chunk_max);
  // `lanes` (<= 16) neighbouring rows of n elements, element d of row l at x[d * stride + l].
  void (*softmax_strided_f32)(const float* x, float* y, int64_t n, int64_t stride, int64_t lanes);
  void (*bf16_to_f32)(const c10::BFloat16* src, float* dst, int64_t n);
  void (*f32_to_bf16)(const float* src, c10::BFloat16* dst, int64_t n);
  void (*f16_to_f32)(const c10::Half* src, float* dst, int64_t n);
  void (*f32_to_f16)(const float* src, c10::Half* dst, int64_t n);
  const char* isa;  // "avx512", "avx2" or "baseline"
};

// The variant for this CPU, chosen on first use.
const RowKernels& row_kernels();

int64_t chunk_max_floats(int64_t n);

// fp64 reference-grade row softmax (gradcheck, not speed): same semantics as softmax_f32.
void softmax_row_f64(const double* x, double* y, int64_t n, double scale);

// Row conversions to/from the fp32 working precision; the float overloads are plain copies.
inline void to_f32(const RowKernels& k, const c10::BFloat16* s, float* d, int64_t n) {
  k.bf16_to_f32(s, d, n);
}
inline void to_f32(const RowKernels& k, const c10::Half* s, float* d, int64_t n) {
  k.f16_to_f32(s, d, n);
}
inline void from_f32(const RowKernels& k, const float* s, c10::BFloat16* d, int64_t n) {
  k.f32_to_bf16(s, d, n);
}
inline void from_f32(const RowKernels& k, const float* s, c10::Half* d, int64_t n) {
  k.f32_to_f16(s, d, n);
}

// Work per at::parallel_for task: enough elements that the fork/join cost is noise.
constexpr int64_t kParallelGrainElements = 1 << 15;

}  // namespace flashmod::cpu
