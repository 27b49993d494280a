// Tile choices per head dim and the (torch-free) launch of the tensor-core kernel. Each
// attention_fwd_<dtype>_hd<D>.cu instantiates one run_attention_fwd so ninja compiles the
// 16 variants in parallel.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "entry_points.h"
#include "fwd_sm80_kernel.h"

namespace flashmod::cuda_kernels {

// (Br, Bc, warps, stages, Q in registers) per padded head dim. Each warp owns 32 query rows (two
// m16 tiles) where registers allow: every K_j/V_j fragment a warp reads from shared memory then
// feeds twice the mma work, and ldmatrix traffic stays under shared-memory bandwidth. Past
// D = 128 the O accumulator alone (D fp32 registers per thread at 32 rows per warp) would not
// fit, so warps own 16 rows. Measured on an H100 (bf16, N = 1k..16k, vs SDPA FLASH in the same
// process; benchmarks/results/design/cuda-sm80.md):
//   D = 64:  128x64 with Q in registers 1.02-1.08x FLASH; 128x64 re-reading Q 0.97-1.02x;
//            128x128 1.00-1.08x; 128x64 3 stages + Q in regs 1.01-1.08x (no better, more smem).
//   D = 128: 128x64 0.96-1.08x over three runs (FLASH itself moves ~3% run to run); 128x32
//            0.94-1.02x; 8 warps x 16 rows 0.79-0.89x (smem-bound); 3 stages 0.83-0.96x (one
//            CTA per SM instead of two).
//   D = 160..256: 64x64, 4 warps of 16 rows: fits sm80's 163 KB; 0.77-0.86x FLASH at D = 256.
template <typename Elem, int kHeadDim>
struct FwdConfig;
// Tile per head dim (Br, Bc, warps, CTAs per SM, Q kept in registers), as measured above.
#define FLASHMOD_CONFIG(D, ...)                     \
  template <typename Elem>                          \
  struct FwdConfig<Elem, D> {                       \
    using Traits = FwdTraits<Elem, D, __VA_ARGS__>; \
  };
FLASHMOD_CONFIG(32, 128, 64, 4, 2, true)
FLASHMOD_CONFIG(64, 128, 64, 4, 2, true)
FLASHMOD_CONFIG(96, 128, 64, 4, 2, false)
FLASHMOD_CONFIG(128, 128, 64, 4, 2, false)
FLASHMOD_CONFIG(160, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(192, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(224, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(256, 64, 64, 4, 2, false)
#undef FLASHMOD_CONFIG

template <class Tr>
cudaError_t launch_fwd(const AttentionParams& p, const FwdLaunchFlags& flags, cudaStream_t stream) {
  const bool general = p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
  const int64_t blocks = (p.seqlen_q + Tr::Br - 1) / Tr::Br * p.heads_q * p.batch;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  auto kernel = general ? attention_fwd_kernel<Tr, true> : attention_fwd_kernel<Tr, false>;
  if (Tr::kSmemBytes > 48 * 1024) {
    // Dynamic shared memory above 48 KB is opt-in per kernel.
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, flags,
                                                                                   SplitKvArgs{});
  return cudaSuccess;  // the caller checks the launch itself (cudaGetLastError)
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              cudaStream_t stream) {
  return launch_fwd<typename FwdConfig<Elem, kHeadDim>::Traits>(p, flags, stream);
}

// ---------------------------------------------------------------------------------------------
// Decode: seqlen_q <= kDecodeMaxNq (after GQA packing up to kDecodeMaxNq * g rows per kv head).
// 64-row tiles of 4 warps x 16 rows (one m16 tile each): a prefill tile of 128 rows would be
// mostly padding, and its mma work (Br x Bc x D per 2 Bc D bytes of K/V) would approach the
// memory roofline's budget. With MT = 1 registers are plentiful, so Q stays in registers up to
// D = 128. Shared memory: 64 D (Q) + 2 stages x 2 x 64 D (K, V) elements = 80 KB at D = 128,
// two CTAs per SM on sm80 and sm90.
template <typename Elem, int kHeadDim>
struct DecodeConfig {
  using Traits = FwdTraits<Elem, kHeadDim, 64, kDecodeBc, 4, 2, (kHeadDim <= 128)>;
};

// Merges the splits of each row: with M = max_s lse_s, lse = M + log(sum_s exp(lse_s - M)) and
// out = sum_s exp(lse_s - lse) O_s (each O_s normalized by its own sum, so the weights are the
// splits' shares of the total). Splits with lse_s = -inf saw no visible key and are skipped
// (their O_s is not even read); a row whose splits are all empty gets out = 0, lse = -inf; a
// split with a NaN lse (a NaN or +inf score) makes the row NaN.
// One warp per row, lanes over 4-column groups; the splits are summed in index order by every
// lane, so the result is deterministic. Weights in double: a few hundred exps per row.
constexpr int kCombineWarps = 4;
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps)
    attention_fwd_split_combine_kernel(const AttentionParams p, const SplitKvArgs sk) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t bh = row / p.seqlen_q, r = row % p.seqlen_q;
  const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
  Elem* out = static_cast<Elem*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
              r * p.out_row_stride;
  const int head_dim = static_cast<int>(p.head_dim);

  float m = -CUDART_INF_F;
  bool poisoned = false;
  for (int s = 0; s < sk.splits; ++s) {
    const float ls = sk.lse[s * rows + row];
    poisoned |= ls != ls;
    m = fmaxf(m, ls);
  }
  if (poisoned) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(CUDART_NAN_F);
    if (lane == 0) p.lse[row] = CUDART_NAN_F;
    return;
  }
  if (m == -CUDART_INF_F) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(0.f);
    if (lane == 0) p.lse[row] = -CUDART_INF_F;
    return;
  }
  double sum = 0.0;
  for (int s = 0; s < sk.splits; ++s) sum += exp(static_cast<double>(sk.lse[s * rows + row]) - m);
  const double lse = static_cast<double>(m) + log(sum);  // sum >= 1: the max split adds 1
  for (int c0 = 4 * lane; c0 < kHeadDim; c0 += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < sk.splits; ++s) {
      const float ls = sk.lse[s * rows + row];
      if (ls == -CUDART_INF_F) continue;
      const float w = static_cast<float>(exp(static_cast<double>(ls) - lse));
      const float4 o = *reinterpret_cast<const float4*>(sk.o + (s * rows + row) * kHeadDim + c0);
      acc.x = fmaf(w, o.x, acc.x);
      acc.y = fmaf(w, o.y, acc.y);
      acc.z = fmaf(w, o.z, acc.z);
      acc.w = fmaf(w, o.w, acc.w);
    }
    if (c0 < head_dim) out[c0] = from_float<Elem>(acc.x);
    if (c0 + 1 < head_dim) out[c0 + 1] = from_float<Elem>(acc.y);
    if (c0 + 2 < head_dim) out[c0 + 2] = from_float<Elem>(acc.z);
    if (c0 + 3 < head_dim) out[c0 + 3] = from_float<Elem>(acc.w);
  }
  if (lane == 0) p.lse[row] = static_cast<float>(lse);
}

