// The fp32 backward on the tensor cores with 3xTF32 products (sm_80+): the portable backward's
// structure (bwd_sm80_kernel.h: a dK/dV kernel per key block over every visible query block of
// the GQA group, a separate dQ kernel per query block, no atomics, so every gradient is bitwise
// reproducible; or, kFusedDQ, dQ added by atomics from the dK/dV kernel) and its per-element math
// (bwd_common.h), with the products of the fp32 forward (fwd_fp32_3xtf32.cu): every operand split
// into tf32 halves hi + lo and a * b computed as a_lo * b_hi + a_hi * b_lo (one accumulator)
// + a_hi * b_hi (another), ~22 of 24 mantissa bits.
//
// Accuracy: the tensor cores' accumulation truncates, so no long chain of mma's accumulates in
// place: the products over the head dim (S = Q K^T, dP = dO V^T) add each k8 step's big terms to
// the sum in fp32 (the small terms, 2^-11 smaller, keep one accumulator of their own), and the
// products over the streamed rows (dV += P^T dO, dK += dS^T Q, dQ += dS K) run into a fresh
// accumulator per step that joins the gradient with an fp32 add, as the forward's O does.
//
// Layout: each warp owns 16 rows (the mma's m16) of the CTA's "own" tile (K_j and V_j in the dK/dV
// kernel, Q_i and dO_i in the dQ kernel) and every CTA streams Bs rows of the other pair per step,
// double-buffered (cp.async of step s + 1 runs under step s's products). Every tile stays fp32 in
// shared memory and fragments are split into tf32 halves as they are read: splitting tiles in place
// (a hi and a lo copy) doubled the shared memory, held D = 128 to two CTAs of two warps per SM and
// ran at 0.43x SDPA EFFICIENT there (H100, run 2). Rows are padded to kHeadDim + 4 floats: with a
// pitch of 4 (mod 32) words the fragment reads (8 rows x 4 columns, or 4 row pairs x 8 columns)
// hit 32 different banks. P and dS go from the accumulator straight into the A operand of the next
// product, with the forward's relabelling of the k index (position t <-> row 2t, t + 4 <-> 2t + 1
// of each k8 slice) and the B^T fragment reading rows 2t and 2t + 1 to match.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/launch_bounds.h"
#include "../../common/cuda/ptx_ops.h"
#include "../attention_params.h"
#include "bwd_common.h"
#include "entry_points.h"
#include "tf32_tile.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// kWarps warps own 16 rows each (Bo rows); Bs rows stream per step. kColSplit = 2 (the dK/dV kernel
// only): two warps share each 16 own rows, each summing S^T and dP^T over half the head dim (the
// pair adds the halves through an exchange area) and accumulating half of dK / dV's columns.
template <int kHeadDim_, int kWarps, int kBs, int kColSplit_ = 1>
struct Tf32BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kLd = tf32_tile_pitch<kHeadDim>();
  static constexpr int kColSplit = kColSplit_;
  static constexpr int kRowTiles = kWarps / kColSplit;
  static constexpr int Bo = 16 * kRowTiles;
  static constexpr int Bs = kBs;
  static constexpr int kNWarps = kWarps;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kNTiles = Bs / 8;  // n8 tiles of S per warp = k8 steps of the 2nd product
  static constexpr int kDTiles = kHeadDim / 8;  // k8 steps of the 1st product = its n8 tiles
  static constexpr int kPartTiles = kDTiles / kColSplit;  // of those, one warp's
  static constexpr int kOwnTile = Bo * kLd;               // floats of one own tile
  static constexpr int kStreamTile = Bs * kLd;  // floats of one stage of one streamed tile
  // Per warp, its partial S^T and dP^T (lane-major: 2 x kNTiles x 4 floats a lane).
  static constexpr int kExchangeWarp = 2 * kNTiles * 4 * 32;
  static constexpr int kExchange = kColSplit == 1 ? 0 : kNWarps * kExchangeWarp;
  static_assert(kWarps % kColSplit == 0 && kDTiles % kColSplit == 0, "whole warps and n8 tiles");
  // Two own tiles, two streamed tiles in two stages; the dK/dV kernel adds two stages of Bs lse2
  // and delta, and the exchange area. A dV-only launch holds no V tile.
  static constexpr int kSmemBytes = 4 * (2 * kOwnTile + 4 * kStreamTile + 4 * Bs + kExchange);
  static constexpr int kDVOnlySmemBytes = kSmemBytes - 4 * kOwnTile;
  static_assert(Bs % 8 == 0 && Bs / 2 <= kNThreads, "one 16-byte lse2/delta chunk per thread");
  static_assert(kBwdRowPad % Bs == 0 && kBwdRowPad % Bo == 0, "row statistics cover whole blocks");
  // The fused dQ (kFusedDQ): the step's dS (Bs queries x Bo keys) for the CTA's dQ product. A pitch
  // of 8 (mod 32) words makes its float2 fragment reads (rows g, columns 2t) conflict-free.
  static constexpr int kDSLd = Bo + 8;
  static constexpr int kFusedDQSmemBytes = kSmemBytes + 4 * Bs * kDSLd;
  // The dK/dV kernel's, per launch.
  template <int kWhich, bool kFusedDQ>
  static constexpr int dkdv_smem_bytes() {
    return kFusedDQ ? kFusedDQSmemBytes : kWhich == kBwdOnlyDV ? kDVOnlySmemBytes : kSmemBytes;
  }
  // Opt-in shared memory per block: A100 163 KB, H100 / H200 227 KB.
  static constexpr bool kFitsA100 = kFusedDQSmemBytes <= 163 * 1024;
  static_assert(kFusedDQSmemBytes <= 227 * 1024, "must fit a Hopper SM");
};

