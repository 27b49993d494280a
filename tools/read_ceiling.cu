// How much of the copy rate a kernel that only reads a decode step's K/V bytes can reach from a
// cold L2, measured the way benchmarks/bench_serve.py measures the decode step (issue 14): the copy
// rate from a device-to-device copy of as many bytes (read + written) in the same process, a read
// of twice the L2 before every timed call (clean lines, outside the events), the median of many
// calls. It answers whether the bars (0.85 of the copy rate at 4k tokens, 0.95 from 16k, paged
// within 5 %) leave room above what streaming the bytes alone costs. Session 26's read ceiling was
// torch's sum kernel (0.83 at 4k); these are hand-written streams of several shapes:
//   grid xN    a grid-stride loop, N CTAs of 256 threads per SM, 8 loads of 16 bytes in flight per
//              thread
//   split      the decode step's decomposition: 64 (batch, kv head) x 4 splits = 256 CTAs of 128
//              threads, each streaming its contiguous K and V ranges, 8 + 8 loads in flight per
//              thread
//   split il   the same with each split taking every 4th block of 64 tokens (interleaved)
//   pages rnd  the split shape over pages of 16 tokens (32 KB of pool each, K and V pools apart),
//              placed at random in the pool; "pages ord": the same pages in sequence order
//   pipe ...   the decode kernel's pipeline without its arithmetic (stream_chunks): 128 threads,
//              two 32 KB stages of 64 tokens' K and V, block n + 1's cp.async copies issued once
//              block n has landed, block n then read from shared memory; at most 2 CTAs a SM.
//              Work comes in items, a run of key blocks of one (batch, kv head) tile, each ending
//              with a 2 KB partial written, and the tile's last item reading all of the tile's
//              partials (the split combine's traffic). "pipe split": one item per CTA, the
//              decode's 4 splits. "pipe dyn N": 2 CTAs a SM take items from a counter until none
//              is left (the next one taken while the current one streams, so its first block is
//              in flight before the current one ends), N items a tile, tile-major order (a tile's
//              items handed out one after another); "pipe dcm N": chunk-major (every tile's
//              first item, then every tile's second, ...). "pipe fma N": the split shape with a
//              dependent chain of N FMAs per block and thread after the block's reads (the
//              kernel's math stood in for); "pipe kcopies": the decode kernel's copy order and
//              form (all of K_j, then all of V_j, each with a source size); "kc fma500": both.
//              These modes also print, from per-CTA global-timer stamps, the span of the CTAs
//              (the rest of the step is the launch), when half of them had ended and when the last
//              key loop ended, and a CTA's mean time to its first block and from there to its last
//              (tools/decode_timeline.cu prints the same for the decode kernel).
//   empty grid the split shape's launch with nothing to do: what a step costs outside its CTAs
// Every mode but "empty grid" sums the buffer's 32-bit words, and the sum is checked against the
// host's.
//
// Build and run on the GPU machine (no torch needed):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/read_ceiling \
//     tools/read_ceiling.cu && /tmp/read_ceiling [cache tokens, default 4096,16384,65536]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../csrc/common/cuda/ptx_ops.h"
#include "cold_l2.h"
#include "cuda_check.h"

namespace {

using flashmod::cuda_kernels::cp_async_16;
using flashmod::cuda_kernels::cp_async_commit;
using flashmod::cuda_kernels::cp_async_wait;
using flashmod::cuda_kernels::smem_addr;

// The decode benchmark's shape: B 8, 8 kv heads, D 128, bf16; a token's row of one kv head is
// 256 bytes, of all heads 2 KB. A page of 16 tokens is 32 KB of pool.
constexpr int kBatch = 8, kKvHeads = 8, kRowBytes = 256, kPageTokens = 16;
constexpr int kSplits = 4, kUnroll = 8;

__host__ __device__ inline uint32_t word_value(uint64_t i) {
  return static_cast<uint32_t>(i * 2654435761ull) ^ static_cast<uint32_t>(i >> 7);
}

__global__ void fill(uint32_t* p, uint64_t words) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < words;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = word_value(i);
}

__device__ inline unsigned long long sum4(uint4 v) {
  return static_cast<unsigned long long>(v.x) + v.y + v.z + v.w;  // no wrap at 32 bits
}

