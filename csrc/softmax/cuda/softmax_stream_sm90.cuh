// Long softmax rows on sm_90: row segments streamed through shared memory by the bulk-copy engine,
// so that loading the next row overlaps reducing and writing the current one.
//
// Why (benchmarks/results/design/softmax.md, long rows v2-v5): the register-cached cluster path
// reads a row, waits at a cluster barrier, then writes, and its SM issues no loads while it waits.
// It reached 0.79-0.90 of copy bandwidth on rows of 64k-256k elements. Here a producer warp keeps a
// ring of 16 KB chunks in shared memory filled with cp.async.bulk: as soon as a chunk of row r has
// been written out, its slot is refilled with the next chunk of row r + 1 (or later), so the memory
// pipe stays busy across the reduction and the cluster exchange. Still one read and one write.
//
// Layout: one block per SM (a 208 KB ring), 16 consumer warps + 1 producer warp. A row is split
// into `cluster` segments of at most kMaxSegmentChunks chunks (128 KB), one per block of a
// thread-block cluster; clusters loop over rows. Per row, each block: waits for its segment's
// chunks, computes every thread's (max, sum) online from shared memory, merges them over warps,
// then pushes the block's (max, sum) into every block of the cluster (distributed shared memory
// plus a remote mbarrier arrival, no cluster-wide barrier); each warp merges the cluster's
// summaries itself and writes its share of probabilities from the chunks, releasing each chunk back
// to the producer.
#pragma once

#include <algorithm>
#include <atomic>

#include "../../common/cuda/bulk_copy_ops.h"
#include "../../common/cuda/cluster_launch.h"
#include "../../common/cuda/kernel_launch.h"
#include "softmax_common.cuh"

namespace flashmod::cuda {
namespace softmax_stream {

constexpr int kConsumerWarps = 16;
constexpr int kConsumerThreads = 32 * kConsumerWarps;
constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kChunkBytes = 16384;
constexpr int kPacksPerChunk = kChunkBytes / 16;
constexpr int kPacksPerThread = kPacksPerChunk / kConsumerThreads;
static_assert(kPacksPerChunk % kConsumerThreads == 0, "every consumer reads whole packs");
// A segment must fit in the ring with room to spare: the spare slots are what the producer loads
// ahead (5 chunks, 80 KB per SM, while a block reduces and exchanges; ~10 MB on 132 SMs, well past
// the ~3 MB in flight that 3 TB/s at ~1 us latency needs).
constexpr int kMaxSegmentChunks = 8;
constexpr int kSlots = 13;
static_assert(kSlots > kMaxSegmentChunks, "the producer could not load ahead");
constexpr int kMaxCluster = 16;           // H100's non-portable cluster limit
constexpr uint32_t kConsumerBarrier = 1;  // named barrier id (0 is __syncthreads')

struct SharedStorage {
  alignas(128) unsigned char ring[kSlots][kChunkBytes];
  uint64_t full[kSlots];   // producer -> consumers: the chunk has landed (transaction count)
  uint64_t empty[kSlots];  // consumers -> producer: every consumer warp is done with the chunk
  // Row parity p: every block of the cluster stores its (max, sum) in block_stats[p][its rank]
  // here, then arrives on stats_ready[p]. Two sets suffice: a block can only push row r + 2 after
  // it has every block's row r + 1, which each block pushes after its warps have read row r.
  uint64_t stats_ready[2];
  float2 block_stats[2][kMaxCluster];
  float2 warp_stats[2][kConsumerWarps];  // same parity rule, across one consumer barrier per row
};

template <typename T>
constexpr int kPackElems = 16 / sizeof(T);

constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit: what __expf does after scaling by log2(e), which the callers
// fold into one FFMA with the max (exp(x - m) = 2^(x log2 e - m log2 e)).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A pack past the end of the segment: -inf in every element (the identity of the max and sum).
template <typename T>
constexpr uint32_t kMinusInfWord = std::is_same_v<T, float>           ? 0xff800000u
                                   : std::is_same_v<T, __nv_bfloat16> ? 0xff80ff80u
                                                                      : 0xfc00fc00u;

// Element e of a 16-byte pack held as four words, in fp32.
template <typename T>
__device__ __forceinline__ float element_of(const uint32_t (&w)[4], int e) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w[e]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t word = w[e / 2];
    return __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);  // bf16: fp32's upper half
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w[e / 2] >> (16 * (e % 2)))));
  }
}

