// fp32 forward on the tensor cores with 3xTF32 products (sm_80+).
//
// Why: the FFMA kernel (fwd_fp32_ffma.cu) keeps fp32 accuracy but runs at a third of SDPA's
// EFFICIENT backend, whose fp32 path already uses the tensor cores this way. Every fp32 operand x
// is split into tf32 halves hi = tf32(x), lo = x - hi (tf32_tile.h: split_tf32_fast), and a*b
// becomes a_lo*b_hi + a_hi*b_lo + a_hi*b_hi (ptx_ops.h, mma_3xtf32_apart): ~22 of 24 mantissa bits
// per operand, so S = Q K^T and O += P V keep fp32-level error (the contract for fp32 inputs is <=
// 1e-5 against fp64), at three tf32 mma's per product.
//
// Layout: Br = 64 query rows per CTA, 4 warps of 16 rows (the mma's m16), Bc = 64 or 32 keys per
// block. Q_i, K_j, V_j sit in shared memory as rows padded to kHeadDim + 4 floats: with a row pitch
// of 4 (mod 32) words, the fragment reads (8 rows x 4 columns, or V's 4 row pairs x 8 columns) hit
// 32 different banks. S stays in registers; P is reused as the A operand of P V_j without a trip
// through shared memory: the accumulator holds columns (2t, 2t + 1) where the m16n8k8 A fragment
// wants (t, t + 4), so the k index of P V is relabelled (position t <-> key 2t, t + 4 <-> key
// 2t + 1) and V's fragment reads rows 2t and 2t + 1 to match. The masks, windows, soft cap and the
// double-precision l follow the FFMA kernel, which stays for decode shapes and for head dims > 128
// where the device's shared memory cannot take the tiles below.
//
// Past head dim 128 (kColSplit = 2) two warps share each m16 row tile, 8 warps per CTA: each sums
// S over its half of the head dim, the pair adds the two partial S through shared memory (fp32
// addition commutes, so both warps hold the same S and agree on m and l), and each computes P V_j
// for its half of O's columns. O then takes D / 4 floats a thread, as at D = 128, where a warp of
// its own at D = 256 would need 128 (and every k8 step of S a 32-step in-place mma chain, whose
// truncation the backward measured as tens of ulps at D >= 160). 139-211 KB at D = 160-256: one
// CTA of 8 warps per SM, as D = 128's two CTAs of 4; past D = 192 only Hopper's 227 KB per block
// take it (an A100's 163 KB: D = 160 / 192).
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../../common/alignment.h"
#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fp32_block_softmax.h"
#include "tf32_tile.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kBr = 64, kRowTiles = kBr / 16;  // each warp (pair) owns one m16 row tile

// Shared memory: Q_i as loaded (fp32), K_j and V_j as tf32 halves: the loaded fp32 tile becomes
// the hi half in place, and a second tile holds the lo half. Splitting once per tile, by all
// threads, replaces four warps splitting every K/V element again (counted per warp and block, the
// splits' cvt/fsub outnumbered the mma instructions 2:1 that way).
// Bc = 64 keys per block up to head dim 64, 32 at 128: (64 + 4 * Bc) * (128 + 4) * 4 B = 99 KB,
// two CTAs per SM; S's registers halve too.
// Past D = 128 each warp adds its partner's partial S from a (lane-major) exchange area of
// 16 x Bc floats per warp.
template <int kHeadDim>
struct Tf32Tile {
  static constexpr int kColSplit = kHeadDim <= 128 ? 1 : 2;
  static constexpr int kWarps = kRowTiles * kColSplit, kThreads = 32 * kWarps;
  static constexpr int kBc = kHeadDim <= 64 ? 64 : 32;
  static constexpr int kLd = tf32_tile_pitch<kHeadDim>();
  static constexpr int kExchange = kColSplit == 1 ? 0 : kWarps * 16 * kBc;
  static constexpr int kBytes = ((kBr + 4 * kBc) * kLd + kExchange) * 4;
  static_assert(kBytes <= 227 * 1024, "must fit a Hopper SM");
  static_assert(kHeadDim / 8 % kColSplit == 0, "whole n8 tiles of O per warp");
};

