// The warp-specialized Hopper (sm_90a) forward kernel: TMA loads, a producer warp, consumer
// warpgroups that ping-pong their matmuls and (at D = 128, Tr::kOrderPvWait) overlap each block's
// softmax with their own PV matmul, on a persistent grid.
//
// A tile is Br = 64 * kConsumers query rows Q_i of one (batch, head); the grid has at most one
// CTA per SM. Tiles that cost the same (no right window bound) go round-robin: CTA k takes tiles
// k, k + gridDim.x, ... in cta_tile's order (query blocks of a head side by side). Under a right
// window bound (causal) tile costs differ, and a dynamic scheduler hands them out in the same
// order, so a head's longest query block goes first (WsSchedule): CTA k starts with tile k, and
// the producer claims each next tile from a global counter once it has issued the current tile's
// loads, passing its index to the consumers through shared memory. A CTA has kConsumers + 1
// warpgroups:
//   warpgroup 0, the producer: gives its registers away (setmaxnreg.dec); lane 0 of its first
//     warp issues the TMA loads of each tile's Q_i and of its K_j, V_j into a kStages-deep ring of
//     128-byte-swizzled buffers. Every buffer (Q's too) has a "full" mbarrier (the copy engine
//     completes it with the bytes) and an "empty" one (every consumer warp arrives once it no
//     longer reads the buffer). The ring runs on across tiles, and the next tile's Q is loaded as
//     soon as the consumers' last S of this one is done: the next tile's first loads hide under
//     this tile's last PV and epilogue.
//   warpgroups 1..kConsumers, the consumers: take the registers (setmaxnreg.inc); consumer c owns
//     rows 64c..64c+63 of each tile and runs, per key block j, in this order
//       issue S_j = Q K_j^T,  O *= alpha_{j-1},  issue O += P_{j-1} V_{j-1}    (one turn)
//       wait S_j; release K_j; mask and softmax S_j -> P_j, alpha_j (PV still running where
//         kOrderPvWait keeps ptxas from hoisting the next wait)
//       wait PV; release V_{j-1}
//     The "turn" is serialized across consumers through named barriers (consumer c waits on its
//     own, then signals c + 1's), so one consumer's softmax runs while the next one's matmuls
//     occupy the tensor cores. A consumer stops at the last key block its own 64 rows see
//     (three consumers under a causal bound: a block before the tile's last), passing the
//     turns of the rest without a matmul. The epilogue stages each warp's rows in a
//     shared-memory area of its own, so it needs no barrier either (D = 256, whose shared memory
//     has room for 8 rows a warp: two halves in turn), and at D <= 128 hands them to the copy
//     engine (a TMA store) instead of copying them out itself.
// Nothing waits on the whole CTA after the barrier initialization. Rows past seqlen_q and keys
// past seqlen_k arrive as zeros (the tensor maps bound each (batch, head)'s rows) and are masked as
// in the FlashAttention-2-style kernel (fwd_sm90_kernel.h), whose softmax and epilogue code this
// one shares. Plain scores only (no mask tensor, soft cap or scale <= 0); windows and causal are
// in.
// kVarlen: packed rows (cu_seqlens_q, cu_seqlens_k; flash_attn_varlen_func). The tensor maps
// span the packed tensors, a tile's rows start at its sequence's first row, and tiles run on the
// dynamic schedule: the producer reads each tile's sequence extents, skips the tiles past their
// sequence's queries and hands the extents to the consumers with the index. A box of rows reaches
// into the next sequence: its queries are never stored and its keys are masked, but its values
// would still meet P = 0, and 0 * inf is NaN; so the producer zeroes, in shared memory, the rows
// of a partial last V_j that are not this sequence's before the consumers may read it.
// kKeyMask: a bool key-padding mask, (B, 1, 1, Nk) seen through strides (one visibility bit per
// key, the same for every head and query). The producer warp turns each key block's bytes into
// 128 bits (a ballot per byte of its lanes' 4-byte runs) and hands them on with K_j; consumers
// hide the keys whose bit is clear, in blocks that have one.
// kBias: an additive mask in q's dtype (a dense bias, or transformers' causal + padding mask as
// finfo.min entries), rows 16-byte aligned. The pre-pass of mask_tiles.h classifies its tiles at
// this kernel's Br x Bc: the key range drops hidden tiles at both ends, clear tiles are not read,
// and the producer loads each other tile's rows with the key block, 64 rows per consumer into a
// buffer of that consumer's own (full / empty mbarriers per consumer, so a consumer's next tile
// comes in as soon as its own softmax is done with the last). Scores are then logits (scale
// applied, the mask added; entries at or below kHidingMaskValue hide their key).
// kSoftcap: scores scaled and capped (softcap * tanh(scale q.k / softcap), visibility.h's
// soft_cap, as the FlashAttention-2-style kernel computes them) before masking and softmax, which
// then run in logit units.
#pragma once

#include <cuda.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../../common/cuda/bulk_copy_ops.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/tma_ops.h"
#include "../../common/cuda/wgmma_ops.h"
#include "../attention_params.h"
#include "../sequence_view.h"
#include "cta_tile.h"
#include "dropout.h"
#include "entry_points.h"
#include "fwd_epilogue.h"
#include "mask_tiles.h"
#include "online_softmax.h"
#include "score_mask.h"
#include "visibility.h"

