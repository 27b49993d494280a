// The Hopper (sm_90a) backward: the portable kernels' algorithm (bwd_sm80_kernel.h: row
// statistics, a dK/dV kernel per key block, a dQ kernel per query block, no atomics) with every
// matmul on wgmma. A warpgroup owns 64 rows (keys in the dK/dV kernel, queries in the dQ kernel);
// the score products read both operands from 128-byte-swizzled shared memory (K-major), and the
// products that accumulate gradients take P^T / dS^T / dS from registers, packed straight from
// the score accumulators, with the other operand read transposed (MN-major) from the same tiles.
// The accumulator layout is the mma.sync one, so the per-element score transform and gradient
// (bwd_common.h) are shared with the portable kernels. One variant of the dK/dV kernel
// (kBwdFusedDQ, D = 128) also takes each step's dQ partial and has the copy engine add it into
// fp32 sums: five matmuls per block pair instead of seven, but not bitwise reproducible.
// The streamed tiles (Q_i, dO_i and their row statistics in the dK/dV kernel, K_j and V_j in the dQ
// kernel) come through the copy engine in that variant and in the plain dense ones (kTmaLoads:
// tensor maps, one thread issuing, a "full" mbarrier per stage), through every thread's cp.async
// in the others. Each thread's ten or more 16-byte copies a step waited on the load unit before
// they released their registers (Nsight Compute: 6 % of the fused variant's stall samples at the
// first instruction after them); the copy engine's loads were 5-19 % faster forward + backward
// (H100; benchmarks/results/design/cuda-backward.md, session 30).
#pragma once

#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../../common/cuda/bulk_copy_ops.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/sw128_tile_copy.h"
#include "../../common/cuda/tma_ops.h"
#include "../../common/cuda/wgmma_ops.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "bwd_common.h"
#include "dropout.h"
#include "entry_points.h"
#include "visibility.h"

namespace flashmod::cuda_kernels::sm90 {

// The tensor maps of a kernel's per-step loads through the copy engine (tma_ops.h:
// encode_rows_tensor_map, boxes of a step's rows x 64 columns): the dK/dV kernel's q and
// grad_out as (batch, heads_q, seqlen_q, head_dim), the dQ kernel's k and v as (batch, heads_kv,
// seqlen_k, head_dim). Variants that copy with cp.async get an unused value.
struct BwdStepMaps {
  CUtensorMap first, second;
};

#ifdef FLASHMOD_SM90A
// A step's two tiles of kRows rows (D / 64 boxes of 64 columns each, kRows * 128 bytes apart)
// from maps.first into dst_first and from maps.second into dst_second, completing on bar; by one
// thread. Rows past the map's row count arrive as zeros.
template <int D, int kRows>
__device__ __forceinline__ void tma_load_step_tiles(uint32_t dst_first, uint32_t dst_second,
                                                    const BwdStepMaps& maps, int row0, int head,
                                                    int batch, uint32_t bar) {
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb) {
    tma_load_4d(dst_first + cb * kRows * 128, &maps.first, cb * 64, row0, head, batch, bar);
    tma_load_4d(dst_second + cb * kRows * 128, &maps.second, cb * 64, row0, head, batch, bar);
  }
}

// Zeroes rows [first, kRows) of a swizzled tile of kRows rows x D columns: in each 64-column
// block one run of bytes, since a 128-byte swizzle permutes 16-byte chunks within a row only.
template <int D, int kRows, int kThreads>
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int first, int tid) {
  const int chunks = (kRows - first) * 8;  // 16-byte chunks per 64-column block
  const uint32_t zeros[4] = {0, 0, 0, 0};
  for (int i = tid; i < D / 64 * chunks; i += kThreads)
    sts_128(tile + (i / chunks) * kRows * 128 + first * 128 + (i % chunks) * 16, zeros);
}

// keep_bits_key_rows (dropout.h) with each Philox call shared by the two warps of a 32-key span
// (warps 2 w and 2 w + 1 of a warpgroup: its keys 0-15 and 16-31). A call's eight draws are four
// keys of each warp (words 0-1 and 2-3), and the lane (g, t) of either warp needs the same calls,
// so each warp makes those of half the n8 tiles (the first warp the first half) and hands the other
// warp's four draws per call to its lane (g, t) through shared memory: a word of that lane's own
// keys and a word of its pair lane's (g ^ 1), at exchange (this thread's two words, in the step's
// buffer) and read from sibling_exchange (the other warp's lane's). Two buffers, alternating by
// step, need one barrier per step: a warp writes a buffer again only past the next step's barrier,
// which the other warp reaches after its read. Every lane of both warps calls it each step. (The
// dK/dV kernel then makes NT / 2 calls per step and lane, the dQ kernel's rate per element.)
template <int NT>
__device__ __forceinline__ uint32_t keep_bits_key_rows_paired(const DropoutState& d, uint32_t bh,
                                                              uint32_t key_g, uint32_t row0, int t,
                                                              uint32_t exchange,
                                                              uint32_t sibling_exchange,
                                                              uint32_t barrier_id) {
  static_assert(NT % 2 == 0 && 4 * NT <= 32, "halves of whole n8 tiles, one 32-bit mask");
  const uint32_t span = key_g / 32, key_t = (key_g % 8) / 2;
  const int upper = static_cast<int>((key_g % 32) / 16);  // this warp's keys: words 2, 3 of a call
  const int parity = static_cast<int>(key_g % 2);
  // Bits of queries e % 2 == parity: this lane's keys, its pair lane's, and the same two for the
  // other warp's lane (g, t).
  uint32_t mine = 0, partners = 0, sibling_mine = 0, sibling_partners = 0;
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) {
    const int ni = upper * (NT / 2) + i;
    const PhiloxWords w = dropout_draws(d, bh, row0 + 8 * ni + 2 * t + parity, span, key_t);
    const uint32_t own0 = upper ? w.z : w.x, own1 = upper ? w.w : w.y;
    const uint32_t other0 = upper ? w.x : w.z, other1 = upper ? w.y : w.w;
    const int bit = 4 * ni + parity;
    mine |= (static_cast<uint32_t>(kept(d, own0, parity)) << bit) |
            (static_cast<uint32_t>(kept(d, own1, parity)) << (bit + 2));
    partners |= (static_cast<uint32_t>(kept(d, own0, parity ^ 1)) << bit) |
                (static_cast<uint32_t>(kept(d, own1, parity ^ 1)) << (bit + 2));
    sibling_mine |= (static_cast<uint32_t>(kept(d, other0, parity)) << bit) |
                    (static_cast<uint32_t>(kept(d, other1, parity)) << (bit + 2));
    sibling_partners |= (static_cast<uint32_t>(kept(d, other0, parity ^ 1)) << bit) |
                        (static_cast<uint32_t>(kept(d, other1, parity ^ 1)) << (bit + 2));
  }
  sts_32(exchange, sibling_mine);
  sts_32(exchange + 4, sibling_partners);
  named_barrier(barrier_id, 64);  // both warps' words of this step are written
  mine |= lds_32(sibling_exchange);
  partners |= lds_32(sibling_exchange + 4);
  // The pair lane made the calls of the queries of the other parity, for this lane's keys too.
  return mine | __shfl_xor_sync(0xffffffffu, partners, 4);
}
#endif  // FLASHMOD_SM90A

// Shared-memory stages of the tiles a kernel streams (Q_i/dO_i in dK/dV, K_j/V_j in dQ), and how
// far ahead cp.async runs. kOverlap: a step's gradient wgmma (dV/dK += ..., dQ += ...) is left in
// flight while the next step waits for its tiles, passes the barrier and issues its score wgmma;
// it is waited for after those (in the fused dQ variant, with the next step's dQ product, which
// comes before the score products). Its operand tiles are then still being read one step later,
// so the prefetch runs one stage less ahead than the stages allow.
template <int kStages_, bool kOverlap_>
struct BwdStagesSm90 {
  static constexpr int kStages = kStages_;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr int kAhead = kOverlap ? kStages - 2 : kStages - 1;  // steps prefetched
  static_assert(kAhead >= 1, "at least one step in flight: 2 stages, 3 with kOverlap");
};

