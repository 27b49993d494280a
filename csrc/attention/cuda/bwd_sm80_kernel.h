// The tensor-core backward (FlashAttention-2's, made deterministic): three kernels.
//
//   1. attention_bwd_rowstats_kernel (bwd_rowstats.cu, shared with the Hopper kernels): per query
//      row, delta_i = rowsum(dO_i * O_i) - grad_lse_i and the saved lse in log2 units (+inf for a
//      row that saw no key, so that its P is exactly 0).
//   2. attention_bwd_dkdv_kernel: per key block K_j, over every visible query block Q_i of the GQA
//      group: S^T = K_j Q_i^T, P^T = exp(S^T - lse), dP^T = V_j dO_i^T, dS^T = P^T (dP^T - delta),
//      dV_j += P^T dO_i, dK_j += dS^T Q_i.
//   3. attention_bwd_dq_kernel: per query block Q_i, over its visible key blocks: S, P, dP, dS as
//      above (not transposed), dQ_i += dS K_j.
// FlashAttention-2 accumulates dQ with atomic adds from the dK/dV pass, whose order varies from
// run to run; recomputing S and dP in a dQ pass of its own costs 3 more matmuls per block pair
// (7 instead of 5) and makes every gradient bitwise reproducible with no atomics at all. Adding dQ
// from the dK/dV kernel in a fixed order measured slower, even unordered (design/cuda-backward.md).
//
// Scores: s = scale * q.k, then softcap * tanh(s / softcap) if a soft cap is set, then the mask;
// ds/d(q.k) = scale * (1 - tanh^2). grad_lse enters through delta: d lse_i / d s_ij = P_ij.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/launch_bounds.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "bwd_common.h"
#include "dropout.h"
#include "entry_points.h"
#include "kernel_traits.h"

namespace flashmod::cuda_kernels {

// C[16 x (8 kNTiles)] += A[16 x D] B^T where A's rows start at a_off (ldmatrix lane offsets) in
// one swizzled tile and B's rows (the n index) in another: S = Q K^T, S^T = K Q^T, dP = dO V^T.
template <typename Elem, int kHeadDim, int kNTiles>
__device__ __forceinline__ void mma_abt(float (&c)[kNTiles][4], uint32_t a_base,
                                        const LaneTileOffsets<kHeadDim>& a_off, uint32_t b_base,
                                        const LaneTileOffsets<kHeadDim>& b_off) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, a_base + 2 * a_off.at(0, ks));
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_base + 2 * b_off.at(np * 16, ks));
      Mma16816<Elem>::run(c[2 * np], a, b[0], b[1]);
      Mma16816<Elem>::run(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x D] += A[16 x (8 kNTiles)] B where A is an accumulator (P, dS) packed to 16 bits and B
