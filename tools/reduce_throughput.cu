// How fast many CTAs can add fp32 tiles into a buffer in global memory: step 0 of the plan for a
// five-matmul Hopper backward (benchmarks/results/design/cuda-backward.md, session 27), whose dQ
// comes from one Br x D fp32 partial per (query block, key block) pair added into a dQ accumulator.
// At B 4, H 16, N 4k, D 128 with 64 x 128 pairs that is 4.3 GB of partials per backward, against
// ~0.7 ms for a whole backward at CUDNN's rate: about 6 TB/s.
//
// Each CTA adds kTiles tiles of kRows x 128 floats (32 KB at 64 rows) into row blocks of a target
// buffer, stepping through it so that concurrent CTAs hit different blocks, as the backward's key
// blocks do. Modes:
//   store   plain 16-byte stores of the tile (no reduction): the write-bandwidth reference
//   red     red.global.add.f32, four per 16 bytes
//   red.v4  red.global.add.v4.f32, one per 16 bytes (sm_90)
//   bulk    the tile staged in shared memory, then one cp.reduce.async.bulk add of its 32 KB
//           (sm_90; the target laid out so each tile is contiguous, as a tiled dQ accumulator would
//           be)
// Every mode is checked: the target must equal the number of tiles that landed on each element
// (the 'store' mode: 1 wherever written).
//
// Build and run on the GPU machine (no torch needed):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/reduce_throughput \
//     tools/reduce_throughput.cu && /tmp/reduce_throughput [target MB] [group]
// (target MB: default 16; group: default 0, see target_block)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kCols = 128;     // D
constexpr int kRows = 64;      // Br
constexpr int kThreads = 256;  // two warpgroups, as the planned kernel's consumers
constexpr int kTileFloats = kRows * kCols;
constexpr int kTileBytes = kTileFloats * 4;
static_assert(kTileFloats % (4 * kThreads) == 0, "whole float4s per thread");

enum Mode { kStore, kRed, kRedV4, kBulk };
const char* const kModeNames[] = {"store", "red", "red.v4", "bulk"};

// Row block that CTA `cta` adds its t-th tile into. group 0: consecutive CTAs start far apart and
// walk the buffer with a stride co-prime to the block count, so a block is hit by many CTAs over
// the run but rarely by two at once. group G > 0: G consecutive CTAs walk the same blocks in step,
// as the key blocks of one head walk its query blocks in the fused backward (G = 32 at N = 4k with
// 128 keys a CTA): G reductions into one tile at a time.
__host__ __device__ inline int64_t target_block(int64_t cta, int64_t t, int64_t blocks,
                                                int64_t group) {
  return group > 0 ? ((cta / group) * 64 + t) % blocks : (cta * 7919 + t * 131) % blocks;
}

template <int kMode>
__global__ void __launch_bounds__(kThreads)
    add_tiles(float* target, int64_t blocks, int tiles, int64_t group) {
  extern __shared__ __align__(128) float staged[];
  const int tid = threadIdx.x;
  for (int t = 0; t < tiles; ++t) {
    float* dst = target + target_block(blockIdx.x, t, blocks, group) * kTileFloats;
    if constexpr (kMode == kBulk) {
      // The previous bulk reduce must have read the staging tile before it is overwritten.
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      __syncthreads();  // the wait above, seen by every writer
      for (int i = 4 * tid; i < kTileFloats; i += 4 * kThreads)
        *reinterpret_cast<float4*>(staged + i) = make_float4(1.f, 1.f, 1.f, 1.f);
      // Generic-proxy writes, read next by the bulk copy (async proxy).
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();  // every thread's part of the tile is written and fenced
      if (tid == 0) {
        const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(staged));
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
            "cp.async.bulk.commit_group;\n" ::"l"(dst),
            "r"(src), "n"(kTileBytes)
            : "memory");
      }
    } else {
      for (int i = 4 * tid; i < kTileFloats; i += 4 * kThreads) {
        float* p = dst + i;
        if constexpr (kMode == kStore) {
          *reinterpret_cast<float4*>(p) = make_float4(1.f, 1.f, 1.f, 1.f);
        } else if constexpr (kMode == kRed) {
          for (int e = 0; e < 4; ++e)
            asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + e), "f"(1.f) : "memory");
        } else {
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(1.f),
                       "f"(1.f), "f"(1.f), "f"(1.f)
                       : "memory");
        }
      }
    }
  }
  if constexpr (kMode == kBulk) {
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // done before exit
  }
}

