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
// Every mode sums the buffer's 32-bit words, and the sum is checked against the host's.
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

#include "cold_l2.h"
#include "cuda_check.h"

namespace {

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

    std::vector<std::vector<float>> ms(modes.size());
    constexpr int kReps = 30, kWarmup = 3;
    for (int rep = 0; rep < kWarmup + kReps; ++rep) {
      for (size_t j = 0; j < modes.size(); ++j) {
        const size_t m = (j + rep) % modes.size();  // rotate the order per round
        cold_l2.flush();
        CHECK(cudaMemset(total, 0, 8));
        CHECK(cudaEventRecord(start));
        modes[m].launch();
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t = 0;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        if (rep >= kWarmup) ms[m].push_back(t);
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
    std::printf("%-10s %10s %10s %12s\n", "mode", "us", "TB/s", "of copy rate");
    for (size_t m = 1; m < modes.size(); ++m) {
      const float t = median(ms[m]);
      std::printf("%-10s %10.1f %10.2f %12.3f\n", modes[m].name.c_str(), t * 1e3,
                  kv_bytes / (t * 1e-3) / 1e12, copy_ms / t);
    }
    CHECK(cudaFree(buf));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(d_random));
    CHECK(cudaFree(d_identity));
  }
  return 0;
}
