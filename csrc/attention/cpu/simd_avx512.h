// AVX-512 definitions for engine_common.h, shared by kernel_avx512.cpp and kernel_amx.cpp. Included
// inside their anonymous namespace, after their `#pragma GCC target`.

// GCC 12's AVX-512 intrinsics pass an "undefined" vector as the unused merge source, which
// -Wmaybe-uninitialized reports wherever they inline (cvtph_ps, max_ps, roundscale_ps, ...).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

constexpr int kW = 16;
using vf = float __attribute__((vector_size(64)));
using vi = int32_t __attribute__((vector_size(64)));

inline vf splat(float s) {
  return (vf)_mm512_set1_ps(s);
}
inline vf fmadd(vf a, vf b, vf c) {
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
inline float hsum(vf v) {
  return _mm512_reduce_add_ps((__m512)v);
}
inline vf load_f16(const uint16_t* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf load_bf16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vf)_mm512_slli_epi32(wide, 16);
}
inline vi load_u8(const uint8_t* p) {
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