namespace tf32_bwd {

// Starts copying rows [0, valid_rows) x [0, head_dim) of a global fp32 tile (row starts 16-byte
// aligned: the host's align_rows16) into a kRows x kLd shared tile, zeros elsewhere. Where the
// threads cover whole rows per pass (kThreads % kChunks == 0), a thread's column, and so its byte
// count and addresses, stay the same from pass to pass: one 64-bit address computed, then stepped.
// From D = 128 only (D = 128 / 256), with the dK/dV kernel's step counters: below it the two
// together measured slower (that kernel's comment).
template <int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void load_tile(float* s, const float* g, int64_t row_stride,
                                          int valid_rows, int head_dim, int tid) {
  constexpr int kLd = tf32_tile_pitch<kHeadDim>(), kChunks = kHeadDim / 4;
  static_assert(kRows * kChunks % kThreads == 0, "even split");
  if constexpr (kHeadDim >= 128 && kThreads % kChunks == 0) {
    constexpr int kRowsPerPass = kThreads / kChunks;
    const int r = tid / kChunks, c = tid % kChunks * 4, left = head_dim - c;
    const int bytes = left > 0 ? 4 * (left < 4 ? left : 4) : 0;
    const float* src = g + r * row_stride + c;
    const uint32_t dst = smem_addr(s + r * kLd + c);
#pragma unroll
    for (int it = 0; it < kRows / kRowsPerPass; ++it) {
      const bool in = r + it * kRowsPerPass < valid_rows && bytes > 0;
      cp_async_16(dst + 4 * it * kRowsPerPass * kLd, in ? src : g, in ? bytes : 0);
      src += kRowsPerPass * row_stride;
    }
  } else {
#pragma unroll 4
    for (int it = 0; it < kRows * kChunks / kThreads; ++it) {
      const int idx = tid + it * kThreads;
      const int r = idx / kChunks, c = idx % kChunks * 4;
      const int left = head_dim - c;
      const int bytes = r < valid_rows && left > 0 ? 4 * (left < 4 ? left : 4) : 0;
      cp_async_16(smem_addr(s + r * kLd + c), bytes > 0 ? g + r * row_stride + c : g, bytes);
    }
  }
}

__device__ __forceinline__ uint32_t lds(const float* p) {
  return __float_as_uint(*p);
}

// c[16 x 8 kNT] = A B^T over the head dim: A = 16 rows of an own tile (a: its first row), B = the
// kNT * 8 rows of a streamed tile, both split into tf32 halves as their fragments are read. 3xTF32
// with the small terms in an accumulator of their own. The big terms of each k8 step go into a
// fresh accumulator that joins c with an fp32 add: the tensor cores truncate when they accumulate,
// and a chain over the whole head dim biased dP by tens of ulps at D >= 160 (dQ failed the 3x rule
// there, H100 run 1); per step, the truncation is that of one 8-term sum.
// kKSteps: the k8 steps summed, from a and b's first column (a warp's half under kColSplit = 2).
// Fragments come through ldmatrix, as in the forward (fwd_fp32_3xtf32.cu: b16 matrices of 8 rows x
// 16 bytes carry 8 x 4 fp32 values in the tf32 fragment layout): one instruction for A's four
// values or two n8 tiles' B values instead of four 32-bit loads. Lane L addresses row L % 8 of
// matrix L / 8: A's matrices are (rows 0-7, k 0-3), (8-15, k 0-3), (0-7, k 4-7), (8-15, k 4-7);
// B's are tile nt's (k 0-3), (k 4-7), then tile nt + 1's.
template <int kHeadDim, int kNT, int kKSteps = kHeadDim / 8>
__device__ __forceinline__ void product_abt(float (&c)[kNT][4], const float* a, const float* b,
                                            int lane) {
  constexpr int kLd = tf32_tile_pitch<kHeadDim>();
  static_assert(kNT % 2 == 0, "B fragments load two n8 tiles at a time");
  float small[kNT][4];
  zero(c);
  zero(small);
  const uint32_t a_frag = smem_addr(a + (lane % 8 + 8 * (lane / 8 % 2)) * kLd + 4 * (lane / 16));
  const uint32_t b_frag = smem_addr(b + (lane % 8 + 8 * (lane / 16)) * kLd + 4 * (lane / 8 % 2));
#pragma unroll 2
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a_raw[4], a_hi[4], a_lo[4];
    ldmatrix_x4(a_raw, a_frag + 32 * ks);
#pragma unroll
    for (int e = 0; e < 4; ++e) split_tf32_fast(a_raw[e], a_hi[e], a_lo[e]);
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2) {
      uint32_t b_raw[4], b_hi[4], b_lo[4];  // (t, g) and (t + 4, g) of tiles nt and nt + 1
      ldmatrix_x4(b_raw, b_frag + 4 * (nt * 8 * kLd) + 32 * ks);
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32_fast(b_raw[e], b_hi[e], b_lo[e]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float big[4] = {0.f, 0.f, 0.f, 0.f};
        mma_3xtf32_apart(big, small[nt + half], a_hi, a_lo, b_hi[2 * half], b_hi[2 * half + 1],
                         b_lo[2 * half], b_lo[2 * half + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) c[nt + half][e] += big[e];
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nt][e] = add_small_terms(c[nt][e], small[nt][e]);
}

// acc[16 x 8 kOutTiles] += A B, A = an accumulator (P^T, dS^T or dS: 16 x 8 kNT), B = the kNT * 8
// rows of a streamed fp32 tile from its column b (kOutTiles n8 tiles of them), read transposed and
// split as its fragments are read.
template <int kHeadDim, int kNT, int kOutTiles = kHeadDim / 8>
__device__ __forceinline__ void product_ab(float (&acc)[kOutTiles][4], const float (&a_acc)[kNT][4],
                                           const float* b, int g, int t) {
  constexpr int kLd = tf32_tile_pitch<kHeadDim>();
  uint32_t a_hi[kNT][4], a_lo[kNT][4];
#pragma unroll
  for (int kt = 0; kt < kNT; ++kt) {
    // Accumulator (row, column 2t + c) -> A fragment position (row, t + 4c).
    split_tf32_fast(__float_as_uint(a_acc[kt][0]), a_hi[kt][0], a_lo[kt][0]);
    split_tf32_fast(__float_as_uint(a_acc[kt][2]), a_hi[kt][1], a_lo[kt][1]);
    split_tf32_fast(__float_as_uint(a_acc[kt][1]), a_hi[kt][2], a_lo[kt][2]);
    split_tf32_fast(__float_as_uint(a_acc[kt][3]), a_hi[kt][3], a_lo[kt][3]);
  }
  const float* b_lane = b + 2 * t * kLd + g;
#pragma unroll
  for (int dt = 0; dt < kOutTiles; ++dt) {
    float big[4] = {0.f, 0.f, 0.f, 0.f}, small[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kt = 0; kt < kNT; ++kt) {
      const float* bp = b_lane + kt * 8 * kLd + 8 * dt;
      uint32_t b_hi[2], b_lo[2];
      split_tf32_fast(lds(bp), b_hi[0], b_lo[0]);
      split_tf32_fast(lds(bp + kLd), b_hi[1], b_lo[1]);
      mma_3xtf32_apart(big, small, a_hi[kt], a_lo[kt], b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] += add_small_terms(big[e], small[e]);
  }
}

// The fused dQ's step (kFusedDQ): dQ_i += scale * dS K_j for the step's Bs query rows, added into
// grad_q (zeroed by the host) by fp32 atomics. dS is in shared memory (sdS: Bs x Tr::kDSLd,
// queries x the CTA's Bo keys), K_j in sK. Warps split the Bs x D result into m16 row tiles x
// column ranges. Each k8 step's big terms start a fresh accumulator (as product_abt: no long
// chain of truncating tensor-core adds); the k index is relabelled as in product_ab (position t
// <-> key 2t, t + 4 <-> 2t + 1), so A is read as float2 and B by rows 2t, 2t + 1.
template <class Tr>
__device__ __forceinline__ void add_fused_dq(const AttentionBwdParams& p, const float* sdS,
                                             const float* sK, float scale, int64_t b, int64_t h,
                                             int64_t r0, int warp, int g, int t, bool vec) {
  constexpr int D = Tr::kHeadDim, kLd = Tr::kLd, kDSLd = Tr::kDSLd;
  constexpr int kMTiles = Tr::Bs / 16, kWarpsPerM = Tr::kNWarps / kMTiles;
  constexpr int kCols = D / kWarpsPerM, kNT = kCols / 8;
  // Columns in chunks of at most 4 n8 tiles: past D = 128 two warps hold dK's 128-256 floats a
  // thread, so a warp's 80-128 columns of dQ cannot all be live at once.
  // An odd count past 5 (D = 224 on 4 warps: 7) ends with a partial chunk.
  constexpr int kChunk = kNT <= 5 ? kNT : kNT % 4 == 0 ? 4 : kNT % 2 == 0 ? 2 : 4;
  constexpr bool kRagged = kNT % kChunk != 0;
  static_assert(Tr::Bs % 16 == 0 && Tr::kNWarps % kMTiles == 0 && kCols % 8 == 0,
                "whole m16 x n8 tiles per warp");
  const int wm = warp / kWarpsPerM, col0 = (warp % kWarpsPerM) * kCols;
  const float* a_lane = sdS + (16 * wm + g) * kDSLd + 2 * t;
  const int head_dim = static_cast<int>(p.head_dim);
#pragma unroll 1
  for (int c0 = 0; c0 < kNT; c0 += kChunk) {
    const float* b_lane = sK + 2 * t * kLd + col0 + 8 * c0 + g;
    float acc[kChunk][4], small[kChunk][4];
    zero(acc);
    zero(small);
#pragma unroll 2
    for (int ks = 0; ks < Tr::Bo / 8; ++ks) {
      const float2 top = *reinterpret_cast<const float2*>(a_lane + 8 * ks);
      const float2 bottom = *reinterpret_cast<const float2*>(a_lane + 8 * kDSLd + 8 * ks);
      uint32_t a_hi[4], a_lo[4];
      split_tf32_fast(__float_as_uint(top.x), a_hi[0], a_lo[0]);
      split_tf32_fast(__float_as_uint(bottom.x), a_hi[1], a_lo[1]);
      split_tf32_fast(__float_as_uint(top.y), a_hi[2], a_lo[2]);
      split_tf32_fast(__float_as_uint(bottom.y), a_hi[3], a_lo[3]);
#pragma unroll
      for (int nt = 0; nt < kChunk; ++nt) {
        if (kRagged && c0 + nt >= kNT) continue;
        const float* bp = b_lane + 8 * ks * kLd + 8 * nt;
        uint32_t b_hi[2], b_lo[2];
        split_tf32_fast(lds(bp), b_hi[0], b_lo[0]);
        split_tf32_fast(lds(bp + kLd), b_hi[1], b_lo[1]);
        float big[4] = {0.f, 0.f, 0.f, 0.f};
        mma_3xtf32_apart(big, small[nt], a_hi, a_lo, b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += big[e];
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = r0 + 16 * wm + g + 8 * half;
      if (row >= p.seqlen_q) continue;
      float* dst = grad_rows<float>(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride,
                                    p.grad_q_row_stride, b, h, row);
#pragma unroll
      for (int nt = 0; nt < kChunk; ++nt) {
        if (kRagged && c0 + nt >= kNT) continue;
        const int col = col0 + 8 * (c0 + nt) + 2 * t;
        const float x = scale * add_small_terms(acc[nt][2 * half], small[nt][2 * half]);
        const float y = scale * add_small_terms(acc[nt][2 * half + 1], small[nt][2 * half + 1]);
#if __CUDA_ARCH__ >= 900
        if (vec && col + 1 < head_dim) {  // rows_aligned_pairs: 8-byte aligned pairs
          atomicAdd(reinterpret_cast<float2*>(dst + col), make_float2(x, y));
          continue;
        }
#endif
        if (col < head_dim) atomicAdd(dst + col, x);
        if (col + 1 < head_dim) atomicAdd(dst + col + 1, y);
      }
    }
  }
}

}  // namespace tf32_bwd

// kFusedDQ: also dQ (add_fused_dq) from the step's dS, so no dQ kernel runs (five products per
// block pair instead of seven; past D = 128, six in the two launches instead of eight; dQ's sums by
// atomics, so not bitwise reproducible).
template <class Tr, bool kGeneral, int kWhich, bool kFusedDQ = false>
__global__ void __launch_bounds__(
    Tr::kNThreads,
    cuda::min_ctas_for_smem(Tr::template dkdv_smem_bytes<kWhich, kFusedDQ>(), Tr::kNThreads))
    attention_bwd_tf32_dkdv_kernel(const AttentionBwdParams p, const BwdRowStats st) {
  constexpr int D = Tr::kHeadDim, Br = Tr::Bs, Bc = Tr::Bo, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kPartTiles, kLd = Tr::kLd, kSplit = Tr::kColSplit;
  constexpr int kOwn = Tr::kOwnTile, kStream = Tr::kStreamTile;
  constexpr bool kDV = kWhich != kBwdOnlyDK, kDK = kWhich != kBwdOnlyDV;
  static_assert(!kFusedDQ || kDK, "the fused dQ takes dS from the dK launch");

  extern __shared__ __align__(16) float smem[];
  float* sK = smem;
  float* sV = sK + kOwn;                  // kDK only
  float* sQ = sK + (kDK ? 2 : 1) * kOwn;  // stage 1 at + kStream
  float* sdO = sQ + 2 * kStream;
  float* sL = sdO + 2 * kStream;  // stage 1 at + Br
  float* sDelta = sL + 2 * Br;
  float* sExchange = sDelta + 2 * Br;      // kSplit = 2 only
  float* sdS = sExchange + Tr::kExchange;  // kFusedDQ only

  const int tid = threadIdx.x, warp_id = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  // warp: the warp's 16 own rows; part: its half of the head dim (kSplit = 2), from column d0.
  const int warp = kSplit == 1 ? warp_id : warp_id % Tr::kRowTiles;
  const int part = kSplit == 1 ? 0 : warp_id / Tr::kRowTiles;
  const int d0 = part * DT * 8;
  const int Nk = static_cast<int>(p.seqlen_k), head_dim = static_cast<int>(p.head_dim);
  const BwdKeyTile tile = bwd_key_tile(p, (Nk + Bc - 1) / Bc);
  const int n_block = tile.n_block;
  const int64_t hk = tile.hk, b = tile.b;
  const int64_t group = p.heads_q / p.heads_kv;
  const BwdKeyBlock<float> kb = bwd_key_block<float, Br, Bc, kGeneral, kGeneral>(p, tile);
  const int k0 = kb.k0, rows_k = kb.rows_k;
  const int m_lo = kb.walk.m_lo, m_count = kb.walk.m_count, steps = kb.walk.steps;
  const BwdKeyRows<float> gkv = kb.kv;
  // Step s = (head s / m_count of the group, query block m_lo + s % m_count): head-major, so each
  // head's rows stream in order. From D = 128 walked by counters (step_head, step_block): a
  // division by the run-time m_count costs ~20 instructions, and a step took two. With them and
  // load_tile's stepped addresses, forward + backward on the H200 (session 56, quick fp32 set) went
  // +8 % at D = 128 and +1.5 % at D = 256, but -8 % at D = 64, where ptxas then allocated 168
  // registers instead of 255 (why that is slower is open): below D = 128 the divisions stay.
  constexpr bool kStepCounters = D >= 128;
  auto load_step = [&](int head_in_group, int block, int stage) {
    const int64_t h = hk * group + head_in_group;
    const int64_t r0 = static_cast<int64_t>(m_lo + block) * Br;
    const int valid = p.seqlen_q - r0 < Br ? static_cast<int>(p.seqlen_q - r0) : Br;
    const BwdQueryRows<float> rows = query_rows<float>(p, b, h, r0);
    tf32_bwd::load_tile<Br, D, kThreads>(sQ + stage * kStream, rows.q, p.q_row_stride, valid,
                                         head_dim, tid);
    tf32_bwd::load_tile<Br, D, kThreads>(sdO + stage * kStream, rows.grad_out,
                                         p.grad_out_row_stride, valid, head_dim, tid);
    load_row_stats<Br>(sL, sDelta, stage, p, st, b, h, r0, tid);
  };

  tf32_bwd::load_tile<Bc, D, kThreads>(sK, gkv.k, p.k_row_stride, rows_k, head_dim, tid);
  // dV alone needs no V (dP^T only feeds dS^T, hence dK).
  if constexpr (kDK)
    tf32_bwd::load_tile<Bc, D, kThreads>(sV, gkv.v, p.v_row_stride, rows_k, head_dim, tid);
  if (steps > 0) load_step(0, 0, 0);
  cp_async_commit();

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  const int warp_row0 = warp * 16;
  const int key_row[2] = {k0 + warp_row0 + g, k0 + warp_row0 + g + 8};
  const float* sK_warp = sK + warp_row0 * kLd;
  const float* sV_warp = sV + warp_row0 * kLd;

  float dV[kDV ? DT : 1][4], dK[kDK ? DT : 1][4];
  zero(dV);
  zero(dK);

  int step_head = 0, step_block = 0;  // step s's, as load_step takes them
  for (int s = 0; s < steps; ++s) {
    const int stage = s & 1;
    if constexpr (!kStepCounters) step_head = s / m_count, step_block = s % m_count;
    const bool next_head = step_block + 1 == m_count;
    const int next_head_in_group = step_head + (next_head ? 1 : 0);
    const int next_block = next_head ? 0 : step_block + 1;
    cp_async_wait<0>();
    // Publishes step s's tiles (and at s = 0 K_j/V_j), and every warp is done with step s - 1,
    // whose buffers the prefetch below overwrites.
    __syncthreads();
    if (s + 1 < steps) load_step(next_head_in_group, next_block, stage ^ 1);
    cp_async_commit();

    const int64_t h = hk * group + step_head;
    const int64_t r0 = static_cast<int64_t>(m_lo + step_block) * Br;
    step_head = next_head_in_group, step_block = next_block;
    const float* sQ_s = sQ + stage * kStream;
    const float* sdO_s = sdO + stage * kStream;

    float St[NT][4];
    tf32_bwd::product_abt<D, NT, DT>(St, sK_warp + d0, sQ_s + d0, lane);
    float dPt[kDK ? NT : 1][4];
    if constexpr (kDK) tf32_bwd::product_abt<D, NT, DT>(dPt, sV_warp + d0, sdO_s + d0, lane);
    if constexpr (kSplit == 2) {
      // Each warp of the pair adds the other's half-head-dim sums (the same place, lane-major, in
      // the other half's warp): fp32 addition commutes, so both hold the same S^T and dP^T.
      float* mine = sExchange + warp_id * Tr::kExchangeWarp + lane;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          mine[(4 * nt + e) * 32] = St[nt][e];
          if constexpr (kDK) mine[(4 * (NT + nt) + e) * 32] = dPt[nt][e];
        }
      // The pair's partial sums are in place (ids 1..kRowTiles: one barrier per pair). The next
      // step's stores come after the loop top's barrier, which both warps reach past the reads.
      named_barrier(1 + warp, 64);
      const float* theirs = mine + (part == 0 ? 1 : -1) * Tr::kRowTiles * Tr::kExchangeWarp;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          St[nt][e] += theirs[(4 * nt + e) * 32];
          if constexpr (kDK) dPt[nt][e] += theirs[(4 * (NT + nt) + e) * 32];
        }
    }

    transposed_probs_and_grads<float, kGeneral, kDK>(St, dPt, p, tf, scale_log2, b, h, r0, Br,
                                                     n_block, Bc, key_row, sL + stage * Br,
                                                     sDelta + stage * Br, t, kb.plain_keys);

    if constexpr (kFusedDQ) {
      // This warp's 16 keys' columns of dS (one warp of a pair: both hold them); the stores drain
      // under the dV / dK products.
      if (part == 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sdS[(8 * nt + 2 * t + (e & 1)) * Tr::kDSLd + warp_row0 + g + 8 * (e >> 1)] = dPt[nt][e];
      }
    }
    if constexpr (kDV) tf32_bwd::product_ab<D, NT, DT>(dV, St, sdO_s + d0, g, t);
    if constexpr (kDK) tf32_bwd::product_ab<D, NT, DT>(dK, dPt, sQ_s + d0, g, t);
    if constexpr (kFusedDQ) {
      // Every warp's dS columns are in place. The next step's stores into sdS come after the loop
      // top's barrier, which every warp reaches only past this product.
      __syncthreads();
      tf32_bwd::add_fused_dq<Tr>(p, sdS, sK, tf.scale, b, h, r0, warp_id, g, t, st.vec_store != 0);
    }
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  store_dkdv<float, kWhich, DT>(p, b, hk, k0, dV, dK, tf.scale, warp_row0, rows_k, head_dim, lane,
                                st.vec_store != 0, d0);
}

template <class Tr, bool kGeneral>
__global__ void __launch_bounds__(Tr::kNThreads,
                                  cuda::min_ctas_for_smem(Tr::kSmemBytes, Tr::kNThreads))
    attention_bwd_tf32_dq_kernel(const AttentionBwdParams p, const BwdRowStats st) {
  constexpr int D = Tr::kHeadDim, Br = Tr::Bo, Bc = Tr::Bs, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles, kLd = Tr::kLd;
  constexpr int kOwn = Tr::kOwnTile, kStream = Tr::kStreamTile;
  static_assert(Tr::kColSplit == 1, "the dQ kernel's warps own whole rows");

  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;
  float* sdO = sQ + kOwn;
  float* sK = sdO + kOwn;  // stage 1 at + kStream
  float* sV = sK + 2 * kStream;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const BwdQueryTile tile = bwd_query_tile(p, (Nq + Br - 1) / Br);
  const int64_t h = tile.h, b = tile.b, hk = tile.hk;
  const int r0 = tile.m_block * Br, rows_q = min(Br, Nq - r0);

  const KeyBlockRange range = shown_key_blocks<kGeneral, Br, Bc>(
      p, b, h, tile.m_block, key_block_range(p, r0, r0 + rows_q - 1, Bc));

  const BwdQueryRows<float> gq = query_rows<float>(p, b, h, r0);
  const BwdKeyRows<float> gkv = key_rows<float>(p, b, hk, 0);

  tf32_bwd::load_tile<Br, D, kThreads>(sQ, gq.q, p.q_row_stride, rows_q, head_dim, tid);
  tf32_bwd::load_tile<Br, D, kThreads>(sdO, gq.grad_out, p.grad_out_row_stride, rows_q, head_dim,
                                       tid);
  auto load_kv = [&](int n, int stage) {
    const int valid = min(Bc, Nk - n * Bc);
    const int64_t row0 = static_cast<int64_t>(n) * Bc;
    tf32_bwd::load_tile<Bc, D, kThreads>(sK + stage * kStream, gkv.k + row0 * p.k_row_stride,
                                         p.k_row_stride, valid, head_dim, tid);
    tf32_bwd::load_tile<Bc, D, kThreads>(sV + stage * kStream, gkv.v + row0 * p.v_row_stride,
                                         p.v_row_stride, valid, head_dim, tid);
  };
  if (range.lo < range.hi) load_kv(range.lo, 0);
  cp_async_commit();

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  const int warp_row0 = warp * 16;
  // This lane's two query rows and their statistics (padded: rows past Nq read lse2 = +inf).
  const LaneRows rows = lane_rows(p, st, b, h, r0 + warp_row0 + g);
  const float* sQ_warp = sQ + warp_row0 * kLd;
  const float* sdO_warp = sdO + warp_row0 * kLd;
  float dQ[DT][4];
  zero(dQ);

  for (int n = range.lo; n < range.hi; ++n) {
    const int stage = (n - range.lo) & 1;
    cp_async_wait<0>();
    // Publishes K_j/V_j (and at the first block Q_i/dO_i), and every warp is done with block
    // n - 1, whose buffers the prefetch below overwrites.
    __syncthreads();
    if (n + 1 < range.hi) load_kv(n + 1, stage ^ 1);
    cp_async_commit();

    const float* sK_s = sK + stage * kStream;
    float S[NT][4], dP[NT][4];
    tf32_bwd::product_abt<D, NT>(S, sQ_warp, sK_s, lane);
    tf32_bwd::product_abt<D, NT>(dP, sdO_warp, sV + stage * kStream, lane);
    const bool plain_keys = plain_key_block<kGeneral, kGeneral, Br, Bc>(p, b, h, tile.m_block, n);
    probs_and_grads<float, kGeneral>(S, dP, p, tf, scale_log2, rows, r0, Br, n, Bc, t, plain_keys);
    tf32_bwd::product_ab<D, NT>(dQ, S, sK_s, g, t);
  }
  cp_async_wait<0>();

  store_dq<float>(p, b, h, r0, dQ, tf.scale, warp_row0, rows_q, head_dim, lane, st.vec_store != 0);
}

}  // namespace flashmod::cuda_kernels