constexpr int kMaxCachedDevices = 64;
// Resident CTAs per SM of a decode kernel, from the occupancy calculator, cached per device.
template <class Kernel>
int decode_ctas_per_sm(Kernel kernel, int threads, int smem, std::atomic<int>* cache) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxCachedDevices) return 1;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess ||
      n < 1)
    n = 1;
  cache[dev].store(n, std::memory_order_relaxed);  // racing callers store the same value
  return n;
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_decode(const AttentionParams& p, const FwdLaunchFlags& flags,
                                     const DecodeOptions& opt, const DecodeWorkspace& ws,
                                     cudaStream_t stream) {
  using Tr = typename DecodeConfig<Elem, kHeadDim>::Traits;
  const bool general = p.mask_kind != MaskKind::kNone || p.softcap > 0.0 || !(p.scale > 0.0);
  auto kernel =
      general ? attention_fwd_kernel<Tr, true, true> : attention_fwd_kernel<Tr, false, true>;
  if (Tr::kSmemBytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const int64_t ctas = (p.seqlen_q + Tr::Br - 1) / Tr::Br * p.heads_q * p.batch;
  int splits = opt.forced_splits;
  if (splits <= 0) {
    static std::atomic<int> per_sm_cache[2][kMaxCachedDevices];
    const int per_sm =
        decode_ctas_per_sm(kernel, Tr::kNThreads, Tr::kSmemBytes, per_sm_cache[general]);
    splits = choose_splits(ctas, decode_key_blocks(p, Tr::Bc),
                           static_cast<int64_t>(opt.num_sms) * per_sm);
  }
  if (ctas * splits > 0x7fffffff) return cudaErrorInvalidConfiguration;

  SplitKvArgs sk;
  sk.splits = splits;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  if (splits > 1) {
    const size_t floats = static_cast<size_t>(splits) * rows * (kHeadDim + 1);
    float* w = ws.alloc ? static_cast<float*>(ws.alloc(ws.ctx, floats * sizeof(float))) : nullptr;
    if (w == nullptr) return cudaErrorMemoryAllocation;
    sk.o = w;
    sk.lse = w + static_cast<size_t>(splits) * rows * kHeadDim;
  }
  kernel<<<static_cast<unsigned>(ctas * splits), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, flags,
                                                                                          sk);
  if (splits > 1) {
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return err;
    const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    attention_fwd_split_combine_kernel<Elem, kHeadDim>
        <<<static_cast<unsigned>(blocks), 32 * kCombineWarps, 0, stream>>>(p, sk);
  }
  return cudaSuccess;
}

}  // namespace flashmod::cuda_kernels
