// Which decode kernel runs a decode-shaped call (host code, torch-free): the streaming Hopper
// kernel (decode_sm90_kernel.h) where its machine code runs and a variant exists for the head
// dim, else the mma.sync decode kernel. Shared by the dense op (attention_cuda.cpp) and the
// KV-cache op (serve_cuda.cpp).
#pragma once

#include <cuda_runtime.h>

#include "../attention_params.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"

namespace flashmod::cuda_kernels {

// Launches the decode kernel of (p.dtype, padded head dim) into err; false (err untouched) when
// no decode kernel exists for them. sm90: the caller's verdict that the sm_90a kernels may run.
inline bool run_decode_kernel(const AttentionParams& p, const FwdLaunchFlags& flags,
                              const DecodeOptions& opt, const DeviceWorkspace& ws,
                              cudaStream_t stream, int padded, bool sm90, cudaError_t& err) {
  const int key = variant_key(p.dtype, padded);
  if (sm90) {
    switch (key) {
#define FLASHMOD_DECODE_SM90_CASE(Elem, kind, D)                                     \
  case variant_key(ScalarKind::kind, D):                                             \
    err = run_attention_decode_sm90<Elem, D>(p, flags, opt, ws, stream); \
    return true;
      FLASHMOD_DECODE_SM90_VARIANTS(FLASHMOD_DECODE_SM90_CASE)
#undef FLASHMOD_DECODE_SM90_CASE
      default: break;
    }
  }
  switch (key) {
#define FLASHMOD_DECODE_CASE(Elem, kind, D)                                 \
  case variant_key(ScalarKind::kind, D):                                    \
    err = run_attention_fwd_decode<Elem, D>(p, flags, opt, ws, stream); \
    return true;
    FLASHMOD_FWD_SM80_VARIANTS(FLASHMOD_DECODE_CASE)
#undef FLASHMOD_DECODE_CASE
    default: return false;
  }
}

}  // namespace flashmod::cuda_kernels
