// The CPU forward on filled params (dense: no per-sequence extents), for the serving ops'
// per-sequence loop (serve_cpu.cpp). fp64 runs the scalar loop, the rest the ISA kernel.
#pragma once

#include "../attention_params.h"

namespace flashmod {

void run_attention_cpu(const AttentionParams& p);

}  // namespace flashmod
