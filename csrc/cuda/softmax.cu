// CUDA softmax with the online normalizer.
//
// Last-dimension rows: every thread caches up to kPacks 16-byte packs of its row in registers, so
// the row is read from memory once and written once (the copy-bandwidth bound). Each thread
// summarises its elements as (max, sum of exp(x - max)); the summaries are merged with warp
// shuffles (and through shared memory across warps), then every thread writes its cached
// elements. Row length picks the shape: a warp per row (up to 32 * 8 packs), a block per row (up
// to 1024 * 8 packs), or for longer rows several blocks per row. On sm_90 those blocks form a
// thread-block cluster (up to 8, so 256k fp32 / 512k fp16 elements) and swap their (max, sum)
// through distributed shared memory: still one read and one write. Elsewhere, or for longer rows,
// one kernel writes each block's (max, sum) and a second merges them and writes (x read twice).
// Rows along a non-last dimension (stride `inner`) get a thread each, neighbouring threads on
// neighbouring rows so loads coalesce, with the element-by-element online update.
#include <cooperative_groups.h>

#include "softmax_common.cuh"
#include "softmax_launch.cuh"

#include <algorithm>

namespace flashmod::cuda {
namespace {

constexpr int kPacks = 8;              // packs each thread keeps in registers
constexpr int kWarpRowsPerBlock = 4;   // rows per 128-thread block in the warp-per-row kernel
constexpr int kSegmentThreads = 512;   // block size of the two-kernel multi-block path
constexpr int kClusterThreads = 1024;  // block size of the cluster path
constexpr int kMaxCluster = 8;         // the portable cluster size limit

enum class Phase { kWhole, kPartialStats, kFinish, kCluster };

// One row segment [begin, end) per group of kThreadsPerRow threads. kWhole: the segment is the
// row. kPartialStats: write the segment's (max, sum) to stats. kFinish: merge all the row's
// segment stats, then write this segment's probabilities. kCluster (sm_90): the row's segments
// are the blocks of one cluster, which merge their stats through distributed shared memory.
template <typename T, int kVec, int kThreadsPerRow, int kRowsPerBlock, Phase kPhase>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock)
softmax_lastdim_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n,
                       int64_t segment, int segments, float* __restrict__ stats) {
  constexpr int kWarps = kThreadsPerRow / 32;
  __shared__ float warp_m[kWarps > 1 ? kWarps : 1], warp_s[kWarps > 1 ? kWarps : 1];
  const int lane = threadIdx.x % kThreadsPerRow;
  const int seg = kPhase == Phase::kWhole ? 0 : blockIdx.x;
  const int64_t begin = seg * segment, end = begin + segment < n ? begin + segment : n;
  const int64_t row_first = kPhase == Phase::kWhole
                                ? int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow
                                : blockIdx.y;
  const int64_t row_step = kPhase == Phase::kWhole ? rows : gridDim.y;  // one row per group there

  for (int64_t row = row_first; row < rows; row += row_step) {
    const T* xr = x + row * n;
    // Kept in the input type: 16-bit rows take half the registers, widened when used.
    Pack<T, kVec> v[kPacks];
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t idx = begin + (int64_t(i) * kThreadsPerRow + lane) * kVec;
      if (idx < end) {
        v[i] = *reinterpret_cast<const Pack<T, kVec>*>(xr + idx);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[i].v[k] = from_float<T>(-INFINITY);
      }
    }
    // This thread's summary: max first (no exp), then one exp per element for the sum.
    float m = -INFINITY, s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPacks; ++i)
#pragma unroll
      for (int k = 0; k < kVec; ++k) m = fmaxf(m, to_float(v[i].v[k]));
#pragma unroll
    for (int i = 0; i < kPacks; ++i)
