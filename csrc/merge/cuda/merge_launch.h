// The torch-free entry point of the merge_attention kernel (merge_kernel.cu).
#pragma once

#include <cuda_runtime.h>

#include "../merge_params.h"

namespace flashmod::cuda_kernels {

// Launches the merge of p.parts partials on stream; returns the launch's error.
cudaError_t launch_merge_attention(const MergeParams& p, cudaStream_t stream);

}  // namespace flashmod::cuda_kernels
