// Compile-time shape of one tensor-core forward kernel: tile sizes, warp layout, pipeline depth
// and the shared-memory footprint they imply. The paper's names: a CTA owns Br query rows (Q_i)
// and walks key/value blocks of Bc rows (K_j, V_j).
#pragma once

#include <cstdint>

namespace flashmod::cuda_kernels {

template <typename Elem_, int kHeadDim_, int kBr, int kBc, int kWarps, int kStages_,
          bool kQInRegs_ = false>
struct FwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim; columns >= the real D are zeros
  static constexpr int Br = kBr;
  static constexpr int Bc = kBc;
  static constexpr int kNWarps = kWarps;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kStages = kStages_;  // K_j/V_j buffers in flight (cp.async pipeline depth)
  // Keep Q_i's mma fragments in registers for the whole key loop instead of re-reading them from
  // shared memory for every K_j: saves a third of the ldmatrix traffic where registers allow.
  static constexpr bool kQInRegs = kQInRegs_;
  // The decode kernel's key-split form (KeySplitTraits below); false: warps split Q_i by rows.
  static constexpr bool kKeySplit = false;

  // Warps split Q_i by rows only, so every warp sees all of K_j/V_j and softmax rows never cross
  // warps (no shared-memory reduction); the decode kernel's KeySplitTraits is the exception.
  static constexpr int kRowsPerWarp = Br / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  static constexpr int kKeysPerWarp = Bc;            // every warp sees all of K_j / V_j
  static constexpr int kNTiles = kKeysPerWarp / 8;   // n8 tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;       // n8 tiles of O per warp
  static constexpr int kKSteps = kHeadDim / 16;      // k16 steps of Q K^T

  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per smem row

  static constexpr int kSmemQ = Br * kHeadDim;
  static constexpr int kSmemKV = Bc * kHeadDim;  // one K_j or one V_j
  static constexpr int kSmemBytes =
      static_cast<int>(sizeof(Elem)) * (kSmemQ + 2 * kStages * kSmemKV);

  static_assert(sizeof(Elem) == 2, "tensor-core path is for fp16/bf16");
  static_assert(Br % (16 * kNWarps) == 0, "each warp needs whole m16 tiles");
  static_assert(Bc % 16 == 0, "P is fed to the second mma in k16 slices");
  static_assert(kHeadDim % 32 == 0, "head dims are padded to multiples of 32");
  static_assert(kChunksPerRow % 4 == 0, "the swizzle permutes groups of 4 or 8 chunks");
  static_assert(kStages >= 2, "one buffer computing, at least one loading");
  // 163 KB is sm80's opt-in per-block limit; sm90 allows 227 KB.
  static_assert(kSmemBytes <= 163 * 1024, "must also fit an A100");
};

// The decode kernel for tiles of at most 16 real rows (fwd_sm80_kernel.h: kKeySplit): every warp
// takes those rows (one m16 tile) against its own Bc / kNWarps keys of each K_j / V_j, instead of
// warps 1.. computing padding rows against all of them; the warps' softmax states merge once,
// after the key loop (online_softmax.h: merge_key_split_warps).
template <class Base>
struct KeySplitTraits : Base {
  static constexpr bool kKeySplit = true;
  static constexpr int kKeysPerWarp = Base::Bc / Base::kNWarps;
  static constexpr int kNTiles = kKeysPerWarp / 8;
  static_assert(Base::kMTiles == 1, "the rows of one m16 tile");
  static_assert(kKeysPerWarp % 16 == 0, "each warp's keys feed P V_j in whole k16 slices");
};

}  // namespace flashmod::cuda_kernels

namespace flashmod::cuda_kernels {

// The backward's dK/dV kernel: one CTA per (key block K_j, kv head, batch); each warp owns 16 key
// rows (one m16 tile), so S_ij^T = K_j Q_i^T, dP_ij^T = V_j dO_i^T and the dK_j/dV_j accumulators
// of a row never leave its warp (no cross-warp reduction, no atomics: deterministic). The CTA
// walks every query block Q_i of every query head of the GQA group, Br rows at a time,
// double-buffering Q_i, dO_i and their row statistics.
template <typename Elem_, int kHeadDim_, int kWarps, int kBr>
struct BwdKVTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int Bc = 16 * kWarps;  // key rows per CTA
  static constexpr int Br = kBr;          // query rows per step
  static constexpr int kNWarps = kWarps;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kNTiles = Br / 8;         // n8 tiles of S^T per warp
  static constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of dK / dV per warp
  static constexpr int kKSteps = kHeadDim / 16;  // k16 steps of K Q^T
  static constexpr int kSmemKV = Bc * kHeadDim;
  static constexpr int kSmemQ = Br * kHeadDim;  // one stage of Q_i or dO_i
  // K_j, V_j once; Q_i, dO_i and the rows' lse/delta (fp32) in two stages.
  static constexpr int kSmemBytes =
      static_cast<int>(sizeof(Elem)) * (2 * kSmemKV + 2 * 2 * kSmemQ) + 2 * 2 * Br * 4;
  static_assert(sizeof(Elem) == 2, "tensor-core path is for fp16/bf16");
  static_assert(Br % 16 == 0, "P^T and dS^T feed the next mma in k16 slices");
  static_assert(kHeadDim % 32 == 0, "head dims are padded to multiples of 32");
  static_assert(Br % 8 == 0 && Br / 4 <= kNThreads, "one 16-byte chunk of lse/delta per thread");
  static_assert(kSmemBytes <= 163 * 1024, "must also fit an A100");
};

// The backward's dQ kernel: one CTA per (query block Q_i, q head, batch), warps split Q_i by
// rows as in the forward, walking the visible key blocks K_j/V_j (double-buffered).
template <typename Elem_, int kHeadDim_, int kWarps, int kBc>
struct BwdQTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int Br = 16 * kWarps;
  static constexpr int Bc = kBc;
  static constexpr int kNWarps = kWarps;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kNTiles = Bc / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kSmemQ = Br * kHeadDim;
  static constexpr int kSmemKV = Bc * kHeadDim;
  static constexpr int kSmemBytes =
      static_cast<int>(sizeof(Elem)) * (2 * kSmemQ + 2 * 2 * kSmemKV);  // Q, dO; 2 x (K, V)
  static_assert(sizeof(Elem) == 2, "tensor-core path is for fp16/bf16");
  static_assert(Bc % 16 == 0, "dS feeds the dQ mma in k16 slices");
  static_assert(kHeadDim % 32 == 0, "head dims are padded to multiples of 32");
  static_assert(kSmemBytes <= 163 * 1024, "must also fit an A100");
};

}  // namespace flashmod::cuda_kernels
