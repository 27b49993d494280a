// A kernel launch shaped as thread-block clusters (sm_90): the config plus the attribute it points
// at, kept together so the pointer cannot dangle. Host code, no torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace flashmod::cuda {

// `clusters` clusters of `cluster` blocks along x (grid (cluster, clusters)), `threads` threads
// and `smem_bytes` of dynamic shared memory per block.
struct ClusterLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute = {};
  ClusterLaunch(int cluster, int64_t clusters, int threads, size_t smem_bytes,
                cudaStream_t stream) {
    config.gridDim = dim3(static_cast<unsigned>(cluster), static_cast<unsigned>(clusters));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

}  // namespace flashmod::cuda
