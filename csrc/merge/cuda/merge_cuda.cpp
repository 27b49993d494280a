// CUDA registration of flashmod::merge_attention: the shared host checks and passes
// (merge_host.cpp), then the kernel on the current stream of the inputs' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../merge_host.h"
#include "merge_launch.h"

namespace flashmod {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_attention_cuda(at::TensorList outs, at::TensorList lses) {
  TORCH_CHECK(!outs.empty(),
              "flashmod.merge_attention: outs must hold at least one partial output");
  const c10::cuda::CUDAGuard guard(outs[0].device());
  auto [out, lse] = merge_attention_passes(outs, lses, [](const MergeParams& p) {
    C10_CUDA_CHECK(cuda_kernels::launch_merge_attention(p, at::cuda::getCurrentCUDAStream()));
  });
  return {out, lse};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("merge_attention", &flashmod::merge_attention_cuda);
}