// The largest element of a pack, exactly. 16-bit packs take the max two elements at a time; like
// fmaxf, __hmax2 skips a NaN (the sum then makes its row NaN).
template <typename T>
__device__ __forceinline__ float pack_max(const uint32_t (&w)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    return fmaxf(fmaxf(__uint_as_float(w[0]), __uint_as_float(w[1])),
                 fmaxf(__uint_as_float(w[2]), __uint_as_float(w[3])));
  } else {
    using P2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    auto pair = [](uint32_t v) { return *reinterpret_cast<const P2*>(&v); };
    const P2 m = __hmax2(__hmax2(pair(w[0]), pair(w[1])), __hmax2(pair(w[2]), pair(w[3])));
    const uint32_t word = *reinterpret_cast<const uint32_t*>(&m);
    const uint32_t both[4] = {word, 0, 0, 0};
    return fmaxf(element_of<T>(both, 0), element_of<T>(both, 1));
  }
}

// A row's probabilities are p = 2^(x log2 e - offset) * factor, from its (max, sum). 16-bit outputs
// fold 1 / sum into the exponent (one FFMA and one MUFU per element; rounding to 16 bits dwarfs
// the ~1e-7 this costs); fp32 keeps the multiply. A row with nothing visible (all -inf) is all
// zeros; a NaN sum makes NaNs.
struct RowScale {
  float offset, factor;
};

template <typename T>
__device__ __forceinline__ RowScale row_scale(float m, float s) {
  const float max_offset = (m == -INFINITY ? 0.0f : m) * kLog2e;
  if constexpr (std::is_same_v<T, float>) {
    return {max_offset, inv_sum(m, s)};
  } else {
    const bool empty_row = m == -INFINITY && s == 0.0f;
    return {empty_row ? INFINITY : max_offset + __log2f(s), 1.0f};
  }
}

// Rows of n elements, cut into segments of `segment` elements (a whole number of packs), one per
// block of a cluster: the cluster spans gridDim.x, so blockIdx.x is the block's rank, and cluster
// blockIdx.y takes rows blockIdx.y, blockIdx.y + gridDim.y, ...
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    softmax_stream_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n,
                          int64_t segment) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cuda_kernels;
  constexpr int kElems = kPackElems<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sh = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cluster = static_cast<int>(gridDim.x);
  const uint32_t rank = blockIdx.x;
  const int64_t begin = rank * segment;
  // This block's bytes of every row, in chunks of kChunkBytes (the last one shorter).
  const uint32_t span = static_cast<uint32_t>(std::max<int64_t>(0, std::min(segment, n - begin)) *
                                              int64_t(sizeof(T)));
  const int chunks = static_cast<int>((span + kChunkBytes - 1) / kChunkBytes);
  auto chunk_bytes = [&](int k) { return min(uint32_t(kChunkBytes), span - k * kChunkBytes); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      mbarrier_init(smem_addr(&sh.full[s]), 1);
      mbarrier_init(smem_addr(&sh.empty[s]), kConsumerWarps);
    }
    mbarrier_init(smem_addr(&sh.stats_ready[0]), cluster);
    mbarrier_init(smem_addr(&sh.stats_ready[1]), cluster);
    fence_mbarrier_init();
  }
  // No block may arrive on another's barrier before that block has initialised it.
  cluster_barrier();

  if (warp == kConsumerWarps) {
    // Producer: chunk c of this block's sequence goes to slot c % kSlots once the consumers have
    // released the chunk that used the slot before it (use c / kSlots - 1).
    if (lane != 0) return;
    uint32_t c = 0;
    for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
      const auto* src = reinterpret_cast<const unsigned char*>(x + row * n + begin);
      for (int k = 0; k < chunks; ++k, ++c) {
        const uint32_t slot = c % kSlots, use = c / kSlots;
        if (use > 0) mbarrier_wait(smem_addr(&sh.empty[slot]), (use - 1) & 1);
        const uint32_t bytes = chunk_bytes(k);
        mbarrier_arrive_expect_tx(smem_addr(&sh.full[slot]), bytes);
        bulk_copy_to_shared<true>(smem_addr(sh.ring[slot]), src + int64_t(k) * kChunkBytes, bytes,
                                  smem_addr(&sh.full[slot]));
      }
    }
    return;
  }

  // Probabilities of one pack: 2^(x log2 e - offset) * factor (see RowScale).
  auto write_pack = [&](const RowScale& scale, const uint32_t (&w)[4], T* dst) {
    float prob[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      prob[e] = exp2_approx(fmaf(element_of<T>(w, e), kLog2e, -scale.offset));
      if constexpr (std::is_same_v<T, float>) prob[e] *= scale.factor;
    }
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        out[i] = __float_as_uint(prob[i]);
      } else {
        out[i] = Mma16816<T>::pack(prob[2 * i], prob[2 * i + 1]);  // low half: the lower address
      }
    }
    stg_128(dst, out);
  };

  // Consumers. Every warp steps through every chunk in order (waits for it, releases it): then
  // its wait on a slot can only see the use it wants, since it released the slot's previous use
  // itself and the next use cannot be loaded before it releases this one.
  uint32_t c = 0;  // position in the producer's chunk sequence
  int parity = 0;
  for (int64_t row = blockIdx.y, it = 0; row < rows; row += gridDim.y, ++it, parity ^= 1) {
    // This thread's (max, sum) over its packs of the segment, online: one rescale per chunk.
    float m = -INFINITY, s = 0.0f;
    for (int k = 0; k < chunks; ++k) {
      const uint32_t slot = (c + k) % kSlots, use = (c + k) / kSlots;
      mbarrier_wait(smem_addr(&sh.full[slot]), use & 1);
      const int packs = static_cast<int>(chunk_bytes(k) / 16);
      uint32_t w[kPacksPerThread][4];
      float chunk_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPacksPerThread; ++j) {
        const int p = j * kConsumerThreads + threadIdx.x;
        if (p < packs) {
          lds_128(w[j], smem_addr(sh.ring[slot] + p * 16));
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) w[j][i] = kMinusInfWord<T>;
        }
        chunk_max = fmaxf(chunk_max, pack_max<T>(w[j]));
      }
      const float mn = fmaxf(m, chunk_max);
      const float offset = (mn == -INFINITY ? 0.0f : mn) * kLog2e;
      float chunk_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kPacksPerThread; ++j)
