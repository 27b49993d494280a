// Dropout on the probabilities in the mma.sync kernels: keep bits of the draws
// (../dropout_draws.h, the definition) in the two accumulator layouts. A lane whose rows are
// queries (forward, dQ) makes one call per row and 32-key span and uses its eight draws; the
// dK/dV kernel holds S^T (keys as rows), where one call serves two lanes' keys (g and g + 8, and
// g ^ 1's) of one query, twice the calls per element (keep_bits_key_rows).
#pragma once

#include <cstdint>

#include "../dropout_draws.h"

namespace flashmod::cuda_kernels {

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
      const PhiloxWords w = dropout_draws(d, bh, row_g + 8 * half_row, col0 / 32 + s, t);
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
    const PhiloxWords w = dropout_draws(d, bh, row0 + 8 * ni + 2 * t + parity, span, key_t);
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