// dK/dV: Bc = 64 key rows per warpgroup; each step takes Br query rows (wgmma's N of S^T).
// kPair: two warpgroups over the same 64 keys (kBwdPair: one accumulates dV, the other dK).
template <typename Elem_, int kHeadDim_, int kWarpgroups, int kBr, int kMinBlocks_ = 1,
          int kStages_ = 2, bool kOverlap_ = false, bool kPair = false>
struct BwdKVTraitsSm90 : BwdStagesSm90<kStages_, kOverlap_> {
  using Elem = Elem_;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the registers must allow
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int Bc = kPair ? 64 : 64 * kWarpgroups;
  static constexpr int Br = kBr;
  static constexpr int kNThreads = 128 * (kPair ? 2 : kWarpgroups);
  static constexpr int kNTiles = Br / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kOChunk = wgmma_column_chunk(kHeadDim);
  static constexpr int kSmemKV = Bc * kHeadDim * 2;  // bytes of K_j or V_j
  static constexpr int kSmemQ = Br * kHeadDim * 2;   // bytes of one Q_i or dO_i
  // K_j, V_j; kStages stages of Q_i, dO_i and their rows' lse2/delta; +1024 to align the base to
  // the swizzle atom.
  static constexpr int kSmemBytes = 2 * kSmemKV + kStages_ * (2 * kSmemQ + 2 * Br * 4) + 1024;
  static_assert(sizeof(Elem) == 2, "wgmma path is for fp16/bf16");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "whole 64-column blocks");
  static_assert(Br == 64 || Br == 128, "wgmma N of S^T");
  static_assert(Br <= kBwdRowPad, "the row statistics are padded to whole steps");
  static_assert(kSmemBytes <= 227 * 1024, "sm_90's per-block shared-memory limit");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024, "kMinBlocks CTAs fit an SM");
};

// dQ: Br = 64 query rows per warpgroup, key blocks of Bc (wgmma's N of S).
template <typename Elem_, int kHeadDim_, int kWarpgroups, int kBc, int kMinBlocks_ = 1,
          int kStages_ = 2, bool kOverlap_ = false>
struct BwdQTraitsSm90 : BwdStagesSm90<kStages_, kOverlap_> {
  using Elem = Elem_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int Br = 64 * kWarpgroups;
  static constexpr int Bc = kBc;
  static constexpr int kNThreads = 128 * kWarpgroups;
  static constexpr int kNTiles = Bc / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kOChunk = wgmma_column_chunk(kHeadDim);
  static constexpr int kSmemQ = Br * kHeadDim * 2;
  static constexpr int kSmemKV = Bc * kHeadDim * 2;
  // Q_i, dO_i; kStages stages of K_j, V_j.
  static constexpr int kSmemBytes = 2 * kSmemQ + kStages_ * 2 * kSmemKV + 1024;
  static_assert(sizeof(Elem) == 2, "wgmma path is for fp16/bf16");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "whole 64-column blocks");
  static_assert(Bc == 64 || Bc == 128, "wgmma N of S");
  static_assert(kSmemBytes <= 227 * 1024, "sm_90's per-block shared-memory limit");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024, "kMinBlocks CTAs fit an SM");
};

// The fused variant's dQ sums (BwdRowStats::dq_accum): tile (head bh, 64-row block m, 64-column
// block c of col_blocks) of 64 x 64 floats, each in the accumulator's fragment order: warp w4 of
// the warpgroup, n8 tile ni, lane, element e (rows g / g + 8, columns 2t / 2t + 1) at
// (w4 * 8 + ni) * 128 + lane * 4 + e, so that a warp's 16-byte shared-memory stores of its
// fragments are contiguous (no bank conflicts) and the copy engine adds each warp's rows as one
// 4 KB range. A warpgroup's dQ partial of a step is one such tile: D = 128 steps of 64 queries,
// each warpgroup one column block; D = 64 steps of 128 queries, each warpgroup one row block.
constexpr int kDQTileFloats = 64 * 64;
__host__ __device__ __forceinline__ int64_t dq_tile_offset(int64_t bh, int64_t row_blocks,
                                                           int64_t m, int c, int col_blocks) {
  return ((bh * row_blocks + m) * col_blocks + c) * kDQTileFloats;
}

// d = A B, the first k16 step of a score product. With kOverlap the previous step's gradient wgmma
// is in flight: d is then an output only (ss_overwrite), so no ordinary instruction has to define
// its registers meanwhile. Without, the read-write form: ss_overwrite costs the D = 64 kv128
// tile 152 bytes of spill.
template <typename Elem, int N, bool kOverlap>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[N / 8][4], uint64_t desc_a,
                                               uint64_t desc_b) {
#ifdef FLASHMOD_SM90A
  if constexpr (kOverlap) {
    Wgmma<Elem, N>::ss_overwrite(d, desc_a, desc_b);
  } else {
    Wgmma<Elem, N>::ss(d, desc_a, desc_b, 0);
  }
#endif
}

// Byte offset of k16 step ks in a K-major swizzled tile of `rows` rows: 64-column blocks are
// rows * 128 bytes apart, and a k16 step is 32 bytes into its block.
__device__ __forceinline__ uint32_t k_step(int ks, int rows) {
  return static_cast<uint32_t>((ks / 4) * rows * 128 + (ks % 4) * 32);
}

// acc (64 rows x D per warpgroup) (+)= A B with A from registers (a[k16 slice]) and B the
// MN-major (k rows x D) tile at desc: k16 slice kk is 16 rows (2048 bytes) down, column chunk oc
// of kOChunk columns starts kOChunk / 64 column blocks of tile_rows * 128 bytes to the right.
// first: the first product into acc, which overwrites it. With the gradient product in flight
// across the loop's back edge (kOverlap) the accumulators must not be zeroed by ordinary
// instructions: that definition reaching the loop head makes ptxas serialize every wgmma (C7515).
// Without kOverlap they are zeroed ahead of the loop: fewer registers (the D = 64 kv128 tile
// spills 148 bytes with the predicate).
template <typename Elem, int kHeadDim, int kOChunk, int kKSlices>
__device__ __forceinline__ void wgmma_rs_tile(float (&acc)[kHeadDim / 8][4],
                                              const uint32_t (&a)[kKSlices][4], uint64_t desc,
                                              int tile_rows, bool first) {
#ifdef FLASHMOD_SM90A
#pragma unroll
  for (int kk = 0; kk < kKSlices; ++kk)
#pragma unroll
    for (int oc = 0; oc < kHeadDim / kOChunk; ++oc) {
      auto& chunk = *reinterpret_cast<float (*)[kOChunk / 8][4]>(&acc[oc * kOChunk / 8]);
      Wgmma<Elem, kOChunk>::rs_accumulate(
          chunk, a[kk], desc_advance(desc, kk * 2048 + (oc * kOChunk / 64) * tile_rows * 128),
          !(first && kk == 0));
    }
#endif
}

// Whether a dK/dV variant stages a bwd_stages_mask mask's tiles in shared memory: general ones
// that mask tensors reach, with one step of prefetch (the tile is waited for with the step's other
// copies), at D = 128 and in the kBwdFastAdditive variants (D = 256's pair: both warpgroups read
// the one tile, and the variant stages every step, entry_points.h). At D = 128 batched
// global loads (the dQ kernel's path for unstageable masks) spilled 40-56 bytes in this kernel
// (255 registers); in the default D = 64 tile staging spills too (its mask variant 0 -> 64 bytes
// under the 3-CTA cap).
template <class Tr, bool kGeneral, int kWhich, bool kExtents, int kFast>
constexpr bool dkdv_stages_mask() {
  constexpr bool staged = kGeneral && !kExtents && kFast != kBwdFastSoftcap && Tr::kAhead == 1 &&
                          (kWhich != kBwdPair || Tr::kHeadDim == 256) &&
                          (Tr::kHeadDim == 128 || kFast == kBwdFastAdditive);
  static_assert(
      !staged || Tr::kMinBlocks * (Tr::kSmemBytes + Tr::Br * Tr::Bc * 2 + 1024) <= 228 * 1024,
      "the staged mask tile keeps kMinBlocks CTAs per SM");
  return staged;
}

