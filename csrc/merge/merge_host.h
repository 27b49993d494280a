// Host-side preparation of merge_attention shared by the CPU and CUDA registrations: the checks
// (mirrored in flashmod/merge_ops.py's fake implementation), the outputs, and the passes of at most
// kMaxMergeParts partials that cover any number of them.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <utility>
#include <vector>

#include "merge_params.h"

namespace flashmod {

// Checks outs/lses, then calls run_pass(params) once per pass of at most kMaxMergeParts partials;
// the last pass writes the returned (out, lse), shaped like outs[0] (contiguous) and lses[0].
std::pair<at::Tensor, at::Tensor> merge_attention_passes(
    at::TensorList outs, at::TensorList lses,
    const std::function<void(const MergeParams&)>& run_pass);

}  // namespace flashmod
