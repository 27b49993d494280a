// CUDA softmax with the online normalizer.
//
// Last-dimension rows are read from memory once and written once (the copy-bandwidth bound):
// every thread caches its share of a row in registers, summarises it as (max, sum of exp(x - max)),
// the summaries are merged (warp shuffles, then shared memory across warps), and every thread
// writes its cached elements.
//
// Rows up to 16k elements (4k where unaligned rows load one element at a time): a warp per row, or
// a block of <= 512 threads per row, 8 loads per thread. Longer rows are split over the blocks of
// a thread-block cluster (sm_90), which swap their (max, sum) through distributed shared memory:
// still one read and one write. Rows that load in 16-byte packs stream through shared memory
// there (softmax_stream_sm90.cuh); the others, and every row where the stream path cannot run,
// take the register-cached cluster kernel below. Those blocks are small (256 threads for clusters
// of <= 8, 512 for up to 16, H100's non-portable size) and every thread keeps 32 registers of the
// row: 8 packs of 16 bytes, i.e. 32 fp32 or 64 16-bit elements (kept as pairs, widened only when
// used), or 32 single elements of unaligned rows. That fits the 64 registers per thread that 1024
// resident threads per SM allow without spilling, and each SM runs 2-4 blocks at different phases:
// while one waits on its loads or on the cluster barrier, another's loads and stores keep memory
// busy. A single 1024-thread block per SM cannot overlap its phases. A 16-bit row has half the
// bytes of an fp32 row of the same length; at 64 elements per thread it also takes half the blocks,
// so its per-row costs (block and cluster barriers, exchange) weigh as much per byte as fp32's: 64k
// elements take 4 x 256 threads, 256k take 8 x 512 (fp32: 8 x 256, 16 x 512). The largest cluster,
// 16 x 512, covers 256k fp32 or unaligned elements and 512k aligned 16-bit ones. Where clusters are
// unavailable (pre-sm_90, or no room for one), rows up to 32k take one 1024-thread block, longer
// rows two kernels: one writes each segment's (max, sum) to a workspace, the other merges them and
// writes (x read twice); both keep 32 elements per thread.
//
// Rows along a non-last dimension (stride `inner`) get a thread each, neighbouring threads on
// neighbouring rows so loads coalesce, with the element-by-element online update.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <type_traits>

#include "../../common/alignment.h"
#include "../../common/cuda/cluster_launch.h"
#include "../../common/cuda/kernel_launch.h"
#include "softmax_common.cuh"
#include "softmax_launch.cuh"
#include "softmax_stream_sm90.cuh"

namespace flashmod::cuda {
namespace {

constexpr int kPacks = 8;             // 16-byte packs per thread on the short-row paths
constexpr int kWarpRowsPerBlock = 4;  // rows per 128-thread block in the warp-per-row kernel
constexpr int64_t kShortRow = 16384;  // longest row for the block-per-row paths of <= 512 threads
// Elements per thread on the long-row paths (cluster_elems for the cluster path): 32 registers,
// about half of the 64-register budget that __launch_bounds__(threads, 1024 / threads) gives.
constexpr int kLongElems = 32;
constexpr int kSmallClusterThreads = 256;  // clusters of up to kPortableCluster blocks
constexpr int kLargeClusterThreads = 512;  // clusters of up to kMaxCluster blocks
constexpr int kPortableCluster = 8;
constexpr int kMaxCluster = 16;          // H100's non-portable limit
constexpr int kNoClusterThreads = 1024;  // one block per row, where clusters are unavailable
constexpr int kSegmentThreads = 256;     // the two-kernel path
constexpr int kMaxDevices = 64;          // launch_cluster caches its occupancy answer per device

// Blocks per SM that leave each thread 64 registers (65536 per SM): what the long-row kernels need
// to keep 1024 threads resident. The short-row kernels pass 0 (no minimum): an explicit 1 makes
// ptxas spend ~25 more registers on them for nothing.
constexpr int long_min_blocks(int threads) {
  return 1024 / threads;
}

// The pair types of the 16-bit dtypes, for the max on two elements at once.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

// How a thread caches a pack of kVec loaded elements: as loaded, except single 16-bit elements,
// widened to fp32 at once (they fill a register either way), and, with kPairs (16-bit packs in
// the long-row kernels), as kVec / 2 words of two elements each.
template <typename T, int kVec, bool kPairs>
struct Cache {
  using type = std::conditional_t<kVec == 1, float, T>;
  static constexpr int kLen = kVec;
};
template <typename T, int kVec>
struct Cache<T, kVec, true> {
  using type = uint32_t;
  static constexpr int kLen = kVec / 2;
};

// Element k of a thread's cached pack c, in fp32.
template <typename T, typename C>
__device__ __forceinline__ float element(const C* c, int k) {
  if constexpr (std::is_same_v<C, uint32_t>) {
    const uint32_t w = c[k / 2];
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(k % 2 ? w & 0xffff0000u : w << 16);  // bf16: fp32's upper half
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(k % 2 ? w >> 16 : w)));
    }
  } else {
    return to_float(c[k]);
  }
}

