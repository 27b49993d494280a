// The streaming decode kernel for Hopper (sm_90a): few query rows against a long K/V, where the
// whole cost is reading K and V once from HBM, so the kernel is built around keeping the copy
// engine busy rather than around the tensor cores.
//
// A CTA owns the (at most 16) query rows of one (batch, head) of the call (after GQA packing:
// every q head of one kv head, decode_heuristics.h) and one split of its keys (split-KV), and
// has 4 warps that work independently: warp w takes key blocks K_j, V_j of Bc = 32 keys with
// j = w, w + 4, w + 8, ... of the split, through a ring of kStages buffers of its own. Each
// lane of the warp copies one key row of K_j and of V_j with a 1-D bulk copy (cp.async.bulk,
// the TMA engine without a tensor map) that completes on the buffer's mbarrier. One copy per
// row is what makes every K/V layout one code path: contiguous caches, cache lengths, pages of
// any size (the row's page looked up per lane) and the fused KV-cache append (rows from
// cache_seqlens on come from k_new / v_new) differ only in the row's source address. Rows land
// at a stride of D * 2 + 16 bytes, so ldmatrix's 8 rows fall on 8 different bank groups without
// a swizzle.
//
// With 4 warps x kStages blocks in flight (192 KB at D = 128) an SM always has enough bytes
// outstanding to pull its share of HBM bandwidth; the compute per block (one m16 tile of
// mma.sync, S = Q K_j^T, the online softmax, O += P V_j) is a few percent of the time its bytes
// take to arrive. At the end the 4 warps' (m, l, O) are merged through shared memory in warp
// order (deterministic), and the CTA writes its rows, or with split-KV its partial, merged by
// the tile's last CTA (split_combine.h) as the mma.sync decode kernel does.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/bulk_copy_ops.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/wgmma_ops.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fwd_epilogue.h"
#include "online_softmax.h"
#include "paged_kv.h"
#include "score_mask.h"
#include "split_combine.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

template <typename Elem_, int kHeadDim_, int kStages_>
struct DecodeSm90Traits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;  // exact: rows are copied whole (head_dim == kHeadDim)
  static constexpr int kWarps = 4;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kRows = 16;  // query rows of a CTA: one m16 tile
  static constexpr int Bc = 32;     // keys per block: one row per lane
  static constexpr int kStages = kStages_;  // blocks in flight per warp
  static constexpr int kRowCopyBytes = kHeadDim * 2;
  static constexpr int kRowBytes = kRowCopyBytes + 16;  // padded row stride in shared memory
  static constexpr int kTileBytes = Bc * kRowBytes;     // one K_j or V_j
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  static constexpr int kQBytes = kRows * kRowBytes;
  static constexpr int kBarBytes = kWarps * kStages * 8;
  static constexpr int kSmemBytes = kRingBytes + kQBytes + kBarBytes;
  static constexpr int kNTiles = Bc / 8;         // n8 tiles of S
  static constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of O
  static constexpr int kKSteps = kHeadDim / 16;  // k16 steps of Q K^T
  // The warps' (m, l, O) are merged in the ring once the keys are done.
  static constexpr int kMergeBytes = kWarps * kRows * (kHeadDim + 2) * 4;

  static_assert(sizeof(Elem) == 2, "tensor-core path is for fp16/bf16");
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "one lane's columns of a row: float4 at most");
  static_assert(kRowBytes % 128 == 16, "ldmatrix rows 8 apart must hit distinct bank groups");
  static_assert(kRowCopyBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static_assert(kMergeBytes <= kRingBytes, "the merge reuses the ring");
  static_assert(kSmemBytes <= 227 * 1024, "sm_90's per-block shared memory");
};

