// The split-KV combine of the decode path: merges the per-split partials that the decode kernel
// (fwd_sm80_kernel.h with kDecode, sk.splits > 1) wrote to the workspace into out and lse, either
// in a kernel of its own or in the decode kernel's last CTA of each tile (sk.tile_counters).
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../attention_params.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {

// Merges the splits of one row: with M = max_s lse_s, lse = M + log(sum_s exp(lse_s - M)) and
// out = sum_s exp(lse_s - lse) O_s (each O_s normalized by its own sum, so the weights are the
// splits' shares of the total). Splits with lse_s = -inf saw no visible key and are skipped
// (their O_s is not even read); a row whose splits are all empty gets out = 0, lse = -inf. One
// warp per row, lanes over 4-column groups; the splits are summed in index order by every lane,
// so the result is deterministic and the same wherever it runs (the combine kernel below, or the
// decode kernel's last CTA of a tile). Weights in double: a few hundred exps per row. row: the
// flat (B, Hq, Nq) index of the row among rows; out / lse_out: where its result goes. The
// partials are read through L2 (__ldcg): other CTAs wrote them during this kernel.
template <typename Elem, int kHeadDim>
__device__ __noinline__ void combine_split_row(const SplitKvArgs& sk, int64_t rows, int64_t row,
                                               Elem* out, float* lse_out, int head_dim, int lane) {
  float m = -CUDART_INF_F;
  bool poisoned = false;  // a split with a NaN lse (a NaN or +inf visible score) makes the row NaN
  for (int s = 0; s < sk.splits; ++s) {
    const float ls = __ldcg(sk.lse + s * rows + row);
    poisoned |= ls != ls;
    m = fmaxf(m, ls);
  }
  if (poisoned) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(CUDART_NAN_F);
    if (lane == 0) *lse_out = CUDART_NAN_F;
    return;
  }
  if (m == -CUDART_INF_F) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(0.f);
    if (lane == 0) *lse_out = -CUDART_INF_F;
    return;
  }
  double sum = 0.0;
  for (int s = 0; s < sk.splits; ++s)
    sum += exp(static_cast<double>(__ldcg(sk.lse + s * rows + row)) - m);
  const double lse = static_cast<double>(m) + log(sum);  // sum >= 1: the max split adds 1
  for (int c0 = 4 * lane; c0 < kHeadDim; c0 += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < sk.splits; ++s) {
      const float ls = __ldcg(sk.lse + s * rows + row);
      if (ls == -CUDART_INF_F) continue;
      const float w = static_cast<float>(exp(static_cast<double>(ls) - lse));
      const float4 o =
          __ldcg(reinterpret_cast<const float4*>(sk.o + (s * rows + row) * kHeadDim + c0));
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
  if (lane == 0) *lse_out = static_cast<float>(lse);
}

// Split-KV, after a CTA wrote its partial rows: with the fused combine (sk.tile_counters), the
// tile's last CTA to finish merges its rows_q rows (in split order, so the result does not depend
// on which CTA it is). Partials are made visible device-wide before the count (the fence) and read
// through L2. Every thread of the CTA calls it. tile_id: the tile's counter; row_id: the flat
// index of its first row among rows_all; gO / gLse: where its first row's result goes.
template <typename Elem, int kHeadDim, int kThreads>
__device__ __forceinline__ void finish_split_cta(const SplitKvArgs& sk, int64_t tile_id,
                                                 int64_t rows_all, int64_t row_id, int rows_q,
                                                 Elem* gO, int64_t out_row_stride, float* gLse,
                                                 int head_dim) {
  if (sk.tile_counters == nullptr) return;
  __shared__ int last;
  __threadfence();
  // Every thread's partial writes are fenced before thread 0 counts the CTA in.
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(sk.tile_counters + tile_id, 1) == sk.splits - 1;
  // Publishes `last` to the CTA.
  __syncthreads();
  if (!last) return;
  // Every split has counted itself in: the counter is free to be zero for the next launch.
  if (threadIdx.x == 0) sk.tile_counters[tile_id] = 0;
  __threadfence();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows_q; r += kThreads / 32)
    combine_split_row<Elem, kHeadDim>(sk, rows_all, row_id + r, gO + r * out_row_stride, gLse + r,
                                      head_dim, lane);
}

// The combine as its own kernel, after the decode kernel: one warp per row.
constexpr int kCombineWarps = 4;
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps)
    attention_fwd_split_combine_kernel(const AttentionParams p, const SplitKvArgs sk) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t bh = row / p.seqlen_q, r = row % p.seqlen_q;
  const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
  Elem* out = static_cast<Elem*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
              r * p.out_row_stride;
  combine_split_row<Elem, kHeadDim>(sk, rows, row, out, p.lse + row, static_cast<int>(p.head_dim),
                                    threadIdx.x % 32);
}

template <typename Elem, int kHeadDim>
cudaError_t launch_split_combine(const AttentionParams& p, const SplitKvArgs& sk,
                                 cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  return cuda::launch_kernel(attention_fwd_split_combine_kernel<Elem, kHeadDim>,
                             (rows + kCombineWarps - 1) / kCombineWarps, 32 * kCombineWarps, 0,
                             stream, p, sk);
}

// The split-KV workspace of a decode launch with `splits` > 1: partial O and lse (fp32) for
// `rows` rows, then with the fused combine one zeroed counter per CTA tile (`tiles`): the
// stream's shared counters (DeviceWorkspace::zeroed_counters), else a memset node (still cheaper
// than the combine kernel it replaces, which waits for the whole grid).
// Shapes only, never values: a captured graph replays with the same allocation.
template <int kHeadDim>
cudaError_t alloc_split_workspace(SplitKvArgs& sk, int64_t rows, int64_t tiles, bool fused_combine,
                                  const DeviceWorkspace& ws, cudaStream_t stream) {
  const size_t floats = static_cast<size_t>(sk.splits) * rows * (kHeadDim + 1);
  void* w = ws.alloc ? ws.alloc(ws.ctx, floats * sizeof(float)) : nullptr;
  if (w == nullptr) return cudaErrorMemoryAllocation;
  sk.o = static_cast<float*>(w);
  sk.lse = sk.o + static_cast<size_t>(sk.splits) * rows * kHeadDim;
  if (!fused_combine) return cudaSuccess;
  return acquire_zeroed_counters(ws, static_cast<size_t>(tiles), stream, sk.tile_counters);
}

}  // namespace flashmod::cuda_kernels
