// The Hopper dK/dV kernel at head dim 256 (sm_90a) for plain dense scores: four matmuls per block
// pair where the pair kernel (bwd_sm90_kernel.h, kBwdPair) takes five. The two warpgroups of a
// CTA split the head dim, not the gradients: each owns 128 of the 256 columns of both dK_j and
// dV_j (64 keys x 128 columns x 2 accumulators: 128 fp32 a thread). The pair gives each warpgroup
// one whole 64 x 256 gradient instead, so both compute S^T = K_j Q_i^T for themselves. Here the
// score products are split by keys: warpgroup w computes the 64 queries x 32 keys at keys 32 w..
// of S_i = Q_i K_j^T and dP_i = dO_i V_j^T, forms P and dS there, and writes them (Elem, 64 x 64
// each) into shared memory, from which both warpgroups read them as operands of
//   dV_j[:, half] += P^T dO_i[:, half]   (A = P read MN-major, B = dO_i read MN-major)
//   dK_j[:, half] += dS^T Q_i[:, half]   (A = dS read MN-major, B = Q_i read MN-major).
// dQ stays with the dQ kernel (no atomics: bitwise reproducible). Each step's dQ partial added into
// fp32 sums from this kernel was measured and lost: 64 KB of adds a step (the tiles leave no room
// to stage them for the copy engine, so by vector reductions from the registers) made the kernel
// 3.65 ms against this kernel's 2.02 + the dQ kernel's 1.57 (H200, bf16, B 4, H 8, N 4k;
// benchmarks/results/design/cuda-backward.md, session 51).
#pragma once

#include "bwd_sm90_kernel.h"

namespace flashmod::cuda_kernels::sm90 {

template <typename Elem_>
struct BwdHalvesTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = 256;
  static constexpr int Br = 64;  // queries a step: wgmma's M of S and dP
  static constexpr int Bc = 64;  // keys a CTA: wgmma's M of dK and dV
  static constexpr int kNThreads = 256;
  static constexpr int kStages = 2;                  // of Q_i, dO_i and their row statistics
  static constexpr int kHalf = kHeadDim / 2;         // head-dim columns per warpgroup
  static constexpr int kSmemKV = Bc * kHeadDim * 2;  // K_j or V_j
  static constexpr int kSmemQ = Br * kHeadDim * 2;   // one stage of Q_i or of dO_i
  static constexpr int kSmemProbs = Br * Bc * 2;     // P or dS
  // K_j, V_j; the stages of Q_i, dO_i; P, dS; the stages' lse2 and delta rows and mbarriers; +1024
  // to align the base to the swizzle atom.
  static constexpr int kSmemBytes =
      2 * kSmemKV + kStages * 2 * kSmemQ + 2 * kSmemProbs + kStages * (2 * Br * 4 + 8) + 1024;
  static_assert(sizeof(Elem) == 2, "wgmma path is for fp16/bf16");
  static_assert(Br == 64 && Bc == 64, "a warpgroup's m64 of the score and gradient products");
  static_assert(Br <= kBwdRowPad, "the row statistics are padded to whole steps");
  static_assert(kSmemBytes <= 227 * 1024, "sm_90's per-block shared-memory limit");
};

