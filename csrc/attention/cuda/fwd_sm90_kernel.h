// The Hopper (sm_90a) forward kernel: FlashAttention-2's loop with both matmuls on wgmma.
//
// A CTA owns Br = 64 * kWarpgroups query rows Q_i; warpgroup w owns rows 64w..64w+63 and runs
// the whole loop for them. Per key block K_j, V_j (Bc rows, cp.async double-buffered in
// 128-byte-swizzled shared memory):
//   S = Q_i K_j^T      wgmma, Q and K from shared memory, fp32 accumulators in registers
//   mask, online softmax (m, l, rescale O) on those registers (the portable kernel's code)
//   O += P V_j         wgmma, P packed to 16 bits from the S registers, V from shared memory
// The mma.sync kernel (fwd_sm80_kernel.h) issues every m16n8k16 from each warp and re-reads its
// operands through ldmatrix; here one instruction per warpgroup covers a 64 x Bc x 16 product and
// the tensor cores read shared memory themselves, which is what mma.sync cannot match on sm_90.
#pragma once

#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../../common/cuda/sw128_tile_copy.h"
#include "../../common/cuda/wgmma_ops.h"
#include "../attention_params.h"
#include "cta_tile.h"
#include "entry_points.h"
#include "fwd_epilogue.h"
#include "mask_tiles.h"
#include "online_softmax.h"
#include "paged_kv.h"
#include "score_mask.h"
#include "staged_mask.h"
#include "visibility.h"

namespace flashmod::cuda_kernels::sm90 {

template <typename Elem_, int kHeadDim_, int kBc, int kWarpgroups_, int kStages_,
          int kMinBlocks_ = 1>
struct FwdTraitsSm90 {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int Br = 64 * kWarpgroups;  // wgmma's M is 64 rows per warpgroup
  static constexpr int Bc = kBc;
  static constexpr int kNThreads = 128 * kWarpgroups;
  static constexpr int kStages = kStages_;
  // CTAs per SM the register allocation must allow (__launch_bounds__): independent CTAs overlap
  // one's softmax with another's matmuls without any scheduling code.
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kNTiles = Bc / 8;        // n8 tiles of S per thread
  static constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of O per thread
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kSmemQ = Br * kHeadDim * 2;   // bytes
  static constexpr int kSmemKV = Bc * kHeadDim * 2;  // bytes of one K_j or one V_j
  // +1024: the dynamic shared-memory base is rounded up to the swizzle atom.
  static constexpr int kSmemBytes = kSmemQ + 2 * kStages * kSmemKV + 1024;
  // With an additive mask staged beside K/V (staged_mask.h): one Br x Bc tile per stage.
  using MaskTile = StagedMaskTile<Elem, Br, Bc, kNThreads>;
  static constexpr int kSmemBytesStagedMask = kSmemBytes + kStages * MaskTile::kBytes;

  static_assert(sizeof(Elem) == 2, "wgmma path is for fp16/bf16");
  static constexpr int kOChunk = wgmma_column_chunk(kHeadDim);
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "whole 64-column swizzle blocks");
  static_assert(kHeadDim % kOChunk == 0, "whole PV chunks");
  // The tile copies: whole rows per thread, on the threads that split a row's 16-byte chunks
  // evenly (D = 192: 192 of 256).
  template <int kRows>
  using TileCopy =
      std::conditional_t<kNThreads % (kHeadDim / 8) == 0, Sw128TileCopy<kRows, kHeadDim, kNThreads>,
                         Sw128TileCopyOnSome<kRows, kHeadDim, kNThreads>>;
  static_assert(Bc == 64 || Bc == 128, "wgmma N of S");
  static_assert(kStages >= 2, "one buffer computing, at least one loading");
  static_assert(kSmemBytesStagedMask <= 227 * 1024, "sm_90's per-block shared-memory limit");
};

