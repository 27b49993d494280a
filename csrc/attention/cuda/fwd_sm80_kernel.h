// The tensor-core forward kernel: one CTA per (query block Q_i, head, batch), looping over the
// key/value blocks K_j, V_j that the window rule lets it see.
//
// Per K_j:  S = Q_i K_j^T (mma, fp32)  ->  mask if needed  ->  online softmax (m, l, rescale O)
//           ->  O += P V_j with P packed to 16 bits straight from the S registers.
// The S accumulator layout of two adjacent n8 tiles equals the A-operand layout of one k16
// slice, which is what lets P skip shared memory.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../attention_params.h"
#include "cta_tile.h"
#include "cta_timeline.h"
#include "dropout.h"
#include "entry_points.h"
#include "fwd_epilogue.h"
#include "kernel_traits.h"
#include "mask_tiles.h"
#include "online_softmax.h"
#include "paged_kv.h"
#include "score_mask.h"
#include "split_combine.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// kGeneral: a mask tensor, a soft cap or a non-positive scale is present, so every score is
// transformed (scale, cap, mask) before the softmax. Otherwise scores stay raw q.k, the scale
// folds into exp2, and only key blocks that straddle the window or seqlen_k are masked.
//
// kDecode: the decode variant (few query rows, long K/V; fwd_sm80_launch.h picks it from the
// shapes). Two additions, both outside the key loop's per-block work:
//   * GQA packing (p.pos_period > 0): rows are (head, position) pairs of one kv group, so the
//     window rule is applied to the position, row % pos_period;
//   * split-KV (sk.splits > 1): each CTA walks one part of its key blocks and writes its rows'
//     normalized partial O and lse (fp32) to sk's workspace; attention_fwd_split_combine_kernel
//     (split_combine.h) merges them.
// With KeySplitTraits (tiles of at most 16 rows) its warps split each key block instead of the
// rows and merge their softmax states after the loop. Without kDecode, sk is unused and the kernel
// is the prefill kernel, unchanged.
//
// kAddr != kDense: params carry per-sequence extents (varlen, KV-cache lengths, paged K/V;
// attention_params.h). The grid is sized from the upper bounds in params, each CTA works on
// sequence_view(params, b) of its batch row, K/V blocks load through the block table when paged
// (paged_kv.h), and a CTA whose query block lies past its sequence's end exits without writing.
// A template parameter, so that dense calls keep their registers.
//
// Decode at pages smaller than a key block in sm_90a builds (kKvTma, head dims of whole 64-column
// blocks): K_j and V_j sit in shared memory as column blocks (smem_tile.h), the layout the copy
// engine writes, and where the launch passes tensor maps over the page pools (maps.box_rows > 0)
// every whole key block of cached rows comes through it, one box per page, and is waited for on
// the stage's mbarrier; the block holding the appended keys and a partial last block keep the
// cp.async copies, into the same layout. (Contiguous caches and larger pages keep cp.async: the
// copy engine ran them 0-6 % slower on an H100; benchmarks/results/design/cuda-serving.md,
// session 23.)
//
// kDropout: the dense and variable-length prefill kernels (plain or general scores) with dropout
// on P (dropout.h; a sequence view keeps the call's row index b, by which the draws number rows),
// variants of their own so that the others keep their registers (the general one spilled 32
// bytes more with dropout behind a run-time branch).
template <class Tr, bool kGeneral, bool kDecode = false, KvAddressing kAddr = kDense,
          bool kDropout = false>
