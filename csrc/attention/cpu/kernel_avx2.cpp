// The forward kernel for AVX2 + FMA (Haswell and later, Zen): 8 fp32 lanes, 16 registers.
#include <immintrin.h>

#include "kernel.h"

#pragma GCC target("avx2,fma,f16c")

namespace flashmod::cpu {
namespace {

constexpr int kW = 8;
using vf = float __attribute__((vector_size(32)));
using vi = int32_t __attribute__((vector_size(32)));

inline vf splat(float s) {
  return (vf)_mm256_set1_ps(s);
}
inline vf fmadd(vf a, vf b, vf c) {
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vf load_f16(const uint16_t* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf load_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm256_slli_epi32(wide, 16);
}
inline vi load_u8(const uint8_t* p) {
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Scores: 4 keys x 3 vectors (Br = 24 queries) = 12 accumulators + 3 Q vectors + 1 broadcast of
// the 16 registers. P V: 3 rows x 4 vectors = 12 accumulators + 3 broadcasts + 1 row of V.
// Measured (AMD EPYC Zen 5 forced to AVX2, 1 thread, CPU time, D = 128, vs torch in-process):
// scores 4 -> 6 keys x 2 vectors took fp32 from 1.05 to 1.08x and bf16 from 0.92 to 0.95x (8
// accumulators barely cover 2 FMA ports x 4 cycles of latency). P V at 6 rows x 2 vectors lost
// (0.85-0.89x): GCC spilled 3 of its 12 accumulators, having hoisted all 6 broadcasts.
// Session 36 (Xeon Sapphire Rapids forced to AVX2, both sides; 1 thread, CPU time, builds
// alternating twice): P V 4 x 2 -> 3 x 4 (12 accumulators with room for the broadcasts) took the
// fp32 forward at N = 2048, D = 128 from 257-263 to 247-248 ms; then scores 6 keys x 2 vectors ->
// 4 keys x 3 vectors (each broadcast key element feeds 3 FMAs instead of 2: 7 loads per 12 FMAs,
// not 8) to 232-234 ms (0.92-0.93 -> 1.02-1.04x torch), and every other shape measured 3-6 %
// faster (fp32 D = 64 / 96 / 128 at N = 512-2048, causal, bf16).
constexpr int kNV = 3, kKB = 4, kRB = 3, kDV = 4;

// Bc = 64: S_ij (Bc x Br fp32) and a D=128 fp32 K_j/V_j tile (32 KiB) stay near L1.
constexpr int64_t kBc = 64;

#include "engine_common.h"
#include "engine_decode.h"
#include "engine_prefill.h"

}  // namespace

const KernelInfo kAvx2Kernel = {
    "avx2", kBr, nullptr, nullptr, &run_tasks_with<VecEngine>, kW, &decode_run, &decode_merge};

}  // namespace flashmod::cpu