namespace flashmod::cuda_kernels::sm90 {

// How CTAs find their tiles (numbered in cta_tile's order). next_tile == nullptr: round-robin.
// Otherwise two zeroed counters: tile gridDim.x + atomicAdd(next_tile, 1) is the next one to
// take, and next_tile[1] counts the CTAs done claiming (the last one zeroes both again).
struct WsSchedule {
  unsigned* next_tile = nullptr;
};

// A key block's visibility under a key-padding mask (kKeyMask), as one consumer thread holds it:
// the two words of the 128 bits its columns fall in (column ni * 8 + 2 (lane % 4) + e is bit
// 2 ni + (lane % 4) / 2 of w[e]), and whether every key of the block is visible.
struct KeyBits {
  uint32_t w[2];
  bool all;
};

// Hides the keys of S whose bits are clear (both rows of the thread's m16 tile).
template <int NT>
__device__ __forceinline__ void hide_keys(float (&S)[1][NT][4], const KeyBits& bits, int lane) {
  const int shift = (lane % 4) / 2;
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (((bits.w[e] >> (2 * ni + shift)) & 1u) == 0) {
        S[0][ni][e] = -CUDART_INF_F;
        S[0][ni][2 + e] = -CUDART_INF_F;
      }
}

// One sequence's rows in the packed tensors (kVarlen; zero-based rows and the call's lengths
// otherwise).
struct SeqExtents {
  uint32_t q_start, q_len, k_start, k_len;
};

// The epilogue of one consumer warp's 16 rows through the tensor memory accelerator: O,
// normalized by 1/l, goes into the warp's rows of the staging area in Q's 128-byte-swizzled
// layout (kColBlocks boxes of Br rows), and one lane stores them as boxes of 16 rows of the output
// tensor map, which bounds them to the (batch, head)'s rows past its last; kRowsBeforeFirst: rows
// of the tile before first_row (before the head's first) are neither stored nor given an lse. The
// warp goes on to its next tile while the copy engine writes; the staged rows are only overwritten
// once it has read them. Before, the warp copied its rows out itself (8 shared loads and 8 global
// stores a lane, each store waiting on its load) before its next tile's first matmul: at N = 1k,
// where a tile has 8 key blocks, the whole store cost 3 % (7 % causal) of a D = 128 call (session
// 17).
#ifdef FLASHMOD_SM90A
template <class Tr, bool kRowsBeforeFirst = false>
__device__ __forceinline__ void store_out_rows_tma(OnlineSoftmax<1>& softmax,
                                                   float (&O)[1][Tr::kDTiles][4], float c,
                                                   uint32_t sO_addr, const CUtensorMap* tm_o,
                                                   float* gLse, int warp_row0, int first_row,
                                                   int rows_q, int tile_row0, int h, int b,
                                                   int lane) {
  using Mma = Mma16816<typename Tr::Elem>;
  const int g = lane >> 2, t = lane & 3;
  // This warp's store of its previous tile must have read the rows about to be overwritten.
  if (lane == 0) tma_store_wait_read<0>();
  __syncwarp();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float inv_l, lse;
    softmax.finish(0, hh, c, inv_l, lse);  // all lanes: it shuffles within the quad
    const int row = warp_row0 + g + 8 * hh;
    // Column pair 8 di + 2t: chunk di of the row, bytes 4t.. of it. Conflict-free: the eight rows
    // of a store put chunk di in eight different 16-byte slots of their 128-byte lines.
#pragma unroll
    for (int di = 0; di < Tr::kDTiles; ++di)
      sts_32(sO_addr + sw128_offset<Tr::Br>(row, di) + 4 * t,
             Mma::pack(O[0][di][2 * hh] * inv_l, O[0][di][2 * hh + 1] * inv_l));
    if (t == 0 && (!kRowsBeforeFirst || row >= first_row) && row < rows_q) gLse[row] = lse;
  }
  fence_proxy_async_smem();  // each lane's staged values reach the copy engine's (async) view
  __syncwarp();              // every lane's, before lane 0 starts the copy
  // kRowsBeforeFirst: first_row is a multiple of 16, so a warp's rows are all before it or none.
  if (lane == 0 && (!kRowsBeforeFirst || warp_row0 >= first_row)) {
#pragma unroll
    for (int cb = 0; cb < Tr::kColBlocks; ++cb)
      tma_store_4d(tm_o, sO_addr + cb * Tr::Br * 128 + warp_row0 * 128, cb * 64,
                   tile_row0 + warp_row0, h, b);
    tma_store_commit();
  }
}
#endif  // FLASHMOD_SM90A

template <typename Elem_, int kHeadDim_, int kBc, int kConsumers_, int kStages_>
struct FwdWsTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int Br = 64 * kConsumers;  // wgmma's M is 64 rows per consumer warpgroup
  static constexpr int Bc = kBc;
  static constexpr int kNThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = kStages_;
  // Whether the softmax is kept under the PV matmul (the sum mark in the consumer loop). H100,
  // bf16, same process: D = 128 +3-8% from N = 2k (1k: -1 to +3%), but D = 64 -1 to -4% (two or
  // three consumers) and the key-padding mask at D = 128 -4 to -7%, which go without.
  static constexpr bool kOrderPvWait = kHeadDim == 128;
  static constexpr int kNTiles = Bc / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kColBlocks = kHeadDim / 64;  // TMA boxes per tile: 64 columns each
  static constexpr int kOChunk = wgmma_column_chunk(kHeadDim);
  static constexpr int kSmemQ = Br * kHeadDim * 2;   // bytes
  static constexpr int kSmemKV = Bc * kHeadDim * 2;  // bytes of one K_j or one V_j
  // How the epilogue stages O in shared memory for coalesced 16-byte stores: the whole tile
  // (Br x D, as Q), or at D = 256, where Q and the ring take 192 KB and the tile would need 64
  // more, 8 rows per consumer warp (8 x 256 x 2 bytes, 32 KB in all), two halves of its rows
  // one after the other (fwd_epilogue.h: store_out_rows_by_halves).
  static constexpr bool kStageOut = kHeadDim <= 128;
  static constexpr int kSmemOut = kStageOut ? kSmemQ : 4 * kConsumers * 8 * kHeadDim * 2;
  // Q_i, the ring of K_j and V_j, then the epilogue's staging area.
  static constexpr int kSmemTiles = kSmemQ + 2 * kStages * kSmemKV + kSmemOut;
  // Barriers after the tiles: full Q, empty Q, full and empty tile slot, the producer's own for
  // a V_j it zeroes rows of, then full K, full V, empty K, empty V per stage.
  static constexpr int kNBarriers = 5 + 4 * kStages;
  // The tile slot after the barriers: the index and the sequence's query start (one 64-bit
  // word), its query and key lengths (another). Then (kKeyMask) each stage's key block
  // visibility: 128 bits, word j bit l for key 4 l + j.
  static constexpr int kSmemSlot = 16;
  static constexpr int kSmemKeyBits = 16 * kStages;
  // Then a word per thread that each consumer's softmax writes its row sums to (see the loop).
  static constexpr int kSmemSumMarks = 4 * kNThreads;
  // +1024: the dynamic shared-memory base is rounded up to the swizzle atom.
  static constexpr int kSmemBytes =
      kSmemTiles + 8 * kNBarriers + kSmemSlot + kSmemKeyBits + kSmemSumMarks + 1024;
  // kBias variants only, after the rest: per consumer a full and an empty mbarrier, then on the
  // next swizzle atom each consumer's 64 rows of a key block's mask tile (two 64-column boxes,
  // 128-byte swizzled as K_j). One buffer per consumer, not per stage: two stages of the whole
  // tile would not fit beside D = 128's ring (exactly 227 KB as it is: 32 KB over the plain
  // kernel's 195 KB).
  static constexpr int kSmemBiasConsumer = 64 * Bc * 2;
  static constexpr int kSmemBiasBars = kSmemBytes - 1024;
  static constexpr int kSmemBiasOffset = (kSmemBiasBars + 16 * kConsumers + 1023) / 1024 * 1024;
  static constexpr int kSmemBytesBias = kSmemBiasOffset + kConsumers * kSmemBiasConsumer + 1024;
  // Per-thread registers after reallocation; the sum over warpgroups stays within the 64K file
  // (128 * (producer + kConsumers * consumer) <= 65536), each a multiple of 8.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  // Under a causal bound a consumer's last key block may hold no key its 64 rows see in its right
  // half (D = 64: every other consumer where Br's multiples of 64 sit on the diagonal); the
  // kernel then computes the left half alone. Not at D = 128 (the first consumer of every block):
  // it compiles clean since session 26's left-half softmax, but D = 128 causal calls then run the
  // end-aligned kernel, whose schedule ptxas makes 2-5 % slower from N = 2k than the plain one
  // (H100, benchmarks/results/design/cuda-hopper-forward.md); half blocks gained 1 % at 1k only.
  static constexpr bool kHalfBlocks = Bc == 128 && kConsumers == 3;
  // Named barriers: 0 is __syncthreads; 1 + c consumer c's turn.
  static constexpr int kBarTurn0 = 1;

  static_assert(sizeof(Elem) == 2, "wgmma path is for fp16/bf16");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "whole 64-column boxes");
  static_assert(kHeadDim % kOChunk == 0, "whole PV chunks");
  // Bc = 64 (a wgmma N too) with three consumers failed 4 of the kernel's tests in session 9
  // (never shipped, not pursued). D = 256 takes Bc = 64 with two consumers: 128-key blocks
  // would not fit two stages in shared memory.
  static_assert(Bc == 128 || (kHeadDim >= 192 && Bc == 64 && kConsumers == 2),
                "the key blocks this kernel is tested with");
  static_assert(kConsumers == 2 || kConsumers == 3, "Br <= 256: one TMA box of Q rows");
  static_assert(kStages >= 2, "the turn order needs a buffer of slack (no deadlock at 1)");
  // setmaxnreg only moves registers within the CTA's launch allocation (ptxas caps each thread
  // at 65536 / kNThreads rounded down to 8 by __launch_bounds__(kNThreads, 1)): asking for more
  // would leave setmaxnreg.inc waiting forever.
  static constexpr int kEntryRegs = 65536 / kNThreads / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kEntryRegs * kNThreads,
                "register reallocation within the launch allocation");
  static_assert(kSmemBytes <= 227 * 1024, "sm_90's per-block shared-memory limit");
  // Where the kBias variants exist (D <= 128: Bc = 128, O staged like Q).
  static constexpr bool kTakesBias = Bc == 128 && kStageOut;
  static_assert(!kTakesBias || kSmemBytesBias <= 227 * 1024,
                "the mask buffers fit beside the ring");
};