__global__ void __launch_bounds__(Tr::kNThreads)
    attention_fwd_kernel(const AttentionParams params, const FwdLaunchFlags flags,
                         const SplitKvArgs sk, const __grid_constant__ KvTensorMaps maps) {
#ifdef FLASHMOD_CTA_TIMELINE
  CtaTimelineProbe timeline;  // tools/decode_timeline.cu only
#endif
  using Elem = typename Tr::Elem;
  using Mma = Mma16816<Elem>;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int MT = Tr::kMTiles, NT = Tr::kNTiles, DT = Tr::kDTiles;
  // Key split (decode tiles of at most 16 real rows, kernel_traits.h: KeySplitTraits): each warp
  // computes the tile's first 16 rows against its own kKeysPerWarp keys of every K_j / V_j.
  constexpr bool kKeySplit = Tr::kKeySplit;
  constexpr int kKeysPerWarp = Tr::kKeysPerWarp;
  static_assert(!kKeySplit || kDecode, "the key split is a decode kernel's form");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kKvTma = kDecode && kAddr == kRowPages && D % 64 == 0;
#else
  constexpr bool kKvTma = false;
#endif
  constexpr int kKvBlockRows = kKvTma ? Bc : 0;  // K/V tiles as column blocks of Bc rows

  // Q_i, the K_j / V_j stages, then (decode, decode_smem_bytes) the copy engine's mbarriers and the
  // split combine's flag. No static shared memory: the dynamic base is then the CTA's first
  // 1024-byte boundary (H100: 0x400; with one static int before it, 0x480), the 128-byte swizzle
  // atom the copy engine's tiles must start on.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The copy engine takes the K/V tiles where the launch gave maps over the page pools (and the
  // base is so aligned, which the launch cannot check); otherwise cp.async fills the same layout.
  bool kv_tma = false;
  if constexpr (kKvTma) kv_tma = maps.box_rows > 0 && smem_addr(smem_raw) % 1024 == 0;
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + Tr::kSmemQ;                 // kStages buffers of K_j
  Elem* sV = sK + Tr::kStages * Tr::kSmemKV;  // kStages buffers of V_j

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head_dim = static_cast<int>(params.head_dim);

  const int num_m_blocks = static_cast<int>((params.seqlen_q + Br - 1) / Br);
  const int splits = kDecode ? sk.splits : 1;
  const CtaTile tile = kDecode ? cta_tile_of_grid(params, num_m_blocks, splits)
                               : cta_tile(params, num_m_blocks, splits);
  constexpr bool kExtents = kAddr != kDense;
  const AttentionParams p = kExtents ? sequence_view(params, tile.b) : params;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int r0 = tile.m_block * Br;
  // The fused KV-cache append (decode only): keys from new_from on are read from k_new / v_new,
  // never from the cache slots they go to, so one CTA per (batch row, kv head) can write those
  // slots while every CTA reads. The writer is split 0 of query block 0 (r0 = 0) of the kv head's
  // first query head; it writes once its first loads are in flight (after the prologue).
  const bool new_rows = kDecode && kExtents && p.k_new != nullptr;
  const int new_from = new_rows ? Nk - static_cast<int>(p.seqlen_new) : Nk;
  if constexpr (kExtents) {
    if (r0 >= Nq) return;  // past this sequence's queries (varlen): nothing of it to write
  }
  const int rows_q = min(Br, Nq - r0);
  const TilePointers<Elem> gp = tile_pointers<Elem>(p, tile, r0);
  const Elem *gQ = gp.q, *gK = gp.k, *gV = gp.v;
  Elem* gO = gp.out;
  float* gLse = gp.lse;
  const int64_t b = tile.b, h = tile.h;

  // Query positions of rows [r0, r0 + rows_q). A packed tile that spans heads covers every
  // position in between, so the range is then all of [0, pos_period).
  // (32-bit: a period is at most kDecodeMaxNq, and 64-bit divisions delay the first copies.)
  int64_t pos_first = r0, pos_last = r0 + rows_q - 1;
  if constexpr (kDecode) {
    if (p.pos_period == 1) {  // one query a head: every row is position 0
      pos_first = pos_last = 0;
    } else if (p.pos_period > 0) {
      const int period = static_cast<int>(p.pos_period), last = r0 + rows_q - 1;
      const bool one_head = r0 / period == last / period;
      pos_first = one_head ? r0 % period : 0;
      pos_last = one_head ? last % period : period - 1;
    }
  }
  KeyBlockRange range = key_block_range(p, pos_first, pos_last, Bc);
  // Split s of a (query block, head) takes the s-th run of ceil(blocks / splits) key blocks.
  const int64_t part_row0 =
      kDecode ? tile.split * (p.batch * p.heads_q * p.seqlen_q) + gp.row_id : 0;
  if constexpr (kDecode) {
    if (splits > 1) {
      const int per = static_cast<int>(
          (static_cast<unsigned>(max(0, range.hi - range.lo)) + splits - 1) / splits);
      range.lo += tile.split * per;
      range.hi = min(range.hi, range.lo + per);
    }
  }
#ifdef FLASHMOD_CTA_TIMELINE
  timeline.ranged();
#endif
  // Split-KV, after this CTA wrote its partial: the fused combine (split_combine.h).
  auto finish_split = [&]() {
    if constexpr (kDecode) {
      int& last = *reinterpret_cast<int*>(smem_raw + Tr::kSmemBytes + 8 * Tr::kStages);
      finish_split_cta<Elem, D, kThreads>(sk, (b * p.heads_q + h) * num_m_blocks + tile.m_block,
                                          p.batch * p.heads_q * p.seqlen_q, gp.row_id, rows_q, gO,
                                          p.out_row_stride, gLse, head_dim, last);
    }
  };
  // Prefill with a mask tensor: its hidden tiles at either end are not visited, and its clear
  // ones are not masked (mask_tiles.h).
  const uint8_t* mask_classes =
      !kDecode && kGeneral ? mask_tile_row(p, b, h, tile.m_block, Br, Bc) : nullptr;
  skip_hidden_tiles(mask_classes, range);
  // Prefill: a tile without visible keys writes its rows' 0 / -inf and leaves. Decode runs the
  // empty range through the kernel instead (no key loads, no loop iteration; the epilogue and
  // the split partial write 0 / -inf for rows with l = 0): one copy of the fused append and of
  // the split combine in its code, which has to fit the instruction cache (paged_kv.h:
  // append_new_rows).
  if constexpr (!kDecode) {
    if (range.lo >= range.hi) {
      write_rows_without_keys<kThreads>(p, gO, gLse, rows_q, tid);
      return;
    }
  }

  const TileCopyPlan<Br, D, kThreads> q_copy(tid, head_dim);
  const TileCopyPlan<Bc, D, kThreads, kKvTma> kv_copy(tid, head_dim);
  const uint32_t sQ_addr = smem_addr(sQ), sK_addr0 = smem_addr(sK), sV_addr0 = smem_addr(sV);
  constexpr uint32_t kStageBytes = 2 * Tr::kSmemKV;
  // kKvTma: key blocks [.., tma_end) are whole blocks of cached rows and come through the copy
  // engine, each completing on its stage's mbarrier (kStages of them after the tiles:
  // decode_smem_bytes; one arrival per page of a block); tma_phase holds each stage's parity.
  const uint32_t kv_bar0 = sQ_addr + Tr::kSmemBytes;
  int tma_end = 0;
  uint32_t tma_phase = 0;
  if constexpr (kKvTma) {
    if (kv_tma) {
      tma_end = new_from / Bc;
      // One arrival per page of a key block (load_kv_pages_tma).
      if (tid == 0) init_stage_barriers(kv_bar0, Tr::kStages, Bc / maps.box_rows);
      // The barriers are initialized before any other thread issues a copy that completes on one.
      __syncthreads();
    }
  }
  KvRowSources<Elem> row_src{gK, gV, nullptr, nullptr, new_from};
  if constexpr (kDecode && kExtents) {
    if (new_rows) {
      row_src.k_new = static_cast<const Elem*>(p.k_new) + tile.hk * p.kn_head_stride;
      row_src.v_new = static_cast<const Elem*>(p.v_new) + tile.hk * p.vn_head_stride;
    }
  }
  auto load_kv = [&](int n, int stage) {
    if constexpr (kKvTma) {
      if (n < tma_end) {
        if (warp == 0)
          load_kv_pages_tma<Bc, D>(maps, sK_addr0 + stage * kStageBytes,
                                   sV_addr0 + stage * kStageBytes, p, static_cast<int>(tile.hk), n,
                                   kv_bar0 + 8 * stage, lane);
        return;
      }
    }
    load_kv_tile<kAddr, kDecode, Bc>(kv_copy, sK_addr0 + stage * kStageBytes,
                                     sV_addr0 + stage * kStageBytes, row_src, p, n);
  };

  // Pipeline prologue: Q_i, then the first kStages-1 key blocks, one commit group each (empty
  // groups past the range keep the group count, and so cp_async_wait's argument, uniform).
  q_copy.load(sQ_addr, gQ, p.q_row_stride, rows_q);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (range.lo + s < range.hi) load_kv(range.lo + s, s);
    cp_async_commit();
  }
