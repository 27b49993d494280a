// Dropout's keep bits for the CPU kernels, a row of keys at a time on W lanes of Philox4x32-10
// (../dropout_draws.h holds the definition; keep_row there is its scalar form, which W = 4 keeps:
// SSE2's 64-bit products of two lanes lost to it). Generic vector code only, so that it compiles
// for the instruction set of the function it is inlined into: the forward's kernel units
// (#pragma GCC target) and the backward's per-ISA row operations (target attributes). One call's
// counter word x0 is its index 4 * span + t, so W consecutive calls are a lane ramp.
// Zen 5, 10 rounds, per call: 0.9 ns on 16 lanes (AVX-512), 6.1 ns on 8 (AVX2: no 64-bit lane
// product, emulated), 9 ns scalar.
#pragma once

#include <cstdint>
#include <cstring>

#include "../dropout_draws.h"

namespace flashmod::cpu {

template <int W>
struct DropoutLanes {
  typedef unsigned int vu __attribute__((vector_size(4 * W)));
  typedef unsigned long long vq __attribute__((vector_size(4 * W)));  // W / 2 lane pairs

  // The high words of m * x per lane: even and odd lanes as 64-bit products.
  static inline __attribute__((always_inline)) vu mul_hi(uint32_t m, vu x) {
    const vq pairs = (vq)x, mv = vq{} + m;
    const vq even = (pairs & 0xFFFFFFFFull) * mv, odd = (pairs >> 32) * mv;
    return (vu)((even >> 32) | (odd & 0xFFFFFFFF00000000ull));
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
      for (int64_t base = 0; base < calls; base += W) {
        uint32_t ramp[W];
        for (int l = 0; l < W; ++l) ramp[l] = static_cast<uint32_t>(first + base + l);
        vu x0, x1 = vu{} + static_cast<uint32_t>(i), x2 = vu{} + static_cast<uint32_t>(bh),
               x3 = vu{} + d.stream;
        std::memcpy(&x0, ramp, sizeof x0);
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
        uint32_t words[4][W];
        std::memcpy(words[0], &x0, sizeof x0);
        std::memcpy(words[1], &x1, sizeof x1);
        std::memcpy(words[2], &x2, sizeof x2);
        std::memcpy(words[3], &x3, sizeof x3);
        for (int l = 0; l < W && base + l < calls; ++l) {
          const int64_t call = first + base + l, key0 = 32 * (call / 4) + 2 * (call % 4);
          for (int jj = 0; jj < 4; ++jj) {
            for (int e = 0; e < 2; ++e) {
              const int64_t j = key0 + 8 * jj + e;
              if (j >= c0 && j < c_end)
                keep[j - c0] = ((words[jj][l] >> (16 * e)) & 0xFFFFu) >= d.threshold;
            }
          }
        }
      }
    }
  }
};

}  // namespace flashmod::cpu
