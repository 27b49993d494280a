// The backward's pre-passes: its row statistics (entry_points.h: BwdRowStats) and a mask
// tensor's tile classes (classify_bwd_mask_tiles).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../sequence_view.h"
#include "entry_points.h"
#include "mask_tiles.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {
namespace {

// A row is read by kLanes lanes, 16 bytes (8 elements, 4 in fp32) per chunk where the rows are
// 16-byte aligned, so a warp streams 32 / kLanes rows with full-width loads (one warp per row with
// 2-byte loads ran at ~30% of the copy rate: 155 us for 134 MB at D = 64 on an H100). A lane's two
// chunks of a row are requested together, and the row's lse with them; 4 lanes a row where two
// chunks cover it (D <= 64 in 16 bits), else 8. (8 lanes with one chunk in flight each, the row's
// index from 64-bit divisions and lse read after the sum: 56 / 43 / 38 us at D = 64 / 128 / 256 for
// the same 134 MB, H200, B 16, N 1k; session 47.)
constexpr int kThreads = 256, kChunks = 2;

// The sums to zero (the fused dQ's, which the dK/dV kernel then adds into), a share of float4s
// per block: the stores go out beside the statistics' loads instead of in a memset of their own.
struct ClearSums {
  float4* quads = nullptr;
  int64_t count = 0, per_block = 0;
};

// kExtents: a variable-length call; row i of (b, h) is row i of sequence b (sequence_view_bwd), and
// rows past that sequence's end are padding like those past seqlen_q. The grid is exactly
// B * Hq * rows_padded / (kThreads / kLanes) blocks (below 2^31), so the indices are 32-bit.
template <typename Elem, int kLanes, bool kExtents>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_rowstats_kernel(const AttentionBwdParams params, const BwdRowStats st,
                                  const ClearSums clear) {
  constexpr int kRowsPerBlock = kThreads / kLanes;
  static_assert(kBwdRowPad % kRowsPerBlock == 0, "a block's rows belong to one (batch, head)");
  if (clear.quads != nullptr) {
    const int64_t begin = blockIdx.x * clear.per_block;
    const int64_t end =
        begin + clear.per_block < clear.count ? begin + clear.per_block : clear.count;
    for (int64_t q = begin + threadIdx.x; q < end; q += kThreads)
      clear.quads[q] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int sub = threadIdx.x % kLanes;
  const unsigned blocks_per_head = static_cast<unsigned>(st.rows_padded / kRowsPerBlock);
  const unsigned bh = blockIdx.x / blocks_per_head;
  const unsigned b = bh / static_cast<unsigned>(params.heads_q);
  const unsigned h = bh - b * static_cast<unsigned>(params.heads_q);
  const int64_t i = static_cast<int64_t>(blockIdx.x - bh * blocks_per_head) * kRowsPerBlock +
                    threadIdx.x / kLanes;
  const int64_t row = static_cast<int64_t>(bh) * st.rows_padded + i;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  if (i >= p.seqlen_q) {  // pad rows: P = 0, nothing subtracted
    if (sub == 0) st.lse2[row] = CUDART_INF_F, st.delta[row] = 0.f;
    return;  // the row's lanes leave together: the shuffles below involve only a row's own lanes
  }
  // grad_lse has lse's layout: (B, Hq, Nq) contiguous, or (Hq, total_q) for varlen.
  const int64_t flat = b * p.lse_batch_stride + h * p.lse_head_stride + i;
  float lse = 0.f, grad_lse = 0.f;
  if (sub == 0) {
    lse = p.lse[flat];
    if (p.grad_lse != nullptr) grad_lse = p.grad_lse[flat];
  }
  const Elem* o = static_cast<const Elem*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
                  i * p.out_row_stride;
  const Elem* dout = static_cast<const Elem*>(p.grad_out) + b * p.grad_out_batch_stride +
                     h * p.grad_out_head_stride + i * p.grad_out_row_stride;
  float sum = 0.f;
  if (st.vec_rows) {
    constexpr int kVec = 16 / sizeof(Elem), kStride = kVec * kLanes;
#pragma unroll 1
    for (int64_t c0 = kVec * sub; c0 < p.head_dim; c0 += kChunks * kStride) {
      uint4 ov[kChunks], dv[kChunks];
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (c0 + k * kStride < p.head_dim) {
          ov[k] = *reinterpret_cast<const uint4*>(o + c0 + k * kStride);
          dv[k] = *reinterpret_cast<const uint4*>(dout + c0 + k * kStride);
        }
      }
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (c0 + k * kStride < p.head_dim) {
          const Elem* oe = reinterpret_cast<const Elem*>(&ov[k]);
          const Elem* de = reinterpret_cast<const Elem*>(&dv[k]);
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum = fmaf(to_float(oe[e]), to_float(de[e]), sum);
        }
      }
    }
  } else {
    for (int64_t d = sub; d < p.head_dim; d += kLanes)
      sum = fmaf(to_float(o[d]), to_float(dout[d]), sum);
  }
  const unsigned row_lanes = ((1u << kLanes) - 1) << (threadIdx.x % 32 / kLanes * kLanes);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(row_lanes, sum, off);
  if (sub != 0) return;
  // A row that saw no key (lse = -inf) gets +inf, so exp2(s - lse2) is exactly 0 for it.
  st.lse2[row] = lse == -CUDART_INF_F ? CUDART_INF_F : lse * 1.4426950408889634f;
  st.delta[row] = sum - grad_lse;
}

