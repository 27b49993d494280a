// Dropout on the probabilities from a counter-based generator. Whether query i of head bh (=
// batch * heads_q + q head) keeps key j is a pure function of (rng words, bh, i, j): the backward
// regenerates the forward's choices with nothing stored, in its own tile shapes and layouts, and
// flashmod/reference.py (dropout_keep_mask) computes the same bits for the tests.
//
// The definition (reference.py's docstring says the same):
//   Philox4x32-10 (Salmon et al., SC'11) with key (lo, hi words of rng[0]) and counter
//   (4 * (j / 32) + (j % 8) / 2, i, bh, lo word of rng[1]) gives four words, eight 16-bit draws
//   (low half first); key j takes draw 2 * ((j % 32) / 8) + j % 2, and is kept iff that draw is
//   >= the threshold round(dropout_p * 2^16).
// Why that grouping: one call's eight draws are exactly the eight elements a lane of an mma.sync
// accumulator holds in one row of a 32-key span (keys 2t, 2t + 1 of each of four n8 tiles), so a
// lane whose rows are queries makes one call per row and span. The dK/dV kernel holds S^T (keys
// as rows): there one call serves two lanes' keys (g and g + 8, and g ^ 1's) of one query, twice
// the calls per element (keep_bits_key_rows).
#pragma once

#include <cstdint>

#include "../attention_params.h"

namespace flashmod::cuda_kernels {

struct DropoutState {
  uint32_t key0 = 0, key1 = 0, stream = 0, threshold = 0;
  float scale = 1.f;
};

// p's dropout words, read from device memory by every thread (one 16-byte load, L2-resident).
__device__ __forceinline__ DropoutState dropout_state(const AttentionParams& p) {
  DropoutState d;
  const uint64_t seed = static_cast<uint64_t>(p.dropout_rng[0]);
  d.key0 = static_cast<uint32_t>(seed);
  d.key1 = static_cast<uint32_t>(seed >> 32);
  d.stream = static_cast<uint32_t>(p.dropout_rng[1]);
  d.threshold = p.dropout_threshold;
  d.scale = p.dropout_scale;
  return d;
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the Weyl key schedule between rounds
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// The eight draws of query i's keys in the 32-key span `span` with (j % 8) / 2 == t.
__device__ __forceinline__ uint4 dropout_draws(const DropoutState& d, uint32_t bh, uint32_t i,
                                               uint32_t span, uint32_t t) {
  return philox4x32_10(make_uint4(4 * span + t, i, bh, d.stream), d.key0, d.key1);
}

__device__ __forceinline__ uint32_t word_of(const uint4& w, int n) {
  return n == 0 ? w.x : n == 1 ? w.y : n == 2 ? w.z : w.w;
}

__device__ __forceinline__ bool kept(const DropoutState& d, uint32_t word, int half) {
  return ((word >> (16 * half)) & 0xFFFFu) >= d.threshold;
}

// Keep bits of an accumulator in the query-rows layout (the forward's and dQ kernel's S): element
// [ni][e] is query row_g + 8 * (e / 2), key col0 + 8 * ni + 2 t + e % 2; bit 4 ni + e.
// col0 is a multiple of 32 (key blocks of 32 or 64).
template <int NT>
__device__ __forceinline__ uint32_t keep_bits_query_rows(const DropoutState& d, uint32_t bh,
                                                         uint32_t row_g, uint32_t col0, int t) {
  static_assert(NT % 4 == 0 && 4 * NT <= 32, "whole 32-key spans, one 32-bit mask");
  uint32_t bits = 0;
#pragma unroll
  for (int half_row = 0; half_row < 2; ++half_row)
#pragma unroll
    for (int s = 0; s < NT / 4; ++s) {
      const uint4 w = dropout_draws(d, bh, row_g + 8 * half_row, col0 / 32 + s, t);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          bits |= static_cast<uint32_t>(kept(d, word_of(w, jj), e))
                  << (4 * (4 * s + jj) + 2 * half_row + e);
    }
  return bits;
}

// Keep bits of an accumulator in the key-rows layout (the dK/dV kernel's S^T): element [ni][e] is
// key key_g + 8 * (e / 2), query row0 + 8 * ni + 2 t + e % 2; bit 4 ni + e. key_g is the lane's
// first key, g its row in the m16 tile: key_g % 32 is below 8 or in [16, 24) (16-key warp slices
// of blocks of whole 32-key spans), so keys key_g and key_g + 8 share a span and a call, and
// key_g % 2 == g % 2. The call of a query also holds the draws of keys key_g ^ 1 (+ 8), which lane
// g ^ 1 (this lane ^ 4, same t, same queries) owns: each lane of the pair makes the calls of the
// queries of its own parity (NT calls, not 2 NT) and passes the other's bits over by a shuffle.
// Every lane of the warp must call it (the shuffle).
template <int NT>
__device__ __forceinline__ uint32_t keep_bits_key_rows(const DropoutState& d, uint32_t bh,
                                                       uint32_t key_g, uint32_t row0, int t) {
  static_assert(4 * NT <= 32, "one 32-bit mask");
  const uint32_t span = key_g / 32, key_t = (key_g % 8) / 2;
  const int word0 = static_cast<int>((key_g % 32) / 8), parity = static_cast<int>(key_g % 2);
  uint32_t mine = 0, partners = 0;  // bits of queries e % 2 == parity: own keys, the pair's keys
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    const uint4 w = dropout_draws(d, bh, row0 + 8 * ni + 2 * t + parity, span, key_t);
    const int bit = 4 * ni + parity;
    mine |= static_cast<uint32_t>(kept(d, word_of(w, word0), parity)) << bit;
    mine |= static_cast<uint32_t>(kept(d, word_of(w, word0 + 1), parity)) << (bit + 2);
    partners |= static_cast<uint32_t>(kept(d, word_of(w, word0), parity ^ 1)) << bit;
    partners |= static_cast<uint32_t>(kept(d, word_of(w, word0 + 1), parity ^ 1)) << (bit + 2);
  }
  // The pair's lane made the calls of the queries of the other parity, for this lane's keys too.
  return mine | __shfl_xor_sync(0xffffffffu, partners, 4);
}

// acc[ni][e] *= scale where bit 4 ni + e is set, else 0.
template <int NT>
__device__ __forceinline__ void apply_dropout(float (&acc)[NT][4], uint32_t bits, float scale) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[ni][e] = (bits >> (4 * ni + e)) & 1u ? acc[ni][e] * scale : 0.f;
}

}  // namespace flashmod::cuda_kernels