// The step loop is sequential: S_i / dP_i, then P / dS into their tiles, then dV / dK. Issuing
// step s + 1's score products behind step s's gradient products (the tensor cores then idle only
// through the elementwise work) was measured and lost: 2.30 against 2.02 ms at N = 4k, 0.64
// against 0.57 at 1k (session 51), with its prefetch then half a step ahead of its use.
template <class Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    attention_bwd_halves_sm90_kernel(const AttentionBwdParams p, const BwdRowStats st,
                                     const __grid_constant__ BwdStepMaps maps) {
#ifdef FLASHMOD_SM90A
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kStages = Tr::kStages;
  constexpr int kHalfKeys = Bc / 2;  // S and dP columns of a warpgroup
  constexpr int kKSteps = D / 16;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t sK = (raw_addr + 1023) & ~1023u;
  const uint32_t sV = sK + Tr::kSmemKV;
  const uint32_t sQ0 = sV + Tr::kSmemKV;
  const uint32_t sdO0 = sQ0 + kStages * Tr::kSmemQ;
  // P and dS: Br query rows x Bc keys (128-byte rows, swizzled).
  const uint32_t sP = sdO0 + kStages * Tr::kSmemQ;
  const uint32_t sdS = sP + Tr::kSmemProbs;
  float* sL = reinterpret_cast<float*>(smem_raw + (sdS + Tr::kSmemProbs - raw_addr));
  float* sDelta = sL + kStages * Br;
  const uint32_t full_bar0 = smem_addr(sDelta + kStages * Br);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, w4 = warp % 4, g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(p.head_dim);
  const BwdKeyTile tile = bwd_key_tile(p, static_cast<int>((p.seqlen_k + Bc - 1) / Bc));
  const int n_block = tile.n_block;
  const int64_t hk = tile.hk, b = tile.b;
  const int64_t group = p.heads_q / p.heads_kv;
  const BwdKeyBlock<Elem> kb = bwd_key_block<Elem, Br, Bc, false, false>(p, tile);
  const int k0 = kb.k0, rows_k = kb.rows_k;
  const int m_lo = kb.walk.m_lo, m_count = kb.walk.m_count, steps = kb.walk.steps;

  // Step s = (head of the group, query block), head-major as in the other dK/dV kernels; its
  // Q_i, dO_i and row statistics through the copy engine, by one thread.
  auto load_step = [&](int head, int block, int stage) {
    if (tid == 0) {  // rows past seqlen_q arrive as zeros (the maps bound each head's rows)
      const int64_t h = hk * group + head;
      const int64_t r0 = static_cast<int64_t>(m_lo + block) * Br;
      const uint32_t bar = full_bar0 + 8 * stage;
      mbarrier_arrive_expect_tx(bar, 2 * Tr::kSmemQ + 2 * Br * 4);
      tma_load_step_tiles<D, Br>(sQ0 + stage * Tr::kSmemQ, sdO0 + stage * Tr::kSmemQ, maps,
                                 static_cast<int>(r0), static_cast<int>(h), static_cast<int>(b),
                                 bar);
      const int64_t stat = (b * p.heads_q + h) * st.rows_padded + r0;
      bulk_copy_to_shared<false>(smem_addr(sL + stage * Br), st.lse2 + stat, Br * 4, bar);
      bulk_copy_to_shared<false>(smem_addr(sDelta + stage * Br), st.delta + stat, Br * 4, bar);
    }
  };
  if (tid == 0) init_stage_barriers(full_bar0, kStages, 1);
  const Sw128TileCopy<Bc, D, Tr::kNThreads> kv_copy(tid, head_dim);
  kv_copy.load(sK, kb.kv.k, p.k_row_stride, rows_k);
  kv_copy.load(sV, kb.kv.v, p.v_row_stride, rows_k);
  cp_async_commit();
  if (steps > 0) load_step(0, 0, 0);
  cp_async_wait<0>();
  fence_proxy_async_smem();  // this thread's K_j / V_j copies -> visible to wgmma

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  // This warpgroup's keys of K_j / V_j: B of the score products (K-major).
  const uint64_t k_desc = sw128_desc(sK + wg * kHalfKeys * 128, 16, 1024);
  const uint64_t v_desc = sw128_desc(sV + wg * kHalfKeys * 128, 16, 1024);
  // P, dS: A of the gradient products, read MN-major (keys contiguous, k16 = 16 query rows).
  const uint64_t p_mn_desc = sw128_desc(sP, Bc * 128, 1024);
  const uint64_t ds_mn_desc = sw128_desc(sdS, Bc * 128, 1024);
  const int key_col = k0 + wg * kHalfKeys + 2 * t;  // key of this lane's column pairs, n8 tile 0
  const int lane_row = w4 * 16 + g;  // query row (and + 8) of a step; key row of dK / dV

  // dV_j / dK_j columns 128 wg + 64 c.. in chunk c.
  float dV[2][8][4], dK[2][8][4];
  zero(dV[0]);
  zero(dV[1]);
  zero(dK[0]);
  zero(dK[1]);

  int head = 0, block = 0, ahead_head = 0, ahead_block = 0;  // steps s and s + 1
  if (++ahead_block == m_count) ahead_block = 0, ++ahead_head;
  for (int s = 0, stage = 0; s < steps; ++s, stage ^= 1) {
    // Every warp is done with step s - 1's products: the other stage, P and dS may be written
    // again. (At s = 0: the mbarriers' init and every thread's K_j / V_j copies are published.)
    __syncthreads();
    if (s + 1 < steps) {
      load_step(ahead_head, ahead_block, stage ^ 1);
      if (++ahead_block == m_count) ahead_block = 0, ++ahead_head;
    }
    const int64_t r0 = static_cast<int64_t>(m_lo + block) * Br;
    if (++block == m_count) block = 0, ++head;
    // Step s's Q_i, dO_i and row statistics have landed; the stage's barrier completes once per
    // kStages steps.
    mbarrier_wait(full_bar0 + 8 * stage, (s / kStages) & 1);

    // S_i, dP_i at this warpgroup's keys (A: Q_i / dO_i, B: K_j / V_j, both K-major).
    const uint32_t sQ = sQ0 + stage * Tr::kSmemQ, sdO = sdO0 + stage * Tr::kSmemQ;
    const uint64_t q_desc = sw128_desc(sQ, 16, 1024), do_desc = sw128_desc(sdO, 16, 1024);
    float S[kHalfKeys / 8][4], dP[kHalfKeys / 8][4];
    wgmma_fence();
    WgmmaSS<Elem, kHalfKeys>::template overwrite<0, 0>(S, q_desc, k_desc);
#pragma unroll
    for (int ks = 1; ks < kKSteps; ++ks)
      WgmmaSS<Elem, kHalfKeys>::template mma<0, 0>(S, desc_advance(q_desc, k_step(ks, Br)),
                                                   desc_advance(k_desc, k_step(ks, Bc)), 1);
    WgmmaSS<Elem, kHalfKeys>::template overwrite<0, 0>(dP, do_desc, v_desc);
#pragma unroll
    for (int ks = 1; ks < kKSteps; ++ks)
      WgmmaSS<Elem, kHalfKeys>::template mma<0, 0>(dP, desc_advance(do_desc, k_step(ks, Br)),
                                                   desc_advance(v_desc, k_step(ks, Bc)), 1);
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(S);
    pin_registers(dP);

    // P and dS in place of S and dP (rows: queries lane_row, + 8; columns: keys). Rows past
    // seqlen_q have lse2 = +inf (P = 0) and zero dO rows.
    const float l2[2] = {sL[stage * Br + lane_row], sL[stage * Br + lane_row + 8]};
    const float dl[2] = {sDelta[stage * Br + lane_row], sDelta[stage * Br + lane_row + 8]};
    if (key_block_unmasked(p, r0, r0 + Br - 1, n_block, Bc)) {
#pragma unroll
      for (int ni = 0; ni < kHalfKeys / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float prob = exp2f(fmaf(S[ni][e], scale_log2, -l2[e >> 1]));
          S[ni][e] = prob;
          dP[ni][e] = prob * (dP[ni][e] - dl[e >> 1]);
        }
    } else {
      const int64_t last = p.seqlen_q - 1;
      const RowWindow win[2] = {row_window(p, min(r0 + lane_row, last)),
                                row_window(p, min(r0 + lane_row + 8, last))};
#pragma unroll
      for (int ni = 0; ni < kHalfKeys / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1, j = key_col + 8 * ni + (e & 1);
          const float prob = win[hh].contains(j) ? exp2f(fmaf(S[ni][e], scale_log2, -l2[hh])) : 0.f;
          S[ni][e] = prob;
          dP[ni][e] = grad_score(prob, dP[ni][e], dl[hh]);
        }
    }
#pragma unroll
    for (int ni = 0; ni < kHalfKeys / 8; ++ni)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t at = sw128_offset<Br>(lane_row + 8 * hh, wg * (kHalfKeys / 8) + ni) + 4 * t;
        sts_32(sP + at, Mma16816<Elem>::pack(S[ni][2 * hh], S[ni][2 * hh + 1]));
        sts_32(sdS + at, Mma16816<Elem>::pack(dP[ni][2 * hh], dP[ni][2 * hh + 1]));
      }
    fence_proxy_async_smem();  // st.shared -> visible to wgmma (after the barrier)
    __syncthreads();           // both warpgroups' keys of P and dS are written

    // dV_j, dK_j += P^T dO_i, dS^T Q_i at this warpgroup's column blocks 2 wg + c.
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t col_block = (2 * wg + c) * Br * 128;
      const uint64_t do_mn = sw128_desc(sdO + col_block, Br * 128, 1024);
      const uint64_t q_mn = sw128_desc(sQ + col_block, Br * 128, 1024);
#pragma unroll
      for (int kk = 0; kk < Br / 16; ++kk) {
        WgmmaSS<Elem, 64>::template mma<1, 1>(dV[c], desc_advance(p_mn_desc, kk * 2048),
                                              desc_advance(do_mn, kk * 2048), 1);
        WgmmaSS<Elem, 64>::template mma<1, 1>(dK[c], desc_advance(ds_mn_desc, kk * 2048),
                                              desc_advance(q_mn, kk * 2048), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(dV[0]);
    pin_registers(dV[1]);
    pin_registers(dK[0]);
    pin_registers(dK[1]);
  }

  Elem* gv = grad_rows<Elem>(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride,
                             p.grad_v_row_stride, b, hk, k0);
  Elem* gk = grad_rows<Elem>(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride,
                             p.grad_k_row_stride, b, hk, k0);
  if (st.vec_store == kGradStoreRows16) {
    // Through shared memory, as store_dkdv_staged: each warp's column halves of its 16 rows into
    // the K_j / V_j tiles (no warp reads them any more), then warpgroup 0 copies dV's rows out as
    // 16-byte chunks, warpgroup 1 dK's.
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t at = 2 * (tile_offset<D>(lane_row + 8 * hh, wg * 16 + c * 8 + ni) + 2 * t);
          sts_32(sV + at, Mma16816<Elem>::pack(dV[c][ni][2 * hh], dV[c][ni][2 * hh + 1]));
          sts_32(sK + at, Mma16816<Elem>::pack(dK[c][ni][2 * hh] * tf.scale,
                                               dK[c][ni][2 * hh + 1] * tf.scale));
        }
    __syncthreads();  // both warpgroups' halves are staged
    const int row0 = w4 * 16;
    if (wg == 0) {
      copy_staged_rows16<D, 16>(sV, row0, gv + row0 * p.grad_v_row_stride, p.grad_v_row_stride,
                                rows_k - row0, head_dim, lane);
    } else {
      copy_staged_rows16<D, 16>(sK, row0, gk + row0 * p.grad_k_row_stride, p.grad_k_row_stride,
                                rows_k - row0, head_dim, lane);
    }
    return;
  }
  const bool vec = st.vec_store != 0;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int col0 = wg * Tr::kHalf + c * 64;
    store_rows<Elem, 8>(gv + col0, p.grad_v_row_stride, dV[c], 1.f, w4 * 16, rows_k,
                        head_dim - col0, lane, vec);
    store_rows<Elem, 8>(gk + col0, p.grad_k_row_stride, dK[c], tf.scale, w4 * 16, rows_k,
                        head_dim - col0, lane, vec);
  }
#else
  __trap();  // launched only where the sm_90a binary runs (see attention_backward_cuda.cpp)
#endif
}

}  // namespace flashmod::cuda_kernels::sm90