#pragma unroll
        for (int e = 0; e < kElems; ++e)
          chunk_sum += exp2_approx(fmaf(element_of<T>(w[j], e), kLog2e, -offset));
      s = s * exp_from(m, mn) + chunk_sum;
      m = mn;
    }

    warp_merge(m, s);
    if (lane == 0) sh.warp_stats[parity][warp] = make_float2(m, s);
    named_barrier(kConsumerBarrier, kConsumerThreads);  // every warp's summary is in warp_stats
    if (warp == 0) {
      // Lane w takes warp w's summary; the butterfly gives every lane the same bits, so all
      // pushes carry the same block summary.
      const float2 part =
          lane < kConsumerWarps ? sh.warp_stats[parity][lane] : make_float2(-INFINITY, 0.0f);
      float bm = part.x, bs = part.y;
      warp_merge(bm, bs);
      if (lane < cluster) {
        store_remote_float2(map_to_rank(smem_addr(&sh.block_stats[parity][rank]), lane), bm, bs);
        mbarrier_arrive_remote(map_to_rank(smem_addr(&sh.stats_ready[parity]), lane));
      }
    }
    // stats_ready[parity] completes once per two rows: row `it` of the cluster is its phase it / 2.
    mbarrier_wait_cluster(smem_addr(&sh.stats_ready[parity]), (it >> 1) & 1);
    // Lane g takes block g's summary: every lane of every block gets the same row (max, sum).
    const float2 part =
        lane < cluster ? sh.block_stats[parity][lane] : make_float2(-INFINITY, 0.0f);
    m = part.x, s = part.y;
    warp_merge(m, s);
    const RowScale scale = row_scale<T>(m, s);

    T* dst = y + row * n + begin;
    for (int k = 0; k < chunks; ++k, ++c) {
      const uint32_t slot = c % kSlots;
      const int packs = static_cast<int>(chunk_bytes(k) / 16);
#pragma unroll
      for (int j = 0; j < kPacksPerThread; ++j) {
        const int p = j * kConsumerThreads + threadIdx.x;
        if (p < packs) {
          uint32_t w[4];
          lds_128(w, smem_addr(sh.ring[slot] + p * 16));
          write_pack(scale, w,
                     dst + int64_t(k) * (kChunkBytes / int64_t(sizeof(T))) + int64_t(p) * kElems);
        }
      }
      // The warp's reads of this slot are done (they are in registers): release it.
      __syncwarp();
      if (lane == 0) mbarrier_arrive(smem_addr(&sh.empty[slot]));
    }
  }
#endif
}

constexpr int kMaxDevices = 64;

