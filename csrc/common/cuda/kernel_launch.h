// The one way the library launches a kernel: the grid-size check, the opt-in to more than 48 KB
// of dynamic shared memory, the launch, and its error as the return value. Host code, no torch;
// cudaLaunchKernelEx rather than <<<>>> because the host compiler reads this header too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashmod::cuda {

// gridDim.x's limit. Callers that can exceed it turn cudaErrorInvalidConfiguration into an error
// message that names their shapes.
constexpr int64_t kMaxGridBlocks = 0x7fffffff;

// The current device's opt-in shared memory per block in bytes (A100 163 KB, H100 / H200 227 KB),
// for kernels whose tiles need more than some GPUs give; 0 where the runtime cannot say (its error
// cleared).
inline int device_smem_optin() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return optin;
}

// Dynamic shared memory above 48 KB is opt-in, per kernel (and needed before an occupancy query
// of a kernel that uses that much).
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, int64_t smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem_bytes));
}

// kernel(args...) on `grid` of `threads`-thread CTAs with smem_bytes of dynamic shared memory, on
// stream. Returns the opt-in's error or the launch's; an empty grid has nothing to run (success).
// (Cluster-shaped launches: cluster_launch.h.)
template <typename Kernel, typename... Args>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, int threads, int64_t smem_bytes,
                          cudaStream_t stream, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  const cudaError_t err = allow_dynamic_smem(kernel, smem_bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// The usual case: a 1-D grid of `blocks` CTAs, checked against gridDim.x's limit. An empty grid
// (a dimension of size 0, e.g. no query heads) has nothing to run: success, not CUDA's "invalid
// argument".
template <typename Kernel, typename... Args>
cudaError_t launch_kernel(Kernel kernel, int64_t blocks, int threads, int64_t smem_bytes,
                          cudaStream_t stream, Args... args) {
  if (blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), threads, smem_bytes, stream,
                       args...);
}

// dkdv(stream), then dq(...): on `beside` where given, forked from `stream` after the work queued
// there and joined back into it by events, so that two independent grids share the SMs, each one's
// last wave beside the other's CTAs (the backward's dK/dV and dQ kernels: bwd_sm90_launch.h has
// the numbers); else on `stream` after dkdv. CUDA graph capture records the fork and the join as
// edges.
template <typename DKDV, typename DQ>
cudaError_t launch_beside(cudaStream_t stream, cudaStream_t beside, DKDV dkdv, DQ dq) {
  if (beside == nullptr) {
    const cudaError_t err = dkdv(stream);
    return err != cudaSuccess ? err : dq(stream);
  }
  cudaEvent_t fork = nullptr, join = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventRecord(fork, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(beside, fork, 0);
  if (err == cudaSuccess) err = dkdv(stream);
  if (err == cudaSuccess) err = dq(beside);
  if (err == cudaSuccess) err = cudaEventRecord(join, beside);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, join, 0);
  // Released once the recorded work completes (or, captured, as soon as the graph holds the edges).
  if (fork != nullptr) cudaEventDestroy(fork);
  if (join != nullptr) cudaEventDestroy(join);
  return err;
}

}  // namespace flashmod::cuda
