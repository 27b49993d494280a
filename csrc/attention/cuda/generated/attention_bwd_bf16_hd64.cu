// One instantiation per file: ninja builds the 16 backward variants in parallel.
#include "../bwd_sm80_launch.h"

namespace flashmod::cuda_kernels {
template cudaError_t run_attention_bwd<__nv_bfloat16, 64>(const AttentionBwdParams&, const BwdRowStats&,
                                                   cudaStream_t);
}  // namespace flashmod::cuda_kernels
