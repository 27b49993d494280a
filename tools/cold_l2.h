// A cold L2 before every timed call of the standalone CUDA tools (tools/*.cu), as
// benchmarks/bench_serve.py makes it: a read of twice the L2 (at least 64 MB) of zeros, so the
// lines it leaves are clean and nothing is written back during the timed call.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"

__global__ void cold_l2_read(const float4* p, int64_t n, float* sink) {
  float s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 x = p[i];
    s += x.x + x.y + x.z + x.w;
  }
  if (s == 123.f) *sink = s;  // never true for the buffer's zeros; keeps the loads
}

struct ColdL2 {
  float4* buf = nullptr;
  float* sink = nullptr;
  int64_t n = 0;
  int grid = 0;
  explicit ColdL2(const cudaDeviceProp& prop) {
    n = std::max<int64_t>(2ll * prop.l2CacheSize, 64ll << 20) / 16;
    grid = 4 * prop.multiProcessorCount;
    CHECK(cudaMalloc(&buf, n * 16));
    CHECK(cudaMemset(buf, 0, n * 16));
    CHECK(cudaMalloc(&sink, 4));
  }
  void flush(cudaStream_t stream = nullptr) const {
    cold_l2_read<<<grid, 256, 0, stream>>>(buf, n, sink);
  }
};
