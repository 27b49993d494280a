// fp32 forward on Hopper's wgmma (sm_90a), 3xTF32 as fwd_fp32_3xtf32.cu: every product is
// a_lo b_hi + a_hi b_lo + a_hi b_hi of tf32 halves, big and small terms in separate accumulators,
// P V_j into fresh accumulators per block joined to O with an fp32 add (the accuracy measures of
// design/cuda-fp32.md). Head dims up to 128, rows 16-byte aligned; fwd_fp32_3xtf32.cu serves the
// rest and every GPU before Hopper.
//
// Why: the mma.sync kernel issues ~6.5 instructions per tf32 mma (fragment loads, splits) and runs
// its tensor work at about a quarter of the dense tf32 peak (design/cuda-fp32.md, session 58). A
// wgmma reads its B operand (and here A of Q K^T) from shared memory itself.
//
// Layout: two warpgroups of 64 query rows (Br = 128) share each 32-key block (Bc = 32). tf32 wgmma
// reads both operands K-major only, so:
// - Q_i, K_j: 128-byte-swizzled tiles of D floats a row (32 floats a swizzle row), split into tf32
//   hi halves with the lo halves in a second tile of the same layout; Q once per CTA, in place.
// - V_j lands in the same layout, and the split writes V_j^T (D rows of Bc = 32 keys: one
//   128-byte swizzle row each) as hi and lo halves: the B operand of P V_j, keys along K.
// - K_j's halves are stored in pairs, the lo rows right below the hi rows of each 32-float
//   slice, so one m64n64k8 wgmma takes Q_hi K_hi and Q_hi K_lo together: two wgmmas a k8
//   step of S instead of three, and Q_hi read from shared memory once (an m64n32k8 reads 3 KB per
//   16 tensor-core cycles, where shared memory gives 128 bytes a cycle). Q_lo K_hi needs an
//   accumulator of its own: a wgmma whose accumulator overlaps one still in flight makes ptxas
//   serialize them all (C7511). P V_j keeps three wgmmas: P comes from registers (only V^T is
//   read), and an N = 128 pair's accumulators would not fit at D = 128.
// - K_j and V_j land in buffers of their own, so one split phase per block frees both and
//   K_{j+1}, V_{j+1} land during all of block j's products and softmax: two CTA barriers per
//   block (session 59: four before, with K split in place and V's split between softmax and P V).
// - P stays in registers as the A operand: the S accumulator holds keys 2t, 2t + 1 where the tf32
//   A fragment wants positions t, t + 4, so V_j^T stores key k of each 8 at position k / 2 (even)
//   or 4 + k / 2 (odd) (fp32_block_softmax.h relabels P the same way).
// Shared memory: D = 128 225 KB (one CTA per SM), D = 64 113 KB.
#include <cuda_bf16.h>

#include <cstdint>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/sw128_tile_copy.h"
#include "../../common/cuda/wgmma_ops.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fp32_block_softmax.h"
#include "tf32_tile.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {
namespace {

using sm90::sw128_offset;

template <int kHeadDim>
struct Fp32WgmmaTile {
  static constexpr int Br = 128, Bc = 32, kThreads = 256;  // two warpgroups of 64 rows
  static constexpr int kKTiles = Bc / 8;                   // n8 tiles of S = k8 steps of P V_j
  static constexpr int kKSteps = kHeadDim / 8;             // k8 steps of Q K^T
  // The first kQHiRegSteps k8 steps of S take Q_hi from registers, so their m64n64k8 reads only
  // K's pair from shared memory. H200, session 60, against none: D = 128 6 of 16 +4-6 % (8 spill
  // 72 bytes, 4 spill 36 and ran 3 % slower than 6); D = 64 any of 2-8 ran 7-10 % slower.
  static constexpr int kQHiRegSteps = kHeadDim == 128 ? 6 : 0;
  static constexpr int kDTiles = kHeadDim / 8;       // n8 tiles of O
  static constexpr int kBytesQ = Br * kHeadDim * 4;  // Q_i hi, then Q_i lo
  // K_j and V_j as landed; K_j hi, lo; V_j^T hi, lo.
  static constexpr int kBytesKV = Bc * kHeadDim * 4;
  // A 32-float slice of K_j's halves: Bc hi rows, then Bc lo rows (128 bytes each).
  static constexpr int kKSliceBytes = 2 * Bc * 128;
  static constexpr int kPvChunk = 64;  // the N of a P V_j wgmma
  // +1024: the dynamic shared-memory base is rounded up to the swizzle atom.
  static constexpr int kBytes = 2 * kBytesQ + 6 * kBytesKV + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "whole P V chunks, Q K^T in 32-float rows");
  static_assert(Bc * 4 == 128, "a V_j^T row is one 128-byte swizzle row");
  static_assert(kBytesKV % 1024 == 0 && kBytesQ % 1024 == 0, "tiles on swizzle atoms");
  static_assert(kBytes <= 227 * 1024, "sm_90's per-block shared-memory limit");
};

