// fp32 forward on CUDA cores (FFMA), for inputs whose users asked for fp32 accuracy. Serves head
// dims > 128 and decode shapes; the rest runs 3xTF32 on the tensor cores
// (fwd_fp32_3xtf32.cu).
//
// Why not tensor cores: their fp32 mode (tf32) keeps 10 mantissa bits, ~1e-3 relative error,
// and the contract for fp32 inputs is <= 1e-5 against an fp64 reference. So this is a plain
// tiled kernel: one CTA of 128 threads owns Br = 32 query rows, four threads (a quad) per row.
// Each quad splits the keys of a block for S = Q_i K_j^T and the head dim for O += P V_j; P goes
// through shared memory because every thread of the quad needs the whole row of it. Scores are
// always transformed (scale, soft cap, mask) before the softmax; the exp2 only folds log2(e).
// Speed: see benchmarks/results/design/cuda-fp32.md (a small fraction of the fp16/bf16 kernel's).
#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "online_softmax.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kBr = 32, kBc = 32, kThreads = 128;

template <int kHeadDim>
struct Fp32Smem {
  static constexpr int kLd = kHeadDim + 4;  // +4 floats: rows of a quad land in different banks
  static constexpr int kLdP = kBc + 1;
  static constexpr int kFloats = (kBr + 2 * kBc) * kLd + kBr * kLdP;
  static constexpr int kBytes = kFloats * 4;
};

// Copies rows [0, valid_rows) x [0, head_dim) of a global tile into smem, zero elsewhere. Scalar
// loads (coalesced along the row): no alignment is assumed.
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_tile(float* s, const float* g, int64_t row_stride,
                                          int valid_rows, int head_dim, int tid) {
  constexpr int kLd = Fp32Smem<kHeadDim>::kLd;
  for (int idx = tid; idx < kRows * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim, c = idx % kHeadDim;
    s[r * kLd + c] = (r < valid_rows && c < head_dim) ? g[r * row_stride + c] : 0.f;
  }
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) attention_fwd_fp32_kernel(const AttentionParams p) {
  using Smem = Fp32Smem<kHeadDim>;
  constexpr int kLd = Smem::kLd, kLdP = Smem::kLdP;
  constexpr int kKeysPerThread = kBc / 4;
  constexpr int kColChunks = kHeadDim / 16;  // float4 chunks of O per thread
  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;
  float* sK = sQ + kBr * kLd;
  float* sV = sK + kBc * kLd;
  float* sP = sV + kBc * kLd;

  const int tid = threadIdx.x, r = tid / 4, sub = tid % 4;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const int num_m_blocks = (Nq + kBr - 1) / kBr;
  const CtaTile tile = cta_tile(p, num_m_blocks, 1);  // longest rows first when right-bounded
  const int64_t b = tile.b, h = tile.h;
  const int r0 = tile.m_block * kBr, rows_q = min(kBr, Nq - r0);

  const TilePointers<float> gp = tile_pointers<float>(p, tile, r0);
  const float *gQ = gp.q, *gK = gp.k, *gV = gp.v;
  float* gO = gp.out;
  float* gLse = gp.lse;

  const KeyBlockRange range = key_block_range(p, r0, r0 + rows_q - 1, kBc);
  const int64_t i = r0 + r;
  const RowWindow win = row_window(p, i);
  const int64_t mask_row =
      b * p.mask_batch_stride + h * p.mask_head_stride + (i < Nq ? i : Nq - 1) * p.mask_row_stride;
  const float scale = static_cast<float>(p.scale), softcap = static_cast<float>(p.softcap);
  const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
  const float log2e = 1.4426950408889634f;

  load_tile<kBr, kHeadDim>(sQ, gQ, p.q_row_stride, rows_q, head_dim, tid);
  float O[kColChunks][4] = {};
  // l and its rescale factor in double (once per row and key block, cheap here): O's error from
  // an approximate alpha cancels in O / l, but lse = log(l) + m keeps it, and fp32 alpha/l put
  // lse ~5x above a plain fp32 computation's error at ~1000 keys.
  OnlineSoftmaxRowF64 row;
  row.init();

  for (int n = range.lo; n < range.hi; ++n) {
    // The previous block's K_j/V_j/P are no longer read by any thread.
    __syncthreads();
    const int64_t k0 = static_cast<int64_t>(n) * kBc;
    const int valid = min(kBc, Nk - n * kBc);
    load_tile<kBc, kHeadDim>(sK, gK + k0 * p.k_row_stride, p.k_row_stride, valid, head_dim, tid);
    load_tile<kBc, kHeadDim>(sV, gV + k0 * p.v_row_stride, p.v_row_stride, valid, head_dim, tid);
    // K_j/V_j (and Q_i on the first pass) written by all threads are visible.
    __syncthreads();

    float s[kKeysPerThread] = {};
    for (int d = 0; d < kHeadDim; d += 4) {
      const float4 q4 = *reinterpret_cast<const float4*>(sQ + r * kLd + d);
#pragma unroll
      for (int kk = 0; kk < kKeysPerThread; ++kk) {
        const float4 k4 = *reinterpret_cast<const float4*>(sK + (sub + 4 * kk) * kLd + d);
        s[kk] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, s[kk]))));
      }
    }
    float block_max = -CUDART_INF_F;
