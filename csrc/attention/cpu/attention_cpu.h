// The CPU forward and backward on filled params (dense: no per-sequence extents), for the serving
// ops' per-sequence loops (serve_cpu.cpp). fp64 runs the scalar loops, the rest the ISA kernels.
#pragma once

#include "../attention_host.h"
#include "../attention_params.h"

namespace flashmod {

void run_attention_cpu(const AttentionParams& p);

// The same on a paged sequence view (sequence_view.h: k / v the page pools, block_table its
// pages) where the decode engine takes the call (at most 8 queries, not fp64), which reads the
// pages in place; false, with nothing written, where it does not.
bool run_attention_cpu_paged(const AttentionParams& p);

// attention_backward's gradients of q, k and v on the CPU into prepared's (zeroed here first),
// after prepare_attention_backward and, for dropout, set_dropout (the variable-length backward's
// per-sequence calls set params.dropout_batch0 too).
void run_attention_backward_cpu(PreparedAttentionBackward& prepared);

}  // namespace flashmod