// 4-byte cp.async (no alignment assumed); bytes == 0 zero-fills.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// Starts copying rows [0, valid_rows) x [0, head_dim) of a global tile into shared memory, zeros
// elsewhere. vec16: every row start is 16-byte aligned and head_dim % 4 == 0.
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_tile_async(float* s, const float* g, int64_t row_stride,
                                                int valid_rows, int head_dim, bool vec16, int tid) {
  constexpr int kLd = Tf32Tile<kHeadDim>::kLd, kThreads = Tf32Tile<kHeadDim>::kThreads;
  if (vec16) {
    constexpr int kChunks = kHeadDim / 4;
    for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks * 4;
      const bool in = r < valid_rows && c < head_dim;
      cp_async_16(smem_addr(s + r * kLd + c), in ? g + r * row_stride + c : g, in ? 16 : 0);
    }
  } else {
    for (int idx = tid; idx < kRows * kHeadDim; idx += kThreads) {
      const int r = idx / kHeadDim, c = idx % kHeadDim;
      const bool in = r < valid_rows && c < head_dim;
      cp_async_4(smem_addr(s + r * kLd + c), in ? g + r * row_stride + c : g, in ? 4 : 0);
    }
  }
}

__device__ __forceinline__ uint32_t lds_32(const float* p) {
  return __float_as_uint(*p);
}