// kGeneral: an additive mask, a soft cap or a non-positive scale: every score is transformed
// (score_mask.h). kBoolMask (only without kGeneral): a bool mask tensor, prefetched as bits per
// key block; scores stay raw as on the plain path.
// kStagedMask (only with kGeneral and kDense): an additive mask whose tiles are copied into shared
// memory with K_j / V_j (staged_mask.h) rather than read per score from global memory.
// kAddr != kDense: per-sequence extents (varlen, KV-cache lengths, paged K/V), as in the portable
// kernel: the grid is sized from the upper bounds, each CTA works on sequence_view(params, b),
// K/V blocks load through the block table when paged (paged_kv.h), and a CTA whose query block
// lies past its sequence's end exits without writing.
template <class Tr, bool kGeneral, bool kBoolMask, KvAddressing kAddr = kDense,
          bool kStagedMask = false>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    attention_fwd_sm90_kernel(const AttentionParams params, const FwdLaunchFlags flags) {
  static_assert(!(kGeneral && kBoolMask), "the general path applies bool masks itself");
  static_assert(!kStagedMask || (kGeneral && kAddr == kDense),
                "a staged mask is an additive mask tensor, which only dense calls take");
#ifdef FLASHMOD_SM90A
  using Elem = typename Tr::Elem;
  using Mma = Mma16816<Elem>;
  constexpr int D = Tr::kHeadDim, Br = Tr::Br, Bc = Tr::Bc, kThreads = Tr::kNThreads;
  constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t sQ_addr = (raw_addr + 1023) & ~1023u;
  const uint32_t sK_addr0 = sQ_addr + Tr::kSmemQ;                  // kStages buffers of K_j
  const uint32_t sV_addr0 = sK_addr0 + Tr::kStages * Tr::kSmemKV;  // kStages buffers of V_j
  const uint32_t sM_addr0 = sV_addr0 + Tr::kStages * Tr::kSmemKV;  // kStagedMask: mask tiles
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw + (sQ_addr - raw_addr));

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Broadcast from lane 0 so ptxas can prove it warp-uniform: what derives from it (this
  // warpgroup's Q descriptor) then stays on the uniform datapath (the warp-specialized kernel's
  // consumer index, session 10).
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int head_dim = static_cast<int>(params.head_dim);

  const int num_m_blocks = static_cast<int>((params.seqlen_q + Br - 1) / Br);
  const CtaTile tile = cta_tile(params, num_m_blocks, 1);
  constexpr bool kExtents = kAddr != kDense;
  const AttentionParams p = kExtents ? sequence_view(params, tile.b) : params;
  const int Nq = static_cast<int>(p.seqlen_q), Nk = static_cast<int>(p.seqlen_k);
  const int r0 = tile.m_block * Br;
  if constexpr (kExtents) {
    if (r0 >= Nq) return;  // past this sequence's queries (varlen): nothing of it to write
  }
  const int rows_q = min(Br, Nq - r0);
  const TilePointers<Elem> gp = tile_pointers<Elem>(p, tile, r0);
  const Elem *gQ = gp.q, *gK = gp.k, *gV = gp.v;
  Elem* gO = gp.out;
  float* gLse = gp.lse;
  const int64_t b = tile.b, h = tile.h;

  KeyBlockRange range = key_block_range(p, r0, r0 + rows_q - 1, Bc);
  // A mask tensor's tiles (mask_tiles.h): its hidden ones at either end are not visited, and its
  // clear ones are not masked.
  const uint8_t* mask_classes =
      kGeneral || kBoolMask ? mask_tile_row(p, b, h, tile.m_block, Br, Bc) : nullptr;
  skip_hidden_tiles(mask_classes, range);
  if (range.lo >= range.hi) {
    write_rows_without_keys<kThreads>(p, gO, gLse, rows_q, tid);
    return;
  }

  const typename Tr::template TileCopy<Br> q_copy(tid, head_dim);
  const typename Tr::template TileCopy<Bc> kv_copy(tid, head_dim);
  constexpr uint32_t kStageBytes = Tr::kSmemKV;
  const KvRowSources<Elem> kv_src{gK, gV, nullptr, nullptr, Nk};
  using MaskTile = typename Tr::MaskTile;
  auto load_kv = [&](int n, int stage) {
    load_kv_tile<kAddr, false, Bc>(kv_copy, sK_addr0 + stage * kStageBytes,
                                   sV_addr0 + stage * kStageBytes, kv_src, p, n);
    // A clear tile's values are all 0 and are not read (tile_needs_mask).
    if constexpr (kStagedMask) {
      if (tile_needs_mask(mask_classes, n))
        MaskTile::load(sM_addr0 + stage * MaskTile::kBytes, p, b, h, r0, n, tid);
    }
  };

  // Prologue: Q_i, then the first kStages-1 key blocks, one commit group each (empty groups past
  // the range keep cp_async_wait's count uniform).
  q_copy.load(sQ_addr, gQ, p.q_row_stride, rows_q);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (range.lo + s < range.hi) load_kv(range.lo + s, s);
    cp_async_commit();
  }

  // Descriptors. Q: this warpgroup's 64 rows; k16 step ks is 32 bytes into column block ks / 4.
  // K_j: all Bc rows, same stepping. V_j (MN-major: keys along k, head dim along n): k16 step kk
  // is 16 rows (2048 bytes) down; its D / 64 column blocks are Bc * 128 bytes apart.
  // (The leading offset of a swizzled K-major operand is unused; 16 bytes is the customary 1.)
  const uint64_t q_desc = sw128_desc(sQ_addr + warpgroup * 64 * 128, 16, 1024);
  const uint64_t k_desc0 = sw128_desc(sK_addr0, 16, 1024);
  const uint64_t v_desc0 = sw128_desc(sV_addr0, Bc * 128, 1024);
  auto k_step = [](int ks, int rows) {
    return static_cast<uint32_t>((ks / 4) * rows * 128 + (ks % 4) * 32);
  };

  const float log2e = 1.4426950408889634f;
  const ScoreTransform tf(p);
  const float c = kGeneral ? log2e : tf.scale * log2e;
  const int warp_row0 = warp * 16;  // warp w of warpgroup g owns rows 64g + 16(w % 4): warp * 16

  float O[1][DT][4];
