// The launch of the decode kernel for a call's (dtype, padded head dim) (host code, torch-free):
// one switch for the dense op (attention_cuda.cpp) and the KV-cache op (serve_cuda.cpp).
#pragma once

#include <cuda_runtime.h>

#include "../attention_params.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"

namespace flashmod::cuda_kernels {

// Launches the decode kernel of (p.dtype, padded head dim) into err; false (err untouched) when
// no decode kernel exists for them.
inline bool run_decode_kernel(const AttentionParams& p, const FwdLaunchFlags& flags,
                              const DecodeOptions& opt, const DeviceWorkspace& ws,
                              cudaStream_t stream, int padded, cudaError_t& err) {
  switch (variant_key(p.dtype, padded)) {
#define FLASHMOD_DECODE_CASE(Elem, kind, D)                             \
  case variant_key(ScalarKind::kind, D):                                \
    err = run_attention_fwd_decode<Elem, D>(p, flags, opt, ws, stream); \
    return true;
    FLASHMOD_FWD_SM80_VARIANTS(FLASHMOD_DECODE_CASE)
#undef FLASHMOD_DECODE_CASE
    default: return false;
  }
}

}  // namespace flashmod::cuda_kernels