template <int kHeadDim>
__global__ void __launch_bounds__(Tf32Tile<kHeadDim>::kThreads, 3 - Tf32Tile<kHeadDim>::kColSplit)
    attention_fwd_fp32_tc_kernel(const AttentionParams p, bool vec16) {
  using Tile = Tf32Tile<kHeadDim>;
  constexpr int kBc = Tile::kBc, kLd = Tile::kLd, kThreads = Tile::kThreads;
  constexpr int kKTiles = kBc / 8;  // n8 tiles of S = k8 steps of P V
  // k8 steps of this warp's part of Q K^T = n8 tiles of its part of O
  constexpr int kDTiles = kHeadDim / 8 / Tile::kColSplit;
  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;
  float* sK = sQ + kBr * kLd;  // hi halves (the landed fp32 tile until split)
  float* sKlo = sK + kBc * kLd;
  float* sV = sKlo + kBc * kLd;
  float* sVlo = sV + kBc * kLd;
  float* sExchange = sVlo + kBc * kLd;  // kColSplit = 2 only

  // warp: the m16 row tile; part: the half of the head dim (S's k8 steps, O's columns) it takes.
  const int tid = threadIdx.x, warp = Tile::kColSplit == 1 ? tid / 32 : tid / 32 % kRowTiles;
  const int lane = tid % 32, part = Tile::kColSplit == 1 ? 0 : tid / 32 / kRowTiles;
  const int d0 = part * kDTiles * 8;     // first column of that half
  const int g = lane / 4, t = lane % 4;  // the mma layout's row and column-pair index
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const int num_m_blocks = (Nq + kBr - 1) / kBr;
  const CtaTile tile = cta_tile(p, num_m_blocks, 1);  // longest rows first when right-bounded
  const int64_t b = tile.b, h = tile.h;
  const int r0 = tile.m_block * kBr, rows_q = min(kBr, Nq - r0);
  const TilePointers<float> gp = tile_pointers<float>(p, tile, r0);
  const KeyBlockRange range = key_block_range(p, r0, r0 + rows_q - 1, kBc);

  // This thread's two rows of the warp's 16: g and g + 8 (index ri = 0, 1). Their l and its
  // rescale factor in double, as in the FFMA kernel: lse = log(l) + m keeps the error of an fp32
  // alpha, which O / l cancels.
  const int row_in_tile[2] = {16 * warp + g, 16 * warp + g + 8};
  Fp32Rows rows(p, b, h, {r0 + row_in_tile[0], r0 + row_in_tile[1]});

  float o[kDTiles][4] = {};

  auto load_kv = [&](float* dst, const float* src, int64_t row_stride, int n) {
    const int64_t k0 = static_cast<int64_t>(n) * kBc;
    load_tile_async<kBc, kHeadDim>(dst, src + k0 * row_stride, row_stride, min(kBc, Nk - n * kBc),
                                   head_dim, vec16, tid);
  };
  if (range.lo < range.hi) {
    load_tile_async<kBr, kHeadDim>(sQ, gp.q, p.q_row_stride, rows_q, head_dim, vec16, tid);
    load_kv(sK, gp.k, p.k_row_stride, range.lo);
    cp_async_commit();
    load_kv(sV, gp.v, p.v_row_stride, range.lo);
    cp_async_commit();
  }

  for (int n = range.lo; n < range.hi; ++n) {
    cp_async_wait<1>();  // this thread's Q_i and K_j copies have landed (V_j may be in flight)
    __syncthreads();     // ... and every thread's
    split_tf32_tile<kBc, kHeadDim, kThreads>(sK, sKlo, tid);
    __syncthreads();  // K_j's halves are in place

    // S = Q_i K_j^T for this warp's 16 rows, 3xTF32 (Q split on the fly: each warp owns its rows),
    // big and small terms in separate accumulators: twice the independent mma chains (Bc = 32
    // leaves only 4 n8 tiles per warp) and the small terms kept apart from the large sum.
    // Fragments come through ldmatrix (b16 matrices of 8 rows x 16 bytes carry 8 x 4 fp32 values
    // in the tf32 fragment layout unchanged): one instruction per A fragment or per two n8 tiles'
    // B halves instead of four 32-bit loads. Lane L addresses row L % 8 of matrix L / 8.
    static_assert(kKTiles % 2 == 0, "K fragments load two n8 tiles at a time");
    float s[kKTiles][4] = {}, s_small[kKTiles][4] = {};
    const uint32_t q_frag =
        smem_addr(sQ + (16 * warp + lane % 8 + 8 * (lane / 8 % 2)) * kLd + 4 * (lane / 16) + d0);
    const int k_frag = (lane % 8 + 8 * (lane / 16)) * kLd + 4 * (lane / 8 % 2) + d0;
#pragma unroll 4
    for (int ks = 0; ks < kDTiles; ++ks) {
      uint32_t a[4], a_hi[4], a_lo[4];
      ldmatrix_x4(a, q_frag + ks * 32);  // (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32_fast(a[e], a_hi[e], a_lo[e]);
#pragma unroll
      for (int nt = 0; nt < kKTiles; nt += 2) {
        uint32_t b_hi[4], b_lo[4];  // (t, g) and (t + 4, g) of tiles nt and nt + 1
        const int off = nt * 8 * kLd + k_frag + ks * 8;
        ldmatrix_x4(b_hi, smem_addr(sK + off));
        ldmatrix_x4(b_lo, smem_addr(sKlo + off));
        mma_3xtf32_apart(s[nt], s_small[nt], a_hi, a_lo, b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
        mma_3xtf32_apart(s[nt + 1], s_small[nt + 1], a_hi, a_lo, b_hi[2], b_hi[3], b_lo[2],
                         b_lo[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = add_small_terms(s[nt][e], s_small[nt][e]);
    float* my_part = sExchange + (tid / 32) * 16 * kBc + lane;
    if constexpr (Tile::kColSplit == 2) {
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) my_part[(4 * nt + e) * 32] = s[nt][e];
    }
    // Every warp has read K_j: its buffers can take K_{j+1}, which lands while P V_j runs; and
    // (kColSplit = 2) every warp's partial S is in place.
    __syncthreads();
    if constexpr (Tile::kColSplit == 2) {
      // The partner's partial S sits at the same lane-major place of the other half's warp.
      const float* partner = my_part + (part == 0 ? 1 : -1) * kRowTiles * 16 * kBc;
#pragma unroll
      for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += partner[(4 * nt + e) * 32];
    }
    if (n + 1 < range.hi) load_kv(sK, gp.k, p.k_row_stride, n + 1);
    cp_async_commit();  // (possibly empty: keeps the group count uniform)

    // Scale, soft cap, mask; the online softmax of the two rows; P as the A operand of P V_j.
    const int64_t key0 = static_cast<int64_t>(n) * kBc;
    const bool unmasked =
        key_block_unmasked(p, r0, r0 + rows_q - 1, n, kBc) && p.mask_kind == MaskKind::kNone;
    float alpha[2];
    uint32_t p_hi[kKTiles][4], p_lo[kKTiles][4];
    rows.block_to_p(p, s, key0, t, unmasked, alpha, p_hi, p_lo);

    cp_async_wait<1>();  // this thread's V_j copies have landed (K_{j+1} may be in flight)
    __syncthreads();     // ... and every thread's
    split_tf32_tile<kBc, kHeadDim, kThreads>(sV, sVlo, tid);
    __syncthreads();  // V_j's halves are in place

    // O = alpha O + P V_j. The block's product goes into a fresh accumulator and joins O with an
    // fp32 add: the tensor cores' accumulation rounds coarsely, and a chain over every key of the
    // row (not just this block's Bc) measured ~1e-5 relative error at 1k keys, past the contract.
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      float pv[4] = {}, pv_small[4] = {};
#pragma unroll
      for (int kt = 0; kt < kKTiles; ++kt) {
        const int off = (kt * 8 + 2 * t) * kLd + d0 + dt * 8 + g;
        mma_3xtf32_apart(pv, pv_small, p_hi[kt], p_lo[kt], lds_32(sV + off), lds_32(sV + off + kLd),
                         lds_32(sVlo + off), lds_32(sVlo + off + kLd));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o[dt][e] = fmaf(o[dt][e], alpha[e / 2], add_small_terms(pv[e], pv_small[e]));
    }
    // Every warp has read V_j: its buffers can take V_{j+1}, which lands while S_{j+1} runs; and
    // every warp has read its partner's partial S, whose place the next block's S overwrites.
    __syncthreads();
    if (n + 1 < range.hi) load_kv(sV, gp.v, p.v_row_stride, n + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  rows.store(p, gp, o, row_in_tile, rows_q, d0, t, t == 0 && part == 0);
}

template <int kHeadDim>
cudaError_t launch_fp32_tc(const AttentionParams& p, bool vec16, cudaStream_t stream) {
  return cuda::launch_kernel(attention_fwd_fp32_tc_kernel<kHeadDim>, cta_count(p, kBr),
                             Tf32Tile<kHeadDim>::kThreads, Tf32Tile<kHeadDim>::kBytes, stream, p,
                             vec16);
}

// f(std::integral_constant<int, D>{}) for the instantiated head dim D that serves head_dim (the
// next one up): one ladder for the launch and for the shared-memory check.
template <class F>
decltype(auto) with_tile_head_dim(int64_t head_dim, F&& f) {
  if (head_dim <= 32) return f(std::integral_constant<int, 32>{});
  if (head_dim <= 64) return f(std::integral_constant<int, 64>{});
  if (head_dim <= 128) return f(std::integral_constant<int, 128>{});
  if (head_dim <= 160) return f(std::integral_constant<int, 160>{});
  if (head_dim <= 192) return f(std::integral_constant<int, 192>{});
  if (head_dim <= 224) return f(std::integral_constant<int, 224>{});
  return f(std::integral_constant<int, 256>{});
}

}  // namespace

bool fp32_rows_aligned16(const AttentionParams& p) {
  return p.head_dim % 4 == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) &&
         (p.q_batch_stride | p.q_head_stride | p.q_row_stride) % 4 == 0 &&
         (p.k_batch_stride | p.k_head_stride | p.k_row_stride) % 4 == 0 &&
         (p.v_batch_stride | p.v_head_stride | p.v_row_stride) % 4 == 0;
}

cudaError_t run_attention_fwd_fp32_tc(const AttentionParams& p, cudaStream_t stream) {
  // 16-byte copies where every row of q, k and v starts 16-byte aligned.
  const bool vec16 = fp32_rows_aligned16(p);
  return with_tile_head_dim(
      p.head_dim, [&](auto d) { return launch_fp32_tc<decltype(d)::value>(p, vec16, stream); });
}

bool attention_fwd_fp32_tc_fits(int64_t head_dim) {
  const int bytes =
      with_tile_head_dim(head_dim, [](auto d) { return Tf32Tile<decltype(d)::value>::kBytes; });
  return head_dim <= 256 && cuda::device_smem_optin() >= bytes;
}

}  // namespace flashmod::cuda_kernels