#pragma unroll
  for (int di = 0; di < DT; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) O[0][di][e] = 0.f;
  OnlineSoftmax<1> softmax;
  softmax.init();

  // S = Q_i K_j^T, issued and committed; the caller waits.
  auto issue_scores = [&](float (&Sx)[1][NT][4], int n) {
    const uint64_t k_desc = desc_advance(k_desc0, ((n - range.lo) % Tr::kStages) * kStageBytes);
    wgmma_fence();  // Sx's registers were last touched by ordinary instructions
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks)
      Wgmma<Elem, Bc>::ss(Sx[0], desc_advance(q_desc, k_step(ks, Br)),
                          desc_advance(k_desc, k_step(ks, Bc)), ks > 0);
    wgmma_commit();
  };
  // Mask and online softmax of block n's scores, then O += P V_j issued and committed with P
  // packed straight from the S registers into pa; the caller waits.
  auto softmax_and_issue_pv = [&](float (&Sx)[1][NT][4], uint32_t (&pa)[Bc / 16][4], int n,
                                  const BoolMaskBits<1, NT>& mask_bits, bool masked) {
    auto pos_of = [](int64_t i) { return i; };
    if constexpr (kStagedMask) {
      const MaskTile staged{sM_addr0 + ((n - range.lo) % Tr::kStages) * MaskTile::kBytes, r0};
      mask_scores<Elem, kGeneral>(Sx, p, tf, b, h, r0 + warp_row0, r0, r0 + Br - 1, n, Bc, lane,
                                  pos_of, masked, staged);
    } else {
      mask_scores<Elem, kGeneral>(Sx, p, tf, b, h, r0 + warp_row0, r0, r0 + Br - 1, n, Bc, lane,
                                  pos_of, masked);
    }
    if constexpr (kBoolMask) {
      if (masked) mask_bits.apply(Sx);
    }
    softmax.update(Sx, O, c);
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      pa[kk][0] = Mma::pack(Sx[0][2 * kk][0], Sx[0][2 * kk][1]);
      pa[kk][1] = Mma::pack(Sx[0][2 * kk][2], Sx[0][2 * kk][3]);
      pa[kk][2] = Mma::pack(Sx[0][2 * kk + 1][0], Sx[0][2 * kk + 1][1]);
      pa[kk][3] = Mma::pack(Sx[0][2 * kk + 1][2], Sx[0][2 * kk + 1][3]);
    }
    const uint64_t v_desc = desc_advance(v_desc0, ((n - range.lo) % Tr::kStages) * kStageBytes);
    // O (rescaled) and P were written by ordinary instructions: pinning them first keeps those
    // writes ahead of the fence that orders them before the wgmma reads.
    pin_registers(O[0]);
    pin_registers(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk)