// kEndAligned, the kernel for calls under a right window bound (causal): a head's query blocks
// end near its last row, so where Br does not divide seqlen_q the first block starts before row 0
// (r0 < 0, a multiple of 16): TMA zero-fills Q's rows there, and output, lse and rows without keys
// are written from row 0 on. And (kHalfBlocks) a consumer's last key block is computed as its left
// half where its rows see nothing in the right half. The launch says when it is taken.
// kDropout: dropout on P (dropout.h) after the row sums took it (l normalizes the undropped
// probabilities; lse is the undropped one), plain scores under any window, dense or packed rows
// (the tile's b is its sequence, r0 and the key blocks count from the sequence's first row, as
// the draws number them): variants of their own, so the others keep their registers.
template <class Tr, bool kVarlen, bool kKeyMask, bool kSoftcap, bool kEndAligned = false,
          bool kDropout = false, bool kBias = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    attention_fwd_sm90_ws_kernel(const __grid_constant__ CUtensorMap tm_q,
                                 const __grid_constant__ CUtensorMap tm_k,
                                 const __grid_constant__ CUtensorMap tm_v,
                                 const __grid_constant__ CUtensorMap tm_o,
                                 const __grid_constant__ CUtensorMap tm_mask,
                                 const AttentionParams p, const FwdLaunchFlags flags,
                                 const WsSchedule sched) {
#ifdef FLASHMOD_SM90A
  static_assert(!(kVarlen && kKeyMask), "packed rows carry no mask");
  static_assert(!(kKeyMask && kSoftcap), "the launch sends capped masked calls elsewhere");
  static_assert(!kEndAligned || (!kVarlen && Tr::kStageOut),
                "rows before a head's first are skipped by the copy engine's epilogue only");
  static_assert(!kEndAligned || (!kKeyMask && !kSoftcap), "half blocks mask by windows alone");
  static_assert(!kKeyMask || Tr::Bc == 128, "a key block's mask bytes: 4 per lane of one warp");
  static_assert(!kDropout || (!kKeyMask && !kSoftcap && !kEndAligned),
                "dropout: plain scores (dense or packed rows), whole key blocks");
  static_assert(
      !kBias || (Tr::kTakesBias && !kVarlen && !kKeyMask && !kSoftcap && !kEndAligned && !kDropout),
      "an additive mask: dense rows, plain tiles, no other transform");
  using Elem = typename Tr::Elem;
  using Mma = Mma16816<Elem>;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kStages = Tr::kStages;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles, kConsumers = Tr::kConsumers;
  // Causal blocks only (kEndAligned), so the other instantiations keep their machine code.
  constexpr bool kHalfBlocks = kEndAligned && Tr::kHalfBlocks;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warpgroup = warp / 4;
  const int Nq = static_cast<int>(p.seqlen_q);
  const int num_m_blocks = (Nq + Br - 1) / Br;
  // Tile indices are 32-bit (the launch checks the count): they feed 32-bit divisions, which the
  // producer's 24 registers hold without spilling.
  const uint32_t num_tiles = static_cast<uint32_t>(cta_count(p, Br));
  // A tile's rows and visible key blocks; producer and consumers derive the same ones, so they
  // agree on which tiles load nothing (no visible key) and on every barrier's count.
  struct Tile {
    CtaTile t;
    int r0, rows_q;  // rows_q <= 0: past its sequence's queries (kVarlen), nothing to do
    KeyBlockRange range;
    const uint8_t* classes;  // kBias: its mask tiles' classes (nullptr: every tile mixed)
  };
  const bool dynamic = sched.next_tile != nullptr;
  // The call itself, or (kVarlen) one sequence of it (sequence_view.h).
  auto view_of = [&](const SeqExtents& e) {
    return kVarlen ? packed_view(p, e.q_start, e.q_len, e.k_start, e.k_len) : p;
  };
  auto tile_of = [&](const CtaTile& t, const AttentionParams& s) {
    Tile x;
    x.t = t;
    // kBias: a mask that hides keys hides them most often as a causal mask does (transformers'),
    // so there too a head's last query blocks, which see the most keys, go first (cta_tile_at
    // already reverses them under a right window bound).
    if constexpr (kBias) {
      if (s.window_right < 0) x.t.m_block = num_m_blocks - 1 - x.t.m_block;
    }
    if constexpr (kEndAligned) {
      // The first block ends at the first multiple of 16 rows at or past its share of the rows
      // (seqlen_q % Br, or Br), so its rows before row 0 fill whole output boxes, which are
      // skipped (a TMA store at a negative row is an illegal instruction; loads there read
      // zeros). The last block may then reach up to 15 rows past the head's end, which the
      // tensor map clips as before. Where Br divides seqlen_q, the blocks are the plain ones.
      const int first_end = ((static_cast<int>(s.seqlen_q) - 1) % Br + 16) & ~15;
      x.r0 = first_end - Br + x.t.m_block * Br;
    } else {
      x.r0 = x.t.m_block * Br;
    }
    x.rows_q = min(Br, static_cast<int>(s.seqlen_q) - x.r0);
    if constexpr (kEndAligned)
      x.range = key_block_range(s, max(0, x.r0), x.r0 + x.rows_q - 1, Bc);
    else
      x.range = x.rows_q > 0 ? key_block_range(s, x.r0, x.r0 + x.rows_q - 1, Bc) : KeyBlockRange{};
    x.classes = nullptr;
    if constexpr (kBias) {
      x.classes = mask_tile_row(s, x.t.b, x.t.h, x.t.m_block, Br, Bc);
      skip_hidden_tiles(x.classes, x.range);  // both ends: producer and consumers alike
    }
    return x;
  };

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t sQ_addr = (raw_addr + 1023) & ~1023u;
  const uint32_t sK_addr0 = sQ_addr + Tr::kSmemQ;              // kStages buffers of K_j
  const uint32_t sV_addr0 = sK_addr0 + kStages * Tr::kSmemKV;  // kStages buffers of V_j
  const uint32_t sO_addr = sV_addr0 + kStages * Tr::kSmemKV;   // the staging area
  const uint32_t bar0 = sQ_addr + Tr::kSmemTiles;
  const uint32_t full_q = bar0, empty_q = bar0 + 8;
  const uint32_t full_slot = bar0 + 16, empty_slot = bar0 + 24, tail_v = bar0 + 32;
  auto full_k = [&](int s) { return bar0 + 8 * (5 + s); };
  auto full_v = [&](int s) { return bar0 + 8 * (5 + kStages + s); };
  auto empty_k = [&](int s) { return bar0 + 8 * (5 + 2 * kStages + s); };
  auto empty_v = [&](int s) { return bar0 + 8 * (5 + 3 * kStages + s); };
  unsigned long long* slot =
      reinterpret_cast<unsigned long long*>(smem_raw + (bar0 + 8 * Tr::kNBarriers - raw_addr));
  // Stage st's key bits: key_bits[2 st] holds words 0-1, key_bits[2 st + 1] words 2-3. Written
  // and read with atomics, ordered by full_k / empty_k like the tile slot (racecheck).
  unsigned long long* key_bits = slot + 2;
  // This thread's word of the softmax's sum marks (after the key bits).
  const uint32_t sum_mark = bar0 + 8 * Tr::kNBarriers + Tr::kSmemSlot + Tr::kSmemKeyBits + 4 * tid;
  // kBias: consumer c's mask rows and its two barriers.
  const uint32_t sBias_addr0 = sQ_addr + Tr::kSmemBiasOffset;
  const uint32_t bias_bar0 = sQ_addr + Tr::kSmemBiasBars;
  auto full_bias = [&](int c) { return bias_bar0 + 16 * c; };
  auto empty_bias = [&](int c) { return bias_bar0 + 16 * c + 8; };

  if (tid == 0) {
    mbarrier_init(full_q, 1);
    mbarrier_init(empty_q, 4 * kConsumers);  // one arrival per consumer warp
    mbarrier_init(full_slot, 1);
    mbarrier_init(empty_slot, 4 * kConsumers);
    mbarrier_init(tail_v, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_k(s), 1);
      mbarrier_init(full_v(s), 1);
      mbarrier_init(empty_k(s), 4 * kConsumers);
      mbarrier_init(empty_v(s), 4 * kConsumers);
    }
    if constexpr (kBias) {
      for (int c = 0; c < kConsumers; ++c) {
        mbarrier_init(full_bias(c), 1);
        mbarrier_init(empty_bias(c), 4);  // one arrival per warp of that consumer
      }
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  // Round r of a buffer (r = its use count so far) waits, on "full", for phase parity r & 1; the
  // producer's reuse of it waits, on "empty", for the consumers' release of round r - 1: parity
  // (r & 1) ^ 1, which a fresh barrier reports as complete for round 0. `blocks` counts the key
  // blocks this CTA has gone through (buffer blocks % kStages, round blocks / kStages), `tiles`
  // the tiles that loaded a Q, `claims` the indices passed through the tile slot (dynamic
  // schedule only: every index goes through it, the last one, past num_tiles, telling the
  // consumers to stop). full_slot orders the producer's write before the consumers' reads and
  // empty_slot their reads before its next write; the accesses are atomics all the same, since
  // compute-sanitizer's racecheck does not see mbarriers (nor named barriers, tried) order them.
  if (warpgroup == 0) {
    // Producer. Warps 1-3 leave at once; their registers go to the consumers.
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (warp != 0) return;
    const bool leader = lane == 0;
    if (leader) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      if constexpr (kBias) prefetch_tensor_map(&tm_mask);
    }
    // A tile's sequence (kVarlen: from cu_seqlens; L2 hits after the first tile of a sequence).
    auto extents_of = [&](const CtaTile& t) {
      SeqExtents e{0, static_cast<uint32_t>(p.seqlen_q), 0, static_cast<uint32_t>(p.seqlen_k)};
      if constexpr (kVarlen) {
        e.q_start = p.cu_seqlens_q[t.b];
        e.q_len = p.cu_seqlens_q[t.b + 1] - e.q_start;
        e.k_start = p.cu_seqlens_k[t.b];
        e.k_len = p.cu_seqlens_k[t.b + 1] - e.k_start;
      }
      return e;
    };
    auto claim_next = [&](uint32_t index) {
      if (!dynamic) return index + gridDim.x;
      uint32_t claim = 0;
      if (leader) claim = atomicAdd(sched.next_tile, 1u);
      return gridDim.x + __shfl_sync(0xffffffffu, claim, 0);
    };
    int blocks = 0, tiles = 0, tails = 0, bias_rounds = 0;
    for (uint32_t index = blockIdx.x, claims = 0;; ++claims) {
      SeqExtents e{};
      Tile x{};
      // Tiles past their sequence's queries (kVarlen) are skipped here, never handed on.
      for (; index < num_tiles; index = claim_next(index)) {
        const CtaTile t = cta_tile_at<uint32_t>(p, index, num_m_blocks, 1);
        e = extents_of(t);
        x = tile_of(t, view_of(e));
        if (x.rows_q > 0) break;
      }
      if (dynamic) {
        mbarrier_wait(empty_slot, (claims & 1) ^ 1);  // every consumer warp read the last one
        if (leader) {
          atomicExch(slot, index | static_cast<unsigned long long>(e.q_start) << 32);
          if constexpr (kVarlen)
            atomicExch(slot + 1, e.q_len | static_cast<unsigned long long>(e.k_len) << 32);
          mbarrier_arrive(full_slot);  // release: the writes above come first
        }
      }
      if (index >= num_tiles) break;
      // Packed rows: one (batch, head) plane, the sequence's rows from its start.
      const int b = kVarlen ? 0 : static_cast<int>(x.t.b), h = static_cast<int>(x.t.h);
      const int hk = static_cast<int>(x.t.hk);
      const int q_row0 = e.q_start + x.r0, k_row0 = e.k_start;
      for (int n = x.range.lo; n < x.range.hi; ++n, ++blocks) {  // none: rows without keys
        const int st = blocks % kStages;
        const uint32_t parity = ((blocks / kStages) & 1) ^ 1;
        // kKeyMask: lane l reads the mask bytes of keys n Bc + 4 l .. + 3 (read before the wait,
        // so their latency hides under it) and ballot j gathers byte j of every lane.
        unsigned long long bits01 = 0, bits23 = 0;
        if constexpr (kKeyMask) {
          const uint8_t* mask_row =
              static_cast<const uint8_t*>(p.mask) + x.t.b * p.mask_batch_stride;
          uint32_t w[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int64_t key = static_cast<int64_t>(n) * Bc + 4 * lane + j;
            const bool seen = key < p.seqlen_k && mask_row[key * p.mask_col_stride] != 0;
            w[j] = __ballot_sync(0xffffffffu, seen);
          }
          bits01 = w[0] | static_cast<unsigned long long>(w[1]) << 32;
          bits23 = w[2] | static_cast<unsigned long long>(w[3]) << 32;
        }
        // kBias: whether this block's mask tile is read (its class, read before the wait).
        const bool bias_tile = kBias && tile_needs_mask(x.classes, n);
        mbarrier_wait(empty_k(st), parity);
        if (leader) {
          if constexpr (kKeyMask) {
            atomicExch(key_bits + 2 * st, bits01);
            atomicExch(key_bits + 2 * st + 1, bits23);
          }
          mbarrier_arrive_expect_tx(full_k(st), Tr::kSmemKV);  // release: the bits come first
#pragma unroll
          for (int cb = 0; cb < Tr::kColBlocks; ++cb)
            tma_load_4d(sK_addr0 + st * Tr::kSmemKV + cb * Bc * 128, &tm_k, cb * 64,
                        k_row0 + n * Bc, hk, b, full_k(st));
        }
        // Q after the first K: that K's buffer is free earlier than Q's (released only after the
        // previous tile's last S).
        if (n == x.range.lo) {
          mbarrier_wait(empty_q, (tiles & 1) ^ 1);
          if (leader) {
            mbarrier_arrive_expect_tx(full_q, Tr::kSmemQ);
#pragma unroll
            for (int cb = 0; cb < Tr::kColBlocks; ++cb)
              tma_load_4d(sQ_addr + cb * Br * 128, &tm_q, cb * 64, q_row0, h, b, full_q);
          }
          ++tiles;
        }
        // The mask rows of each consumer, once that consumer's softmax is done with its last
        // ones; before V_j, which no consumer needs before this block's softmax.
        if (bias_tile) {
          const int mask_b = p.mask_batch_stride != 0 ? b : 0;
          const int mask_h = p.mask_head_stride != 0 ? h : 0;
          for (int c = 0; c < kConsumers; ++c) {
            mbarrier_wait(empty_bias(c), (bias_rounds & 1) ^ 1);
            if (leader) {
              mbarrier_arrive_expect_tx(full_bias(c), Tr::kSmemBiasConsumer);
#pragma unroll
              for (int cb = 0; cb < Bc / 64; ++cb)
                tma_load_4d(sBias_addr0 + c * Tr::kSmemBiasConsumer + cb * 64 * 128, &tm_mask,
                            n * Bc + cb * 64, q_row0 + 64 * c, mask_h, mask_b, full_bias(c));
            }
          }
          ++bias_rounds;
        }
        mbarrier_wait(empty_v(st), parity);
        const uint32_t sV = sV_addr0 + st * Tr::kSmemKV;
        // kVarlen: rows of V_j past this sequence's keys (another sequence's) are zeroed before
        // the consumers may read it, so the box lands on tail_v first and full_v completes by
        // an arrival once the zeros are written.
        const int own_rows = static_cast<int>(e.k_len) - n * Bc;
        const bool zero_tail = kVarlen && own_rows < Bc;
        if (leader) {
          const uint32_t done = zero_tail ? tail_v : full_v(st);
          mbarrier_arrive_expect_tx(done, Tr::kSmemKV);
#pragma unroll
          for (int cb = 0; cb < Tr::kColBlocks; ++cb)
            tma_load_4d(sV + cb * Bc * 128, &tm_v, cb * 64, k_row0 + n * Bc, hk, b, done);
        }
        if (zero_tail) {
          mbarrier_wait(tail_v, tails++ & 1);
          // Row r of a 64-column box is the 128 bytes at r * 128 whatever the swizzle, so rows
          // own_rows.. of each box are one run of bytes.
          const uint32_t zero_bytes = (Bc - own_rows) * 128;
          for (int cb = 0; cb < Tr::kColBlocks; ++cb)
            for (uint32_t off = 16 * lane; off < zero_bytes; off += 16 * 32)
              sts_128(sV + cb * Bc * 128 + own_rows * 128 + off, {0u, 0u, 0u, 0u});
          fence_proxy_async_smem();  // the zeros reach the tensor cores' (async) view
          __syncwarp();
          if (leader) mbarrier_arrive(full_v(st));
        }
      }
      index = claim_next(index);
    }
    // This CTA claims no more tiles. The last CTA to get here zeroes the claim counter and the
    // count of finished CTAs, so the next launch on the stream finds them zero (no memset).
    if (dynamic && leader) {
      __threadfence();  // this CTA's claims come before its count
      if (atomicAdd(sched.next_tile + 1, 1u) == gridDim.x - 1) {
        __threadfence();  // and every CTA's claims before the reset
        atomicExch(sched.next_tile, 0u);
        atomicExch(sched.next_tile + 1, 0u);
      }
    }
  } else {
    setmaxnreg_inc<Tr::kConsumerRegs>();
    // Broadcast from lane 0: ptxas then knows it is the same across the warp, so what derives
    // from it (this consumer's key range, the loop bounds) stays on the uniform datapath. Taken
    // from threadIdx directly, the main loop's bounds became per-thread values and its wgmma
    // descriptors went through R2UR at every k-step: every shape ran 10-14% slower.
    const int consumer = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    const int warp_row0 = 16 * (warp - 4);  // row of this warp's first row within Q_i

    // Descriptors as in fwd_sm90_kernel.h: Q (this consumer's 64 rows) and K_j K-major, V_j
    // MN-major with its 64-wide column blocks Bc * 128 bytes apart.
    const uint64_t q_desc = sw128_desc(sQ_addr + consumer * 64 * 128, 16, 1024);
    const uint64_t k_desc0 = sw128_desc(sK_addr0, 16, 1024);
    const uint64_t v_desc0 = sw128_desc(sV_addr0, Bc * 128, 1024);
    auto k_step = [](int ks, int rows) {
      return static_cast<uint32_t>((ks / 4) * rows * 128 + (ks % 4) * 32);
    };
    // The turn: wait for this consumer's barrier, issue, signal the next consumer's. Per tile,
    // the last consumer signals consumer 0 once up front and skips its signal after its last
    // turn, so every barrier phase completes within the tile (nothing half-arrived at exit).
    const uint32_t bar_mine = Tr::kBarTurn0 + consumer;
    const uint32_t bar_next = Tr::kBarTurn0 + (consumer + 1) % kConsumers;
    const bool last_consumer = consumer == kConsumers - 1;
    // exp2 units: raw q.k carries the scale; capped and masked (kBias) scores are logits already.
    const float c = (kSoftcap || kBias ? 1.f : static_cast<float>(p.scale)) * 1.4426950408889634f;
    const float softcap = static_cast<float>(p.softcap);
    const float inv_softcap = kSoftcap ? static_cast<float>(1.0 / p.softcap) : 0.f;
    const float scale = static_cast<float>(p.scale);
    Elem* sO = reinterpret_cast<Elem*>(smem_raw + (sO_addr - raw_addr));

    float O[1][DT][4];
    OnlineSoftmax<1> softmax;
    float alpha[1][2];
    float S[1][NT][4];
    uint32_t pa[Bc / 16][4];
    // The lane's two row windows, computed once per tile: per block they would cost registers.
    RowWindow win[1][2];
    // The rng words live in registers (read from device memory once); the threshold and scale
    // are read from the kernel's parameters where used (two registers fewer across the loop:
    // the D = 128 variant spilled 28 bytes with all five held).
    DropoutState rng_words;
    if constexpr (kDropout) rng_words = dropout_state(p);

    // half (kHalfBlocks): no row of this consumer sees a key in the block's right half, so only
    // its left half's scores are computed (mask_and_softmax turns only those into P) and only
    // that half of P meets V.
    auto issue_scores = [&](int s, auto half_tag) {
      const uint64_t k_desc = desc_advance(k_desc0, s * Tr::kSmemKV);
      wgmma_fence();  // S's registers were last touched by ordinary instructions
      if constexpr (decltype(half_tag)::value) {
        auto& s_left = *reinterpret_cast<float (*)[NT / 2][4]>(&S[0][0]);
        // Named through half_tag so it is instantiated only where half blocks exist: at D = 256
        // (Bc = 64) a plain Wgmma<Elem, Bc / 2> would name the undefined N = 32 form.
        using HalfWgmma = Wgmma<Elem, decltype(half_tag)::value ? Bc / 2 : Bc>;
#pragma unroll
        for (int ks = 0; ks < Tr::kKSteps; ++ks)
          HalfWgmma::ss(s_left, desc_advance(q_desc, k_step(ks, Br)),
                        desc_advance(k_desc, k_step(ks, Bc)), ks > 0);
      } else {
#pragma unroll
        for (int ks = 0; ks < Tr::kKSteps; ++ks)
          Wgmma<Elem, Bc>::ss(S[0], desc_advance(q_desc, k_step(ks, Br)),
                              desc_advance(k_desc, k_step(ks, Bc)), ks > 0);
      }
      wgmma_commit();
    };
    auto issue_pv = [&](int s, bool half) {
      const uint64_t v_desc = desc_advance(v_desc0, s * Tr::kSmemKV);
      // O (rescaled) and P were written by ordinary instructions: pinned first so those writes
      // stay ahead of the fence.
      pin_registers(O[0]);
      pin_registers(pa);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Bc / 16; ++kk) {
        if (kHalfBlocks && half && kk >= Bc / 32) break;  // P is 0 there
#pragma unroll
        for (int oc = 0; oc < D / Tr::kOChunk; ++oc) {
          // Columns [oc * kOChunk, ...) of O and of V_j: n8 tiles from oc * kOChunk / 8, V's
          // 64-wide column blocks from oc * kOChunk / 64 (each Bc * 128 bytes).
          auto& o_chunk =
              *reinterpret_cast<float (*)[Tr::kOChunk / 8][4]>(&O[0][oc * Tr::kOChunk / 8]);
          Wgmma<Elem, Tr::kOChunk>::rs_accumulate(
              o_chunk, pa[kk],
              desc_advance(v_desc, kk * 2048 + (oc * Tr::kOChunk / 64) * Bc * 128));
        }
      }
      wgmma_commit();
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) mbarrier_arrive(bar);
    };
    // kBias: S -> logits, scaled and (where the block's tile was read) plus this consumer's mask
    // rows, the keys whose entry is at or below kHidingMaskValue hidden. A lane's words: rows
    // lane / 4 (+ 8) of its warp's 16, keys 8 ni + 2 (lane % 4), + 1, in box ni / 8 at chunk
    // ni % 8 xor the row's swizzle phase, so the eight rows of a load hit eight distinct 16-byte
    // slots (conflict-free). Each kind of block has a loop of its own (a load under a branch became
    // a branch per load, staged_mask.h): not read (clear), the scale alone; read, the values added
    // and tested for hiding; read from a tile that hides no key (kTileShownAdded, a dense bias),
    // added untested.
    enum BiasBlock { kBiasNone, kBiasTested, kBiasShown };
    auto bias_block = [&](const uint8_t* classes, int n) {
      if (!kBias || !tile_needs_mask(classes, n)) return kBiasNone;
      return flags.mask_shown_tiles && tile_hides_no_key(classes, n) ? kBiasShown : kBiasTested;
    };
    int bias_rounds = 0;
    const uint32_t bias_rows = sBias_addr0 + consumer * Tr::kSmemBiasConsumer;
    auto add_mask_rows = [&](auto test_tag) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = 16 * (warp % 4) + lane / 4 + 8 * hh;
        const uint32_t row_addr = bias_rows + row * 128 + 4 * (lane % 4);
        const uint32_t phase = static_cast<uint32_t>(row % 8) * 16;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) {
          uint32_t word = lds_32(row_addr + (ni / 8) * 64 * 128 + (((ni % 8) * 16) ^ phase));
          float2 values;
          if constexpr (std::is_same_v<Elem, __nv_bfloat16>)
            values = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
          else
            values = __half22float2(*reinterpret_cast<const __half2*>(&word));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float value = e == 0 ? values.x : values.y;
            const float x = fmaf(S[0][ni][2 * hh + e], scale, value);
            S[0][ni][2 * hh + e] =
                decltype(test_tag)::value && mask_value_hides(value) ? -CUDART_INF_F : x;
          }
        }
      }
    };
    auto mask_to_logits = [&](BiasBlock block) {
      if (block == kBiasNone) {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[0][ni][e] *= scale;
        return;
      }
      mbarrier_wait(full_bias(consumer), bias_rounds & 1);
      if (block == kBiasShown)
        add_mask_rows(std::false_type{});
      else
        add_mask_rows(std::true_type{});
      __syncwarp();  // every lane's reads of the rows, before lane 0 hands them back
      release(empty_bias(consumer));
      ++bias_rounds;
    };
    // A block past this consumer's own (read, never used): handed back once it landed.
    auto skip_mask_rows = [&](bool tile_read) {
      if (!tile_read) return;
      mbarrier_wait(full_bias(consumer), bias_rounds & 1);
      release(empty_bias(consumer));
      ++bias_rounds;
    };
    // Stage st's key bits (kKeyMask; once full_k(st) completed, before K_j is released).
    auto take_key_bits = [&](int st) {
      KeyBits bits{{0u, 0u}, true};
      if constexpr (kKeyMask) {
        unsigned long long w01 = 0, w23 = 0;
        if (lane == 0)
          w01 = atomicOr(key_bits + 2 * st, 0ull), w23 = atomicOr(key_bits + 2 * st + 1, 0ull);
        w01 = __shfl_sync(0xffffffffu, w01, 0);
        w23 = __shfl_sync(0xffffffffu, w23, 0);
        // Columns 2 (lane % 4) + e sit in words (2 (lane % 4) + e) % 4: 0-1 or 2-3.
        const unsigned long long mine = (lane % 4) & 1 ? w23 : w01;
        bits.w[0] = static_cast<uint32_t>(mine);
        bits.w[1] = static_cast<uint32_t>(mine >> 32);
        bits.all = (w01 & w23) == ~0ull;
      }
      return bits;
    };
    // P packed to 16 bits: the register A operand of the next PV (a half block's left half only:
    // its P.V reads no more).
    auto pack_p = [&](auto half_tag) {
      constexpr int kk_end = decltype(half_tag)::value ? Bc / 32 : Bc / 16;
#pragma unroll
      for (int kk = 0; kk < kk_end; ++kk) {
        pa[kk][0] = Mma::pack(S[0][2 * kk][0], S[0][2 * kk][1]);
        pa[kk][1] = Mma::pack(S[0][2 * kk][2], S[0][2 * kk][3]);
        pa[kk][2] = Mma::pack(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
        pa[kk][3] = Mma::pack(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
      }
    };

    int blocks = 0, tiles = 0;
    // (Under the dynamic schedule the slot overwrites the step.)
    for (uint32_t index = blockIdx.x, claims = 0;; index += gridDim.x, ++claims) {
      SeqExtents e{0, static_cast<uint32_t>(p.seqlen_q), 0, static_cast<uint32_t>(p.seqlen_k)};
      if (dynamic) {
        mbarrier_wait(full_slot, claims & 1);
        unsigned long long word0 = 0, word1 = 0;
        if (lane == 0) {
          word0 = atomicOr(slot, 0ull);
          if constexpr (kVarlen) word1 = atomicOr(slot + 1, 0ull);
        }
        release(empty_slot);  // lane 0, after its reads
        word0 = __shfl_sync(0xffffffffu, word0, 0);
        index = static_cast<uint32_t>(word0);
        if constexpr (kVarlen) {
          word1 = __shfl_sync(0xffffffffu, word1, 0);
          e = {static_cast<uint32_t>(word0 >> 32), static_cast<uint32_t>(word1), 0,
               static_cast<uint32_t>(word1 >> 32)};
        }
      }
      if (index >= num_tiles) break;
      // The call, or this tile's sequence alone: its rows, lengths, diagonal and output rows.
      const AttentionParams seq = view_of(e);
      const Tile x = tile_of(cta_tile_at<uint32_t>(p, index, num_m_blocks, 1), seq);
      const int r0 = x.r0, lo = x.range.lo, hi = x.range.hi;
      const TilePointers<Elem> gp = tile_pointers<Elem>(seq, x.t, r0);
      const uint32_t dropout_bh = static_cast<uint32_t>(x.t.b * p.heads_q + x.t.h);
      // kEndAligned: rows of the tile before the head's first (r0 < 0) are not written.
      if (lo >= hi) {
        const int first_row = kEndAligned ? max(0, -r0) : 0;
        write_rows_without_keys<128 * kConsumers>(seq, gp.out + first_row * seq.out_row_stride,
                                                  gp.lse + first_row, x.rows_q - first_row,
                                                  tid - 128);
        continue;
      }
      // This consumer's own rows see no key block past mhi - 1: under a causal bound the first
      // 64 rows of a 192-row tile see a block fewer than its last, and rows past seqlen_q (a
      // head's last tile) none (they compute block lo alone). It computes blocks [lo, mhi); for
      // the rest it takes and passes the turns and releases the buffers once loaded, so the turn
      // chain and the buffer counts stay the tile's.
      int mhi = lo + 1;
      bool half_last = false;  // kHalfBlocks: block mhi - 1 is computed as its left half alone
      {
        const int own_row0 = r0 + 64 * consumer, own_rows = min(64, x.rows_q - 64 * consumer);
        if (own_rows > 0)
          mhi = max(mhi, min(hi, key_block_range(seq, own_row0, own_row0 + own_rows - 1, Bc).hi));
        if constexpr (kHalfBlocks) {
          // In units of half blocks: no own row sees a key past the left half of block mhi - 1.
          half_last =
              flags.half_blocks && own_rows > 0 &&
              key_block_range(seq, own_row0, own_row0 + own_rows - 1, Bc / 2).hi <= 2 * mhi - 1;
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        win[0][hh] = row_window(seq, r0 + warp_row0 + lane / 4 + 8 * hh);
      // Mask and softmax of block n's scores: S -> P in place, alpha for O. Only blocks that
      // straddle a window of this consumer's own 64 rows, or seqlen_k, test elements (the
      // tile's 192 rows at D = 64 straddle a causal diagonal in one block more than a
      // consumer's do); only blocks with a hidden key test key bits.
      const int own_first = r0 + 64 * consumer;
      auto mask_and_softmax = [&](int n, const KeyBits& bits, BiasBlock bias, auto half_tag) {
        if constexpr (decltype(half_tag)::value) {
          // Half block: no score was computed in the right half and no row sees a key there, so
          // the softmax runs over the left half alone (the sum and max a right half of -inf
          // would give, bit for bit) and P.V stops after the left half's k-steps (issue_pv).
          // The right half's registers are then rewritten: their stale values, left to live until
          // the next block's wgmma names them as accumulators, made ptxas serialize every wgmma
          // of the kernel (C7511).
          auto& s_left = *reinterpret_cast<float (*)[1][NT / 2][4]>(&S);
          if (!key_block_unmasked(seq, own_first, own_first + 63, n, Bc))
            mask_outside_windows(s_left, win, n * Bc + 2 * (lane % 4));
          softmax.scores_to_p(s_left, c, alpha);
#pragma unroll
          for (int ni = NT / 2; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) S[0][ni][e] = 0.f;
          return;
        }
        if constexpr (kSoftcap) {
#pragma unroll
          for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              S[0][ni][e] = soft_cap(S[0][ni][e] * scale, softcap, inv_softcap);
        }
        if constexpr (kBias) mask_to_logits(bias);
        if (!key_block_unmasked(seq, own_first, own_first + 63, n, Bc))
          mask_outside_windows(S, win, n * Bc + 2 * (lane % 4));
        if constexpr (kKeyMask) {
          if (!bits.all) hide_keys(S, bits, lane);
        }
        softmax.scores_to_p(S, c, alpha);
        if constexpr (kDropout) {
          // keep_bits_query_rows' 64-key parts (one 32-bit mask each): query rows r0 + warp_row0
          // + lane / 4 (+ 8), keys n * Bc + 64 part + 8 ni + 2 (lane % 4) + e % 2.
          static_assert(NT % 8 == 0, "whole 64-key parts");
          DropoutState drop = rng_words;
          drop.threshold = p.dropout_threshold;
          drop.scale = static_cast<float>(p.dropout_scale);
#pragma unroll
          for (int part = 0; part < NT / 8; ++part) {
            auto& s_part = *reinterpret_cast<float (*)[8][4]>(&S[0][8 * part]);
            apply_dropout(s_part,
                          keep_bits_query_rows<8>(
                              drop, dropout_bh, static_cast<uint32_t>(r0 + warp_row0 + lane / 4),
                              static_cast<uint32_t>(n * Bc + 64 * part), lane % 4),
                          drop.scale);
          }
        }
      };
#pragma unroll
      for (int di = 0; di < DT; ++di)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[0][di][e] = 0.f;
      softmax.init();
      if (last_consumer) named_barrier_arrive(Tr::kBarTurn0, 256);

      mbarrier_wait(full_q, tiles & 1);
      // First block: S only.
      auto first_block = [&](auto half_tag) {
        const int s = blocks % kStages;
        const BiasBlock bias = bias_block(x.classes, lo);  // its class read before the wait
        mbarrier_wait(full_k(s), (blocks / kStages) & 1);
        const KeyBits bits = take_key_bits(s);
        named_barrier(bar_mine, 256);
        issue_scores(s, half_tag);
        if (!(last_consumer && hi - lo == 1)) named_barrier_arrive(bar_next, 256);
        wgmma_wait<0>();
        pin_registers(S[0]);
        release(empty_k(s));
        if (mhi - lo == 1) release(empty_q);  // its last S: the next Q may come in
        mask_and_softmax(lo, bits, bias, half_tag);
        pack_p(half_tag);
      };
      auto next_block = [&](int n, auto half_tag) {
        const int prev = blocks + n - lo - 1, cur = prev + 1;
        const int s = cur % kStages, sp = prev % kStages;
        const BiasBlock bias = bias_block(x.classes, n);  // its class read before the wait
        mbarrier_wait(full_k(s), (cur / kStages) & 1);
        const KeyBits bits = take_key_bits(s);
        named_barrier(bar_mine, 256);
        issue_scores(s, half_tag);
        // PV_{j-1} finished last iteration, so O is free to rescale while S_j runs.
        OnlineSoftmax<1>::rescale(O, alpha);
        mbarrier_wait(full_v(sp), (prev / kStages) & 1);
        issue_pv(sp, false);
        if (!(last_consumer && n == hi - 1)) named_barrier_arrive(bar_next, 256);
        wgmma_wait<1>();  // S_j done (groups retire in order); PV_{j-1} may still run
        pin_registers(S[0]);
        release(empty_k(s));
        if (n == mhi - 1) release(empty_q);
        // Softmax of S_j in S's own registers; pa still feeds PV_{j-1}, so packing waits for it.
        mask_and_softmax(n, bits, bias, half_tag);
        // Left to itself, ptxas hoists this wait to the softmax's first instructions (it packs
        // each part of P as soon as it is ready, and packing needs PV_{j-1} done), so the softmax
        // never ran under PV. It does not move the wait above a shared-memory store, and a store
        // of the row sums can only issue once every exponential is done: with it, all 64 of a
        // thread's exponentials sit between the two waits (tools/sass_softmax_overlap.py).
        if constexpr (Tr::kOrderPvWait && !kKeyMask)
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(sum_mark),
                       "f"(softmax.l[0][0] + softmax.l[0][1])
                       : "memory");
        wgmma_wait<0>();
        pin_registers(O[0]);
        pin_registers(pa);
        release(empty_v(sp));
        pack_p(half_tag);
      };
      // A half block has its own copy of the block's code: a runtime choice between the two
      // widths inside one wgmma pipeline stage made ptxas serialize every wgmma of the kernel
      // (C7511 with a branch, C7515 with predicated instructions). Each copy closes its
      // pipeline (wait<0>) before the next begins.
      if constexpr (kHalfBlocks) {
        if (half_last && mhi - lo == 1)
          first_block(std::true_type{});
        else
          first_block(std::false_type{});
      } else {
        first_block(std::false_type{});
      }
      const int full_end = half_last ? mhi - 1 : mhi;
      for (int n = lo + 1; n < full_end; ++n) next_block(n, std::false_type{});
      if constexpr (kHalfBlocks) {
        if (half_last && mhi - lo >= 2) next_block(mhi - 1, std::true_type{});
      }
      // Its last block's PV, outside the turn order (no matmul of this consumer's follows it).
      {
        const int last = blocks + mhi - lo - 1, s = last % kStages;
        OnlineSoftmax<1>::rescale(O, alpha);
        mbarrier_wait(full_v(s), (last / kStages) & 1);
        issue_pv(s, half_last);
        wgmma_wait<0>();
        pin_registers(O[0]);
        pin_registers(pa);
        release(empty_v(s));
      }
      // The blocks past its own: their turns, and their buffers released once loaded (an
      // arrival before that could count toward the buffer's previous round).
      for (int n = mhi; n < hi; ++n) {
        named_barrier(bar_mine, 256);
        if (!(last_consumer && n == hi - 1)) named_barrier_arrive(bar_next, 256);
        const int b = blocks + n - lo, s = b % kStages;
        mbarrier_wait(full_k(s), (b / kStages) & 1);
        release(empty_k(s));
        mbarrier_wait(full_v(s), (b / kStages) & 1);
        release(empty_v(s));
        if constexpr (kBias) skip_mask_rows(tile_needs_mask(x.classes, n));
      }
      blocks += hi - lo;
      ++tiles;

      // Epilogue through this warp's own rows of the staging area (its 16 rows of the tile, or at
      // D = 256 8 rows of its own): by the copy engine where the output has a tensor map (packed
      // rows have none: a box would reach into the next sequence's rows), else by the warp
      // (fwd_epilogue.h), once the previous tile's copy-out by other lanes is done.
      // (kEndAligned is launched with the output's tensor map only: the warps' stores below
      // would write rows before the head's first.)
      if (!kVarlen && Tr::kStageOut && flags.out_tma) {
        store_out_rows_tma<Tr, kEndAligned>(softmax, O, c, sO_addr, &tm_o, gp.lse, warp_row0,
                                            kEndAligned ? max(0, -r0) : 0, x.rows_q, r0,
                                            static_cast<int>(x.t.h), static_cast<int>(x.t.b), lane);
      } else if constexpr (Tr::kStageOut) {
        __syncwarp();
        store_out_rows<D, 16>(softmax, O, c, sO, seq, flags, gp.out, gp.lse, warp_row0, x.rows_q,
                              lane);
      } else {
        __syncwarp();
        store_out_rows_by_halves<D>(softmax, O, c, sO_addr + warp_row0 * D, seq, flags, gp.out,
                                    gp.lse, warp_row0, x.rows_q, lane);
      }
    }
    // The last tile's output stores finish before the CTA (and its shared memory) does.
    if (lane == 0) tma_store_wait_all();
  }
#else
  __trap();  // launched only where the sm_90a binary runs (see run_attention_fwd_sm90_ws)
#endif
}

}  // namespace flashmod::cuda_kernels::sm90
