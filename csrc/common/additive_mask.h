// Additive mask entries that hide their key. Masks written as "a very negative number" (HF's
// finfo(dtype).min, -1e9, fp16's -65504) mean "hidden", but as numbers they break the lse form of
// attention: a row whose every key carries one has lse ~ the mask value, and an fp32 lse of
// -3.4e38 (or -1e9) has lost the log of the row sum, so P = exp(s - lse) in the backward is off
// by that factor (and c * m overflows in the forward's exp2 form, giving NaN). Entries at or below
// kHidingMaskValue therefore hide their key exactly as a False in a bool mask: such a row gets
// output 0, lse -inf and zero gradients. Rows that keep a key above it are unchanged (a key 32768
// below the row max has weight exp(-32768) = 0 either way), and the largest |lse| left, ~2^15,
// keeps fp32's spacing there at 2^-8: P in the backward stays within 0.2 %.
#pragma once

#include <cmath>

#include "host_device.h"

namespace flashmod {

constexpr float kHidingMaskValue = -32768.f;

// NaN compares false: a NaN entry stays a visible NaN score, as in SDPA.
template <typename T>
FLASHMOD_HD bool mask_value_hides(T value) {
  return value <= static_cast<T>(kHidingMaskValue);
}

// score += value, or score = -inf where the value hides the key.
template <typename Score, typename Value>
FLASHMOD_HD void add_mask_value(Score& score, Value value) {
  score =
      mask_value_hides(value) ? static_cast<Score>(-INFINITY) : score + static_cast<Score>(value);
}

}  // namespace flashmod