#pragma unroll
      for (int k = 0; k < kVec; ++k) s += exp_from(to_float(v[i].v[k]), m);

    warp_merge(m, s, kThreadsPerRow < 32 ? kThreadsPerRow : 32);
    if constexpr (kWarps > 1) {
      const int warp = lane / 32;
      if (lane % 32 == 0) warp_m[warp] = m, warp_s[warp] = s;
      __syncthreads();
      m = warp_m[0], s = warp_s[0];
      for (int w = 1; w < kWarps; ++w) merge(m, s, warp_m[w], warp_s[w]);
      __syncthreads();  // warp_m/warp_s are reused by the next row of this block
    }

    if constexpr (kPhase == Phase::kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      __shared__ float block_stats[2];
      namespace cg = cooperative_groups;
      const cg::cluster_group cluster = cg::this_cluster();
      if (threadIdx.x == 0) block_stats[0] = m, block_stats[1] = s;
      cluster.sync();
      m = -INFINITY, s = 0.0f;
      for (int g = 0; g < segments; ++g) {
        const float* remote = cluster.map_shared_rank(block_stats, g);
        merge(m, s, remote[0], remote[1]);
      }
      cluster.sync();  // no block moves on (or exits) while another still reads its stats
#else
      __trap();  // the host launches this phase only where the kernel's binary is sm_90 or newer
#endif
    }

    if constexpr (kPhase == Phase::kPartialStats) {
      if (lane == 0) {
        stats[(row * segments + seg) * 2] = m;
        stats[(row * segments + seg) * 2 + 1] = s;
      }
      continue;
    } else {
      if constexpr (kPhase == Phase::kFinish) {
        m = -INFINITY, s = 0.0f;
        for (int g = 0; g < segments; ++g) merge(m, s, stats[(row * segments + g) * 2], stats[(row * segments + g) * 2 + 1]);
      }
      const float inv = inv_sum(m, s);
      T* yr = y + row * n;
#pragma unroll
      for (int i = 0; i < kPacks; ++i) {
        const int64_t idx = begin + (int64_t(i) * kThreadsPerRow + lane) * kVec;
        if (idx < end) {
          Pack<T, kVec> pk;
#pragma unroll
          for (int k = 0; k < kVec; ++k) pk.v[k] = from_float<T>(exp_from(to_float(v[i].v[k]), m) * inv);
          *reinterpret_cast<Pack<T, kVec>*>(yr + idx) = pk;
        }
      }
    }
  }
}

template <typename T>
__global__ void softmax_strided_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t outer,
                                       int64_t n, int64_t inner) {
  const int64_t total = outer * inner;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (t / inner) * n * inner + t % inner;
    float m = -INFINITY, s = 0.0f;
    for (int64_t d = 0; d < n; ++d) {
      const float v = to_float(x[base + d * inner]);
      const float mn = fmaxf(m, v);
      s = s * exp_from(m, mn) + exp_from(v, mn);
      m = mn;
    }
    const float inv = inv_sum(m, s);
    for (int64_t d = 0; d < n; ++d) y[base + d * inner] = from_float<T>(exp_from(to_float(x[base + d * inner]), m) * inv);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Segments per row on the multi-block path for a per-thread capacity of `per_thread` elements.
int64_t segments_for(int64_t n, int64_t per_thread) { return ceil_div(n, int64_t(kSegmentThreads) * per_thread); }

template <typename T, int kVec, int kThreads>
void launch_block_per_row(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  softmax_lastdim_kernel<T, kVec, kThreads, 1, Phase::kWhole>
      <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, y, rows, n, n, 1, nullptr);
}

