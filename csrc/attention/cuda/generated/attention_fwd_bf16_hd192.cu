// One instantiation per file: ninja builds the 16 tensor-core variants in parallel.
#include "../fwd_sm80_launch.h"

namespace flashmod::cuda_kernels {
template cudaError_t run_attention_fwd<__nv_bfloat16, 192>(const AttentionParams&,
                                                           const FwdLaunchFlags&, cudaStream_t);
template cudaError_t run_attention_fwd_decode<__nv_bfloat16, 192>(const AttentionParams&,
                                                                  const FwdLaunchFlags&,
                                                                  const DecodeOptions&,
                                                                  const DecodeWorkspace&,
                                                                  cudaStream_t);
}  // namespace flashmod::cuda_kernels
