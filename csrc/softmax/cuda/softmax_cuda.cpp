// CUDA registrations of flashmod::softmax and flashmod::matmul_softmax: the shared host checks
// (csrc/softmax/softmax_host.cpp), then the launchers of softmax.cu / matmul_softmax.cu on the
// current stream of the inputs' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../softmax_host.h"
#include "softmax_launch.cuh"

namespace flashmod::cuda {
namespace {

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim) {
  const c10::cuda::CUDAGuard guard(x.device());
  PreparedSoftmax prepared = prepare_softmax(x, dim);
  if (prepared.y.numel() == 0) return prepared.y;
  SoftmaxCudaKnobs& knobs = prepared.params.knobs;
  knobs.trace = env_flag("FLASHMOD_SOFTMAX_TRACE", false);
  knobs.stream = env_flag("FLASHMOD_SOFTMAX_STREAM", true);
  knobs.stream_cluster = static_cast<int>(env_int("FLASHMOD_SOFTMAX_STREAM_CLUSTER", 0));
  const int64_t workspace_floats = softmax_workspace_floats(prepared.params);
  at::Tensor workspace;
  if (workspace_floats > 0)
    workspace = at::empty({workspace_floats}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(launch_softmax(prepared.params,
                                workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr,
                                at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return prepared.y;
}

// Whether matmul_softmax tries its fused kernels before the cuBLAS + normalize fallback.
// FLASHMOD_MMSM_FUSED: 0 the fallback always, 2 the fused kernels wherever they run, 1 (default)
// by this rule. On Hopper (H200, session 42, unmasked calls, same process; x torch, fused /
// fallback): fp32 without causality at depth 96 / 128 0.73-0.91x / 0.86-1.01x (the 3xTF32
// mma.sync kernels against cuBLAS's SGEMM), at depth 32 / 64 1.16-1.54x / 0.96-1.01x; bf16 without
// causality at N = 4096 (depth 64, 128) 1.55x / 2.12x and 1.96x / 2.16x, at depth 256 0.94x /
// 1.22x, but at N <= 2048 and depth <= 128 1.28-2.08x / 0.45-1.22x; causal calls, where the fused
// kernels skip the hidden half, 1.4-11.7x / 1.1-4.8x. So on sm_90 unmasked non-causal calls take
// the fallback at fp32 depth > 64 and at 16-bit depth > 128 or N >= 4096. Masked calls, fp16 and
// other GPUs were not timed against the fallback and keep the fused kernels' side of the rule.
bool fused_preferred(const MatmulSoftmaxParams& p) {
  const int64_t knob = env_int("FLASHMOD_MMSM_FUSED", 1);
  TORCH_CHECK(knob >= 0 && knob <= 2,
              error_message("FLASHMOD_MMSM_FUSED must be 0, 1 or 2, got ", knob));
  if (knob != 1) return knob == 2;
  if (p.causal || p.mask_kind != MaskKind::kNone) return true;
  if (at::cuda::getCurrentDeviceProperties()->major != 9) return true;
  if (p.dtype == ScalarKind::kFloat32) return p.depth <= 64;
  return p.depth <= 128 && p.cols < 4096;
}

at::Tensor matmul_softmax_cuda(const at::Tensor& a, const at::Tensor& b,
                               std::optional<double> scale, bool is_causal,
                               const std::optional<at::Tensor>& attn_mask) {
  const c10::cuda::CUDAGuard guard(a.device());
  PreparedMatmulSoftmax prepared = prepare_matmul_softmax(a, b, scale, is_causal, attn_mask);
  if (prepared.out.numel() == 0) return prepared.out;
  prepared.params.single_pass_max_cols = env_int("FLASHMOD_MMSM_SINGLE_PASS_MAX_N", -1);
  prepared.params.normalize_warp_rows = env_flag("FLASHMOD_MMSM_WARP_ROWS", true);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!fused_preferred(prepared.params) || !launch_matmul_softmax_fused(prepared.params, stream)) {
    logits_into_output(prepared);  // cuBLAS on the same current stream
    C10_CUDA_CHECK(launch_normalize_logits_in_place(prepared.params, stream));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return prepared.out;
}

}  // namespace
}  // namespace flashmod::cuda

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("softmax", &flashmod::cuda::softmax_cuda);
  m.impl("matmul_softmax", &flashmod::cuda::matmul_softmax_cuda);
}