// Elementwise max of two words of 16-bit pairs.
template <typename T>
__device__ __forceinline__ uint32_t pair_max(uint32_t a, uint32_t b) {
  using P2 = typename Pair<T>::type;
  const P2 m = __hmax2(*reinterpret_cast<const P2*>(&a), *reinterpret_cast<const P2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&m);
}

// -inf as a cached value: what a thread holds past the end of its segment.
template <typename T, typename C>
__device__ __forceinline__ C minus_inf() {
  if constexpr (std::is_same_v<C, uint32_t>) {
    return std::is_same_v<T, __nv_bfloat16> ? 0xff80ff80u : 0xfc00fc00u;  // -inf twice
  } else {
    return from_float<C>(-INFINITY);
  }
}

enum class Phase { kWhole, kPartialStats, kFinish, kCluster };

template <typename To, typename From>
__device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else {
    return from_float<To>(to_float(v));
  }
}

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __trap();  // the host launches kCluster only where the kernel's binary is sm_90 or newer
#endif
}

// One row segment [begin, end) per group of kThreadsPerRow threads, kPacksPerThread packs of kVec
// elements per thread. kWhole: the segment is the row. kPartialStats: write the segment's
// (max, sum) to stats. kFinish: merge all the row's segment stats, then write this segment's
// probabilities. kCluster (sm_90): the row's segments are the blocks of one cluster, which merge
// their stats through distributed shared memory.
template <typename T, int kVec, int kPacksPerThread, int kThreadsPerRow, int kRowsPerBlock,
          int kMinBlocks, Phase kPhase>