// a row-major (k x D) tile read transposed: dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <typename Elem, int kHeadDim, int kNTiles>
__device__ __forceinline__ void mma_ab(float (&acc)[kHeadDim / 8][4],
                                       const float (&a_acc)[kNTiles][4], uint32_t b_base,
                                       const LaneTileOffsets<kHeadDim>& bt_off) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    uint32_t a[4];
    pack_a<Elem>(a, a_acc, kk);
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_base + 2 * bt_off.at(kk * 16, dp));
      Mma16816<Elem>::run(acc[2 * dp], a, b[0], b[1]);
      Mma16816<Elem>::run(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// kExtents (both kernels): a variable-length call. The grid is sized from the upper bounds in
// params, each CTA works on sequence_view_bwd(params, b), and a CTA whose block lies past its
// sequence's end exits without writing.
//
// kDropout (both kernels): dropout on P (dropout.h), dense and variable-length calls (a sequence
// view keeps the call's row index b, by which the draws number rows); variants of their own so
// that the others keep their registers.
template <class Tr, bool kGeneral, int kWhich, bool kExtents, bool kDropout = false>
__global__ void __launch_bounds__(Tr::kNThreads,
                                  cuda::min_ctas_for_smem(Tr::kSmemBytes, Tr::kNThreads))
    attention_bwd_dkdv_kernel(const AttentionBwdParams params, const BwdRowStats st) {
  using Elem = typename Tr::Elem;
  // Mask tensors skip the blocks they hide at a walk's ends and run the ones they show whole the
  // plain way (bwd_common.h: kBwdFastMask); masks come without per-sequence extents.
  constexpr bool kMask = kGeneral && !kExtents;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles;
  constexpr bool kDV = kWhich != kBwdOnlyDK, kDK = kWhich != kBwdOnlyDV;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + Tr::kSmemKV;
  Elem* sQ = sV + Tr::kSmemKV;                                 // 2 stages
  Elem* sdO = sQ + 2 * Tr::kSmemQ;                             // 2 stages
  float* sL = reinterpret_cast<float*>(sdO + 2 * Tr::kSmemQ);  // 2 stages of Br lse2
  float* sDelta = sL + 2 * Br;                                 // 2 stages of Br delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(params.head_dim);
  const BwdKeyTile tile = bwd_key_tile(params, static_cast<int>((params.seqlen_k + Bc - 1) / Bc));
  const int n_block = tile.n_block;
  const int64_t hk = tile.hk, b = tile.b;
  const int64_t group = params.heads_q / params.heads_kv;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  const BwdKeyBlock<Elem> kb = bwd_key_block<Elem, Br, Bc, kGeneral, kMask>(p, tile);
  if (kExtents && kb.rows_k <= 0) return;  // past this sequence's keys: no rows of it to write
  const int k0 = kb.k0, rows_k = kb.rows_k;
  const int m_lo = kb.walk.m_lo, m_count = kb.walk.m_count, steps = kb.walk.steps;
  const BwdKeyRows<Elem> gkv = kb.kv;

  const TileCopyPlan<Bc, D, kThreads> kv_copy(tid, head_dim);
  const TileCopyPlan<Br, D, kThreads> q_copy(tid, head_dim);
  const uint32_t sK_addr = smem_addr(sK), sV_addr = smem_addr(sV);
  const uint32_t sQ_addr0 = smem_addr(sQ), sdO_addr0 = smem_addr(sdO);
  constexpr uint32_t kQStageBytes = 2 * Tr::kSmemQ;

  // Step s = (head of the group, query block): head-major, so each head's rows stream in order.
  auto load_step = [&](int s, int stage) {
    const int64_t h = hk * group + s / m_count;
    const int m = m_lo + s % m_count;
    const int64_t r0 = static_cast<int64_t>(m) * Br;
    const int valid = p.seqlen_q - r0 < Br ? static_cast<int>(p.seqlen_q - r0) : Br;
    const BwdQueryRows<Elem> rows = query_rows<Elem>(p, b, h, r0);
    q_copy.load(sQ_addr0 + stage * kQStageBytes, rows.q, p.q_row_stride, valid);
    q_copy.load(sdO_addr0 + stage * kQStageBytes, rows.grad_out, p.grad_out_row_stride, valid);
    load_row_stats<Br>(sL, sDelta, stage, p, st, b, h, r0, tid);
  };

  kv_copy.load(sK_addr, gkv.k, p.k_row_stride, rows_k);
  kv_copy.load(sV_addr, gkv.v, p.v_row_stride, rows_k);
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  const int lm_mat = lane >> 3, lm_row = lane & 7;
  const int warp_row0 = warp * 16;
  const LaneTileOffsets<D> a_off(warp_row0 + lm_row + (lm_mat & 1) * 8, lm_mat >> 1);  // K, V rows
  const LaneTileOffsets<D> b_off(lm_row + (lm_mat >> 1) * 8, lm_mat & 1);   // Q, dO rows as B
  const LaneTileOffsets<D> bt_off(lm_row + (lm_mat & 1) * 8, lm_mat >> 1);  // Q, dO as B^T

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  // This lane's two key rows (absolute key index).
  const int key_row[2] = {k0 + warp_row0 + g, k0 + warp_row0 + g + 8};

  float dV[kDV ? DT : 1][4], dK[kDK ? DT : 1][4];
  zero(dV);
  zero(dK);
  // Dropout: dP^T is masked and scaled before dS^T (whose delta = rowsum(dO * O) already holds
  // the dropped O), and P^T before dV.
  DropoutState drop;
  if constexpr (kDropout) drop = dropout_state(p);

  for (int s = 0; s < steps; ++s) {
    const int stage = s & 1;
    cp_async_wait<0>();
    // Publishes step s's tiles (and K_j/V_j at s = 0) copied by every thread, and every warp is
    // done with step s - 1, whose buffers the prefetch below overwrites.
    __syncthreads();
    if (s + 1 < steps) load_step(s + 1, stage ^ 1);
    cp_async_commit();

    const int64_t h = hk * group + s / m_count;
    const int m = m_lo + s % m_count;
    const int64_t r0 = static_cast<int64_t>(m) * Br;
    // Read ahead of the products, so a tile class's latency hides under them.
    const bool plain_keys = step_plain_keys<Br, Bc, kMask>(kb, p, b, h, m, n_block);
    const uint32_t sQ_addr = sQ_addr0 + stage * kQStageBytes;
    const uint32_t sdO_addr = sdO_addr0 + stage * kQStageBytes;
    const float* lse2 = sL + stage * Br;
    const float* delta = sDelta + stage * Br;

    float St[NT][4];
    zero(St);
    mma_abt<Elem, D, NT>(St, sK_addr, a_off, sQ_addr, b_off);
    float dPt[kDK ? NT : 1][4];
    if constexpr (kDK) {
      zero(dPt);
      mma_abt<Elem, D, NT>(dPt, sV_addr, a_off, sdO_addr, b_off);
    }

    uint32_t keep = 0;
    if constexpr (kDropout) {
      keep = keep_bits_key_rows<NT>(drop, static_cast<uint32_t>(b * p.heads_q + h), key_row[0],
                                    static_cast<uint32_t>(r0), t);
      if constexpr (kDK) apply_dropout(dPt, keep, drop.scale);
    }

    transposed_probs_and_grads<Elem, kGeneral, kDK>(
        St, dPt, p, tf, scale_log2, b, h, r0, Br, n_block, Bc, key_row, lse2, delta, t, plain_keys);
    if constexpr (kDropout && kDV) apply_dropout(St, keep, drop.scale);

    if constexpr (kDV) mma_ab<Elem, D, NT>(dV, St, sdO_addr, bt_off);
    if constexpr (kDK) mma_ab<Elem, D, NT>(dK, dPt, sQ_addr, bt_off);
  }
  cp_async_wait<0>();

  // The general packed-rows variants store directly: staged, ptxas spilled 32 bytes at D = 128.
  if constexpr (!(kGeneral && kExtents)) {
    if (st.vec_store == kGradStoreRows16) {
      // Only this warp reads its rows of K_j and V_j (the A operand of S^T and dP^T), so they
      // stage its gradient rows (bwd_common.h) once every thread's copies into them have landed
      // (a tile no query sees had no step to wait for them).
      __syncthreads();
      store_dkdv_staged<Elem, kWhich, D>(p, b, hk, k0, dV, dK, tf.scale, sV_addr, sK_addr,
                                         warp_row0, rows_k, head_dim, lane);
      return;
    }
  }
  store_dkdv<Elem, kWhich, DT>(p, b, hk, k0, dV, dK, tf.scale, warp_row0, rows_k, head_dim, lane,
                               st.vec_store != 0);
}

template <class Tr, bool kGeneral, bool kExtents, bool kDropout = false>
__global__ void __launch_bounds__(Tr::kNThreads,
                                  cuda::min_ctas_for_smem(Tr::kSmemBytes, Tr::kNThreads))
    attention_bwd_dq_kernel(const AttentionBwdParams params, const BwdRowStats st) {
  using Elem = typename Tr::Elem;
  // Mask tensors skip the blocks they hide at a walk's ends and run the ones they show whole the
  // plain way (bwd_common.h: kBwdFastMask); masks come without per-sequence extents.
  constexpr bool kMask = kGeneral && !kExtents;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sdO = sQ + Tr::kSmemQ;
  Elem* sK = sdO + Tr::kSmemQ;      // 2 stages
  Elem* sV = sK + 2 * Tr::kSmemKV;  // 2 stages

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(params.head_dim);
  const BwdQueryTile tile =
      bwd_query_tile(params, static_cast<int>((params.seqlen_q + Br - 1) / Br));
  const int m_block = tile.m_block;
  const int64_t h = tile.h, b = tile.b, hk = tile.hk;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int r0 = m_block * Br;
  if constexpr (kExtents) {
    if (r0 >= Nq) return;  // past this sequence's queries: no rows of it to write
  }
  const int rows_q = min(Br, Nq - r0);

  const KeyBlockRange range = shown_key_blocks<kMask, Br, Bc>(
      p, b, h, m_block, key_block_range(p, r0, r0 + rows_q - 1, Bc));

  const BwdQueryRows<Elem> gq = query_rows<Elem>(p, b, h, r0);
  const BwdKeyRows<Elem> gkv = key_rows<Elem>(p, b, hk, 0);

  const TileCopyPlan<Br, D, kThreads> q_copy(tid, head_dim);
  const TileCopyPlan<Bc, D, kThreads> kv_copy(tid, head_dim);
  const uint32_t sQ_addr = smem_addr(sQ), sdO_addr = smem_addr(sdO);
  const uint32_t sK_addr0 = smem_addr(sK), sV_addr0 = smem_addr(sV);
  constexpr uint32_t kKVStageBytes = 2 * Tr::kSmemKV;
  auto load_kv = [&](int n, int stage) {
    const int valid = min(Bc, Nk - n * Bc);
    const int64_t row0 = static_cast<int64_t>(n) * Bc;
    kv_copy.load(sK_addr0 + stage * kKVStageBytes, gkv.k + row0 * p.k_row_stride, p.k_row_stride,
                 valid);
    kv_copy.load(sV_addr0 + stage * kKVStageBytes, gkv.v + row0 * p.v_row_stride, p.v_row_stride,
                 valid);
  };

  q_copy.load(sQ_addr, gq.q, p.q_row_stride, rows_q);
  q_copy.load(sdO_addr, gq.grad_out, p.grad_out_row_stride, rows_q);
  if (range.lo < range.hi) load_kv(range.lo, 0);
  cp_async_commit();

  const int lm_mat = lane >> 3, lm_row = lane & 7;
  const int warp_row0 = warp * 16;
  const LaneTileOffsets<D> a_off(warp_row0 + lm_row + (lm_mat & 1) * 8, lm_mat >> 1);  // Q, dO
  const LaneTileOffsets<D> b_off(lm_row + (lm_mat >> 1) * 8, lm_mat & 1);   // K, V rows as B
  const LaneTileOffsets<D> bt_off(lm_row + (lm_mat & 1) * 8, lm_mat >> 1);  // K as B^T

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  // This lane's two query rows and their statistics (padded: rows past Nq read lse2 = +inf).
  const LaneRows rows = lane_rows(p, st, b, h, r0 + warp_row0 + g);
  float dQ[DT][4];
  zero(dQ);
  // Dropout: dP is masked and scaled before dS.
  DropoutState drop;
  if constexpr (kDropout) drop = dropout_state(p);

  for (int n = range.lo; n < range.hi; ++n) {
    const int stage = (n - range.lo) & 1;
    cp_async_wait<0>();
    // Publishes K_j/V_j (and Q_i, dO_i at the first block) copied by every thread, and every warp
    // is done with block n - 1, whose buffers the prefetch below overwrites.
    __syncthreads();
    if (n + 1 < range.hi) load_kv(n + 1, stage ^ 1);
    cp_async_commit();

    const uint32_t sK_addr = sK_addr0 + stage * kKVStageBytes;
    const uint32_t sV_addr = sV_addr0 + stage * kKVStageBytes;
    float S[NT][4], dP[NT][4];
    zero(S);
    zero(dP);
    mma_abt<Elem, D, NT>(S, sQ_addr, a_off, sK_addr, b_off);
    mma_abt<Elem, D, NT>(dP, sdO_addr, a_off, sV_addr, b_off);

    const bool plain_keys = plain_key_block<kGeneral, kMask, Br, Bc>(p, b, h, m_block, n);

    if constexpr (kDropout) {
      apply_dropout(dP,
                    keep_bits_query_rows<NT>(drop, static_cast<uint32_t>(b * p.heads_q + h),
                                             static_cast<uint32_t>(r0 + warp_row0 + g),
                                             static_cast<uint32_t>(n * Bc), t),
                    drop.scale);
    }
    probs_and_grads<Elem, kGeneral>(S, dP, p, tf, scale_log2, rows, r0, Br, n, Bc, t, plain_keys);
    mma_ab<Elem, D, NT>(dQ, S, sK_addr, bt_off);
  }
  cp_async_wait<0>();

  if (st.vec_store == kGradStoreRows16) {
    // Only this warp reads its rows of Q_i: they stage its dQ rows, as the dK/dV kernel's.
    __syncthreads();
    store_dq_staged<Elem, D>(p, b, h, r0, dQ, tf.scale, sQ_addr, warp_row0, rows_q, head_dim, lane);
    return;
  }
  store_dq<Elem>(p, b, h, r0, dQ, tf.scale, warp_row0, rows_q, head_dim, lane, st.vec_store != 0);
}

}  // namespace flashmod::cuda_kernels
