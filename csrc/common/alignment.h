// The 16-byte alignment test that vectorized (16-byte) loads and stores need. Torch-free host
// code, for host launchers of every operator.
#pragma once

#include <cstdint>

namespace flashmod {

inline bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace flashmod