// kBulkRows: each key row arrives by one 1-D bulk copy (the TMA engine); otherwise by D / 8
// 16-byte cp.async chunks per lane (the load/store unit), counted on the same mbarrier through
// cp.async.mbarrier.arrive.noinc.
template <class Tr, bool kBulkRows>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    attention_decode_sm90_kernel(const AttentionParams params, const FwdLaunchFlags flags,
                                 const SplitKvArgs sk) {
#ifdef FLASHMOD_SM90A
  using Elem = typename Tr::Elem;
  using Mma = Mma16816<Elem>;
  constexpr int D = Tr::kHeadDim, Bc = Tr::Bc, kStages = Tr::kStages, kWarps = Tr::kWarps;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles, RB = Tr::kRowBytes;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t ring = smem_addr(smem_raw);
  const uint32_t sQ = ring + Tr::kRingBytes;
  const uint32_t bar0 = sQ + Tr::kQBytes;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int splits = sk.splits;
  const CtaTile tile = cta_tile(params, 1, splits);
  const AttentionParams p = sequence_view(params, tile.b);
  const int Nk = static_cast<int>(p.seqlen_k);
  const int rows_q = static_cast<int>(p.seqlen_q);
  const TilePointers<Elem> gp = tile_pointers<Elem>(p, tile, 0);
  const int64_t rows_all = params.batch * params.heads_q * params.seqlen_q;
  const int64_t part_row0 = tile.split * rows_all + gp.row_id;

  // The fused KV-cache append: keys from new_from on are read from k_new / v_new, never from the
  // cache slots they go to, so split 0 of each kv head's first query head can write those slots
  // while every CTA reads (as in the mma.sync decode kernel).
  const bool new_rows = p.k_new != nullptr;
  const int new_from = new_rows ? Nk - static_cast<int>(p.seqlen_new) : Nk;
  auto append_if_writer = [&]() {
    if (new_rows && tile.split == 0 && tile.h % (params.heads_q / params.heads_kv) == 0)
      append_new_rows<Elem, Tr::kNThreads>(p, tile.hk, tid);
  };

  // Query position of a row: GQA-packed rows fold pos_period positions of several heads.
  const int period = static_cast<int>(p.pos_period);
  auto pos_of = [period](int row) { return period > 0 ? row % period : row; };
  const int pos_last = (period > 0 ? min(period, rows_q) : rows_q) - 1;
  KeyBlockRange range = key_block_range(p, 0, pos_last, Bc);
  {
    const int per = (max(0, range.hi - range.lo) + splits - 1) / splits;
    range.lo += tile.split * per;
    range.hi = min(range.hi, range.lo + per);
  }
  auto finish_split = [&]() {
    finish_split_cta<Elem, D, Tr::kNThreads>(sk, tile.b * params.heads_q + tile.h, rows_all,
                                             gp.row_id, rows_q, gp.out, p.out_row_stride, gp.lse,
                                             static_cast<int>(p.head_dim));
  };
  if (range.lo >= range.hi) {
    append_if_writer();
    if (splits > 1) {
      // This split sees no key: its partial is empty (lse = -inf; the combine skips O).
      for (int r = tid; r < rows_q; r += Tr::kNThreads) sk.lse[part_row0 + r] = -CUDART_INF_F;
      finish_split();
    } else {
      write_rows_without_keys<Tr::kNThreads>(p, gp.out, gp.lse, rows_q, tid);
    }
    return;
  }
  const int key_lo = range.lo * Bc, key_hi = min(range.hi * Bc, Nk);
  const int blocks = range.hi - range.lo;

  // Bulk copies: one arrival (lane 0's, with the bytes to expect); cp.async: one per lane.
  if (tid < kWarps * kStages) mbarrier_init(bar0 + 8 * tid, kBulkRows ? 1 : 32);
  fence_mbarrier_init();
  // The barriers are initialized before any warp issues a copy that completes on them.
  __syncthreads();

  // Block `blk` of the split into this warp's buffer `stage`. Lane l copies key row l of K_j and
  // of V_j; lanes past the keys zero their V row instead (P is 0 there, but 0 * a stale NaN in
  // shared memory would not be). Only the split's last block is partial, and it is the last one
  // its buffer holds, so no copy ever lands on those zeros.
  const Elem* k_head = gp.k;
  const Elem* v_head = gp.v;
  const Elem* kn_head =
      new_rows ? static_cast<const Elem*>(p.k_new) + tile.hk * p.kn_head_stride : nullptr;
  const Elem* vn_head =
      new_rows ? static_cast<const Elem*>(p.v_new) + tile.hk * p.vn_head_stride : nullptr;
  const uint32_t page_size = p.block_table != nullptr ? static_cast<uint32_t>(p.page_size) : 0u;
  auto issue = [&](int blk, int stage) {
    const int slot = warp * kStages + stage;
    const uint32_t bar = bar0 + 8 * slot;
    const uint32_t sk_row = ring + slot * Tr::kStageBytes + lane * RB;
    const uint32_t sv_row = sk_row + Tr::kTileBytes;
    const int j0 = key_lo + blk * Bc;
    const int valid = min(Bc, key_hi - j0);
    if (kBulkRows && lane == 0) mbarrier_arrive_expect_tx(bar, 2 * valid * Tr::kRowCopyBytes);
    const Elem* ks = k_head;  // any address: a zero-byte cp.async reads nothing
    const Elem* vs = v_head;
    if (lane < valid) {
      const int j = j0 + lane;
      if (j >= new_from) {
        ks = kn_head + (j - new_from) * p.kn_row_stride;
        vs = vn_head + (j - new_from) * p.vn_row_stride;
      } else if (page_size != 0) {
        const uint32_t page_idx = static_cast<uint32_t>(j) / page_size;
        const int64_t page = __ldg(p.block_table + page_idx);
        const int64_t in_page = static_cast<uint32_t>(j) - page_idx * page_size;
        ks = k_head + page * p.k_page_stride + in_page * p.k_row_stride;
        vs = v_head + page * p.v_page_stride + in_page * p.v_row_stride;
      } else {
        ks = k_head + static_cast<int64_t>(j) * p.k_row_stride;
        vs = v_head + static_cast<int64_t>(j) * p.v_row_stride;
      }
    }
    if constexpr (kBulkRows) {
      if (lane < valid) {
        bulk_copy_to_shared(sk_row, ks, Tr::kRowCopyBytes, bar);
        bulk_copy_to_shared(sv_row, vs, Tr::kRowCopyBytes, bar);
      } else {
        const uint32_t zero[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int c = 0; c < Tr::kRowCopyBytes / 16; ++c) sts_128(sv_row + 16 * c, zero);
      }
    } else {
      // Coalesced: each instruction copies 32 / (D / 8) whole rows, lane l chunk l % (D / 8) of
      // row l / (D / 8) (one chunk per lane of a row each, as a lane per row was: half-sector
      // requests ran at 0.66 of the copy rate). Row addresses come from the lane that resolved
      // them. Rows past the keys are zero-filled (a zero-byte source).
      constexpr int kChunks = Tr::kRowCopyBytes / 16, kRowsPerCopy = 32 / kChunks;
      const int chunk = lane % kChunks, sub = lane / kChunks;
      const auto k_src = reinterpret_cast<uintptr_t>(ks), v_src = reinterpret_cast<uintptr_t>(vs);
#pragma unroll
      for (int r0 = 0; r0 < Bc; r0 += kRowsPerCopy) {
        const int row = r0 + sub;
        const auto* kr = reinterpret_cast<const Elem*>(__shfl_sync(0xffffffffu, k_src, row));
        const auto* vr = reinterpret_cast<const Elem*>(__shfl_sync(0xffffffffu, v_src, row));
        const int bytes = row < valid ? 16 : 0;
        const uint32_t dst = ring + slot * Tr::kStageBytes + row * RB + chunk * 16;
        cp_async_16(dst, kr + chunk * 8, bytes);
        cp_async_16(dst + Tr::kTileBytes, vr + chunk * 8, bytes);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
    }
  };
  // Blocks w, w + kWarps, ...: this warp's i-th block goes to buffer i % kStages.
#pragma unroll
  for (int i = 0; i < kStages; ++i)
    if (warp + i * kWarps < blocks) issue(warp + i * kWarps, i);
  append_if_writer();

  // Q: rows_q rows (the rest zeros) into the padded tile, while the first blocks are in flight.
  for (int idx = tid; idx < Tr::kRows * (D / 8); idx += Tr::kNThreads) {
    const int row = idx / (D / 8), chunk = idx % (D / 8);
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (row < rows_q) {
      const uint4 x = *reinterpret_cast<const uint4*>(gp.q + row * p.q_row_stride + chunk * 8);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    }
    sts_128(sQ + row * RB + chunk * 16, v);
  }
  // Q's rows were written by all threads (and every lane's zeroed V rows are visible).
  __syncthreads();
  // Per-lane ldmatrix coordinates: lanes 8i..8i+7 address the rows of 8x8 matrix i.
  const int lm_mat = lane >> 3, lm_row = lane & 7;
  uint32_t qf[Tr::kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < Tr::kKSteps; ++ks)
    ldmatrix_x4(qf[ks], sQ + (lm_row + (lm_mat & 1) * 8) * RB + (ks * 16 + (lm_mat >> 1) * 8) * 2);
  const uint32_t k_lane = (lm_row + (lm_mat >> 1) * 8) * RB + (lm_mat & 1) * 16;  // B
  const uint32_t v_lane = (lm_row + (lm_mat & 1) * 8) * RB + (lm_mat >> 1) * 16;  // B^T

  // Accumulator coordinates: rows g and g + 8, columns 2 t (+1) of each n8 tile. Each row's
  // visible keys: its window, cut to the split's keys.
  const int g = lane >> 2, t = lane & 3;
  RowWindow win[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = g + 8 * hh;
    win[hh] = row < rows_q ? row_window(p, pos_of(row)) : RowWindow{1, 0};
    win[hh].lo = max(win[hh].lo, key_lo);
    win[hh].hi = min(win[hh].hi, key_hi - 1);
  }
  const ScoreTransform tf(p);
  const float c = 1.4426950408889634f;  // scores are scaled (and capped) before the softmax

  float O[1][DT][4];
#pragma unroll
  for (int di = 0; di < DT; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) O[0][di][e] = 0.f;
  OnlineSoftmax<1> softmax;
  softmax.init();

  for (int i = 0, blk = warp; blk < blocks; ++i, blk += kWarps) {
    const int stage = i % kStages;
    const uint32_t sK = ring + (warp * kStages + stage) * Tr::kStageBytes;
    const uint32_t sV = sK + Tr::kTileBytes;
    mbarrier_wait(bar0 + 8 * (warp * kStages + stage), (i / kStages) & 1);

    // S = Q K_j^T
    float S[1][NT][4];
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[0][ni][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sK + k_lane + np * 16 * RB + ks * 32);
        Mma::run(S[0][2 * np], qf[ks], bk[0], bk[1]);
        Mma::run(S[0][2 * np + 1], qf[ks], bk[2], bk[3]);
      }

    // Scores, and the keys outside each row's window (or past the split) hidden.
    const int key0 = key_lo + blk * Bc + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = S[0][ni][2 * hh + e] * tf.scale;
          if (tf.softcap > 0.f) x = soft_cap(x, tf.softcap, tf.inv_softcap);
          S[0][ni][2 * hh + e] = win[hh].contains(key0 + ni * 8 + e) ? x : -CUDART_INF_F;
        }
    softmax.update(S, O, c);

    // O += P V_j
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = Mma::pack(S[0][2 * kk][0], S[0][2 * kk][1]);
      pa[1] = Mma::pack(S[0][2 * kk][2], S[0][2 * kk][3]);
      pa[2] = Mma::pack(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
      pa[3] = Mma::pack(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sV + v_lane + kk * 16 * RB + dp * 32);
        Mma::run(O[0][2 * dp], pa, bv[0], bv[1]);
        Mma::run(O[0][2 * dp + 1], pa, bv[2], bv[3]);
      }
    }
    // Every lane's reads of this buffer are done before the copy engine refills it.
    __syncwarp();
    const int next = blk + kStages * kWarps;
    if (next < blocks) {
      if constexpr (kBulkRows) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      issue(next, stage);
    }
  }

  // Merge the warps' rows: warp w's m (x units), quad-summed l and O go to the ring (every warp
  // has consumed all of its copies, so nothing lands there any more).
  float* merge_o = reinterpret_cast<float*>(smem_raw);  // [warp][row][D]
  float* merge_m = merge_o + kWarps * Tr::kRows * D;    // [warp][row]
  float* merge_l = merge_m + kWarps * Tr::kRows;        // [warp][row]
  // All warps are past their last ldmatrix of the ring.
  __syncthreads();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = g + 8 * hh;
    const float l = quad_sum(softmax.l[0][hh]);
    if (t == 0) {
      merge_m[warp * Tr::kRows + row] = softmax.m[0][hh];
      merge_l[warp * Tr::kRows + row] = l;
    }
    float* o_row = merge_o + (warp * Tr::kRows + row) * D + 2 * t;
