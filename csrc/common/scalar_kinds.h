// The element and mask kinds every operator's params struct names. Torch-free, like the params
// structs that include it.
#pragma once

#include <cstdint>

namespace flashmod {

enum class ScalarKind : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

enum class MaskKind : int32_t {
  kNone = 0,
  kBool = 1,         // uint8/bool storage, nonzero = attend
  kAdditive = 2,     // same dtype as q, added to the scaled (and soft-capped) score
  kAdditiveF32 = 3,  // fp32 additive mask for fp16/bf16 q
};

}  // namespace flashmod
