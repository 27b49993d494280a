// CUDA registrations of flashmod::softmax and flashmod::matmul_softmax: the shared host checks
// (csrc/softmax/softmax_host.cpp), then the launchers of softmax.cu / matmul_softmax.cu on the
// current stream of the inputs' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

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

at::Tensor matmul_softmax_cuda(const at::Tensor& a, const at::Tensor& b,
                               std::optional<double> scale, bool is_causal,
                               const std::optional<at::Tensor>& attn_mask) {
  const c10::cuda::CUDAGuard guard(a.device());
  PreparedMatmulSoftmax prepared = prepare_matmul_softmax(a, b, scale, is_causal, attn_mask);
  if (prepared.out.numel() == 0) return prepared.out;
  prepared.params.single_pass_max_cols = env_int("FLASHMOD_MMSM_SINGLE_PASS_MAX_N", -1);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!launch_matmul_softmax_fused(prepared.params, stream)) {
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