#pragma unroll
      for (int oc = 0; oc < D / Tr::kOChunk; ++oc) {
        // Columns [oc * kOChunk, ...) of O and of V_j: n8 tiles from oc * kOChunk / 8, V's
        // 64-wide column blocks from oc * kOChunk / 64 (each Bc * 128 bytes).
        auto& o_chunk =
            *reinterpret_cast<float (*)[Tr::kOChunk / 8][4]>(&O[0][oc * Tr::kOChunk / 8]);
        Wgmma<Elem, Tr::kOChunk>::rs_accumulate(
            o_chunk, pa[kk], desc_advance(v_desc, kk * 2048 + (oc * Tr::kOChunk / 64) * Bc * 128));
      }
    wgmma_commit();
  };

  // Softmax and matmuls of one warpgroup run back to back; the overlap comes from the other
  // warpgroup and, where registers allow, a second CTA on the SM. (Issuing S_{j+1} before the
  // softmax of S_j, FlashAttention-3's intra-warpgroup overlap, measured slower here: NOTES v6.)
  for (int n = range.lo; n < range.hi; ++n) {
    cp_async_wait<Tr::kStages - 2>();
    fence_proxy_async_smem();  // this thread's copies of K_j/V_j (and Q_i) -> visible to wgmma
    // Publishes every thread's copies, and guarantees both warpgroups are done with the buffer
    // the prefetch below overwrites (block n-1's).
    __syncthreads();
    {
      const int next = n + Tr::kStages - 1;
      if (next < range.hi) load_kv(next, (next - range.lo) % Tr::kStages);
      cp_async_commit();
    }
    const bool masked = tile_needs_mask(mask_classes, n);
    BoolMaskBits<1, NT> mask_bits;
    if constexpr (kBoolMask) {
      if (masked) mask_bits.load(p, b, h, r0 + warp_row0, n, Bc, lane);
    }
    float S[1][NT][4];
    issue_scores(S, n);
    wgmma_wait<0>();
    pin_registers(S[0]);
    uint32_t pa[Bc / 16][4];
    softmax_and_issue_pv(S, pa, n, mask_bits, masked);
    wgmma_wait<0>();
    pin_registers(O[0]);
    pin_registers(pa);
  }
  cp_async_wait<0>();  // only empty groups can be pending; retire them before exit

  // Epilogue: this warp's 16 rows of O staged in shared memory (plain row-major with the
  // portable kernel's swizzle) over Q's, then written out. Another warpgroup may still be reading
  // Q rows that this warp's staging area overlaps.
  __syncthreads();
  store_out_rows<D, 16>(softmax, O, c, sQ, p, flags, gO, gLse, warp_row0, rows_q, lane);
#else
  __trap();  // launched only where the sm_90a binary runs (see run_attention_fwd_sm90)
#endif
}

}  // namespace flashmod::cuda_kernels::sm90
