// Dropout's keep bits for the CPU kernels, a row of keys at a time on W lanes of Philox4x32-10
// (../dropout_draws.h holds the definition; keep_row there is its scalar form, which W = 4 keeps:
// SSE2's 64-bit products of two lanes lost to it). Generic vector code only, so that it compiles
// for the instruction set of the function it is inlined into: the forward's kernel units
// (#pragma GCC target) and the backward's per-ISA row operations (target attributes). One call's
// counter word x0 is its index 4 * span + t, so W consecutive calls are a lane ramp.
// Zen 5, 10 rounds, per call: 0.9 ns on 16 lanes (AVX-512), 6.1 ns on 8 (AVX2: no 64-bit lane
// product, emulated), 9 ns scalar. A whole row (512 keys): 0.40 ns a key on 16 lanes, 1.37 on 8;
// with the keep bytes written one draw at a time it was 0.67 on 16 lanes, most of it that loop.
#pragma once

#include <cstdint>
#include <cstring>

#include "../dropout_draws.h"

namespace flashmod::cpu {

template <int W>
struct DropoutLanes {
  typedef unsigned int vu __attribute__((vector_size(4 * W)));
  typedef unsigned long long vq __attribute__((vector_size(4 * W)));  // W / 2 lane pairs
  typedef unsigned short vh __attribute__((vector_size(4 * W)));      // 2 W 16-bit draws
  typedef short vs __attribute__((vector_size(4 * W)));               // their comparisons

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