// The SM count of the current device if kernel K can run there (sm_90 binary, the shared memory
// opt-in, non-portable clusters), else 0. Asked once per device and kernel; the driver queries
// cost microseconds.
template <typename T>
int usable_sms(int device) {
  static std::atomic<int> cache[kMaxDevices];  // 0: not asked yet, -1: cannot run
  int sms = cache[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    const auto kernel = softmax_stream_kernel<T>;
    cudaFuncAttributes attributes;
    const bool ok =
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess &&
        attributes.binaryVersion >= 90 &&
        allow_dynamic_smem(kernel, sizeof(SharedStorage)) == cudaSuccess &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
            cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();
      sms = -1;
    }
    cache[device].store(sms, std::memory_order_relaxed);
  }
  return sms > 0 ? sms : 0;
}

inline int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return -1;
  }
  return device;
}

struct Shape {
  int cluster = 0;       // blocks per row; 0: the stream path cannot take the call
  int64_t clusters = 0;  // clusters launched (each loops over rows)
};

// The launch shape for `rows` rows of row_bytes. Picks the cluster size that keeps the
// most SMs busy over the call: the fraction of SMs in resident clusters times how evenly the rows
// divide into rounds of those clusters. forced_cluster != 0 (FLASHMOD_SOFTMAX_STREAM_CLUSTER=c)
// takes c or nothing (tests, tuning).
template <typename T>
Shape choose_shape(int64_t rows, int64_t row_bytes, int forced_cluster, cudaStream_t stream) {
  constexpr int64_t kMaxSegmentBytes = int64_t(kMaxSegmentChunks) * kChunkBytes;
  const int64_t min_cluster = (row_bytes + kMaxSegmentBytes - 1) / kMaxSegmentBytes;
  const int device = current_device();
  if (min_cluster > kMaxCluster || device < 0) return {};
  const int sms = usable_sms<T>(device);
  if (sms == 0) return {};
  // Per cluster size: clusters resident at once, plus one (0: not asked yet).
  static std::atomic<int> fit_cache[kMaxDevices][kMaxCluster + 1];
  auto fit = [&](int cluster) -> int64_t {
    int cached = fit_cache[device][cluster].load(std::memory_order_relaxed);
    if (cached == 0) {
      const ClusterLaunch probe(cluster, 1, kThreads, sizeof(SharedStorage), stream);
      int active = 0;
      if (cudaOccupancyMaxActiveClusters(&active, softmax_stream_kernel<T>, &probe.config) !=
          cudaSuccess) {
        (void)cudaGetLastError();
        active = 0;
      }
      cached = active + 1;
      fit_cache[device][cluster].store(cached, std::memory_order_relaxed);
    }
    return cached - 1;
  };
  if (forced_cluster != 0) {
    const int cluster = forced_cluster;
    if (cluster < min_cluster || cluster > kMaxCluster || fit(cluster) == 0) return {};
    return {cluster, std::min(rows, fit(cluster))};
  }
  Shape best;
  double best_busy = 0.0;
  for (int cluster = static_cast<int>(min_cluster); cluster <= kMaxCluster; ++cluster) {
    const int64_t resident = std::min(fit(cluster), rows);
    if (resident == 0) continue;
    const int64_t rounds = (rows + resident - 1) / resident;
    const double busy = double(resident * cluster) / sms * double(rows) / double(rounds * resident);
    // A larger cluster must win clearly: each adds a block to every row's exchange.
    if (busy > best_busy + 0.005) best = {cluster, resident}, best_busy = busy;
  }
  return best;
}

// Rows of n elements split over the blocks of a cluster (n * sizeof(T) a multiple of 16, at most
// kMaxCluster segments of kMaxSegmentChunks chunks; x and y 16-byte aligned). Returns the blocks
// per row, or 0, launching nothing, where the kernel cannot run.
template <typename T>
int launch(const T* x, T* y, int64_t rows, int64_t n, int forced_cluster, cudaStream_t stream) {
  const Shape shape = choose_shape<T>(rows, n * int64_t(sizeof(T)), forced_cluster, stream);
  if (shape.cluster == 0) return 0;
  // One segment per block, in whole packs; the last block may get fewer elements (or none).
  constexpr int64_t kElems = kPackElems<T>;
  const int64_t segment = ((n + shape.cluster - 1) / shape.cluster + kElems - 1) / kElems * kElems;
  const ClusterLaunch launch(shape.cluster, shape.clusters, kThreads, sizeof(SharedStorage),
                             stream);
  if (cudaLaunchKernelEx(&launch.config, softmax_stream_kernel<T>, x, y, rows, n, segment) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return shape.cluster;
}

}  // namespace softmax_stream
}  // namespace flashmod::cuda
