// Dropout's random draws, shared by the CUDA kernels (cuda/dropout.h: keep bits in the mma
// accumulator layouts) and the CPU ones (keep_multipliers: a row of keys at a time). Whether query
// i of head bh (= batch * heads_q + q head) keeps key j is a pure function of (the call's rng
// words, bh, i, j): a backward regenerates its forward's choices with nothing stored, in its own
// tiles and layouts, on either device, and flashmod/reference.py (dropout_keep_mask) computes the
// same bits for the tests.
//
// The definition (reference.py's docstring says the same):
//   Philox4x32-10 (Salmon et al., SC'11) with key (lo, hi words of rng[0]) and counter
//   (4 * (j / 32) + (j % 8) / 2, i, bh, lo word of rng[1]) gives four words, eight 16-bit draws
//   (low half first); key j takes draw 2 * ((j % 32) / 8) + j % 2, and is kept iff that draw is
//   >= the threshold round(dropout_p * 2^16).
// Why that grouping: one call's eight draws are exactly the eight elements a lane of an mma.sync
// accumulator holds in one row of a 32-key span (keys 2t, 2t + 1 of each of four n8 tiles).
#pragma once

#include <cstdint>

#include "../common/host_device.h"
#include "attention_params.h"

namespace flashmod {

struct PhiloxWords {
  uint32_t x, y, z, w;
};

FLASHMOD_HD uint32_t mul_hi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

FLASHMOD_HD PhiloxWords philox4x32_10(PhiloxWords c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the Weyl key schedule between rounds
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = mul_hi32(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = mul_hi32(0xCD9E8D57u, c.z);
    c = PhiloxWords{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

FLASHMOD_HD uint32_t word_of(const PhiloxWords& w, int n) {
  return n == 0 ? w.x : n == 1 ? w.y : n == 2 ? w.z : w.w;
}

struct DropoutState {
  uint32_t key0 = 0, key1 = 0, stream = 0, threshold = 0;
  float scale = 1.f;
};

// p's dropout words, read from the memory of p's device (the CUDA kernels: every thread, one
// 16-byte L2-resident load).
FLASHMOD_HD DropoutState dropout_state(const AttentionParams& p) {
  DropoutState d;
  const uint64_t seed = static_cast<uint64_t>(p.dropout_rng[0]);
  d.key0 = static_cast<uint32_t>(seed);
  d.key1 = static_cast<uint32_t>(seed >> 32);
  d.stream = static_cast<uint32_t>(p.dropout_rng[1]);
  d.threshold = p.dropout_threshold;
  d.scale = static_cast<float>(p.dropout_scale);
  return d;
}

// The head index `bh` the draws take for batch row b, query head h of p's call. The CUDA kernels,
// where dropout_batch0 is always 0, spell it b * heads_q + h: reading the field there cost the
// Hopper backward's dropout variants 4-16 bytes more spill each (ptxas, sm_90a, session 45).
FLASHMOD_HD uint32_t dropout_head_index(const AttentionParams& p, int64_t b, int64_t h) {
  return static_cast<uint32_t>((p.dropout_batch0 + b) * p.heads_q + h);
}

// The eight draws of query i's keys in the 32-key span `span` with (j % 8) / 2 == t.
FLASHMOD_HD PhiloxWords dropout_draws(const DropoutState& d, uint32_t bh, uint32_t i, uint32_t span,
                                      uint32_t t) {
  return philox4x32_10(PhiloxWords{4 * span + t, i, bh, d.stream}, d.key0, d.key1);
}

// Whether the draw in half `half` (0: low) of `word` keeps its key.
FLASHMOD_HD bool kept(const DropoutState& d, uint32_t word, int half) {
  return ((word >> (16 * half)) & 0xFFFFu) >= d.threshold;
}

// CPU kernels: keep[c] = 1 where query i of head bh keeps key c0 + c, else 0, for c < cols. Not
// a template, and defined before the CPU kernel units' `#pragma GCC target`: every unit's copy is
// the same baseline code, whichever one the linker keeps.
inline void keep_row(const DropoutState& d, int64_t bh, int64_t i, int64_t c0, int64_t cols,
                     uint8_t* keep) {
  const int64_t c_end = c0 + cols;
  for (int64_t span = c0 / 32; span * 32 < c_end; ++span) {
    for (uint32_t t = 0; t < 4; ++t) {
      const PhiloxWords w = dropout_draws(d, static_cast<uint32_t>(bh), static_cast<uint32_t>(i),
                                          static_cast<uint32_t>(span), t);
      for (int jj = 0; jj < 4; ++jj) {
        for (int e = 0; e < 2; ++e) {
          const int64_t j = 32 * span + 8 * jj + 2 * t + e;
          if (j >= c0 && j < c_end) keep[j - c0] = kept(d, word_of(w, jj), e);
        }
      }
    }
  }
}

}  // namespace flashmod