#pragma unroll
    for (int kk = 0; kk < kKeysPerThread; ++kk) {
      const int j = n * kBc + sub + 4 * kk;
      float x = s[kk] * scale;
      if (softcap > 0.f) x = soft_cap(x, softcap, inv_softcap);
      bool visible = win.contains(j);
      if (visible && p.mask_kind != MaskKind::kNone)
        visible = apply_mask<float>(p, mask_row + j * p.mask_col_stride, x);
      s[kk] = visible ? x : -CUDART_INF_F;
      block_max = fmaxf(block_max, s[kk]);
    }
    float cm;
    const float alpha = row.rescale(quad_max(block_max), log2e, cm);
    float sum = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKeysPerThread; ++kk) {
      const float pij = exp2f(fmaf(s[kk], log2e, -cm));
      sum += pij;
      sP[r * kLdP + sub + 4 * kk] = pij;
    }
    row.add(sum);
#pragma unroll
    for (int c = 0; c < kColChunks; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) O[c][e] *= alpha;
    // The quad's P row, written by its 4 lanes, is read whole by each of them.
    __syncwarp();
    for (int kc = 0; kc < kBc; ++kc) {
      const float pij = sP[r * kLdP + kc];
#pragma unroll
      for (int c = 0; c < kColChunks; ++c) {
        const float4 v4 = *reinterpret_cast<const float4*>(sV + kc * kLd + 4 * (sub + 4 * c));
        O[c][0] = fmaf(pij, v4.x, O[c][0]);
        O[c][1] = fmaf(pij, v4.y, O[c][1]);
        O[c][2] = fmaf(pij, v4.z, O[c][2]);
        O[c][3] = fmaf(pij, v4.w, O[c][3]);
      }
    }
  }

  float inv_l, lse;
  row.finish(log2e, inv_l, lse);  // all lanes: it shuffles within the quad
  if (r < rows_q) {
    float* o_row = gO + static_cast<int64_t>(r) * p.out_row_stride;
#pragma unroll
    for (int c = 0; c < kColChunks; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 4 * (sub + 4 * c) + e;
        if (col < head_dim) o_row[col] = O[c][e] * inv_l;
      }
    if (sub == 0) gLse[r] = lse;
  }
}

template <int kHeadDim>
cudaError_t launch_fp32(const AttentionParams& p, cudaStream_t stream) {
  return cuda::launch_kernel(attention_fwd_fp32_kernel<kHeadDim>, cta_count(p, kBr), kThreads,
                             Fp32Smem<kHeadDim>::kBytes, stream, p);
}

}  // namespace

cudaError_t run_attention_fwd_fp32(const AttentionParams& p, bool force_ffma, bool sm90,
                                   cudaStream_t stream) {
  if (!force_ffma && sm90 && p.seqlen_q > 32) {
    const cudaError_t err = run_attention_fwd_fp32_sm90(p, stream);
    if (err != cudaErrorNotSupported) return err;
  }
  // Decode-like shapes (<= 32 query rows) fill a 32-row CTA here but half of the tensor-core
  // kernel's 64 rows.
  if (!force_ffma && p.seqlen_q > 32 && attention_fwd_fp32_tc_fits(p.head_dim))
    return run_attention_fwd_fp32_tc(p, stream);
  if (p.head_dim <= 32) return launch_fp32<32>(p, stream);
  if (p.head_dim <= 64) return launch_fp32<64>(p, stream);
  if (p.head_dim <= 128) return launch_fp32<128>(p, stream);
  return launch_fp32<256>(p, stream);
}

}  // namespace flashmod::cuda_kernels
