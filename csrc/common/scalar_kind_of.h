// The ScalarKind a params struct records for a (checked) floating tensor dtype. Host code only:
// it names at::ScalarType, which the torch-free kernel units never see.
#pragma once

#include <c10/core/ScalarType.h>

#include "scalar_kinds.h"

namespace flashmod {

// Callers have already checked the dtype is fp32, fp16, bf16 or fp64.
inline ScalarKind scalar_kind_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kDouble: return ScalarKind::kFloat64;
    default: return ScalarKind::kFloat32;
  }
}

}  // namespace flashmod
