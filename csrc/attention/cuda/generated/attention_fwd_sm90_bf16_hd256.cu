// One instantiation per file: ninja builds the Hopper variants in parallel with the others.
#include "../fwd_sm90_launch.h"

namespace flashmod::cuda_kernels {
template cudaError_t run_attention_fwd_sm90<__nv_bfloat16, 256>(const AttentionParams&,
                                                                const FwdLaunchFlags&,
                                                                cudaStream_t);
}  // namespace flashmod::cuda_kernels