template <int kMode>
float run(float* target, int64_t blocks, int ctas, int tiles, int64_t group,
          std::vector<float>& host) {
  const int smem = kMode == kBulk ? kTileBytes : 0;
  if (smem > 48 * 1024)
    CHECK(
        cudaFuncSetAttribute(add_tiles<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaMemset(target, 0, blocks * kTileBytes));
  add_tiles<kMode>
      <<<ctas, kThreads, smem>>>(target, blocks, 1, group);  // warm-up (its adds are counted)
  CHECK(cudaGetLastError());
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  add_tiles<kMode><<<ctas, kThreads, smem>>>(target, blocks, tiles, group);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaMemcpy(host.data(), target, blocks * kTileBytes, cudaMemcpyDeviceToHost));
  // Expected count per block: the warm-up's tile 0 of every CTA, then tiles 0 .. tiles-1.
  std::vector<int64_t> hits(blocks, 0);
  for (int64_t c = 0; c < ctas; ++c) {
    ++hits[target_block(c, 0, blocks, group)];
    for (int t = 0; t < tiles; ++t) ++hits[target_block(c, t, blocks, group)];
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const float want = kMode == kStore ? (hits[b] > 0 ? 1.f : 0.f) : static_cast<float>(hits[b]);
    for (int i = 0; i < kTileFloats; ++i) {
      if (host[b * kTileFloats + i] != want) {
        std::fprintf(stderr, "%s: block %lld element %d is %g, expected %g\n", kModeNames[kMode],
                     static_cast<long long>(b), i, host[b * kTileFloats + i], want);
        std::exit(1);
      }
    }
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t target_mb = argc > 1 ? std::atoll(argv[1]) : 16;
  const int64_t group = argc > 2 ? std::atoll(argv[2]) : 0;
  const int64_t blocks = target_mb * (1 << 20) / kTileBytes;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int ctas = 2 * prop.multiProcessorCount, tiles = 256;
  float* target = nullptr;
  CHECK(cudaMalloc(&target, blocks * kTileBytes));
  std::vector<float> host(blocks * kTileFloats);
  const double bytes = static_cast<double>(ctas) * tiles * kTileBytes;
  std::printf(
      "%s: %d CTAs x %d threads, %d tiles of %d x %d fp32 each, target %lld MB (L2 %d MB), %lld "
      "CTAs a tile at once\n",
      prop.name, ctas, kThreads, tiles, kRows, kCols, static_cast<long long>(target_mb),
      prop.l2CacheSize >> 20, static_cast<long long>(group > 0 ? group : 1));
  std::printf("%-8s %10s %12s %s\n", "mode", "ms", "GB/s added", "time for 4.3 GB of dQ partials");
  const float ms[] = {run<kStore>(target, blocks, ctas, tiles, group, host),
                      run<kRed>(target, blocks, ctas, tiles, group, host),
                      run<kRedV4>(target, blocks, ctas, tiles, group, host),
                      run<kBulk>(target, blocks, ctas, tiles, group, host)};
  for (int m = 0; m < 4; ++m)
    std::printf("%-8s %10.3f %12.0f %8.2f ms\n", kModeNames[m], ms[m], bytes / (ms[m] * 1e6),
                4.3e9 / (bytes / (ms[m] * 1e-3)) * 1e3);
  CHECK(cudaFree(target));
  return 0;
}