#ifdef FLASHMOD_CTA_TIMELINE
  timeline.issued();
#endif
  if constexpr (kDecode && kExtents) {
    if (new_rows && tile.split == 0 && tile.m_block == 0 &&
        tile.h % (params.heads_q / params.heads_kv) == 0)
      append_new_rows<Elem, kThreads, D, kAddr>(p, tile.hk, tid);
  }

  // Per-lane ldmatrix coordinates: lanes 8i..8i+7 address the rows of 8x8 matrix i.
  const int lm_mat = lane >> 3, lm_row = lane & 7;
  // warp_row0: the rows this warp stores; q_row0 / kv_row0: the Q_i rows and K_j / V_j rows it
  // computes with (key split: rows 0-15 and its quarter of the keys).
  const int warp_row0 = warp * Tr::kRowsPerWarp;
  const int q_row0 = kKeySplit ? 0 : warp_row0, kv_row0 = kKeySplit ? warp * kKeysPerWarp : 0;
  const LaneTileOffsets<D> q_off(q_row0 + lm_row + (lm_mat & 1) * 8, lm_mat >> 1);  // A
  const LaneTileOffsets<D, kKvBlockRows> k_off(kv_row0 + lm_row + (lm_mat >> 1) * 8,
                                               lm_mat & 1);  // B
  const LaneTileOffsets<D, kKvBlockRows> v_off(kv_row0 + lm_row + (lm_mat & 1) * 8,
                                               lm_mat >> 1);  // B^T

  // Accumulator coordinates: row lane/4 (+8), columns 2*(lane%4) (+1).
  const int g = lane >> 2, t = lane & 3;

  const float log2e = 1.4426950408889634f;
  const ScoreTransform tf(p);
  const float c = kGeneral ? log2e : tf.scale * log2e;
  // Rows whose windows decide whether a key block needs masking. Prefill: the whole tile (rows
  // past Nq are computed, never stored). Decode: the positions of the stored rows.
  const int64_t row_first = kDecode ? pos_first : r0, row_last = kDecode ? pos_last : r0 + Br - 1;
  // Query position of a row (GQA packing folds heads into rows). 32-bit: rows are < 2^31 and a
  // 64-bit remainder is a called subroutine (it cost spills).
  const int period = kDecode ? static_cast<int>(p.pos_period) : 0;
  auto pos_of = [period](int64_t i) -> int64_t {
    if constexpr (kDecode) return period > 0 ? static_cast<int>(i) % period : i;
    return i;
  };

  float O[MT][DT][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int di = 0; di < DT; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) O[mi][di][e] = 0.f;
  OnlineSoftmax<MT> softmax;
  softmax.init();
  static_assert(!kDropout || (!kDecode && (kAddr == kDense || kAddr == kSequences)),
                "dropout is built into the dense and variable-length prefill kernels");
  DropoutState drop;
  if constexpr (kDropout) drop = dropout_state(p);
  const uint32_t dropout_bh = static_cast<uint32_t>(b * p.heads_q + h);

  // Q_i fragments, loaded once when kQRegs (otherwise re-read per K_j and this stays unused).
  // The general path needs its registers for the mask/soft-cap arithmetic (it spilled with both).
  constexpr bool kQRegs = Tr::kQInRegs && !kGeneral;
  uint32_t qf[kQRegs ? MT : 1][kQRegs ? Tr::kKSteps : 1][4];
  if constexpr (kQRegs) {
    cp_async_wait<Tr::kStages - 1>();  // the Q_i group is the oldest one
    // Q_i's chunks were copied by all threads.
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ks = 0; ks < Tr::kKSteps; ++ks)
        ldmatrix_x4(qf[mi][ks], sQ_addr + 2 * q_off.at(mi * 16, ks));
  }

  for (int n = range.lo; n < range.hi; ++n) {
    const int stage = (n - range.lo) % Tr::kStages;
    cp_async_wait<Tr::kStages - 2>();
    if constexpr (kKvTma) {
      if (n < tma_end) {  // the copy engine's K_j/V_j: each thread waits for the bytes itself
        wait_kv_tma(kv_bar0 + 8 * stage, (tma_phase >> stage) & 1);
        tma_phase ^= 1u << stage;
      }
    }
    // Publishes K_j/V_j (and Q_i on the first pass) copied by other threads, and guarantees
    // every warp is done with the buffer the prefetch below overwrites (block n-1's).
    __syncthreads();
#ifdef FLASHMOD_CTA_TIMELINE
    timeline.landed(n == range.lo, n == range.hi - 1);
#endif
    {
      const int next = n + Tr::kStages - 1;
      if (next < range.hi) load_kv(next, (next - range.lo) % Tr::kStages);
      cp_async_commit();
    }

    // S = Q_i K_j^T
    float S[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mi][ni][e] = 0.f;
    const uint32_t sK_addr = sK_addr0 + stage * kStageBytes;
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        if constexpr (kQRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mi][e] = qf[mi][ks][e];
        } else {
          ldmatrix_x4(a[mi], sQ_addr + 2 * q_off.at(mi * 16, ks));
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sK_addr + 2 * k_off.at(np * 16, ks));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          Mma::run(S[mi][2 * np], a[mi], bk[0], bk[1]);
          Mma::run(S[mi][2 * np + 1], a[mi], bk[2], bk[3]);
        }
      }
    }

    // Scores -> logit units, hiding invisible keys (key split: this warp's keys as a block of
    // their own).
    mask_scores<Elem, kGeneral>(S, p, tf, b, h, r0 + q_row0, row_first, row_last,
                                kKeySplit ? n * Tr::kNWarps + warp : n, kKeysPerWarp, lane, pos_of,
                                tile_needs_mask(mask_classes, n));

    softmax.update(S, O, c);
    // Dropout after the row sums took P: l normalizes the undropped probabilities.
    if constexpr (kDropout) {
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        apply_dropout(
            S[mi], keep_bits_query_rows<NT>(drop, dropout_bh, r0 + q_row0 + mi * 16 + g, n * Bc, t),
            drop.scale);
    }

    // O += P V_j
    const uint32_t sV_addr = sV_addr0 + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kKeysPerWarp / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        pa[mi][0] = Mma::pack(S[mi][2 * kk][0], S[mi][2 * kk][1]);
        pa[mi][1] = Mma::pack(S[mi][2 * kk][2], S[mi][2 * kk][3]);
        pa[mi][2] = Mma::pack(S[mi][2 * kk + 1][0], S[mi][2 * kk + 1][1]);
        pa[mi][3] = Mma::pack(S[mi][2 * kk + 1][2], S[mi][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sV_addr + 2 * v_off.at(kk * 16, dp));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          Mma::run(O[mi][2 * dp], pa[mi], bv[0], bv[1]);
          Mma::run(O[mi][2 * dp + 1], pa[mi], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be pending; retire them before exit
  if constexpr (kKeySplit) {
    static_assert(key_split_merge_bytes<Tr::kNWarps, DT>() <= 4 * Tr::kStages * Tr::kSmemKV,
                  "the merge fits the K/V stages");
    // Every warp is done reading the last K_j / V_j, whose stages now hold the merge. Afterwards
    // warp 0 holds the tile's state; warps 1.. own rows past rows_q (<= 16) and store nothing.
    __syncthreads();
    merge_key_split_warps<Tr::kNWarps, DT>(softmax, O, c, reinterpret_cast<float*>(sK), warp, lane);
  }
#ifdef FLASHMOD_CTA_TIMELINE
  timeline.mark();
#endif

  if constexpr (kDecode) {
    if (splits > 1) {
      // Split-KV partial: this split's normalized O rows (fp32, kHeadDim columns, the padding
      // ones zero) and lse, straight from the accumulator layout. A quad writes 32 contiguous
      // bytes per n8 tile.
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float inv_l, lse;
          softmax.finish(mi, hh, c, inv_l, lse);  // all lanes: it shuffles within the quad
          const int row = warp_row0 + mi * 16 + g + 8 * hh;
          if (row >= rows_q) continue;
          float* dst = sk.o + (part_row0 + row) * D + 2 * t;
#pragma unroll
          for (int di = 0; di < DT; ++di)
            *reinterpret_cast<float2*>(dst + di * 8) =
                make_float2(O[mi][di][2 * hh] * inv_l, O[mi][di][2 * hh + 1] * inv_l);
          if (t == 0) sk.lse[part_row0 + row] = lse;
        }
      finish_split();
      return;
    }
  }

  // Epilogue: O staged in this warp's own rows of sQ, then written out. Every lane of this warp
  // must be done reading its Q rows via ldmatrix before they are overwritten.
  __syncwarp();
  store_out_rows<D, Tr::kRowsPerWarp>(softmax, O, c, sQ, p, flags, gO, gLse, warp_row0, rows_q,
                                      lane);
}

}  // namespace flashmod::cuda_kernels