__global__ void __launch_bounds__(kThreadsPerRow* kRowsPerBlock, kMinBlocks)
    softmax_lastdim_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n,
                           int64_t segment, int segments, float* __restrict__ stats) {
  constexpr int kWarps = kThreadsPerRow / 32;
  constexpr int kSlots = kWarps > 1 ? kWarps : 1;
  // Double-buffered by row parity, so one barrier per row is enough: a warp can only write row
  // r + 2's slot after the barrier of row r + 1, which every thread passes after reading row r's.
  // (kWhole gives each group one row, so its slot stays 0.)
  __shared__ float warp_m[2][kSlots], warp_s[2][kSlots];
  const int lane = threadIdx.x % kThreadsPerRow;
  const int seg = kPhase == Phase::kWhole ? 0 : blockIdx.x;
  const int64_t begin = seg * segment, end = begin + segment < n ? begin + segment : n;
  const int64_t row_first = kPhase == Phase::kWhole
                                ? int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow
                                : blockIdx.y;
  const int64_t row_step = kPhase == Phase::kWhole ? rows : gridDim.y;  // one row per group there

  // The long-row kernels (a 64-register budget) keep 16-bit packs as words of two elements:
  // with 8 packs, 64 elements in 32 registers. The max needs no widening; each exp pass widens
  // again (see the write).
  constexpr bool kPairs = kMinBlocks > 0 && kVec > 1 && sizeof(T) == 2;
  using Cached = typename Cache<T, kVec, kPairs>::type;
#ifdef FLASHMOD_SOFTMAX_NO_EXP_CACHE  // A/B hook for benchmarks/results/design/softmax.md
  constexpr bool kCacheExp = false;
#else
  constexpr bool kCacheExp = std::is_same_v<Cached, float> && kPhase == Phase::kWhole;
#endif
  constexpr int kCachedVec = Cache<T, kVec, kPairs>::kLen;
  // Pack i of this thread is pack i * kThreadsPerRow + lane of the segment. 32-bit indices (a
  // segment never holds 2^31 packs) leave one base address per row and constant offsets.
  const int packs = static_cast<int>((end - begin) / kVec);
  int parity = 0;
  for (int64_t row = row_first; row < rows; row += row_step, parity ^= kPhase != Phase::kWhole) {
    const auto* xs = reinterpret_cast<const Pack<T, kVec>*>(x + row * n + begin) + lane;
    Pack<Cached, kCachedVec> v[kPacksPerThread];
#pragma unroll
    for (int i = 0; i < kPacksPerThread; ++i) {
      if (i * kThreadsPerRow + lane < packs) {
        if constexpr (kPairs) {
          v[i] = reinterpret_cast<const Pack<Cached, kCachedVec>*>(xs)[i * kThreadsPerRow];
        } else {
          const Pack<T, kVec> pk = xs[i * kThreadsPerRow];
#pragma unroll
          for (int k = 0; k < kVec; ++k) v[i].v[k] = convert<Cached>(pk.v[k]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kCachedVec; ++k) v[i].v[k] = minus_inf<T, Cached>();
      }
    }
    // This thread's summary: max first (no exp), then one exp per element for the sum.
    float m = -INFINITY, s = 0.0f;
    if constexpr (kPairs) {
      // Exact in 16 bits, two elements an instruction. A NaN is skipped here as fmaxf skips it;
      // the sum below makes its row NaN.
      uint32_t pm = v[0].v[0];
#pragma unroll
      for (int i = 0; i < kPacksPerThread; ++i)
#pragma unroll
        for (int k = 0; k < kCachedVec; ++k) pm = pair_max<T>(pm, v[i].v[k]);
      m = fmaxf(element<T>(&pm, 0), element<T>(&pm, 1));
    } else {
#pragma unroll
      for (int i = 0; i < kPacksPerThread; ++i)
#pragma unroll
        for (int k = 0; k < kVec; ++k) m = fmaxf(m, element<T>(v[i].v, k));
    }
#pragma unroll
    for (int i = 0; i < kPacksPerThread; ++i)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float e = exp_from(element<T>(v[i].v, k), m);
        s += e;
        // fp32 caches keep e = exp(x - this thread's max): the write then needs one multiply per
        // element instead of a second exp (exp(m_thread - m_row) / sum is one factor per thread).
        if constexpr (kCacheExp) v[i].v[k] = e;
      }

    const float m_thread = m;
    warp_merge(m, s, kThreadsPerRow < 32 ? kThreadsPerRow : 32);
    if constexpr (kWarps > 1) {
      if (lane % 32 == 0) warp_m[parity][lane / 32] = m, warp_s[parity][lane / 32] = s;
      __syncthreads();
      m = warp_m[parity][0], s = warp_s[parity][0];
      for (int w = 1; w < kWarps; ++w) merge(m, s, warp_m[parity][w], warp_s[parity][w]);
    }

    if constexpr (kPhase == Phase::kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      __shared__ float2 block_stats[2];  // this block's (max, sum); same parity rule as warp_m
      if (threadIdx.x == 0) block_stats[parity] = make_float2(m, s);
      cluster_sync();
      // Every warp gathers the cluster's summaries itself, lane g from block g, and merges them
      // with shuffles: no second block barrier to broadcast one warp's result. The butterfly gives
      // every lane of every block bit-identical (max, sum).
      const int g = threadIdx.x % 32;
      float2 remote = make_float2(-INFINITY, 0.0f);
      if (g < segments) {
        remote = *cooperative_groups::this_cluster().map_shared_rank(&block_stats[parity], g);
      }
      m = remote.x, s = remote.y;
      warp_merge(m, s);
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
        for (int g = 0; g < segments; ++g) {
          merge(m, s, stats[(row * segments + g) * 2], stats[(row * segments + g) * 2 + 1]);
        }
      }
      const float inv = inv_sum(m, s);
      // exp(m_thread - m) is 0 for a thread that saw only -inf (its e's are 0 too); NaN stays NaN.
      const float factor = kCacheExp ? exp_from(m_thread, m) * inv : 0.0f;
      if constexpr (kPairs) {
        // Left to themselves, the compilers (ptxas included) reuse the sum's 64 widened floats
        // here instead of widening the 32 words again, and spill them. XOR with a zero they
        // cannot see through makes the words new values, one integer op each: n >= 0, so its
        // sign fill is 0, but all they know is that its 32 bits are equal.
        const uint32_t zero = static_cast<uint32_t>(n >> 63);
#pragma unroll
        for (int i = 0; i < kPacksPerThread; ++i)
#pragma unroll
          for (int k = 0; k < kCachedVec; ++k) v[i].v[k] ^= zero;
      }
      auto* ys = reinterpret_cast<Pack<T, kVec>*>(y + row * n + begin) + lane;
#pragma unroll
      for (int i = 0; i < kPacksPerThread; ++i) {
        if (i * kThreadsPerRow + lane < packs) {
          Pack<T, kVec> pk;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            if constexpr (kCacheExp) {
              pk.v[k] = from_float<T>(v[i].v[k] * factor);
            } else {
              pk.v[k] = from_float<T>(exp_from(element<T>(v[i].v, k), m) * inv);
            }
          }
          ys[i * kThreadsPerRow] = pk;
        }
      }
    }
  }
  // No block exits (freeing its shared memory) while another may still read its block_stats.
  if constexpr (kPhase == Phase::kCluster) cluster_sync();
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
    for (int64_t d = 0; d < n; ++d)
      y[base + d * inner] = from_float<T>(exp_from(to_float(x[base + d * inner]), m) * inv);
  }
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Elements per thread on the cluster path: 8 packs of 16 bytes (32 fp32 or 64 16-bit elements,
// 32 registers either way) where rows load in packs; kLongElems single elements, each widened to
// fp32 at once, where they do not.
constexpr int cluster_elems(int vec) {
  return vec == 1 ? kLongElems : kPacks * vec;
}

// Segments per row on the two-kernel path.
int64_t segments_for(int64_t n) {
  return ceil_div(n, int64_t(kSegmentThreads) * kLongElems);
}

// knobs.trace (FLASHMOD_SOFTMAX_TRACE=1): print which long-row path each call takes, to stderr.
// tests/softmax/test_softmax.py uses it to check that each path is taken where expected.
void trace(const SoftmaxCudaKnobs& knobs, int64_t n, const char* path, int threads,
           int64_t blocks_per_row) {
  if (!knobs.trace) return;
  std::fprintf(stderr, "flashmod softmax: n=%lld path=%s threads=%d blocks_per_row=%lld\n",
               static_cast<long long>(n), path, threads, static_cast<long long>(blocks_per_row));
}

template <typename T, int kVec, int kPacksPerThread, int kThreads, int kMinBlocks>
cudaError_t launch_block_per_row(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  return launch_kernel(
      softmax_lastdim_kernel<T, kVec, kPacksPerThread, kThreads, 1, kMinBlocks, Phase::kWhole>,
      rows, kThreads, 0, stream, x, y, rows, n, n, 1, static_cast<float*>(nullptr));
}

// How many clusters of config's shape fit on the device at once; 0 where none does or the
// kernel's binary predates sm_90. Errors are cleared: the caller then takes another path.
template <typename Kernel>
int max_active_clusters(Kernel kernel, const cudaLaunchConfig_t& config, int cluster) {
  cudaFuncAttributes attributes;
  int active = 0;
  const bool ok =
      cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.binaryVersion >= 90 &&
      (cluster <= kPortableCluster ||
       cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
           cudaSuccess) &&
      cudaOccupancyMaxActiveClusters(&active, kernel, &config) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    return 0;
  }
  return active;
}