// Whether a dQ variant takes bwd_common.h's additive paths (bwd_additive_fast: staged tiles, else
// batched loads): general ones that mask tensors reach (not variable-length or mask-free soft-cap
// variants), at D = 128 and in the kBwdFastAdditive variants. The batched loads spill in the
// default D = 64 tile (its 128-register cap: 36-44 bytes) and at D = 256 (dK/dV +120-250 bytes),
// also in the mask variant that transformers' causal + padding masks take; D = 256's variant
// stages only (its host takes it for bwd_stages_mask masks alone).
template <bool kGeneral, bool kExtents, int kFast, int kHeadDim>
constexpr bool additive_fast_variant() {
  return kGeneral && !kExtents && kFast != kBwdFastSoftcap &&
         (kHeadDim == 128 || kFast == kBwdFastAdditive);
}

// kWhich (bwd_common.h): dK and dV together, or, where the two D-wide accumulators do not fit one
// warpgroup's registers (D = 256), one of them per launch or one per warpgroup of the CTA.
// kExtents (both kernels): a variable-length call, as in the portable kernels
// (bwd_sm80_kernel.h): the grid comes from the upper bounds in params, each CTA works on
// sequence_view_bwd(params, b), and one whose block lies past its sequence's end exits. In the
// fused dQ variant packed rows only (bwd_fused_dq_packed), their sums laid out by sequence
// (entry_points.h: dq_packed_row_blocks).
// kFast (both kernels, a general variant; bwd_common.h: BwdFastPath): kBwdFastMask, mask tensors
// skip the blocks they hide at either end of a walk and run the blocks they show whole, adding
// nothing, through the plain elementwise code (key-padding masks by vote_key_mask, others by
// their tile classes); kBwdFastSoftcap, soft-capped scores without a mask
// tensor take capped_prob in blocks the window shows whole. Variants of their own: in the general
// variant that the other soft caps and masks take, the plain code beside the general one spilled
// (D = 128 dK/dV: 20 bytes; soft-capped fwd+bwd 3-4 % slower).
// kTmaLoads: the step loads of kBwdFusedDQ's (Q_i, dO_i and their row statistics through the
// copy engine, maps as BwdStepMaps) in a plain dense variant.
// kDropout (both kernels): dropout on P (dropout.h), as in the portable kernels; dense and
// variable-length calls (a sequence view keeps the call's row index b, by which the draws number
// rows), plain or general scores in the seven-matmul kernels, plain ones in the fused dQ variant
// (its dS^T already holds the dropped dP, so dQ needs no draws of its own).
// kDeferFences (kBwdFusedDQ): each proxy fence after the work that follows its tile's stores, not
// right behind them (a fence waits for the thread's shared-memory stores to land: Nsight Compute
// had 6.8 % + 2.3 % of the D = 128 kernel's per-step stall samples there, session 48). The dS^T
// tile's fence comes after the step's gradient wait, the dQ tile's (and its add) after the next
// step's score products are issued. Launched at D = 64 only (bwd_sm90_launch.h has the numbers).
template <class Tr, bool kGeneral, int kWhich, bool kExtents, int kFast, bool kTmaLoads = false,
          bool kDropout = false, bool kDeferFences = false>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    attention_bwd_dkdv_sm90_kernel(const AttentionBwdParams params, const BwdRowStats st,
                                   const __grid_constant__ BwdStepMaps maps) {
#ifdef FLASHMOD_SM90A
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles;
  static_assert((kWhich == kBwdPair) == (kThreads == 256 && Bc == 64),
                "kBwdPair: two warpgroups over the same 64 keys");
  static_assert(kFast == kBwdFastNone || (kGeneral && !kExtents), "fast paths: general, dense");
  // D = 256's additive variant runs only where bwd_stages_mask holds (bwd_additive_staged_only,
  // the host's choice): every step reads the staged tile (no per-score global path, no plain steps
  // beside it: both spill there), and the walk still drops the hidden tiles at its ends (once,
  // before it).
  constexpr bool kStagedOnly = kFast == kBwdFastAdditive && bwd_additive_staged_only(Tr::kHeadDim);
  constexpr bool kMask = (kFast == kBwdFastMask || kFast == kBwdFastAdditive) && !kStagedOnly;
  constexpr bool kSoftcapFast = kFast == kBwdFastSoftcap;
  constexpr bool kStageMask = dkdv_stages_mask<Tr, kGeneral, kWhich, kExtents, kFast>();
  using MaskTile = StagedMaskTile<Elem, Br, Bc, kThreads>;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t sK_addr = (raw_addr + 1023) & ~1023u;
  const uint32_t sV_addr = sK_addr + Tr::kSmemKV;
  constexpr int kStages = Tr::kStages, kAhead = Tr::kAhead;
  const uint32_t sQ_addr0 = sV_addr + Tr::kSmemKV;             // kStages stages
  const uint32_t sdO_addr0 = sQ_addr0 + kStages * Tr::kSmemQ;  // kStages stages
  // kBwdFusedDQ: two steps' dS^T, Bc key rows x Br queries each (128-byte rows, swizzled), the A
  // operand of dQ_i += dS_i K_j read MN-major (step s writes one while step s - 1's dQ product
  // reads the other); then a dQ tile per warpgroup (dq_tile_offset's layout) that the copy engine
  // adds into the sums while the next step runs. Every swizzled tile sits at a multiple of 1 KB
  // from sK; the row statistics and the barriers come after them (the 512-byte gap that aligning
  // sdS behind the statistics cost would not fit 227 KB).
  constexpr bool kFusedDQ = kWhich == kBwdFusedDQ;
  constexpr uint32_t kSdSBytes = Bc * Br * 2;
  const uint32_t sdS_addr = sdO_addr0 + kStages * Tr::kSmemQ;
  const uint32_t sdQ_addr = sdS_addr + 2 * kSdSBytes;
  const uint32_t stats_addr = kFusedDQ ? sdQ_addr + 2 * kDQTileFloats * 4 : sdS_addr;
  float* sL = reinterpret_cast<float*>(smem_raw + (stats_addr - raw_addr));
  float* sDelta = sL + kStages * Br;
  // kStageMask: one Br x Bc mask tile, the step's (staged_mask.h), refilled for the next step once
  // every warp has read it (a second stage would not fit two CTAs per SM at D = 128).
  const uint32_t sMask_addr = smem_addr(sDelta + kStages * Br);
  // kBwdFusedDQ and kTmaLoads: each Q_i / dO_i stage's "full" mbarrier (its copies' bytes), after
  // the row statistics, where a staged mask tile would be.
  constexpr bool kTmaSteps = kFusedDQ || kTmaLoads;
  static_assert(!kTmaLoads || (!kExtents && !kStageMask && !Tr::kOverlap),
                "dense rows, no staged mask, the plain pipeline");
  static_assert(!kDropout || (kFast == kBwdFastNone && (!kFusedDQ || !kGeneral)),
                "dropout: no fast path; plain scores in the fused dQ variant");
  const uint32_t full_bar0 = sMask_addr;
  // kDropout: the keep bits' exchange between the warps of a 32-key span (two buffers of two words
  // per thread; keep_bits_key_rows_paired), past the staged mask tile or the stages' mbarriers;
  // in the fused dQ variant, whose tiles leave no 4 KB free, inside the step's dS^T tile (below).
  const uint32_t exchange_addr =
      sMask_addr + (kStageMask ? Br * Bc * 2 : 0) + (kTmaSteps ? 8 * kStages : 0);
  const auto staged_tile = [&] {
    if constexpr (kStageMask) {
      return MaskTile{sMask_addr, 0};
    } else {
      return GlobalMaskValues{};
    }
  }();

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warpgroup = warp / 4;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(params.head_dim);
  const BwdKeyTile tile = bwd_key_tile(params, static_cast<int>((params.seqlen_k + Bc - 1) / Bc));
  const int n_block = tile.n_block;
  const int64_t hk = tile.hk, b = tile.b;
  const int64_t group = params.heads_q / params.heads_kv;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  BwdKeyBlock<Elem> kb = bwd_key_block<Elem, Br, Bc, kGeneral, kMask>(p, tile);
  if constexpr (kStagedOnly) {
    if (bwd_mask_tiles(p)) kb.walk = bwd_shown_steps<Br, Bc>(p, tile, kb.walk, group);
  }
  if (kExtents && kb.rows_k <= 0) return;  // past this sequence's keys: no rows of it to write
  // kBwdFusedDQ with packed rows (bwd_fused_dq_packed): the maps span all of q and grad_out, so
  // the sequence's first row is the step loads' row origin, and its first block of the sums.
  int64_t q_start = 0;
  if constexpr (kExtents && kFusedDQ) q_start = params.cu_seqlens_q[b];
  const int k0 = kb.k0, rows_k = kb.rows_k;
  const int m_lo = kb.walk.m_lo, m_count = kb.walk.m_count, steps = kb.walk.steps;
  const BwdKeyRows<Elem> gkv = kb.kv;
  const Sw128TileCopy<Bc, D, kThreads> kv_copy(tid, head_dim);
  const Sw128TileCopy<Br, D, kThreads> q_copy(tid, head_dim);

  // Step s = (head of the group, query block), head-major as in the portable kernel.
  // Steps are walked with a (head, block) cursor rather than divided out of s: at D = 64 the
  // per-step integer work is a large share of the step's instructions.
  struct StepCursor {
    int head, block;  // head of the group, query block from m_lo
    __device__ __forceinline__ void next(int m_count) {
      if (++block == m_count) block = 0, ++head;
    }
  };
  auto load_step = [&](StepCursor c, int stage) {
    const int64_t h = hk * group + c.head;
    const int64_t r0 = static_cast<int64_t>(m_lo + c.block) * Br;
    if constexpr (kTmaSteps) {
      // One thread: rows past seqlen_q arrive as zeros (the maps bound each head's rows), as the
      // cp.async path's zero fill leaves them.
      if (tid == 0) {
        const uint32_t bar = full_bar0 + 8 * stage;
        mbarrier_arrive_expect_tx(bar, 2 * Tr::kSmemQ + 2 * Br * 4);
        tma_load_step_tiles<D, Br>(sQ_addr0 + stage * Tr::kSmemQ, sdO_addr0 + stage * Tr::kSmemQ,
                                   maps, static_cast<int>(q_start + r0), static_cast<int>(h),
                                   kExtents ? 0 : static_cast<int>(b), bar);
        const int64_t stat = (b * p.heads_q + h) * st.rows_padded + r0;
        // Not marked to leave L2: every key block of the head reads them.
        bulk_copy_to_shared<false>(smem_addr(sL + stage * Br), st.lse2 + stat, Br * 4, bar);
        bulk_copy_to_shared<false>(smem_addr(sDelta + stage * Br), st.delta + stat, Br * 4, bar);
      }
      return;
    }
    const int valid = p.seqlen_q - r0 < Br ? static_cast<int>(p.seqlen_q - r0) : Br;
    const BwdQueryRows<Elem> rows = query_rows<Elem>(p, b, h, r0);
    q_copy.load(sQ_addr0 + stage * Tr::kSmemQ, rows.q, p.q_row_stride, valid);
    q_copy.load(sdO_addr0 + stage * Tr::kSmemQ, rows.grad_out, p.grad_out_row_stride, valid);
    load_row_stats<Br>(sL, sDelta, stage, p, st, b, h, r0, tid);
  };

  if constexpr (kTmaSteps) {
    if (tid == 0) init_stage_barriers(full_bar0, kStages, 1);
    // Packed rows: every warp past the inits before any use of the barriers. (Without it,
    // compute-sanitizer's racecheck saw warp 0's inits race its first arrival in the CTAs that
    // zero rows; one barrier per CTA.)
    if constexpr (kExtents) __syncthreads();
  }
  // One cp.async group per step (the first also holds K_j, V_j), committed even when empty so
  // that a step's group is always kAhead - 1 groups behind the newest.
  kv_copy.load(sK_addr, gkv.k, p.k_row_stride, rows_k);
  kv_copy.load(sV_addr, gkv.v, p.v_row_stride, rows_k);
#pragma unroll
  for (int a = 0; a < kAhead; ++a) {
    if (a < steps) load_step({a / m_count, a % m_count}, a);
    cp_async_commit();
  }
  const bool stage_mask = kStageMask && (kStagedOnly || bwd_stages_mask(params, st));
  if constexpr (kStageMask) {
    if (stage_mask && steps > 0)
      MaskTile::load(sMask_addr, p, b, hk * group, static_cast<int64_t>(m_lo) * Br, n_block, tid);
    cp_async_commit();  // step 0 waits for every group (kAhead 1)
  }

  // A: this warpgroup's 64 rows of K_j / V_j (K-major). B of the score products: Q_i / dO_i
  // (K-major). B of the gradient products: the same Q_i / dO_i tiles read MN-major.
  const int row_block = kWhich == kBwdPair ? 0 : warpgroup;  // this warpgroup's 64 keys
  const uint64_t k_desc = sw128_desc(sK_addr + row_block * 64 * 128, 16, 1024);
  const uint64_t v_desc = sw128_desc(sV_addr + row_block * 64 * 128, 16, 1024);
  const uint64_t q_desc0 = sw128_desc(sQ_addr0, 16, 1024);
  const uint64_t do_desc0 = sw128_desc(sdO_addr0, 16, 1024);
  const uint64_t q_mn_desc0 = sw128_desc(sQ_addr0, Br * 128, 1024);
  const uint64_t do_mn_desc0 = sw128_desc(sdO_addr0, Br * 128, 1024);

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  const int warp_row0 = row_block * 64 + (warp % 4) * 16;  // the warp's 16 key rows
  const int key_row[2] = {k0 + warp_row0 + g, k0 + warp_row0 + g + 8};
  // keep_bits_key_rows' layout: key_row[0] % 32 is below 8 or in [16, 24), as warp_row0 is a
  // multiple of 16 and k0 one of Bc.
  // A 32-bit keep mask per 64 queries of a step: the fused dQ variant's 128-query steps (D = 64)
  // take two, each with its own exchange and barrier.
  constexpr int kKeepWords = NT > 8 ? NT / 8 : 1;
  static_assert(!kDropout || ((NT <= 8 || (kFusedDQ && NT == 16)) && Bc % 32 == 0),
                "one 32-bit keep mask per 64 queries of a step");
  DropoutState drop;
  if constexpr (kDropout) drop = dropout_state(p);

  // The step loop for one gradient set (a warpgroup's accumulators): kBwdPair runs it for dV on
  // warpgroup 0 and for dK on warpgroup 1, both over the same tiles and barriers.
  auto mainloop = [&](auto which) {
    constexpr int kW = decltype(which)::value;
    constexpr bool kDV = kW != kBwdOnlyDK, kDK = kW != kBwdOnlyDV, kDQ = kW == kBwdFusedDQ;
    // kBwdPair's warpgroups run two instantiations of this loop, so they meet at two different
    // barrier instructions: the unaligned form, which allows that.
    auto sync_cta = [] {
      if constexpr (kWhich == kBwdPair) {
        cta_barrier_unaligned();
      } else {
        __syncthreads();
      }
    };
    static_assert(!kDQ || (kThreads == 256 && Br * D == 64 * 128 && !kStageMask),
                  "fused dQ: two warpgroups, each adding a 64 x 64 tile of the step's dQ_i: 64 of "
                  "the 128 columns of a 64-row step, or 64 of the 128 rows of a 64-column one");
    static_assert(!kDQ || !Tr::kOverlap || (!kDeferFences && !kDropout && !kExtents),
                  "fused dQ with the gradient products in flight: the plain dense variant");
    float dV[kDV ? DT : 1][4], dK[kDK ? DT : 1][4];
    if constexpr (!Tr::kOverlap) {  // kOverlap: written first by step 0's products
      zero(dV);
      zero(dK);
    }
    // P^T / dS^T packed for the gradient products; with kOverlap they stay live (read by the wgmma
    // in flight) until the next step's wait.
    uint32_t pa[kDV ? Br / 16 : 1][4], da[kDK ? Br / 16 : 1][4];

    // kDQ: step s's dQ product runs at step s + 1, after the loop-top barrier that already has
    // both warpgroups' dS^T rows written, so the step needs no barrier of its own; the product
    // and its adds come before that step's score products, while its tiles land. (Issued within
    // the step behind a second CTA barrier, 15 % of the kernel's stall samples sat at that
    // barrier: H100, N = 4k, design log, session 31; queued behind the score products instead,
    // it spilled and ran 1-4 % slower.)
    // This warpgroup's 64 of dQ_i's columns, used by dq_product_and_stage alone. (Declared here:
    // inside it, ptxas orders the measured kernel's machine code differently.)
    float dQ[kDQ ? 8 : 1][4];
    int64_t dq_h = 0;  // the head and query block of the dS^T tile the next product reads
    int dq_m = 0;
    // The dQ product of the dS^T tile `tile` (D = 128: dQ_i[:, 64 wg .. 64 wg + 63] =
    // dS_i K_j[:, 64 wg ..]; D = 64: dQ_i[64 wg .. 64 wg + 63, :] = dS_i[64 wg .., :] K_j. A = the
    // tile read MN-major, queries contiguous, at D = 64 the warpgroup's 64-query column block of
    // it; B = K_j read MN-major, at D = 128 the warpgroup's 64-column block; k16 = 16 keys),
    // then this warpgroup's partial through shared memory to the copy engine, which adds it into
    // the sums while the next steps run (atomic adds from the warps' registers held the warps
    // until the L2 took them: 3.45 ms against 2.07 without the sums at N = 4k). Each warp's 16
    // rows are 4 KB of their own, in the tile and in the sums (dq_tile_offset's layout), so each
    // warp stages and adds its rows alone: no warpgroup barrier. (One add of the warpgroup's
    // 16 KB behind two named barriers, the leader waiting for the previous add's read between
    // them: forward + backward 1.5-5 % slower at D = 128, 1k-4k; session 30.)
    constexpr int kColBlocks = D / 64;
    auto issue_dq_add = [&] {
      if constexpr (kDQ) {
        constexpr int kWarpFloats = kDQTileFloats / 4;
        const uint32_t warp_addr =
            sdQ_addr + (warpgroup * kDQTileFloats + (warp % 4) * kWarpFloats) * 4;
        fence_proxy_async_smem();  // st.shared -> visible to the copy engine
        __syncwarp();              // the warp's rows are all written
        if (lane == 0) {
          // D = 128: the step's row block, this warpgroup's column block; D = 64: this
          // warpgroup's row block of the step's two.
          // Packed rows: head dq_h's row blocks of every sequence, this one's from block0.
          const int64_t bh = kExtents ? dq_h : b * p.heads_q + dq_h;
          const int64_t row_blocks = kExtents ? dq_packed_row_blocks(p) : st.rows_padded / 64;
          const int64_t block0 = kExtents ? dq_packed_block0(q_start, b) : 0;
          const int64_t rows_at =
              kColBlocks == 2
                  ? dq_tile_offset(bh, row_blocks, block0 + dq_m, warpgroup, 2)
                  : dq_tile_offset(bh, row_blocks,
                                   block0 + 2 * static_cast<int64_t>(dq_m) + warpgroup, 0, 1);
          bulk_reduce_add_f32(st.dq_accum + rows_at + (warp % 4) * kWarpFloats, warp_addr,
                              kWarpFloats * 4);
          tma_store_commit();
        }
      }
    };

    auto dq_product_and_stage = [&](int tile) {
      if constexpr (kDQ) {
        const int a_block = kColBlocks == 1 ? warpgroup : 0,
                  b_block = kColBlocks == 2 ? warpgroup : 0;
        const uint64_t ds_desc =
            sw128_desc(sdS_addr + tile * kSdSBytes + a_block * Bc * 128, Bc * 128, 1024);
        const uint64_t kb_desc = sw128_desc(sK_addr + b_block * Bc * 128, Bc * 128, 1024);
        wgmma_fence();
        WgmmaSS<Elem, 64>::template overwrite<1, 1>(dQ, ds_desc, kb_desc);
#pragma unroll
        for (int kk = 1; kk < Bc / 16; ++kk)
          WgmmaSS<Elem, 64>::template mma<1, 1>(dQ, desc_advance(ds_desc, kk * 2048),
                                                desc_advance(kb_desc, kk * 2048), 1);
        wgmma_commit();
        wgmma_wait<0>();  // with kOverlap, also step s - 1's gradient products
        pin_registers(dQ);
        if constexpr (Tr::kOverlap) {
          pin_registers(dV);
          pin_registers(dK);
          pin_registers(pa);
          pin_registers(da);
        }

        constexpr int kWarpFloats = kDQTileFloats / 4;
        const uint32_t warp_addr =
            sdQ_addr + (warpgroup * kDQTileFloats + (warp % 4) * kWarpFloats) * 4;
        // The previous add has read the warp's rows. (It had a step to do so; a second tile per
        // warpgroup, in place of the third stage of Q_i / dO_i, ran 10 % slower.)
        if (lane == 0) tma_store_wait_read<0>();
        __syncwarp();  // ... which every lane now knows
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const uint32_t words[4] = {__float_as_uint(dQ[ni][0]), __float_as_uint(dQ[ni][1]),
                                     __float_as_uint(dQ[ni][2]), __float_as_uint(dQ[ni][3])};
          sts_128(warp_addr + ni * 512 + lane * 16, words);
        }
      }
    };
    StepCursor step{0, 0};  // the step s, and the step the prefetch loads next (s + kAhead)
    StepCursor ahead_step{0, 0};
    if (steps > kAhead) ahead_step = {kAhead / m_count, kAhead % m_count};
    if constexpr (kTmaSteps) {
      cp_async_wait<0>();        // K_j, V_j: the only cp.async copies
      fence_proxy_async_smem();  // this thread's copies -> visible to wgmma
    }
    for (int s = 0, stage = 0; s < steps; ++s, stage = stage + 1 < kStages ? stage + 1 : 0) {
      if constexpr (!kTmaSteps) {
        cp_async_wait<kAhead - 1>();
        fence_proxy_async_smem();  // this thread's copies -> visible to wgmma
      }
      // Publishes step s's tiles copied by every thread (kTmaSteps: K_j, V_j at s = 0), and every
      // warp is done with the stage the prefetch below overwrites: step s - 1's (s - 2's with
      // kOverlap, whose gradient wgmma each warp waited for during step s - 1).
      sync_cta();
      if (s + kAhead < steps) {
        const int ahead = stage + kAhead;
        load_step(ahead_step, ahead < kStages ? ahead : ahead - kStages);
        ahead_step.next(m_count);
      }
      if constexpr (kDQ) {
        // Step s - 1's dQ product and its adds, while this step's tiles land.
        if (s > 0) {
          dq_product_and_stage((s - 1) & 1);
          if constexpr (!kDeferFences) issue_dq_add();
        }
      }
      if constexpr (kTmaSteps) {
        // Step s's Q_i, dO_i and row statistics have landed (visible to this thread and to its
        // wgmma); the stage's barrier completes once per kStages steps.
        mbarrier_wait(full_bar0 + 8 * stage, (s / kStages) & 1);
      } else {
        cp_async_commit();
      }

      const int64_t h = hk * group + step.head;
      const int m = m_lo + step.block;
      const int64_t r0 = static_cast<int64_t>(m) * Br;
      step.next(m_count);
      if constexpr (kExtents && kFusedDQ) {
        // A box past the sequence's last row holds the next sequence's queries, which the
        // padded row statistics (lse2 = +inf, delta = 0) would meet as 0 x inf = NaN wherever they
        // are not finite: those rows become the zeros a dense map's bounds give, before any
        // warp's products read the stage.
        if (r0 + Br > p.seqlen_q) {
          const int first = static_cast<int>(p.seqlen_q - r0);
          zero_tile_rows<D, Br, kThreads>(sQ_addr0 + stage * Tr::kSmemQ, first, tid);
          zero_tile_rows<D, Br, kThreads>(sdO_addr0 + stage * Tr::kSmemQ, first, tid);
          __syncwarp();              // the lanes, apart in the loops, together again
          fence_proxy_async_smem();  // st.shared -> visible to wgmma
          sync_cta();                // every thread's zeros are written
        }
      }
      // Read ahead of the products, so a tile class's latency hides under them.
      // kStagedOnly: every step through the staged values (a clear tile adds zeros).
      const bool plain_keys =
          !kStagedOnly && step_plain_keys<Br, Bc, kMask>(kb, p, b, h, m, n_block);
      const uint32_t stage_bytes = stage * Tr::kSmemQ;

      float St[NT][4], dPt[kDK ? NT : 1][4];
      wgmma_fence();
      wgmma_ss_first<Elem, Br, Tr::kOverlap>(St, k_desc, desc_advance(q_desc0, stage_bytes));
#pragma unroll
      for (int ks = 1; ks < Tr::kKSteps; ++ks)
        Wgmma<Elem, Br>::ss(St, desc_advance(k_desc, k_step(ks, Bc)),
                            desc_advance(q_desc0, stage_bytes + k_step(ks, Br)), 1);
      if constexpr (kDK) {
        wgmma_ss_first<Elem, Br, Tr::kOverlap>(dPt, v_desc, desc_advance(do_desc0, stage_bytes));
#pragma unroll
        for (int ks = 1; ks < Tr::kKSteps; ++ks)
          Wgmma<Elem, Br>::ss(dPt, desc_advance(v_desc, k_step(ks, Bc)),
                              desc_advance(do_desc0, stage_bytes + k_step(ks, Br)), 1);
      }
      wgmma_commit();
      if constexpr (kDQ && kDeferFences) {
        // Step s - 1's dQ partial leaves once the score products are issued: the fence then
        // finds the tile's stores done instead of waiting for them.
        if (s > 0) issue_dq_add();
      }
      // Dropout: the keep bits are drawn while the score products run (their registers are not
      // touched); dP^T is masked and scaled before dS^T (whose delta = rowsum(dO * O) already
      // holds the dropped O), and P^T before dV, once the products have landed.
      uint32_t keep[kKeepWords] = {};
      constexpr int kPartTiles = NT / kKeepWords;  // n8 tiles of a keep word: 64 queries or fewer
      // A keep word's part of an accumulator.
      auto part = [](float (&acc)[NT][4], int w) -> float (&)[kPartTiles][4] {
        return *reinterpret_cast<float (*)[kPartTiles][4]>(&acc[w * kPartTiles][0]);
      };
      if constexpr (kDropout) {
        uint32_t mine_at, sibling_at;
        if constexpr (kDQ) {
          // In the step's dS^T tile, each word where the warp that reads it later stores its own
          // dS^T rows (16 key rows x 128 bytes of the first 64 queries: 2 KB): the tile is free
          // from the loop-top barrier (step s - 2's dQ product, its last reader, was waited for
          // in step s - 1) and the reader overwrites its words itself, after its reads (the
          // __syncwarp there).
          static_assert(kKeepWords * 32 * 8 <= 16 * 128, "a warp's words fit its 2 KB of rows");
          const uint32_t tile_addr = sdS_addr + (s & 1) * kSdSBytes;
          mine_at = tile_addr + (warp ^ 1) * 2048 + lane * 8;
          sibling_at = tile_addr + warp * 2048 + lane * 8;
        } else {
          const uint32_t buffer = exchange_addr + (s & 1) * kThreads * 8;
          mine_at = buffer + tid * 8;
          sibling_at = buffer + (tid ^ 32) * 8;
        }
#pragma unroll
        for (int w = 0; w < kKeepWords; ++w)
          keep[w] = keep_bits_key_rows_paired<kPartTiles>(
              drop, static_cast<uint32_t>(b * p.heads_q + h), key_row[0],
              static_cast<uint32_t>(r0 + 64 * w), t, mine_at + w * 256, sibling_at + w * 256,
              1 + warp / 2);
      }
      wgmma_wait<0>();  // with kOverlap, also step s - 1's gradient products
      pin_registers(St);
      pin_registers(dPt);
      if constexpr (Tr::kOverlap) {
        pin_registers(dV);
        pin_registers(dK);
        pin_registers(pa);
        pin_registers(da);
      }

      if constexpr (kDropout && kDK) {
#pragma unroll
        for (int w = 0; w < kKeepWords; ++w) apply_dropout(part(dPt, w), keep[w], drop.scale);
      }
      transposed_probs_and_grads<Elem, kGeneral, kDK, kSoftcapFast, kStageMask>(
          St, dPt, p, tf, scale_log2, b, h, r0, Br, n_block, Bc, key_row, sL + stage * Br,
          sDelta + stage * Br, t, plain_keys, stage_mask, staged_tile);
      if constexpr (kDropout && kDV) {
#pragma unroll
        for (int w = 0; w < kKeepWords; ++w) apply_dropout(part(St, w), keep[w], drop.scale);
      }
      if constexpr (kStageMask) {
        if (stage_mask) {
          // Every warp has read this step's mask tile: the next step's may overwrite it. (Its
          // copy then lands under this step's gradient products and the next step's scores.)
          sync_cta();
          if (s + 1 < steps)
            MaskTile::load(sMask_addr, p, b, hk * group + step.head,
                           static_cast<int64_t>(m_lo + step.block) * Br, n_block, tid);
          cp_async_commit();
        }
      }
      // The gradient products take P^T / dS^T packed from the score registers. Those and the
      // accumulators were written by ordinary instructions: pinned ahead of the fence that orders
      // them before the wgmma reads.
#pragma unroll
      for (int kk = 0; kk < Br / 16; ++kk) {
        if constexpr (kDV) pack_a<Elem>(pa[kk], St, kk);
        if constexpr (kDK) pack_a<Elem>(da[kk], dPt, kk);
      }
      pin_registers(dV);
      pin_registers(dK);
      pin_registers(pa);
      pin_registers(da);
      wgmma_fence();
      if constexpr (kDV)
        wgmma_rs_tile<Elem, D, Tr::kOChunk>(dV, pa, desc_advance(do_mn_desc0, stage_bytes), Br,
                                            Tr::kOverlap && s == 0);
      if constexpr (kDK)
        wgmma_rs_tile<Elem, D, Tr::kOChunk>(dK, da, desc_advance(q_mn_desc0, stage_bytes), Br,
                                            Tr::kOverlap && s == 0);
      wgmma_commit();
      if constexpr (kDQ) {
        // dS^T into this warpgroup's 64 rows of the step's tile: each 32-bit word of da is two
        // queries of one key row (pack_a's layout: rows g / g + 8, queries 16 kk + 2 t (+ 8)).
        // The tile was last read by step s - 2's dQ product, which each warpgroup waited for
        // during step s - 1, before this step's loop-top barrier.
        const uint32_t tile_addr = sdS_addr + (s & 1) * kSdSBytes;
        if constexpr (kDropout) __syncwarp();  // every lane has read its keep-bit words here
#pragma unroll
        for (int kk = 0; kk < Br / 16; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = warp_row0 + g + 8 * (e & 1), chunk = 2 * kk + (e >> 1);
            sts_32(tile_addr + sw128_offset<Bc>(row, chunk) + 4 * t, da[kk][e]);
          }
        if constexpr (!kDeferFences)
          fence_proxy_async_smem();  // st.shared -> visible to wgmma (after the next barrier)
        dq_h = h;
        dq_m = m;
      }
      if constexpr (!Tr::kOverlap) {
        wgmma_wait<0>();
        // The dS^T stores -> visible to the next step's dQ product (after the loop-top barrier).
        // Here, past the gradient products' wait, the stores are done.
        if constexpr (kDQ && kDeferFences) fence_proxy_async_smem();
        pin_registers(dV);
        pin_registers(dK);
        pin_registers(pa);
        pin_registers(da);
      }
    }
    if constexpr (Tr::kOverlap) {
      wgmma_wait<0>();
      pin_registers(dV);
      pin_registers(dK);
      pin_registers(pa);
      pin_registers(da);
    }
    cp_async_wait<0>();
    if constexpr (kDQ) {
      if (steps > 0) {
        sync_cta();  // both warpgroups' dS^T rows of the last step are written
        dq_product_and_stage((steps - 1) & 1);
        issue_dq_add();
      }
      if (lane == 0) tma_store_wait_all();  // the warp's last adds are done before the CTA exits
    }
    if (Tr::kOverlap && steps == 0) {  // no query sees these keys
      zero(dV);
      zero(dK);
    }

    // Packed rows under dropout store through the sequence's view taken again, not one held
    // through the loop: ptxas (sm_90a, bf16) spill D = 128 fused 124 / 116 -> 60 / 92 bytes,
    // seven-matmul 180 / 160 -> 132 / 128 (its forward + backward 1.3-1.5 % faster, the fused
    // variant's the same; H200, session 46, against session 45's run). Without dropout the packed
    // kernels had no spill to save, and their seven-matmul path timed 2-5 % slower with it
    // (contenders within 3 % between the two machines): left as it was.
    // Staged stores where ptxas fits them without new spill: the general variants (to 252 bytes at
    // D = 64 with packed rows) and D = 256's packed-rows and dropout ones (to 302 / 226) keep the
    // direct stores.
    constexpr bool kStagedStores = !kGeneral && !(D == 256 && (kExtents || kDropout));
    if constexpr (kStagedStores) {
      if (st.vec_store == kGradStoreRows16) {
        // Every warp is past its last reads of K_j and V_j (each warpgroup waited for its
        // products, the fused dQ product included): their tiles stage the gradients' rows.
        sync_cta();
        store_dkdv_staged<Elem, kW, D>(kExtents && kDropout ? sequence_view_bwd(params, b) : p, b,
                                       hk, k0, dV, dK, tf.scale, sV_addr, sK_addr, warp_row0,
                                       rows_k, head_dim, lane);
        return;
      }
    }
    store_dkdv<Elem, kW, DT>(kExtents && kDropout ? sequence_view_bwd(params, b) : p, b, hk, k0, dV,
                             dK, tf.scale, warp_row0, rows_k, head_dim, lane, st.vec_store != 0);
  };
  if constexpr (kWhich == kBwdPair) {
    if (warpgroup == 0) {
      mainloop(std::integral_constant<int, kBwdOnlyDV>{});
    } else {
      mainloop(std::integral_constant<int, kBwdOnlyDK>{});
    }
  } else {
    mainloop(std::integral_constant<int, kWhich>{});
  }