#pragma unroll
    for (int di = 0; di < DT; ++di)
      *reinterpret_cast<float2*>(o_row + di * 8) = make_float2(O[0][di][2 * hh], O[0][di][2 * hh + 1]);
  }
  // Every warp's rows are in shared memory before any warp merges them.
  __syncthreads();
  constexpr int kCols = D / 32;  // columns per lane
  for (int row = warp; row < rows_q; row += kWarps) {
    float m = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_m[w * Tr::kRows + row]);
    // Warp w's p's were exp2(c x - c m_w); rescaled to the row's max they weigh exp2(c m_w - c m).
    const float cm = m == -CUDART_INF_F ? 0.f : c * m;
    float l = 0.f, acc[kCols] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float alpha = exp2f(c * merge_m[w * Tr::kRows + row] - cm);
      l = fmaf(merge_l[w * Tr::kRows + row], alpha, l);
      const float* o_row = merge_o + (w * Tr::kRows + row) * D + kCols * lane;
#pragma unroll
      for (int e = 0; e < kCols; ++e) acc[e] = fmaf(o_row[e], alpha, acc[e]);
    }
    // A row that saw no key gets 0 and -inf; a NaN score leaves l NaN, so out and lse NaN.
    const bool empty = l == 0.f;
    const float inv_l = empty ? 0.f : 1.f / l;
    const float lse = empty ? -CUDART_INF_F
                            : static_cast<float>(log(static_cast<double>(l)) +
                                                 static_cast<double>(cm) * 0.6931471805599453);
    if (splits > 1) {
      float* dst = sk.o + (part_row0 + row) * D + kCols * lane;
#pragma unroll
      for (int e = 0; e < kCols; ++e) dst[e] = acc[e] * inv_l;
      if (lane == 0) sk.lse[part_row0 + row] = lse;
    } else {
      Elem* dst = gp.out + row * p.out_row_stride + kCols * lane;
#pragma unroll
      for (int e = 0; e < kCols; ++e) dst[e] = from_float<Elem>(acc[e] * inv_l);
      if (lane == 0) gp.lse[row] = lse;
    }
  }
  if (splits > 1) finish_split();
  (void)flags;
#endif  // FLASHMOD_SM90A
}

}  // namespace flashmod::cuda_kernels