// One row per cluster of kThreads-thread blocks (clusters loop over rows past 65535): up to
// kPortableCluster blocks of 256 threads, or kMaxCluster of 512. Returns false, launching
// nothing, where the row needs more blocks, or no cluster of that size can run (device, kernel
// binary or occupancy).
template <typename T, int kVec, int kThreads>
bool launch_cluster(const T* x, T* y, int64_t rows, int64_t n, const SoftmaxCudaKnobs& knobs,
                    cudaStream_t stream) {
  constexpr int kLimit = kThreads == kLargeClusterThreads ? kMaxCluster : kPortableCluster;
  constexpr int kElems = cluster_elems(kVec);
  const int64_t cluster = ceil_div(n, int64_t(kThreads) * kElems);
  int device = 0;
  if (cluster > kLimit || cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return false;
  }
  const auto kernel = softmax_lastdim_kernel<T, kVec, kElems / kVec, kThreads, 1,
                                             long_min_blocks(kThreads), Phase::kCluster>;
  ClusterLaunch launch(static_cast<int>(cluster), 1, kThreads, 0, stream);
  cudaLaunchConfig_t& config = launch.config;
  // Clusters resident at once, plus one (0: not asked yet); the driver queries cost microseconds.
  static std::atomic<int> fit_cache[kMaxDevices][kMaxCluster + 1];
  int fit = fit_cache[device][cluster].load(std::memory_order_relaxed);
  if (fit == 0) {
    fit = 1 + max_active_clusters(kernel, config, static_cast<int>(cluster));
    fit_cache[device][cluster].store(fit, std::memory_order_relaxed);
  }
  if (fit == 1) return false;
  const int64_t grid_rows = std::min<int64_t>(rows, 65535);  // the kernel loops over the rest
  config.gridDim = dim3(static_cast<unsigned>(cluster), static_cast<unsigned>(grid_rows));
  const int64_t segment = ceil_div(ceil_div(n, cluster), kVec) * kVec;  // packs never straddle
  if (cudaLaunchKernelEx(&config, kernel, x, y, rows, n, segment, static_cast<int>(cluster),
                         static_cast<float*>(nullptr)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  trace(knobs, n, "cluster", kThreads, cluster);
  return true;
}

// Rows > 16k that load in 16-byte packs, on sm_90: the stream path (softmax_stream_sm90.cuh),
// measured 0.86-0.92 of copy bandwidth against the cluster path's 0.81-0.88
// (benchmarks/results/design/softmax.md, v5). Shorter rows stay on the warp and block kernels,
// which measured faster there.
// knobs.stream = false (FLASHMOD_SOFTMAX_STREAM=0) skips it, for side-by-side timing against the
// cluster path.
template <typename T, int kVec>
bool launch_stream(const T* x, T* y, int64_t rows, int64_t n, const SoftmaxCudaKnobs& knobs,
                   cudaStream_t stream) {
  if constexpr (kVec == 1) {
    return false;
  } else {
    if (!knobs.stream) return false;
    const int cluster = softmax_stream::launch<T>(x, y, rows, n, knobs.stream_cluster, stream);
    if (cluster > 0) trace(knobs, n, "stream", softmax_stream::kThreads, cluster);
    return cluster > 0;
  }
}

// Launch errors are returned, except a cluster launch's: a failed one falls back to the next path.
template <typename T, int kVec>
cudaError_t launch_lastdim(const T* x, T* y, int64_t rows, int64_t n, float* workspace,
                           const SoftmaxCudaKnobs& knobs, cudaStream_t stream) {
  constexpr int64_t kPerThread = int64_t(kPacks) * kVec;
  constexpr int kLongPacks = kLongElems / kVec;
  if (n <= 32 * kPerThread) {
    return launch_kernel(
        softmax_lastdim_kernel<T, kVec, kPacks, 32, kWarpRowsPerBlock, 0, Phase::kWhole>,
        ceil_div(rows, kWarpRowsPerBlock), 32 * kWarpRowsPerBlock, 0, stream, x, y, rows, n, n, 1,
        static_cast<float*>(nullptr));
  } else if (n <= 128 * kPerThread) {
    return launch_block_per_row<T, kVec, kPacks, 128, 0>(x, y, rows, n, stream);
  } else if (n <= 256 * kPerThread) {
    return launch_block_per_row<T, kVec, kPacks, 256, 0>(x, y, rows, n, stream);
  } else if (n <= 512 * kPerThread && n <= kShortRow) {
    return launch_block_per_row<T, kVec, kPacks, 512, 0>(x, y, rows, n, stream);
  } else if (launch_stream<T, kVec>(x, y, rows, n, knobs, stream) ||
             launch_cluster<T, kVec, kSmallClusterThreads>(x, y, rows, n, knobs, stream) ||
             // 256-thread blocks first: a 64k 16-bit row takes 4 x 256 rather than 2 x 512. Same
             // bytes in flight per SM, but 4 blocks at independent phases instead of 2, and an
             // 8-warp block barrier; the 4-block cluster barrier costs little (fp32 at 8 x 256
             // measured 0.90 of copy bandwidth).
             launch_cluster<T, kVec, kLargeClusterThreads>(x, y, rows, n, knobs, stream)) {
    return cudaSuccess;
  } else if (n <= int64_t(kNoClusterThreads) * kLongElems) {
    trace(knobs, n, "block", kNoClusterThreads, 1);
    return launch_block_per_row<T, kVec, kLongPacks, kNoClusterThreads, 1>(x, y, rows, n, stream);
  } else {
    const int segments = static_cast<int>(segments_for(n));
    const int64_t segment = ceil_div(ceil_div(n, segments), kVec) * kVec;  // packs never straddle
    const dim3 grid(segments, static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    constexpr int kMin = long_min_blocks(kSegmentThreads);
    trace(knobs, n, "two-kernel", kSegmentThreads, segments);
    const cudaError_t err = launch_kernel(
        softmax_lastdim_kernel<T, kVec, kLongPacks, kSegmentThreads, 1, kMin, Phase::kPartialStats>,
        grid, kSegmentThreads, 0, stream, x, y, rows, n, segment, segments, workspace);
    if (err != cudaSuccess) return err;
    return launch_kernel(
        softmax_lastdim_kernel<T, kVec, kLongPacks, kSegmentThreads, 1, kMin, Phase::kFinish>, grid,
        kSegmentThreads, 0, stream, x, y, rows, n, segment, segments, workspace);
  }
}

template <typename T>
cudaError_t launch_typed(const SoftmaxParams& p, float* workspace, cudaStream_t stream) {
  const auto* x = static_cast<const T*>(p.x);
  auto* y = static_cast<T*>(p.y);
  if (p.inner != 1) {
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(p.outer * p.inner, kThreads), 65535);
    return launch_kernel(softmax_strided_kernel<T>, blocks, kThreads, 0, stream, x, y, p.outer,
                         p.dim_size, p.inner);
  }
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = p.dim_size % kVec == 0 && aligned16(x) && aligned16(y);
  return aligned ? launch_lastdim<T, kVec>(x, y, p.outer, p.dim_size, workspace, p.knobs, stream)
                 : launch_lastdim<T, 1>(x, y, p.outer, p.dim_size, workspace, p.knobs, stream);
}

}  // namespace

int64_t softmax_workspace_floats(const SoftmaxParams& p) {
  // Only the two-kernel path uses it; sized for any row it might take.
  if (p.inner != 1 || p.dim_size <= int64_t(kNoClusterThreads) * kLongElems) return 0;
  return p.outer * segments_for(p.dim_size) * 2;
}

cudaError_t launch_softmax(const SoftmaxParams& p, float* workspace, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarKind::kFloat32: return launch_typed<float>(p, workspace, stream);
    case ScalarKind::kFloat16: return launch_typed<__half>(p, workspace, stream);
    case ScalarKind::kBFloat16: return launch_typed<__nv_bfloat16>(p, workspace, stream);
    case ScalarKind::kFloat64: break;  // rejected by the host checks before any launch
  }
  return cudaSuccess;
}

}  // namespace flashmod::cuda
