// The CPU forward on filled params (dense: no per-sequence extents), for the serving ops'
// per-sequence loop (serve_cpu.cpp). fp64 runs the scalar loop, the rest the ISA kernel.
#pragma once

#include "../attention_params.h"

namespace flashmod {

void run_attention_cpu(const AttentionParams& p);

// The same on a paged sequence view (sequence_view.h: k / v the page pools, block_table its
// pages) where the decode engine takes the call (at most 8 queries, not fp64), which reads the
// pages in place; false, with nothing written, where it does not.
bool run_attention_cpu_paged(const AttentionParams& p);

}  // namespace flashmod
