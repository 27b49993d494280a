// The entry points the torch host launcher (attention_cuda.cpp) calls. Torch-free on purpose:
// the .cu files that define them include nothing from torch.
#pragma once

#include <cuda_runtime.h>

#include "../attention_params.h"

namespace flashmod::cuda_kernels {

struct FwdLaunchFlags {
  int out_vec16;  // out's row starts are 16-byte aligned and head_dim % 8 == 0: 16-byte stores
};

// fp16/bf16 (Elem = __half or __nv_bfloat16) on tensor cores, head_dim <= kHeadDim. Requires
// q/k/v row starts to be 16-byte aligned (cp.async). Returns the first CUDA error of the set-up;
// the caller checks the launch with cudaGetLastError.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              cudaStream_t stream);

// The Hopper variant (wgmma, sm_90a machine code only) for kHeadDim = 64, 128 and 256; same
// contract.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                   cudaStream_t stream);

// fp32 on CUDA cores (FFMA), any alignment.
cudaError_t run_attention_fwd_fp32(const AttentionParams& p, cudaStream_t stream);

// Padded head dims the kernels are compiled for.
inline int padded_head_dim(int64_t d) {
  for (int pd : {32, 64, 96, 128, 160, 192, 224, 256})
    if (d <= pd) return pd;
  return -1;
}

}  // namespace flashmod::cuda_kernels
