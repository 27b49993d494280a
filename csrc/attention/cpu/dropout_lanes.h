// Dropout's keep bits for the CPU kernels, a row of keys at a time on W lanes of Philox4x32-10
// (../dropout_draws.h holds the definition; keep_row there is its scalar form, which W = 4 keeps:
// SSE2's 64-bit products of two lanes lost to it). Generic vector code, so that it compiles for
// the instruction set of the function it is inlined into: the forward's kernel units (#pragma GCC
// target) and the backward's per-ISA row operations (target attributes); AVX2's products alone
// are intrinsics (mul_hi_avx2). One call's counter word x0 is its index 4 * span + t, so W
// consecutive calls are a lane ramp.
// Zen 5, 10 rounds, per call: 0.9 ns on 16 lanes (AVX-512), 9 ns scalar. A whole row (512 keys):
// 0.40 ns a key on 16 lanes, 0.61 on 8 (AVX2); with the keep bytes written one draw at a time it
// was 0.67 on 16 lanes, most of it that loop, and 1.40 on 8 with GCC's 64-bit lane products
// (mul_hi_avx2).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../dropout_draws.h"

namespace flashmod::cpu {

typedef unsigned int DropoutLanes8 __attribute__((vector_size(32)));

// The high words of m * x on 8 lanes, for the AVX2 kernels (W = 8 runs there only). The generic
// form (below) multiplies 64-bit lanes, which AVX2 lacks: GCC built each from three 32-bit
// products, not knowing the operands' high halves are zero; one vpmuludq per lane pair is the
// whole product. Not always_inline: GCC would then inline it into the template's mul_hi first,
// whose target is the default, and refuse; left to itself it inlines it into the AVX2 callers.
__attribute__((target("avx2"))) inline DropoutLanes8 mul_hi_avx2(uint32_t m, DropoutLanes8 x) {
  const __m256i mv = _mm256_set1_epi32(static_cast<int>(m)), xv = (__m256i)x;
  const __m256i even = _mm256_mul_epu32(xv, mv);                        // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xv, 32), mv);  // lanes 1, 3, 5, 7
  return (DropoutLanes8)_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

template <int W>
struct DropoutLanes {
  typedef unsigned int vu __attribute__((vector_size(4 * W)));
  typedef unsigned long long vq __attribute__((vector_size(4 * W)));  // W / 2 lane pairs
  typedef unsigned short vh __attribute__((vector_size(4 * W)));      // 2 W 16-bit draws
  typedef short vs __attribute__((vector_size(4 * W)));               // their comparisons

  // The high words of m * x per lane: even and odd lanes as 64-bit products.
  static inline __attribute__((always_inline)) vu mul_hi(uint32_t m, vu x) {
    if constexpr (W == 8) {  // (copies: GCC takes this template's vector type for a scalar here)
      DropoutLanes8 x8;
      std::memcpy(&x8, &x, sizeof x8);
      const DropoutLanes8 hi = mul_hi_avx2(m, x8);
      vu out;
      std::memcpy(&out, &hi, sizeof hi);
      return out;
    }
    const vq pairs = (vq)x, mv = vq{} + m;
    const vq even = (pairs & 0xFFFFFFFFull) * mv, odd = (pairs >> 32) * mv;
    return (vu)((even >> 32) | (odd & 0xFFFFFFFF00000000ull));
  }

  // Philox4x32-10 on W lanes of counters (x0, x1, x2, x3) under d's key: the output words, in
  // place.
  static inline __attribute__((always_inline)) void philox(vu& x0, vu& x1, vu& x2, vu& x3,
                                                           const DropoutState& d) {
    uint32_t k0 = d.key0, k1 = d.key1;
    for (int round = 0; round < 10; ++round) {
      if (round > 0) {  // the Weyl key schedule between rounds
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      const vu hi0 = mul_hi(0xD2511F53u, x0), lo0 = x0 * 0xD2511F53u;
      const vu hi1 = mul_hi(0xCD9E8D57u, x2), lo1 = x2 * 0xCD9E8D57u;
      x0 = hi1 ^ x1 ^ k0;
      x1 = lo1;
      x2 = hi0 ^ x3 ^ k1;
      x3 = lo0;
    }
  }

  // Dropout on a block of probabilities with the queries in the lanes (the forward's layout:
  // S[(c - c0) * ld + r] is query r0 + r and key c): survivors times d.scale, the rest 0. The lanes
  // run over W consecutive queries of one call (span, t), so its eight draws are eight keys'
  // keep masks for W queries at once: no keep bytes, no transposition. Rows are taken in whole
  // vectors: those past `rows` are the block's padding, whose values no output reads.
  static inline __attribute__((always_inline)) void drop_query_lanes(const DropoutState& d,
                                                                     int64_t bh, int64_t r0,
                                                                     int64_t rows, int64_t c0,
                                                                     int64_t cols, float* S,
                                                                     int64_t ld) {
    typedef float vf __attribute__((vector_size(4 * W)));
    typedef int vi __attribute__((vector_size(4 * W)));
    const int64_t c_end = c0 + cols;
    const vu threshold = vu{} + d.threshold;  // 32-bit: p = 1's 2^16 keeps no 16-bit draw
    const vf scale = vf{} + d.scale;
    uint32_t lane[W];
    for (int l = 0; l < W; ++l) lane[l] = static_cast<uint32_t>(l);
    vu ramp;
    std::memcpy(&ramp, lane, sizeof ramp);
    for (int64_t rv = 0; rv < rows; rv += W) {
      const vu queries = ramp + static_cast<uint32_t>(r0 + rv);
      for (int64_t span = c0 / 32; 32 * span < c_end; ++span) {
        for (uint32_t t = 0; t < 4; ++t) {
          vu x0 = vu{} + static_cast<uint32_t>(4 * span + t), x1 = queries,
             x2 = vu{} + static_cast<uint32_t>(bh), x3 = vu{} + d.stream;
          philox(x0, x1, x2, x3, d);
          const vu words[4] = {x0, x1, x2, x3};
          for (int jj = 0; jj < 4; ++jj) {
            for (int e = 0; e < 2; ++e) {
              const int64_t j = 32 * span + 8 * jj + 2 * t + e;
              if (j < c0 || j >= c_end) continue;
              const vu draws = e ? words[jj] >> 16 : words[jj] & 0xFFFFu;
              const vi keep = (vi)(draws >= threshold);  // all ones or 0 per lane
              float* s = S + (j - c0) * ld + rv;
              vf v;
              std::memcpy(&v, s, sizeof v);
              v = (vf)((vi)(v * scale) & keep);
              std::memcpy(s, &v, sizeof v);
            }
          }
        }
      }
    }
  }

  // keep[c] = 1 where query i of head bh keeps key c0 + c, for c < cols (keep_row's contract).
  static inline __attribute__((always_inline)) void keep_row(const DropoutState& d, int64_t bh,
                                                             int64_t i, int64_t c0, int64_t cols,
                                                             uint8_t* keep) {
    if constexpr (W <= 4) {
      ::flashmod::keep_row(d, bh, i, c0, cols, keep);
    } else {
      const int64_t c_end = c0 + cols, first = 4 * (c0 / 32),
                    calls = 4 * ((c_end + 31) / 32) - first;
      if (d.threshold > 0xFFFFu) {  // p = 1: no 16-bit draw reaches it
        std::memset(keep, 0, static_cast<size_t>(cols));
        return;
      }
      const vh threshold = vh{} + static_cast<unsigned short>(d.threshold);
      for (int64_t base = 0; base < calls; base += W) {
        uint32_t ramp[W];
        for (int l = 0; l < W; ++l) ramp[l] = static_cast<uint32_t>(first + base + l);
        vu x0, x1 = vu{} + static_cast<uint32_t>(i), x2 = vu{} + static_cast<uint32_t>(bh),
               x3 = vu{} + d.stream;
        std::memcpy(&x0, ramp, sizeof x0);
        philox(x0, x1, x2, x3, d);
        // Word jj of call l holds the draws of keys 32 (call / 4) + 8 jj + 2 (call % 4) + e in its
        // halves e: read as 2 W 16-bit draws, word jj's draws 8 q .. 8 q + 7 are keys
        // 32 span + 8 jj + 0 .. 7 of the batch's span q, in order. So each word compares to
        // the threshold at once and its keep bytes go out 8 keys at a time.
        const int64_t span0 = (first + base) / 4;
        const vu words[4] = {x0, x1, x2, x3};
        for (int jj = 0; jj < 4; ++jj) {
          vh draws;
          std::memcpy(&draws, &words[jj], sizeof draws);
          const vs kept_lanes = draws >= threshold;  // -1 or 0 per draw
          uint16_t lanes[2 * W];
          std::memcpy(lanes, &kept_lanes, sizeof lanes);
          uint8_t bytes[2 * W];  // (the narrowing loop vectorizes; __builtin_convertvector does
          for (int k = 0; k < 2 * W; ++k) bytes[k] = static_cast<uint8_t>(lanes[k] & 1u);
          // not take this template's vector types in GCC 11-13)
          for (int q = 0; q < W / 4 && 4 * q + base < calls; ++q) {
            const int64_t key0 = 32 * (span0 + q) + 8 * jj;
            if (key0 >= c0 && key0 + 8 <= c_end) {
              std::memcpy(keep + (key0 - c0), bytes + 8 * q, 8);
            } else {
              for (int e = 0; e < 8; ++e)
                if (key0 + e >= c0 && key0 + e < c_end) keep[key0 + e - c0] = bytes[8 * q + e];
            }
          }
        }
      }
    }
  }
};

}  // namespace flashmod::cpu