// fp32 rows through the 16-bit tile copy: D floats are 2 D 16-bit elements in the same 16-byte
// chunks, and the 128-byte swizzle is one of bytes.
template <int kRows, int kHeadDim, int kThreads>
struct Fp32TileCopy {
  sm90::Sw128TileCopy<kRows, 2 * kHeadDim, kThreads> copy;
  __device__ __forceinline__ Fp32TileCopy(int tid, int head_dim) : copy(tid, 2 * head_dim) {}
  __device__ __forceinline__ void load(uint32_t smem, const float* gmem, int64_t row_stride,
                                       int valid_rows) const {
    copy.load(smem, reinterpret_cast<const __nv_bfloat16*>(gmem), 2 * row_stride, valid_rows);
  }
};

#ifdef FLASHMOD_SM90A
// K_j as landed (Bc x kHeadDim, 32-float slices of Bc rows) -> its tf32 halves in slices of 2 Bc
// rows, hi rows first. Rows 32 apart share their swizzle phase, so a lo row is its hi row moved by
// Bc * 128 bytes.
template <int kHeadDim, int kBc, int kThreads>
__device__ __forceinline__ void split_k_pairs(const unsigned char* k, unsigned char* pairs,
                                              int tid) {
  constexpr int kSlice = kBc * 128, kChunks = kBc * kHeadDim / 4;
  static_assert(kChunks % kThreads == 0 && kBc % 8 == 0, "whole float4s; whole swizzle periods");
#pragma unroll
  for (int i = tid; i < kChunks; i += kThreads) {
    const int off = 16 * i;
    float4 x = *reinterpret_cast<const float4*>(k + off);
    const float4 lo = split_tf32_float4(x);
    unsigned char* const hi_dst = pairs + off + (off / kSlice) * kSlice;
    *reinterpret_cast<float4*>(hi_dst) = x;
    *reinterpret_cast<float4*>(hi_dst + kSlice) = lo;
  }
}

// V_j (Bc x kHeadDim as landed) -> V_j^T's tf32 halves (kHeadDim rows of Bc keys, keys at their
// P-relabelled positions). Lane = key, so each warp reads one 16-byte chunk column of 32 rows
// (the swizzle spreads them over all banks) and writes 32 consecutive words of a V_j^T row.
template <int kHeadDim, int kBc, int kThreads>
__device__ __forceinline__ void split_transpose_v(const unsigned char* v, unsigned char* vt_hi,
                                                  unsigned char* vt_lo, int tid) {
  static_assert(kBc == 32, "a key per lane");
  const int key = tid % 32;
  const int pos = (key & ~7) | ((key & 1) << 2) | ((key & 7) >> 1);
#pragma unroll
  for (int c = tid / 32; c < kHeadDim / 4; c += kThreads / 32) {
    float4 x = *reinterpret_cast<const float4*>(v + sw128_offset<kBc>(key, c));
    const float4 lo = split_tf32_float4(x);
    const float hi4[4] = {x.x, x.y, x.z, x.w}, lo4[4] = {lo.x, lo.y, lo.z, lo.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t off = sw128_offset<kHeadDim>(4 * c + e, pos / 4) + (pos % 4) * 4;
      *reinterpret_cast<float*>(vt_hi + off) = hi4[e];
      *reinterpret_cast<float*>(vt_lo + off) = lo4[e];
    }
  }
}
#endif