#else
  __trap();  // launched only where the sm_90a binary runs (see attention_backward_cuda.cpp)
#endif
}

// kTmaLoads (plain dense variants): each key block's K_j / V_j through the copy engine (maps over
// k and v), completing on its stage's "full" mbarrier, as the dK/dV kernel's step loads.
// kDropout: as the dK/dV kernel's.
template <class Tr, bool kGeneral, bool kExtents, int kFast, bool kTmaLoads = false,
          bool kDropout = false>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    attention_bwd_dq_sm90_kernel(const AttentionBwdParams params, const BwdRowStats st,
                                 const __grid_constant__ BwdStepMaps maps) {
#ifdef FLASHMOD_SM90A
  static_assert(kFast == kBwdFastNone || (kGeneral && !kExtents), "fast paths: general, dense");
  constexpr bool kMask = kFast == kBwdFastMask || kFast == kBwdFastAdditive;
  constexpr bool kSoftcapFast = kFast == kBwdFastSoftcap;
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles;
  constexpr bool kAdditiveFast = additive_fast_variant<kGeneral, kExtents, kFast, D>();
  // D = 256: staged tiles only (the batched global loads do not fit its registers).
  constexpr bool kStagedOnly = kFast == kBwdFastAdditive && bwd_additive_staged_only(D);
  const bool additive_fast = kAdditiveFast && !kStagedOnly && bwd_additive_fast(params, st);
  // A bwd_stages_mask mask: each key block's mask tile staged with its K_j / V_j, one per stage.
  using MaskTile = StagedMaskTile<Elem, Br, Bc, kThreads>;
  const bool stage_mask = kAdditiveFast && (kStagedOnly || bwd_stages_mask(params, st));

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t sQ_addr = (raw_addr + 1023) & ~1023u;
  const uint32_t sdO_addr = sQ_addr + Tr::kSmemQ;
  constexpr int kStages = Tr::kStages, kAhead = Tr::kAhead;
  const uint32_t sK_addr0 = sdO_addr + Tr::kSmemQ;                // kStages stages
  const uint32_t sV_addr0 = sK_addr0 + kStages * Tr::kSmemKV;     // kStages stages
  const uint32_t sMask_addr0 = sV_addr0 + kStages * Tr::kSmemKV;  // stage_mask: kStages tiles
  static_assert(!kTmaLoads || (!kGeneral && !kExtents && !Tr::kOverlap), "plain dense variants");
  static_assert(!kDropout || (kFast == kBwdFastNone && NT <= 8 && Bc % 32 == 0),
                "dropout: no fast path, one 32-bit keep mask per key block");
  const uint32_t full_bar0 = sMask_addr0;  // kTmaLoads: the stages' mbarriers

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warpgroup = warp / 4;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(params.head_dim);
  const BwdQueryTile tile =
      bwd_query_tile(params, static_cast<int>((params.seqlen_q + Br - 1) / Br));
  const int64_t h = tile.h, b = tile.b, hk = tile.hk;
  const AttentionBwdParams p = kExtents ? sequence_view_bwd(params, b) : params;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int r0 = tile.m_block * Br;
  if constexpr (kExtents) {
    if (r0 >= Nq) return;  // past this sequence's queries: no rows of it to write
  }
  const int rows_q = min(Br, Nq - r0);
  const KeyBlockRange range = shown_key_blocks<kMask, Br, Bc>(
      p, b, h, tile.m_block, key_block_range(p, r0, r0 + rows_q - 1, Bc));

  const BwdQueryRows<Elem> gq = query_rows<Elem>(p, b, h, r0);
  const BwdKeyRows<Elem> gkv = key_rows<Elem>(p, b, hk, 0);
  const Sw128TileCopy<Br, D, kThreads> q_copy(tid, head_dim);
  const Sw128TileCopy<Bc, D, kThreads> kv_copy(tid, head_dim);
  auto load_kv = [&](int n, int stage) {
    if constexpr (kTmaLoads) {
      if (tid == 0) {  // rows past seqlen_k arrive as zeros, as the cp.async zero fill leaves them
        const uint32_t bar = full_bar0 + 8 * stage;
        mbarrier_arrive_expect_tx(bar, 2 * Tr::kSmemKV);
        tma_load_step_tiles<D, Bc>(sK_addr0 + stage * Tr::kSmemKV, sV_addr0 + stage * Tr::kSmemKV,
                                   maps, n * Bc, static_cast<int>(hk), static_cast<int>(b), bar);
      }
      return;
    }
    const int valid = min(Bc, Nk - n * Bc);
    const int64_t row0 = static_cast<int64_t>(n) * Bc;
    kv_copy.load(sK_addr0 + stage * Tr::kSmemKV, gkv.k + row0 * p.k_row_stride, p.k_row_stride,
                 valid);
    kv_copy.load(sV_addr0 + stage * Tr::kSmemKV, gkv.v + row0 * p.v_row_stride, p.v_row_stride,
                 valid);
    if constexpr (kAdditiveFast) {
      if (stage_mask) MaskTile::load(sMask_addr0 + stage * MaskTile::kBytes, p, b, h, r0, n, tid);
    }
  };

  if constexpr (kTmaLoads) {
    if (tid == 0) init_stage_barriers(full_bar0, kStages, 1);
  }
  // One cp.async group per key block (the first also holds Q_i, dO_i), committed even when empty.
  q_copy.load(sQ_addr, gq.q, p.q_row_stride, rows_q);
  q_copy.load(sdO_addr, gq.grad_out, p.grad_out_row_stride, rows_q);
#pragma unroll
  for (int a = 0; a < kAhead; ++a) {
    if (range.lo + a < range.hi) load_kv(range.lo + a, a);
    cp_async_commit();
  }

  // A: this warpgroup's 64 rows of Q_i / dO_i (K-major). B of the score products: K_j / V_j
  // (K-major); B of dQ += dS K_j: K_j read MN-major.
  const uint64_t q_desc = sw128_desc(sQ_addr + warpgroup * 64 * 128, 16, 1024);
  const uint64_t do_desc = sw128_desc(sdO_addr + warpgroup * 64 * 128, 16, 1024);
  const uint64_t k_desc0 = sw128_desc(sK_addr0, 16, 1024);
  const uint64_t v_desc0 = sw128_desc(sV_addr0, 16, 1024);
  const uint64_t k_mn_desc0 = sw128_desc(sK_addr0, Bc * 128, 1024);

  const ScoreTransform tf(p);
  const float scale_log2 = tf.scale * 1.4426950408889634f;
  const int warp_row0 = warp * 16;
  const LaneRows rows = lane_rows(p, st, b, h, r0 + warp_row0 + g);
  DropoutState drop;
  if constexpr (kDropout) drop = dropout_state(p);

  float dQ[DT][4];
  if constexpr (!Tr::kOverlap) zero(dQ);  // kOverlap: written first by the first block's product
  uint32_t da[Bc / 16][4];  // dS packed; with kOverlap live until the next block's wait

  if constexpr (kTmaLoads) {
    cp_async_wait<0>();        // Q_i, dO_i: the only cp.async copies
    fence_proxy_async_smem();  // this thread's copies -> visible to wgmma
  }
  for (int n = range.lo, stage = 0; n < range.hi;
       ++n, stage = stage + 1 < kStages ? stage + 1 : 0) {
    if constexpr (!kTmaLoads) {
      cp_async_wait<kAhead - 1>();
      fence_proxy_async_smem();  // this thread's copies -> visible to wgmma
    }
    // Publishes K_j/V_j (and Q_i, dO_i at the first block) copied by every thread, and every
    // warp is done with the stage the prefetch below overwrites (block n - 1's; n - 2's with
    // kOverlap, whose dQ wgmma each warp waited for during block n - 1).
    __syncthreads();
    if (n + kAhead < range.hi) {
      const int ahead = stage + kAhead;
      load_kv(n + kAhead, ahead < kStages ? ahead : ahead - kStages);
    }
    if constexpr (kTmaLoads) {
      // Block n's K_j / V_j have landed; the stage's barrier completes once per kStages blocks.
      mbarrier_wait(full_bar0 + 8 * stage, ((n - range.lo) / kStages) & 1);
    } else {
      cp_async_commit();
    }
    // Read ahead of the products, so the mask bytes' latency hides under them.
    const bool plain_keys = plain_key_block<kGeneral, kMask, Br, Bc>(p, b, h, tile.m_block, n);

    const uint32_t stage_bytes = stage * Tr::kSmemKV;
    float S[NT][4], dP[NT][4];
    wgmma_fence();
    wgmma_ss_first<Elem, Bc, Tr::kOverlap>(S, q_desc, desc_advance(k_desc0, stage_bytes));
#pragma unroll
    for (int ks = 1; ks < Tr::kKSteps; ++ks)
      Wgmma<Elem, Bc>::ss(S, desc_advance(q_desc, k_step(ks, Br)),
                          desc_advance(k_desc0, stage_bytes + k_step(ks, Bc)), 1);
    wgmma_ss_first<Elem, Bc, Tr::kOverlap>(dP, do_desc, desc_advance(v_desc0, stage_bytes));
#pragma unroll
    for (int ks = 1; ks < Tr::kKSteps; ++ks)
      Wgmma<Elem, Bc>::ss(dP, desc_advance(do_desc, k_step(ks, Br)),
                          desc_advance(v_desc0, stage_bytes + k_step(ks, Bc)), 1);
    wgmma_commit();
    // Dropout: the keep bits drawn while the score products run; dP is masked and scaled before
    // dS.
    uint32_t keep = 0;
    if constexpr (kDropout)
      keep = keep_bits_query_rows<NT>(drop, static_cast<uint32_t>(b * p.heads_q + h),
                                      static_cast<uint32_t>(r0 + warp_row0 + g),
                                      static_cast<uint32_t>(n * Bc), t);
    wgmma_wait<0>();  // with kOverlap, also block n - 1's dQ product
    pin_registers(S);
    pin_registers(dP);
    if constexpr (Tr::kOverlap) {
      pin_registers(dQ);
      pin_registers(da);
    }

    if constexpr (kDropout) apply_dropout(dP, keep, drop.scale);
    if constexpr (kAdditiveFast) {
      const MaskTile staged{sMask_addr0 + stage * MaskTile::kBytes, r0};
      probs_and_grads<Elem, kGeneral, kSoftcapFast, kAdditiveFast>(
          S, dP, p, tf, scale_log2, rows, r0, Br, n, Bc, t, plain_keys, additive_fast,
          stage_mask ? &staged : nullptr);
    } else {
      probs_and_grads<Elem, kGeneral, kSoftcapFast, kAdditiveFast>(
          S, dP, p, tf, scale_log2, rows, r0, Br, n, Bc, t, plain_keys, additive_fast);
    }
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) pack_a<Elem>(da[kk], S, kk);
    pin_registers(dQ);
    pin_registers(da);
    wgmma_fence();
    wgmma_rs_tile<Elem, D, Tr::kOChunk>(dQ, da, desc_advance(k_mn_desc0, stage_bytes), Bc,
                                        Tr::kOverlap && n == range.lo);
    wgmma_commit();
    if constexpr (!Tr::kOverlap) {
      wgmma_wait<0>();
      pin_registers(dQ);
      pin_registers(da);
    }
  }
  if constexpr (Tr::kOverlap) {
    wgmma_wait<0>();
    pin_registers(dQ);
    pin_registers(da);
  }
  cp_async_wait<0>();
  if (Tr::kOverlap && range.lo >= range.hi) zero(dQ);  // the rows see no key

  // As the dK/dV kernel's: staged where it adds no spill (packed rows at D = 64 / 256: 0 -> 36, 4
  // -> 44 bytes; the general variants).
  if constexpr (!kGeneral && !(kExtents && D != 128)) {
    if (st.vec_store == kGradStoreRows16) {
      // Every warp is past its last reads of Q_i (each warpgroup waited for its products): its
      // tile stages dQ's rows.
      __syncthreads();
      store_dq_staged<Elem, D>(p, b, h, r0, dQ, tf.scale, sQ_addr, warp_row0, rows_q, head_dim,
                               lane);
      return;
    }
  }
  store_dq<Elem>(p, b, h, r0, dQ, tf.scale, warp_row0, rows_q, head_dim, lane, st.vec_store != 0);
#else
  __trap();  // launched only where the sm_90a binary runs (see attention_backward_cuda.cpp)
#endif
}

}  // namespace flashmod::cuda_kernels::sm90
