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

// Splits one combine can merge: each lane of the row's warp holds the lse and weight of up to
// kSplitsPerLane of them (the host caps splits at kMaxSplits, decode_heuristics.h).
constexpr int kSplitsPerLane = 4;  // the selects below name w[0..3]
constexpr int kMaxCombinedSplits = 32 * kSplitsPerLane;
constexpr int kPrefetched = 4;  // splits whose partials are read with the lse (combine_split_row)

// Merges the splits of one row: with M = max_s lse_s, lse = M + log(sum_s exp(lse_s - M)) and
// out = sum_s exp(lse_s - lse) O_s (each O_s normalized by its own sum, so the weights are the
// splits' shares of the total). Splits with lse_s = -inf saw no visible key and weigh 0 (left
// out of the sum); a row whose splits are all empty gets out = 0, lse = -inf. One
// warp per row. Lane l reads the lse of splits l, l + 32, ... at once and computes their weights;
// the max and the sum are warp reductions in a fixed order. Then every lane sums its 4-column
// groups over the splits in index order, eight splits' partials in flight at a time. Reading the
// splits one after another (a loop-carried L2 round trip per split and pass) kept a 16-split row's
// combine at ~18 us on an H200, past the whole decode of the other CTAs (B 1, 16k: 43 us per call
// with the combine fused, 26 us without it). The result is deterministic and the same wherever it
// runs (the combine kernel below, or the decode kernel's last CTA of a tile). row: the flat (B, Hq,
// Nq) index of the row among rows; out / lse_out: where its result goes. The partials are read
// through L2 (__ldcg): other CTAs wrote them during this kernel.
template <typename Elem, int kHeadDim>
__device__ __noinline__ void combine_split_row(const SplitKvArgs& sk, int64_t rows, int64_t row,
                                               Elem* out, float* lse_out, int head_dim, int lane) {
  float ls[kSplitsPerLane];
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) {
    const int s = lane + 32 * i;
    ls[i] = s < sk.splits ? __ldcg(sk.lse + s * rows + row) : -CUDART_INF_F;
  }
  // The first kPrefetched splits' partials (first 128 columns) are read with the lse, so their
  // L2 round trip overlaps the weights' (a 4k step's last CTA: design log, session 29).
  const bool mine0 = 4 * lane < kHeadDim;
  float4 early[kPrefetched];
#pragma unroll
  for (int j = 0; j < kPrefetched; ++j)
    early[j] =
        mine0 && j < sk.splits
            ? __ldcg(reinterpret_cast<const float4*>(sk.o + (j * rows + row) * kHeadDim + 4 * lane))
            : make_float4(0.f, 0.f, 0.f, 0.f);
  float m = -CUDART_INF_F;
  bool poisoned = false;  // a split with a NaN lse (a NaN or +inf visible score) makes the row NaN
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) {
    poisoned |= ls[i] != ls[i];
    m = fmaxf(m, ls[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (__any_sync(0xffffffffu, poisoned)) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(CUDART_NAN_F);
    if (lane == 0) *lse_out = CUDART_NAN_F;
    return;
  }
  if (m == -CUDART_INF_F) {
    for (int col = lane; col < head_dim; col += 32) out[col] = from_float<Elem>(0.f);
    if (lane == 0) *lse_out = -CUDART_INF_F;
    return;
  }
  // fp32, like the kernels' own softmax: in double (exp and log are long subroutines there) the
  // last CTA of a 4k step spent 0.7 us more past its key loop (design log, session 29).
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) sum += expf(ls[i] - m);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float lse = m + logf(sum);  // sum >= 1: the max split adds 1
  float w[kSplitsPerLane];          // 0 for empty splits and lanes past the last split
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) w[i] = expf(ls[i] - lse);
  // Every lane runs every pass (the shuffles need the whole warp); at kHeadDim 64, lanes 16-31
  // have no columns and only shuffle.
  for (int base = 0; base < kHeadDim; base += 128) {
    const int c0 = base + 4 * lane;
    const bool mine = c0 < kHeadDim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&acc](float ws, float4 o) {
      if (ws != 0.f) {  // a split of weight 0 (empty, or below fp32's range) is left out
        acc.x = fmaf(ws, o.x, acc.x);
        acc.y = fmaf(ws, o.y, acc.y);
        acc.z = fmaf(ws, o.z, acc.z);
        acc.w = fmaf(ws, o.w, acc.w);
      }
    };
    if (base == 0) {
#pragma unroll
      for (int j = 0; j < kPrefetched; ++j) add(__shfl_sync(0xffffffffu, w[0], j), early[j]);
    }
    // Not unrolled (one copy of the loop body keeps the decode kernel's code small); the weights'
    // register is picked by selects, not an indexed (local memory) array.
#pragma unroll 1
    for (int i = 0; i < kSplitsPerLane; ++i) {
      const int first = 32 * i, count = min(32, sk.splits - first);
      const float wi = i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
#pragma unroll 8
      for (int j = i == 0 && base == 0 ? kPrefetched : 0; j < count; ++j) {
        // The same split on every lane: its weight comes from lane j. Every split's partial is
        // read unconditionally, so the loads of eight splits overlap; a split of weight 0 (empty,
        // or below fp32's range) is left out by the select.
        const float ws = __shfl_sync(0xffffffffu, wi, j);
        add(ws, mine ? __ldcg(reinterpret_cast<const float4*>(
                           sk.o + ((first + j) * rows + row) * kHeadDim + c0))
                     : make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
    if (c0 < head_dim) out[c0] = from_float<Elem>(acc.x);
    if (c0 + 1 < head_dim) out[c0 + 1] = from_float<Elem>(acc.y);
    if (c0 + 2 < head_dim) out[c0 + 2] = from_float<Elem>(acc.z);
    if (c0 + 3 < head_dim) out[c0 + 3] = from_float<Elem>(acc.w);
  }
  if (lane == 0) *lse_out = lse;
}

// Split-KV, after a CTA wrote its partial rows: with the fused combine (sk.tile_counters), the
// tile's last CTA to finish merges its rows_q rows (in split order, so the result does not depend
// on which CTA it is). Ordering: the CTA barrier puts every thread's partial stores before thread
// 0's count, whose release (gpu scope, cumulative over what the barrier ordered before it) makes
// them visible with the count; the last CTA's count acquires every other CTA's release, and its
// second barrier hands that on to its threads, whose reads go through L2. (Two __threadfence
// instead, one by every thread before the count and one after the last CTA reset the counter,
// kept a 4k step's last CTA 3.9 us past its key loop: tools/decode_timeline.cu, design log session
// 29.) Every thread of the CTA calls it. tile_id: the tile's counter; row_id: the flat index of its
// first row among rows_all; gO / gLse: where its first row's result goes; last: a shared-memory
// int of the caller's dynamic area (a static one would misalign that area's base:
// fwd_sm80_kernel.h).
template <typename Elem, int kHeadDim, int kThreads>
__device__ __forceinline__ void finish_split_cta(const SplitKvArgs& sk, int64_t tile_id,
                                                 int64_t rows_all, int64_t row_id, int rows_q,
                                                 Elem* gO, int64_t out_row_stride, float* gLse,
                                                 int head_dim, int& last) {
  if (sk.tile_counters == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0)
    last = atomic_add_acq_rel_gpu(sk.tile_counters + tile_id, 1) == sk.splits - 1;
  __syncthreads();
  if (!last) return;
  // Every split has counted itself in: the counter is free to be zero for the next launch (the
  // kernel boundary orders this store before that launch's counts).
  if (threadIdx.x == 0) sk.tile_counters[tile_id] = 0;
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