template <int kHeadDim>
__global__ void __launch_bounds__(256, 1) attention_fwd_fp32_sm90_kernel(const AttentionParams p) {
#ifdef FLASHMOD_SM90A
  using T = Fp32WgmmaTile<kHeadDim>;
  using sm90::desc_advance;
  using sm90::sw128_desc;
  using sm90::WgmmaTf32;
  constexpr int Br = T::Br, Bc = T::Bc, kKTiles = T::kKTiles;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  unsigned char* const q_hi = smem;
  unsigned char* const q_lo = q_hi + T::kBytesQ;
  unsigned char* const k_in = q_lo + T::kBytesQ;      // K_j as landed
  unsigned char* const v_in = k_in + T::kBytesKV;     // V_j as landed
  unsigned char* const k_pairs = v_in + T::kBytesKV;  // K_j's halves, hi and lo rows
  unsigned char* const vt_hi = k_pairs + 2 * T::kBytesKV;
  unsigned char* const vt_lo = vt_hi + T::kBytesKV;
  const uint32_t sQ = base, sK = base + (k_in - smem), sV = base + (v_in - smem);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const int g = lane / 4, t = lane % 4;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const CtaTile tile = cta_tile(p, (Nq + Br - 1) / Br, 1);  // longest rows first when right-bounded
  const int r0 = tile.m_block * Br, rows_q = min(Br, Nq - r0);
  const TilePointers<float> gp = tile_pointers<float>(p, tile, r0);
  const KeyBlockRange range = key_block_range(p, r0, r0 + rows_q - 1, Bc);

  // This thread's two rows: g and g + 8 of its warp's 16 (warp w owns rows 16 w .. 16 w + 15:
  // the wgmma accumulator layout of warpgroup w / 4).
  const int row_in_tile[2] = {16 * warp + g, 16 * warp + g + 8};
  Fp32Rows rows(p, tile.b, tile.h, {r0 + row_in_tile[0], r0 + row_in_tile[1]});
  float o[T::kDTiles][4] = {};
  // Q_i's hi halves as the A fragments of S's first kRegSteps k8 steps, set in the first block.
  // Zeroed here so that they are defined on every path: declared bare, D = 64 took wrong values
  // from the second key block on (ptxas kept no spill and gave no note; the outputs showed it).
  constexpr int kRegSteps = T::kQHiRegSteps;
  uint32_t q_hi_frag[kRegSteps > 0 ? kRegSteps : 1][4] = {};

  const Fp32TileCopy<Br, kHeadDim, T::kThreads> q_copy(tid, head_dim);
  const Fp32TileCopy<Bc, kHeadDim, T::kThreads> kv_copy(tid, head_dim);
  auto load_kv = [&](uint32_t dst, const float* src, int64_t row_stride, int n) {
    kv_copy.load(dst, src + static_cast<int64_t>(n) * Bc * row_stride, row_stride,
                 min(Bc, Nk - n * Bc));
  };
  if (range.lo < range.hi) {
    q_copy.load(sQ, gp.q, p.q_row_stride, rows_q);
    load_kv(sK, gp.k, p.k_row_stride, range.lo);
    load_kv(sV, gp.v, p.v_row_stride, range.lo);
    cp_async_commit();
  }
  // Descriptors (K-major, 128-byte swizzle): k8 step ks is 32 bytes into 32-float slice ks / 4,
  // whose rows are 128 bytes apart (Br rows of Q; 2 Bc of K_j's pairs, hi first). This
  // warpgroup's Q rows start 64 wg rows down; an N = 2 Bc wgmma reads a slice's hi and lo rows,
  // an N = Bc one its hi rows alone. V_j^T: P V chunk oc is rows 64 oc.., k8 step kk 32 bytes
  // into the row.
  const uint64_t q_hi_desc = sw128_desc(sQ + wg * 64 * 128, 16, 1024);
  const uint64_t q_lo_desc = desc_advance(q_hi_desc, T::kBytesQ);
  const uint64_t k_desc = sw128_desc(base + (k_pairs - smem), 16, 1024);
  const uint64_t vt_hi_desc = sw128_desc(base + (vt_hi - smem), 16, 1024);
  const uint64_t vt_lo_desc = desc_advance(vt_hi_desc, T::kBytesKV);

  for (int n = range.lo; n < range.hi; ++n) {
    cp_async_wait<0>();  // this thread's Q_i (first block), K_j and V_j copies have landed
    // ... and every thread's; and both warpgroups are done with K_{j-1}'s and V_{j-1}^T's halves
    // (each waited on its wgmmas before coming here).
    __syncthreads();
    if (n == range.lo)
      split_tf32_flat<Br * kHeadDim, T::kThreads>(reinterpret_cast<float*>(q_hi),
                                                  reinterpret_cast<float*>(q_lo), tid);
    split_k_pairs<kHeadDim, Bc, T::kThreads>(k_in, k_pairs, tid);
    split_transpose_v<kHeadDim, Bc, T::kThreads>(v_in, vt_hi, vt_lo, tid);
    sm90::fence_proxy_async_smem();  // the halves, written by threads, are read next by wgmma
    __syncthreads();  // ... every thread's; and K_j's and V_j's landing buffers are free again
    if (n + 1 < range.hi) {  // they land during this block's products and softmax
      load_kv(sK, gp.k, p.k_row_stride, n + 1);
      load_kv(sV, gp.v, p.v_row_stride, n + 1);
    }
    cp_async_commit();  // (possibly empty: keeps the group count uniform)
    if (kRegSteps > 0 && n == range.lo) {
      // Q_hi into registers once: rows g, g + 8 of this warp's 16, columns t, t + 4 of each k8
      // step (the tf32 A fragment), read off the split tile after the barrier above.
      const int row = 64 * wg + 16 * (warp % 4) + g;
#pragma unroll
      for (int ks = 0; ks < kRegSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = row + 8 * (i % 2), col = 8 * ks + t + 4 * (i / 2);
          q_hi_frag[ks][i] = *reinterpret_cast<const uint32_t*>(
              q_hi + sw128_offset<Br>(r, col / 4) + (col % 4) * 4);
        }
    }

    // S = Q_i K_j^T for this warpgroup's 64 rows: Q_hi K_hi in s_pair's first kKTiles n8 tiles,
    // Q_hi K_lo in the rest, Q_lo K_hi in s_lh.
    float s_pair[2 * kKTiles][4] = {}, s_lh[kKTiles][4] = {};
    float (&s)[kKTiles][4] = *reinterpret_cast<float (*)[kKTiles][4]>(&s_pair[0]);
    const float (&s_hl)[kKTiles][4] = *reinterpret_cast<float (*)[kKTiles][4]>(&s_pair[kKTiles]);
    sm90::wgmma_fence();  // the accumulators were last written by ordinary instructions
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      const uint32_t q_step = (ks / 4) * Br * 128 + (ks % 4) * 32;
      const uint64_t k_step = desc_advance(k_desc, (ks / 4) * T::kKSliceBytes + (ks % 4) * 32);
      if (ks < kRegSteps)  // compile-time: the loop is unrolled
        WgmmaTf32<2 * Bc>::rs(s_pair, q_hi_frag[ks < kRegSteps ? ks : 0], k_step, ks > 0);
      else
        WgmmaTf32<2 * Bc>::ss(s_pair, desc_advance(q_hi_desc, q_step), k_step, ks > 0);
      WgmmaTf32<Bc>::ss(s_lh, desc_advance(q_lo_desc, q_step), k_step, ks > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::pin_registers(s_pair);
    sm90::pin_registers(s_lh);
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = add_small_terms(s[nt][e], s_hl[nt][e] + s_lh[nt][e]);
    const bool unmasked =
        key_block_unmasked(p, r0, r0 + rows_q - 1, n, Bc) && p.mask_kind == MaskKind::kNone;
    float alpha[2];
    uint32_t p_hi[kKTiles][4], p_lo[kKTiles][4];
    rows.block_to_p(p, s, static_cast<int64_t>(n) * Bc, t, unmasked, alpha, p_hi, p_lo);

    // O = alpha O + P V_j, a 64-column chunk at a time (fresh accumulators per block: see the top).
    sm90::pin_registers(p_hi);
    sm90::pin_registers(p_lo);
#pragma unroll
    for (int oc = 0; oc < kHeadDim / T::kPvChunk; ++oc) {
      float pv[8][4] = {}, pv_small[8][4] = {};
      sm90::wgmma_fence();  // P and the fresh accumulators were written by ordinary instructions
#pragma unroll
      for (int kk = 0; kk < kKTiles; ++kk) {
        const uint32_t step = static_cast<uint32_t>(oc * T::kPvChunk * 128 + kk * 32);
        const uint64_t vh = desc_advance(vt_hi_desc, step), vl = desc_advance(vt_lo_desc, step);
        WgmmaTf32<T::kPvChunk>::rs(pv, p_hi[kk], vh, kk > 0);
        WgmmaTf32<T::kPvChunk>::rs(pv_small, p_hi[kk], vl, kk > 0);
        WgmmaTf32<T::kPvChunk>::rs(pv_small, p_lo[kk], vh, 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::pin_registers(pv);
      sm90::pin_registers(pv_small);
      sm90::pin_registers(p_hi);
      sm90::pin_registers(p_lo);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& acc = o[oc * 8 + j][e];
          acc = fmaf(acc, alpha[e / 2], add_small_terms(pv[j][e], pv_small[j][e]));
        }
    }
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  rows.store(p, gp, o, row_in_tile, rows_q, 0, t, t == 0);
#else
  __trap();  // launched only where the sm_90a binary runs (run_attention_fwd_fp32_sm90's caller)
#endif
}

template <int kHeadDim>
cudaError_t launch_fp32_sm90(const AttentionParams& p, cudaStream_t stream) {
  using T = Fp32WgmmaTile<kHeadDim>;
  return cuda::launch_kernel(attention_fwd_fp32_sm90_kernel<kHeadDim>, cta_count(p, T::Br),
                             T::kThreads, T::kBytes, stream, p);
}

}  // namespace

cudaError_t run_attention_fwd_fp32_sm90(const AttentionParams& p, cudaStream_t stream) {
  // The copies are cp.async of whole 16-byte chunks.
  if (!fp32_rows_aligned16(p) || p.head_dim > 128) return cudaErrorNotSupported;
  return p.head_dim <= 64 ? launch_fp32_sm90<64>(p, stream) : launch_fp32_sm90<128>(p, stream);
}

}  // namespace flashmod::cuda_kernels