// The cluster path for one row per cluster of up to 8 blocks of 1024 threads. Returns false,
// launching nothing, where it does not apply: rows too long, a device or a kernel binary older
// than sm_90, or no cluster of that size fits on the device.
template <typename T, int kVec>
bool launch_cluster(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int64_t kPerBlock = int64_t(kClusterThreads) * kPacks * kVec;
  const int64_t cluster = ceil_div(n, kPerBlock);
  if (cluster > kMaxCluster) return false;
  const auto kernel = softmax_lastdim_kernel<T, kVec, kClusterThreads, 1, Phase::kCluster>;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess || attributes.binaryVersion < 90) {
    (void)cudaGetLastError();
    return false;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(cluster), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  config.blockDim = dim3(kClusterThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int active_clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&active_clusters, kernel, &config) != cudaSuccess || active_clusters < 1) {
    (void)cudaGetLastError();
    return false;
  }
  const int64_t segment = ceil_div(ceil_div(n, cluster), kVec) * kVec;  // packs never straddle blocks
  if (cudaLaunchKernelEx(&config, kernel, x, y, rows, n, segment, static_cast<int>(cluster),
                         static_cast<float*>(nullptr)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

template <typename T, int kVec>
void launch_lastdim(const T* x, T* y, int64_t rows, int64_t n, float* workspace, cudaStream_t stream) {
  constexpr int64_t kPerThread = int64_t(kPacks) * kVec;
  if (n <= 32 * kPerThread) {
    softmax_lastdim_kernel<T, kVec, 32, kWarpRowsPerBlock, Phase::kWhole>
        <<<static_cast<unsigned>(ceil_div(rows, kWarpRowsPerBlock)), 32 * kWarpRowsPerBlock, 0, stream>>>(
            x, y, rows, n, n, 1, nullptr);
  } else if (n <= 128 * kPerThread) {
    launch_block_per_row<T, kVec, 128>(x, y, rows, n, stream);
  } else if (n <= 256 * kPerThread) {
    launch_block_per_row<T, kVec, 256>(x, y, rows, n, stream);
  } else if (n <= 512 * kPerThread) {
    launch_block_per_row<T, kVec, 512>(x, y, rows, n, stream);
  } else if (n <= 1024 * kPerThread) {
    launch_block_per_row<T, kVec, 1024>(x, y, rows, n, stream);
  } else if (!launch_cluster<T, kVec>(x, y, rows, n, stream)) {
    const int segments = static_cast<int>(segments_for(n, kPerThread));
    const int64_t segment = ceil_div(ceil_div(n, segments), kVec) * kVec;  // packs never straddle segments
    const dim3 grid(segments, static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    softmax_lastdim_kernel<T, kVec, kSegmentThreads, 1, Phase::kPartialStats>
        <<<grid, kSegmentThreads, 0, stream>>>(x, y, rows, n, segment, segments, workspace);
    softmax_lastdim_kernel<T, kVec, kSegmentThreads, 1, Phase::kFinish>
        <<<grid, kSegmentThreads, 0, stream>>>(x, y, rows, n, segment, segments, workspace);
  }
}

template <typename T>
void launch_typed(const SoftmaxParams& p, float* workspace, cudaStream_t stream) {
  const auto* x = static_cast<const T*>(p.x);
  auto* y = static_cast<T*>(p.y);
  if (p.inner != 1) {
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(p.outer * p.inner, kThreads), 65535);
    softmax_strided_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, y, p.outer, p.dim_size, p.inner);
    return;
  }
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = p.dim_size % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(y) % 16 == 0;
  if (aligned) {
    launch_lastdim<T, kVec>(x, y, p.outer, p.dim_size, workspace, stream);
  } else {
    launch_lastdim<T, 1>(x, y, p.outer, p.dim_size, workspace, stream);
  }
}

}  // namespace

int64_t softmax_workspace_floats(const SoftmaxParams& p) {
  // Sized for the scalar (kVec = 1) variant, which needs the most segments.
  if (p.inner != 1 || p.dim_size <= 1024 * kPacks) return 0;
  return p.outer * segments_for(p.dim_size, kPacks) * 2;
}

void launch_softmax(const SoftmaxParams& p, float* workspace, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarKind::kFloat32: launch_typed<float>(p, workspace, stream); break;
    case ScalarKind::kFloat16: launch_typed<__half>(p, workspace, stream); break;
    case ScalarKind::kBFloat16: launch_typed<__nv_bfloat16>(p, workspace, stream); break;
    case ScalarKind::kFloat64: break;  // rejected by the host checks before any launch
  }
}

}  // namespace flashmod::cuda