__device__ inline void add_to_total(unsigned long long* total, unsigned long long s) {
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) atomicAdd(total, s);
}

__device__ inline uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__global__ void read_grid(const uint4* p, int64_t n16, unsigned long long* total) {
  unsigned long long s = 0;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (; i + (kUnroll - 1) * step < n16; i += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_stream(p + i + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) s += sum4(v[u]);
  }
  for (; i < n16; i += step) s += sum4(load_stream(p + i));
  add_to_total(total, s);
}

// CTA (bh, split) of 128 threads reads 1/kSplits of its (batch, kv head)'s tokens in K and in V,
// 64 tokens an iteration, 8 loads of 16 bytes in flight per thread and tensor. Layout as
// flash-attn's cache, (B, tokens, kv heads, D): a head's row is 256 bytes of every 2 KB token row,
// so a CTA reads a strided set of 256-byte pieces, as the decode kernel does. kOrder:
//   kContiguous   the split's tokens are one range (the decode kernel's splits)
//   kInterleaved  the split takes every kSplits-th block of 64 tokens
//   kPaged        one range, through page_of (logical page (batch, page) -> pool page), the next
//                 iteration's four entries loaded ahead of this iteration's data
enum Order { kContiguous, kInterleaved, kPaged };
template <int kOrder>
__global__ void __launch_bounds__(128) read_split(const uint4* k, const uint4* v, int64_t tokens,
                                                  const int* page_of, unsigned long long* total) {
  const int bh = blockIdx.x / kSplits, split = blockIdx.x % kSplits;
  const int b = bh / kKvHeads, hk = bh % kKvHeads;
  constexpr int kVecPerRow = kRowBytes / 16;           // 16 vectors of one head's row
  constexpr int kVecPerToken = kVecPerRow * kKvHeads;  // 128 vectors of a token
  const int iters = static_cast<int>(tokens / kSplits / 64);
  const int64_t pages = tokens / kPageTokens;
  const int col = hk * kVecPerRow + threadIdx.x % 16, row_in = threadIdx.x / 16;
  auto first_token = [&](int it) -> int64_t {
    return kOrder == kInterleaved ? (int64_t(it) * kSplits + split) * 64
                                  : split * (tokens / kSplits) + int64_t(it) * 64;
  };
  int page[4] = {}, next_page[4] = {};  // kPaged: pool pages of this iteration's 4 logical pages
  if constexpr (kOrder == kPaged) {
#pragma unroll
    for (int q = 0; q < 4; ++q) page[q] = page_of[b * pages + first_token(0) / kPageTokens + q];
  }
  unsigned long long s = 0;
  for (int it = 0; it < iters; ++it) {
    const int64_t t0 = first_token(it);
    uint4 x[2 * kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Token u * 8 + row_in of the 64: page u / 2 of the four (a constant index, so page[]
      // stays in registers), row (u % 2) * 8 + row_in of it.
      const int64_t row = kOrder == kPaged
                              ? int64_t(page[u / 2]) * kPageTokens + (u % 2) * 8 + row_in
                              : b * tokens + t0 + u * 8 + row_in;
      x[u] = load_stream(k + row * kVecPerToken + col);
      x[kUnroll + u] = load_stream(v + row * kVecPerToken + col);
    }
    if constexpr (kOrder == kPaged) {
      if (it + 1 < iters) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          next_page[q] = page_of[b * pages + first_token(it + 1) / kPageTokens + q];
      }
    }
#pragma unroll
    for (int u = 0; u < 2 * kUnroll; ++u) s += sum4(x[u]);
#pragma unroll
    for (int q = 0; q < 4; ++q) page[q] = next_page[q];
  }
  add_to_total(total, s);
}

// The model's own copy form, without the source size of the decode kernel's (ptx_ops.h:
// cp_async_16, which the "kcopies" modes use).
__device__ inline void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

// Per-CTA global-timer stamps of the stream_chunks modes (thread 0: start, key loop done, end), so
// that their span compares with tools/decode_timeline.cu's rows for the decode kernel.
struct CtaStamps {
  unsigned long long start_ns, loop_done_ns, end_ns, first_landed_ns, last_landed_ns;
};
constexpr int kMaxStampedCtas = 4096;
__device__ CtaStamps g_stamps[kMaxStampedCtas];
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The launch alone: stream_chunks' grid and shared memory, no work.
__global__ void __launch_bounds__(128) empty_grid() {
  if (threadIdx.x == 0) {
    const unsigned long long t = global_timer_ns();
    g_stamps[blockIdx.x] = {t, t, t, t, t};
  }
}