template <typename Elem, bool kExtents>
cudaError_t launch_rowstats(const AttentionBwdParams& p, const BwdRowStats& st,
                            int64_t clear_floats, cudaStream_t stream) {
  // Two chunks of 16 bytes a lane cover a row of 4 lanes.
  const bool narrow = p.head_dim <= 4 * kChunks * (16 / static_cast<int64_t>(sizeof(Elem)));
  const int lanes = narrow ? 4 : 8;
  const int64_t blocks = p.batch * p.heads_q * (st.rows_padded / (kThreads / lanes));
  if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  ClearSums sums;
  if (st.dq_accum != nullptr && clear_floats > 0) {
    sums.quads = reinterpret_cast<float4*>(st.dq_accum);
    sums.count = clear_floats / 4;  // dq_sums_floats: a multiple of 64 columns
    sums.per_block = (sums.count + blocks - 1) / blocks;
  }
  return cuda::launch_kernel(narrow ? attention_bwd_rowstats_kernel<Elem, 4, kExtents>
                                    : attention_bwd_rowstats_kernel<Elem, 8, kExtents>,
                             blocks, kThreads, 0, stream, p, st, sums);
}

}  // namespace

cudaError_t run_attention_bwd_rowstats(const AttentionBwdParams& p, const BwdRowStats& st,
                                       cudaStream_t stream, int64_t clear_floats) {
  // Variable-length calls are fp16/bf16 only (flash-attn's dtypes): fp32 has no extents variant.
  const bool extents = has_sequence_extents(p);
  switch (p.dtype) {
    case ScalarKind::kBFloat16:
      return extents ? launch_rowstats<__nv_bfloat16, true>(p, st, clear_floats, stream)
                     : launch_rowstats<__nv_bfloat16, false>(p, st, clear_floats, stream);
    case ScalarKind::kFloat32:
      if (extents) return cudaErrorInvalidValue;
      return launch_rowstats<float, false>(p, st, clear_floats, stream);
    default:
      return extents ? launch_rowstats<__half, true>(p, st, clear_floats, stream)
                     : launch_rowstats<__half, false>(p, st, clear_floats, stream);
  }
}

cudaError_t classify_bwd_mask_tiles(AttentionBwdParams& p, const DeviceWorkspace& ws,
                                    cudaStream_t stream) {
  if (key_padding_mask(p)) return cudaSuccess;
  switch (p.dtype) {
    case ScalarKind::kBFloat16:
      return classify_mask_tiles<__nv_bfloat16>(p, kBwdMaskTile, kBwdMaskTile, ws, stream);
    case ScalarKind::kFloat16:
      return classify_mask_tiles<__half>(p, kBwdMaskTile, kBwdMaskTile, ws, stream);
    default: return cudaSuccess;
  }
}

}  // namespace flashmod::cuda_kernels
