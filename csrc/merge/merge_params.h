// The plain description of one merge_attention call: P partial attention results over disjoint
// key sets, each (rows, D) with its lse (rows), merged into the exact result. Torch-free so that
// nvcc compiles the kernel on a machine without torch or a GPU.
#pragma once

#include <cstdint>

#include "../common/scalar_kinds.h"

namespace flashmod {

// Partials per kernel pass. The host merges more than this in passes of kMaxMergeParts (merging is
// associative: the running (out, lse) is one partial of the next pass), so any count works.
constexpr int kMaxMergeParts = 16;

struct MergeParams {
  // Every partial is contiguous (rows, head_dim); out likewise, lse (rows) fp32.
  const void* outs[kMaxMergeParts] = {};
  const float* lses[kMaxMergeParts] = {};
  int parts = 0;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t rows = 0;
  int64_t head_dim = 0;
  ScalarKind dtype = ScalarKind::kFloat32;  // of outs and out; the math is fp32 (fp64 for fp64)
};

}  // namespace flashmod