constexpr int kBlockTokens = 64, kPipeStageBytes = 2 * kBlockTokens * kRowBytes;  // K_j + V_j
constexpr int kPipeSmemBytes = 96 << 10;  // two 32 KB stages; asking 96 KB caps a SM at 2 CTAs
constexpr int kTiles = kBatch * kKvHeads;

struct ChunkWork {
  const char* k;
  const char* v;
  int64_t tokens;
  int chunk_blocks, chunks_per_tile;
  bool tile_major;
  int math_fmas;  // a dependent chain of this many FMAs per block and thread: the kernel's math
  bool kernel_copies;  // the decode kernel's copy order and form: all of K_j, then all of V_j,
                       // with a source size (zero fill)
  int* counters;  // [0]: items handed out past the grid's first; [1 + tile]: the tile's items done
  float4* partials;  // [tile][chunk][128]: 2 KB each
  float4* out;       // [tile][128]
  unsigned long long* total;
};

template <bool kDynamic>
__global__ void __launch_bounds__(128) stream_chunks(const ChunkWork w) {
  const unsigned long long start_ns = global_timer_ns();
  unsigned long long loop_done_ns = start_ns, first_landed_ns = 0, last_landed_ns = 0;
  bool first_block = true;
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ int next_item, tile_complete;
  const int tid = threadIdx.x, items = kTiles * w.chunks_per_tile;
  auto tile_of = [&](int it) { return w.tile_major ? it / w.chunks_per_tile : it % kTiles; };
  auto chunk_of = [&](int it) { return w.tile_major ? it % w.chunks_per_tile : it / kTiles; };
  auto load_block = [&](int it, int j, int stage) {
    const int tile = tile_of(it), b = tile / kKvHeads, hk = tile % kKvHeads;
    const int64_t t0 = (int64_t(chunk_of(it)) * w.chunk_blocks + j) * kBlockTokens;
    const uint32_t dst = smem_addr(stages + stage * kPipeStageBytes) + (tid % 16) * 16;
    auto src_of = [&](int u) {
      return ((b * w.tokens + t0 + u * 8 + tid / 16) * kKvHeads + hk) * kRowBytes + (tid % 16) * 16;
    };
    const uint32_t row_dst = (tid / 16) * kRowBytes;
    if (w.kernel_copies) {
#pragma unroll
      for (int u = 0; u < 8; ++u)
        cp_async_16(dst + row_dst + u * 8 * kRowBytes, w.k + src_of(u), 16);
#pragma unroll
      for (int u = 0; u < 8; ++u)
        cp_async_16(dst + kPipeStageBytes / 2 + row_dst + u * 8 * kRowBytes, w.v + src_of(u), 16);
      return;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      cp_async16(dst + row_dst + u * 8 * kRowBytes, w.k + src_of(u));
      cp_async16(dst + kPipeStageBytes / 2 + row_dst + u * 8 * kRowBytes, w.v + src_of(u));
    }
  };
  int item = blockIdx.x, j = 0, stage = 0;
  if (item >= items) return;
  load_block(item, 0, 0);
  cp_async_commit();
  unsigned long long s = 0;
  while (true) {
    cp_async_wait<0>();
    // Block (item, j) landed for every thread's copies, and every warp is done reading the other
    // stage, which the copies below overwrite. At j = 0 it also orders the last read of next_item
    // (at the previous item's last block) before thread 0 rewrites it.
    __syncthreads();
    if (first_block) first_landed_ns = global_timer_ns(), first_block = false;
    last_landed_ns = global_timer_ns();
    if (kDynamic && j == 0 && tid == 0) next_item = gridDim.x + atomicAdd(w.counters, 1);
    int following = item, following_j = j + 1;
    if (following_j == w.chunk_blocks) {
      // next_item was written at j = 0, at least one barrier ago (chunk_blocks >= 2).
      following = kDynamic ? next_item : items;
      following_j = 0;
    }
    if (following < items) load_block(following, following_j, stage ^ 1);
    cp_async_commit();
    const uint4* data = reinterpret_cast<const uint4*>(stages + stage * kPipeStageBytes);
#pragma unroll
    for (int u = 0; u < kPipeStageBytes / 16 / 128; ++u) s += sum4(data[u * 128 + tid]);
    float x = static_cast<float>(s & 0xff);
    for (int i = 0; i < w.math_fmas; ++i) x = fmaf(x, 0.999f, 1e-3f);
    if (x < 0.f) s += 1;  // never (x stays positive); keeps the chain
    if (j == w.chunk_blocks - 1) {
      if (following >= items) loop_done_ns = global_timer_ns();
      const int tile = tile_of(item);
      float4* part = w.partials + (int64_t(tile) * w.chunks_per_tile + chunk_of(item)) * 128;
      part[tid] = make_float4(float(tid), float(item), 0.f, 1.f);
      __threadfence();
      // Every thread's partial store is fenced before thread 0 counts the item.
      __syncthreads();
      if (tid == 0) tile_complete = atomicAdd(w.counters + 1 + tile, 1) == w.chunks_per_tile - 1;
      // Publishes tile_complete.
      __syncthreads();
      if (tile_complete) {
        __threadfence();
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c = 0; c < w.chunks_per_tile; ++c) {
          const float4 x = __ldcg(w.partials + (int64_t(tile) * w.chunks_per_tile + c) * 128 + tid);
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
        w.out[tile * 128 + tid] = acc;
      }
    }
    if (following >= items) break;
    item = following, j = following_j, stage ^= 1;
  }
  add_to_total(w.total, s);
  if (tid == 0)
    g_stamps[blockIdx.x] = {start_ns, loop_done_ns, global_timer_ns(), first_landed_ns,
                            last_landed_ns};
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {4096, 16384, 65536};
  if (argc > 1) {
    sizes.clear();
    for (char* tok = std::strtok(argv[1], ","); tok; tok = std::strtok(nullptr, ","))
      sizes.push_back(std::atoll(tok));
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MB; B %d, %d kv heads, D 128, bf16; median of 30 calls, cold L2\n",
              prop.name, sms, prop.l2CacheSize >> 20, kBatch, kKvHeads);
  const ColdL2 cold_l2(prop);
  unsigned long long* total = nullptr;
  CHECK(cudaMalloc(&total, 8));
  constexpr int kMaxChunksPerTile = 32;
  int* counters = nullptr;
  float4 *partials = nullptr, *combined = nullptr;
  CHECK(cudaMalloc(&counters, (1 + kTiles) * sizeof(int)));
  CHECK(cudaMalloc(&partials, kTiles * kMaxChunksPerTile * 128 * sizeof(float4)));
  CHECK(cudaMalloc(&combined, kTiles * 128 * sizeof(float4)));
  CHECK(cudaFuncSetAttribute(stream_chunks<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kPipeSmemBytes));
  CHECK(cudaFuncSetAttribute(stream_chunks<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kPipeSmemBytes));
  CHECK(cudaFuncSetAttribute(empty_grid, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kPipeSmemBytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  for (const int64_t tokens : sizes) {
    const int64_t cache_bytes = kBatch * tokens * kKvHeads * int64_t(kRowBytes);  // K or V
    const int64_t kv_bytes = 2 * cache_bytes;
    char* buf = nullptr;
    char* dst = nullptr;
    CHECK(cudaMalloc(&buf, kv_bytes));
    CHECK(cudaMalloc(&dst, kv_bytes / 2));
    const uint64_t words = kv_bytes / 4;
    fill<<<4 * sms, 256>>>(reinterpret_cast<uint32_t*>(buf), words);
    CHECK(cudaGetLastError());
    unsigned long long want = 0;
    for (uint64_t i = 0; i < words; ++i) want += word_value(i);
    // Pages: per batch row, a random permutation of the row's pages over the whole pool (the
    // benchmark's randperm), and the identity.
    const int64_t pages = tokens / kPageTokens;
    std::vector<int> order(kBatch * pages), identity(kBatch * pages);
    for (size_t i = 0; i < order.size(); ++i) order[i] = identity[i] = static_cast<int>(i);
    std::mt19937 rng(14);
    std::shuffle(order.begin(), order.end(), rng);
    int *d_random = nullptr, *d_identity = nullptr;
    CHECK(cudaMalloc(&d_random, order.size() * 4));
    CHECK(cudaMalloc(&d_identity, order.size() * 4));
    CHECK(cudaMemcpy(d_random, order.data(), order.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_identity, identity.data(), order.size() * 4, cudaMemcpyHostToDevice));
    // The pool view of read_split indexes by (page * 16 + t % 16) rows from page_of[b * pages +
    // t / 16]: with the identity that is (b * tokens + t), the contiguous cache.
    const uint4* k4 = reinterpret_cast<const uint4*>(buf);
    const uint4* v4 = reinterpret_cast<const uint4*>(buf + cache_bytes);
    const int ctas = kBatch * kKvHeads * kSplits;

    struct Mode {
      std::string name;
      bool checked;  // the copy moves bytes without a sum
      std::function<void()> launch;
      int stamped_ctas = 0;  // stream_chunks and empty_grid: CTAs whose stamps to read back
    };
    std::vector<Mode> modes;
    modes.push_back({"copy", false, [&] {
                       CHECK(cudaMemcpyAsync(dst, buf, kv_bytes / 2, cudaMemcpyDeviceToDevice));
                     }});
    for (int per_sm : {1, 2, 4, 8})
      modes.push_back({"grid x" + std::to_string(per_sm), true,
                       [=] { read_grid<<<per_sm * sms, 256>>>(k4, kv_bytes / 16, total); }});
    modes.push_back({"split", true, [=] {
                       read_split<kContiguous><<<ctas, 128>>>(k4, v4, tokens, nullptr, total);
                     }});
    modes.push_back({"split il", true, [=] {
                       read_split<kInterleaved><<<ctas, 128>>>(k4, v4, tokens, nullptr, total);
                     }});
    modes.push_back({"pages ord", true, [=] {
                       read_split<kPaged><<<ctas, 128>>>(k4, v4, tokens, d_identity, total);
                     }});
    modes.push_back({"pages rnd", true,
                     [=] { read_split<kPaged><<<ctas, 128>>>(k4, v4, tokens, d_random, total); }});
    const int tile_blocks = static_cast<int>(tokens / kBlockTokens);
    auto work = [=](int chunks_per_tile, bool tile_major, int math_fmas = 0,
                    bool kernel_copies = false) {
      ChunkWork w{};
      w.k = buf, w.v = buf + cache_bytes, w.tokens = tokens;
      w.chunk_blocks = tile_blocks / chunks_per_tile, w.chunks_per_tile = chunks_per_tile;
      w.tile_major = tile_major, w.math_fmas = math_fmas, w.kernel_copies = kernel_copies;
      w.counters = counters, w.partials = partials, w.out = combined, w.total = total;
      return w;
    };
    modes.push_back({"pipe split", true,
                     [=] {
                       stream_chunks<false>
                           <<<kTiles * kSplits, 128, kPipeSmemBytes>>>(work(kSplits, true));
                     },
                     kTiles * kSplits});
    modes.push_back({"pipe kcopies", true,
                     [=] {
                       stream_chunks<false><<<kTiles * kSplits, 128, kPipeSmemBytes>>>(
                           work(kSplits, true, 0, true));
                     },
                     kTiles * kSplits});
    modes.push_back({"pipe kc fma500", true,
                     [=] {
                       stream_chunks<false><<<kTiles * kSplits, 128, kPipeSmemBytes>>>(
                           work(kSplits, true, 500, true));
                     },
                     kTiles * kSplits});
    for (int fmas : {250, 500, 1000})
      modes.push_back({"pipe fma " + std::to_string(fmas), true,
                       [=] {
                         stream_chunks<false>
                             <<<kTiles * kSplits, 128, kPipeSmemBytes>>>(work(kSplits, true, fmas));
                       },
                       kTiles * kSplits});
    modes.push_back({"empty grid", false,
                     [=] { empty_grid<<<kTiles * kSplits, 128, kPipeSmemBytes>>>(); },
                     kTiles * kSplits});
    for (int per_tile : {8, 16, 32})
      for (bool tile_major : {true, false})
        modes.push_back(
            {std::string(tile_major ? "pipe dyn " : "pipe dcm ") + std::to_string(per_tile), true,
             [=] {
               stream_chunks<true><<<2 * sms, 128, kPipeSmemBytes>>>(work(per_tile, tile_major));
             },
             2 * sms});

    std::vector<std::vector<float>> ms(modes.size());
    // Per stamped mode and call: the span (last end - first start), when the last key loop and
    // half of the CTAs ended (after the first start), in us.
    std::vector<std::vector<float>> span(modes.size()), loop_last(modes.size()),
        half_ended(modes.size()), to_first(modes.size()), first_to_last(modes.size());
    std::vector<CtaStamps> stamps(kMaxStampedCtas);
    constexpr int kReps = 30, kWarmup = 3;
    for (int rep = 0; rep < kWarmup + kReps; ++rep) {
      for (size_t j = 0; j < modes.size(); ++j) {
        const size_t m = (j + rep) % modes.size();  // rotate the order per round
        cold_l2.flush();
        CHECK(cudaMemset(total, 0, 8));
        CHECK(cudaMemset(counters, 0, (1 + kTiles) * sizeof(int)));
        CHECK(cudaEventRecord(start));
        modes[m].launch();
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t = 0;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        if (rep >= kWarmup) ms[m].push_back(t);
        if (rep >= kWarmup && modes[m].stamped_ctas > 0) {
          const int n = modes[m].stamped_ctas;
          CHECK(cudaMemcpyFromSymbol(stamps.data(), g_stamps, n * sizeof(CtaStamps)));
          unsigned long long first = ~0ull, last = 0, loop = 0;
          double first_sum = 0, between_sum = 0;
          std::vector<unsigned long long> ends(n);
          for (int i = 0; i < n; ++i) {
            first = std::min(first, stamps[i].start_ns);
            last = std::max(last, stamps[i].end_ns);
            loop = std::max(loop, stamps[i].loop_done_ns);
            ends[i] = stamps[i].end_ns;
            first_sum += (stamps[i].first_landed_ns - stamps[i].start_ns) * 1e-3;
            between_sum += (stamps[i].last_landed_ns - stamps[i].first_landed_ns) * 1e-3;
          }
          std::nth_element(ends.begin(), ends.begin() + n / 2, ends.end());
          span[m].push_back((last - first) * 1e-3f);
          loop_last[m].push_back((loop - first) * 1e-3f);
          half_ended[m].push_back((ends[n / 2] - first) * 1e-3f);
          to_first[m].push_back(static_cast<float>(first_sum / n));
          first_to_last[m].push_back(static_cast<float>(between_sum / n));
        }
        if (modes[m].checked) {
          unsigned long long got = 0;
          CHECK(cudaMemcpy(&got, total, 8, cudaMemcpyDeviceToHost));
          if (got != want) {
            std::fprintf(stderr, "%s at %lld tokens: sum %llu, expected %llu\n",
                         modes[m].name.c_str(), static_cast<long long>(tokens), got, want);
            return 1;
          }
        }
      }
    }
    auto median = [](std::vector<float> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const float copy_ms = median(ms[0]);
    std::printf("\n%lld tokens: %.1f MB of K/V; copy %.1f us (%.2f TB/s read + written)\n",
                static_cast<long long>(tokens), kv_bytes / 1e6, copy_ms * 1e3,
                kv_bytes / (copy_ms * 1e-3) / 1e12);
    std::printf("%-12s %10s %10s %12s\n", "mode", "us", "TB/s", "of copy rate");
    for (size_t m = 1; m < modes.size(); ++m) {
      const float t = median(ms[m]);
      std::printf("%-12s %10.1f %10.2f %12.3f", modes[m].name.c_str(), t * 1e3,
                  kv_bytes / (t * 1e-3) / 1e12, copy_ms / t);
      if (!span[m].empty())
        std::printf(
            "   span %.1f us, half the CTAs ended at %.1f, the last key loop at %.1f; a CTA's "
            "first block landed %.2f us after its start, its last %.1f us after that",
            median(span[m]), median(half_ended[m]), median(loop_last[m]), median(to_first[m]),
            median(first_to_last[m]));
      std::printf("\n");
    }
    CHECK(cudaFree(buf));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(d_random));
    CHECK(cudaFree(d_identity));
  }
  return 0;
}
