// The launchers that csrc/softmax/cuda/softmax_cuda.cpp calls: plain C++ signatures, no torch, no
// kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../softmax_params.h"

namespace flashmod::cuda {

// fp32 scratch that launch_softmax needs for p (rows too long for one block); 0 for most shapes.
int64_t softmax_workspace_floats(const SoftmaxParams& p);
// Returns the launch's error (the two-kernel and cluster paths leave theirs to cudaGetLastError).
cudaError_t launch_softmax(const SoftmaxParams& p, float* workspace, cudaStream_t stream);

// The fused tensor-core kernel (fp16/bf16 at depth <= 256, a multiple of 8; fp32 at depth <= 128, a
// multiple of 4; 16-byte aligned rows).
// Returns false, launching nothing, when p is outside what it handles.
bool launch_matmul_softmax_fused(const MatmulSoftmaxParams& p, cudaStream_t stream);

// For every other case: p.out already holds the raw logits a @ b^T (cuBLAS); scale, mask and
// normalize every row in place. Returns the launch's error.
cudaError_t launch_normalize_logits_in_place(const MatmulSoftmaxParams& p, cudaStream_t stream);

}  // namespace flashmod::cuda
