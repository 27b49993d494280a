// What the backward kernels share (bwd_sm80_kernel.h, bwd_sm90_kernel.h, and the fp32
// bwd_tf32_kernel.h): the grids and which tile a CTA owns, the global rows of its tiles and of
// each step's row statistics, the score transform and its gradient per element, over the mma
// accumulator layout that mma.sync, wgmma and the 3xTF32 products produce (a warp's m16 tiles;
// lane rows g and g + 8, columns 2t and 2t + 1 of every n8 tile), and the stores of a warp's
// gradient rows.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../attention_params.h"
#include "entry_points.h"
#include "mask_tiles.h"
#include "score_mask.h"
#include "staged_mask.h"
#include "visibility.h"

namespace flashmod::cuda_kernels {

// kWhich: both dK and dV (head dims <= 128), or one of them per launch (larger head dims, whose
// two accumulators would not fit the registers together), or (Hopper) dV by one warpgroup and dK
// by the other of one CTA, sharing its tiles, or (Hopper, kBwdFusedDQ) dK, dV and each step's dQ
// partial, added into BwdRowStats::dq_accum.
enum BwdWhich : int { kBwdBoth = 0, kBwdOnlyDV = 1, kBwdOnlyDK = 2, kBwdPair = 3, kBwdFusedDQ = 4 };

// The Hopper kernels' general variants with a fast path of their own (a variant each, so that the
// general variant keeps its registers): kBwdFastMask, mask tensors whose blocks the kernel can
// tell apart (bool key-padding masks by vote_key_mask, any other by the pre-pass's tile classes;
// both below); kBwdFastSoftcap, a soft cap without a mask tensor: key blocks the window shows whole
// compute the capped probabilities and their derivative without the per-element window and mask
// tests (capped_prob).
// kBwdFastAdditive: kBwdFastMask's tile classes plus the additive paths below, on a tile of its own
// (entry_points.h: bwd_sm90_additive_tile).
enum BwdFastPath : int {
  kBwdFastNone = 0,
  kBwdFastMask = 1,
  kBwdFastSoftcap = 2,
  kBwdFastAdditive = 3
};

// P of one element of a block the window shows whole (score qk, lse2 of its query row), and in
// dcap the soft cap's derivative there: general_prob without the window and mask tests.
__device__ __forceinline__ float capped_prob(const ScoreTransform& tf, float qk, float lse2,
                                             float& dcap) {
  const float capped = soft_cap(qk * tf.scale, tf.softcap, tf.inv_softcap);
  const float t = capped * tf.inv_softcap;
  dcap = 1.f - t * t;
  return exp2f(fmaf(capped, 1.4426950408889634f, -lse2));
}

// The score transform of one (query i, key j) pair of the general path (a mask tensor, a soft cap
// or a non-positive scale): returns P = exp(s - lse) (0 where hidden) and leaves in dcap the
// derivative of the soft cap (1 without one).
template <typename Elem>
__device__ __forceinline__ float general_prob(const AttentionBwdParams& p, const ScoreTransform& tf,
                                              float qk, int64_t mask_row, int j,
                                              const RowWindow& win, float lse2, float& dcap) {
  float x = qk * tf.scale;
  dcap = 1.f;
  if (tf.softcap > 0.f) {
    x = soft_cap(x, tf.softcap, tf.inv_softcap);
    const float t = x * tf.inv_softcap;
    dcap = 1.f - t * t;
  }
  bool visible = win.contains(j);
  if (visible && p.mask_kind != MaskKind::kNone)
    visible = apply_mask<Elem>(p, mask_row + j * p.mask_col_stride, x);
  return visible ? exp2f(fmaf(x, 1.4426950408889634f, -lse2)) : 0.f;
}

// dS from P and dP: 0 where P is 0 (hidden keys, underflow), so an inf or NaN in dP of a hidden
// key cannot leak in; a NaN P (a NaN score) stays NaN.
__device__ __forceinline__ float grad_score(float prob, float dp, float delta) {
  return prob == 0.f ? 0.f : prob * (dp - delta);
}

// Additive masks in the inputs' type without a soft cap (a bias, ALiBi, transformers' eager
// masks; entry_points.h: bwd_additive_fast) take paths of their own on the Hopper kernels. On the
// general path, general_prob's per-score soft-cap branch and its load under the window test put a
// branch between every two mask loads, so each load's L2 latency was waited for before the next
// was issued (D = 128 dense bias, fwd+bwd 100 TFLOP/s against CUDNN's 273). Both kernels now
// read tiles staged in shared memory where the mask's rows allow it (bwd_stages_mask); elsewhere
// the dQ kernel's loads are unconditional (keys clamped to the last real one, whose value the
// window test then ignores) and branch-free, so ptxas issues them together.

// Whether the Hopper dK/dV kernel stages p's mask tiles in shared memory (staged_mask.h): a
// bwd_additive_fast mask whose rows allow it and whose gradient is not wanted. Host (the launch's
// shared-memory size) and kernel decide alike.
FLASHMOD_HD bool bwd_stages_mask(const AttentionBwdParams& p, const BwdRowStats& st) {
  return bwd_additive_fast(p, st) && p.grad_mask == nullptr && additive_mask_stageable(p);
}

// general_prob for bwd_additive_fast: value is the mask entry of (i, j), visible the window test.
__device__ __forceinline__ float additive_prob(const ScoreTransform& tf, float qk, float value,
                                               bool visible, float lse2) {
  visible = visible && !mask_value_hides(value);
  return visible ? exp2f(fmaf(fmaf(qk, tf.scale, value), 1.4426950408889634f, -lse2)) : 0.f;
}

// Bool key-padding masks on the general path. The mask hides whole keys, so most key blocks are
// either hidden entirely (a padded batch row's tail) or shown entirely; only the block at a row's
// padding edge needs the per-element mask. A warp votes on a block's mask bytes (keys
// [k0, k0 + count), one byte per lane and round, neighbouring lanes on neighbouring keys), and the
// kernels skip hidden blocks and run shown ones through the plain elementwise code (H100, fwd+bwd
// with a (B, 1, 1, N) mask was 0.46-0.50x SDPA CUDNN on the per-element path).
struct KeyMaskVote {
  bool any, all;  // some / every key of the block is shown (all: vacuously, for none)
};
template <int Bc>
__device__ __forceinline__ KeyMaskVote vote_key_mask(const AttentionParams& p, int64_t b, int k0,
                                                     int count) {
  const int lane = threadIdx.x % 32;
  const uint8_t* row = static_cast<const uint8_t*>(p.mask) + b * p.mask_batch_stride;
  bool any = false, all = true;
#pragma unroll
  for (int i = 0; i < (Bc + 31) / 32; ++i) {
    const int j = 32 * i + lane;
    if (j < count) {
      const bool shown = row[static_cast<int64_t>(k0 + j) * p.mask_col_stride] != 0;
      any = any || shown;
      all = all && shown;
    }
  }
  return {__any_sync(0xffffffffu, any) != 0, __all_sync(0xffffffffu, all) != 0};
}

// Whether a block whose mask entries all show their keys and add nothing may take the plain
// elementwise code: nothing else makes the path general (a soft cap, a scale <= 0, a wanted mask
// gradient).
__device__ __forceinline__ bool plain_transform_allowed(const AttentionBwdParams& p) {
  return p.softcap == 0.0 && p.scale > 0.0 && p.grad_mask == nullptr;
}

// Any other mask tensor (an additive one, a per-query bool one: transformers' causal + padding
// masks) through the classes of its kBwdMaskTile x kBwdMaskTile tiles (mask_tiles.h), classified
// once per call (classify_bwd_mask_tiles), whatever the kernel's own tile: a kernel tile of whole
// classified tiles is hidden or clear where all of them are, one inside a classified tile takes
// its class (a mixed class only means the per-element mask). Blocks hidden at either end of a
// walk are skipped, clear ones take the plain code, mixed ones the per-element mask; without the
// classes every block of such a mask ran the per-element path, the causal half included.
__device__ __forceinline__ bool bwd_mask_tiles(const AttentionParams& p) {
  return p.mask_tiles != nullptr && p.mask_tiles_br == kBwdMaskTile &&
         p.mask_tiles_bc == kBwdMaskTile;
}

// The class (MaskTileClass) of the Br x Bc tile at query block m, key block n of (b, h): rows and
// keys past the sequence's end do not count (none of them: hidden).
template <int Br, int Bc>
__device__ __forceinline__ int bwd_tile_class(const AttentionParams& p, int64_t b, int64_t h, int m,
                                              int n) {
  constexpr int G = kBwdMaskTile;
  static_assert(Br % G == 0 || G % Br == 0, "query tiles nest in the classified ones or tile them");
  static_assert(Bc % G == 0 || G % Bc == 0, "key tiles nest in the classified ones or tile them");
  constexpr int kRows = Br > G ? Br / G : 1, kCols = Bc > G ? Bc / G : 1;
  const uint8_t* classes =
      p.mask_tiles + b * p.mask_tiles_batch_stride + h * p.mask_tiles_head_stride;
  const int k_blocks = static_cast<int>(p.mask_tiles_k_blocks);
  const int q_blocks = static_cast<int>((p.seqlen_q + G - 1) / G);
  const int r0 = m * Br / G, c0 = n * Bc / G;
  int cls = -1;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (r0 + r >= q_blocks || c0 + c >= k_blocks) continue;
      const int x = classes[static_cast<int64_t>(r0 + r) * k_blocks + c0 + c];
      cls = cls < 0 || cls == x ? x : kTileMixed;
    }
  return cls < 0 ? kTileHidden : cls;
}

// [lo, hi) without the indices at either end where shown(i) is false (empty if it holds nowhere):
// 32 candidates per round, one per lane, so the class reads overlap (a causal mask hides half of
// a walk: one read at a time cost microseconds a CTA). Warp-uniform: every lane calls it.
template <class Shown>
__device__ __forceinline__ void trim_hidden_ends(int& lo, int& hi, Shown shown) {
  const int lane = threadIdx.x % 32;
  for (int base = lo;; base += 32) {
    if (base >= hi) {
      lo = hi;
      return;
    }
    const unsigned vote = __ballot_sync(0xffffffffu, base + lane < hi && shown(base + lane));
    if (vote != 0) {
      lo = base + __ffs(vote) - 1;
      break;
    }
  }
  for (int top = hi - 1;; top -= 32) {  // shown(lo) holds: stops by lo
    const unsigned vote = __ballot_sync(0xffffffffu, top - lane >= lo && shown(top - lane));
    if (vote != 0) {
      hi = top - (__ffs(vote) - 1) + 1;
      return;
    }
  }
}

// plain_keys of a dQ CTA's key block n (the dK/dV kernels take theirs from bwd_key_block and
// step_plain_keys), for the CTA's query block m of head h. kMask: the kernel variant tells mask
// blocks apart (a general variant without per-sequence extents, which masks never come with).
template <bool kGeneral, bool kMask, int Br, int Bc>
__device__ __forceinline__ bool plain_key_block(const AttentionBwdParams& p, int64_t b, int64_t h,
                                                int m, int n) {
  static_assert(!kMask || kGeneral, "masks take the general variants");
  if constexpr (kMask) {
    if (!plain_transform_allowed(p)) return false;
    if (key_padding_mask(p)) {
      const int count = static_cast<int>(p.seqlen_k) - n * Bc;
      return vote_key_mask<Bc>(p, b, n * Bc, count).all;
    }
    return bwd_mask_tiles(p) && bwd_tile_class<Br, Bc>(p, b, h, m, n) == kTileClear;
  }
  return !kGeneral;
}

// A dQ CTA's key blocks (kMask) without the ones at either end of the range that its query block
// m of head h sees no key of (a padded row's tail, or its head under left padding; a causal
// mask's upper triangle); hidden blocks inside the range still run, their scores hidden by the
// per-element mask.
template <bool kMask, int Br, int Bc>
__device__ __forceinline__ KeyBlockRange shown_key_blocks(const AttentionParams& p, int64_t b,
                                                          int64_t h, int m, KeyBlockRange range) {
  if constexpr (kMask) {
    if (key_padding_mask(p)) {
      const int Nk = static_cast<int>(p.seqlen_k);
      auto shown = [&](int n) { return vote_key_mask<Bc>(p, b, n * Bc, Nk - n * Bc).any; };
      while (range.lo < range.hi && !shown(range.lo)) ++range.lo;
      while (range.hi > range.lo && !shown(range.hi - 1)) --range.hi;
    } else if (bwd_mask_tiles(p)) {
      trim_hidden_ends(range.lo, range.hi,
                       [&](int n) { return bwd_tile_class<Br, Bc>(p, b, h, m, n) != kTileHidden; });
    }
  }
  return range;
}

// Stores a warp's m16 x kHeadDim accumulator rows (scaled by `mul`) to global memory: lane rows
// g and g + 8 of the tile, element pairs of each n8 tile (one store of 2 elements where `vec`:
// the rows start at multiples of 2 elements); rows >= valid_rows and columns >= head_dim are not
// written.
template <typename Elem, int kDTiles>
__device__ __forceinline__ void store_rows(Elem* dst, int64_t row_stride,
                                           const float (&acc)[kDTiles][4], float mul, int row0,
                                           int valid_rows, int head_dim, int lane, bool vec) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + g + 8 * hh;
    if (row >= valid_rows) continue;
    Elem* out = dst + static_cast<int64_t>(row) * row_stride;
#pragma unroll
    for (int di = 0; di < kDTiles; ++di) {
      const int col = 8 * di + 2 * t;
      if (col >= head_dim) continue;
      const float lo = acc[di][2 * hh] * mul, hi = acc[di][2 * hh + 1] * mul;
      if (vec && col + 1 < head_dim) {
        if constexpr (sizeof(Elem) == 4)
          *reinterpret_cast<float2*>(out + col) = make_float2(lo, hi);
        else
          *reinterpret_cast<uint32_t*>(out + col) = Mma16816<Elem>::pack(lo, hi);
      } else {
        out[col] = from_float<Elem>(lo);
        if (col + 1 < head_dim) out[col + 1] = from_float<Elem>(hi);
      }
    }
  }
}

// Packs an m16 x 16 slice (n8 tiles 2kk and 2kk + 1) of an fp32 accumulator into the A fragment
// of the next m16n8k16: the accumulator layout of two adjacent n8 tiles is the A layout.
template <typename Elem, int kNTiles>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&acc)[kNTiles][4], int kk) {
  a[0] = Mma16816<Elem>::pack(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = Mma16816<Elem>::pack(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = Mma16816<Elem>::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = Mma16816<Elem>::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

template <int kNTiles>
__device__ __forceinline__ void zero(float (&c)[kNTiles][4]) {
#pragma unroll
  for (int i = 0; i < kNTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
}

// Query rows [lo, hi] that can see a key in [k_first, k_last] (the window rule inverted).
struct QueryRange {
  int64_t lo, hi;
};
__device__ __forceinline__ QueryRange visible_queries(const AttentionParams& p, int64_t k_first,
                                                      int64_t k_last) {
  int64_t lo = 0, hi = p.seqlen_q - 1;
  if (p.window_right >= 0) {
    const int64_t w = k_first - p.diag_offset - p.window_right;
    lo = w > lo ? w : lo;
  }
  if (p.window_left >= 0) {
    const int64_t w = k_last - p.diag_offset + p.window_left;
    hi = w < hi ? w : hi;
  }
  return {lo, hi};
}

// The grids of all three backward families (the launchers' sizes here, the kernels' decodes
// below), written once so that a launcher and its kernel cannot disagree on the order. dK/dV:
// blockIdx.x = (b * heads_kv + hk) * key blocks + n_block; dQ: (b * heads_q + h) * query blocks
// + m_block.
__host__ __device__ inline int64_t bwd_dkdv_ctas(const AttentionParams& p, int bc) {
  return (p.seqlen_k + bc - 1) / bc * p.heads_kv * p.batch;
}
__host__ __device__ inline int64_t bwd_dq_ctas(const AttentionParams& p, int br) {
  return (p.seqlen_q + br - 1) / br * p.heads_q * p.batch;
}

// A dK/dV CTA's key block (of num_n_blocks per kv head), kv head and batch row.
struct BwdKeyTile {
  int n_block;
  int64_t hk, b;
};
__device__ __forceinline__ BwdKeyTile bwd_key_tile(const AttentionParams& p, int num_n_blocks) {
  BwdKeyTile t;
  int64_t bid = blockIdx.x;
  t.n_block = static_cast<int>(bid % num_n_blocks);
  bid /= num_n_blocks;
  t.hk = bid % p.heads_kv;
  t.b = bid / p.heads_kv;
  return t;
}

// A dQ CTA's query block, head, kv head and batch row. With a right window bound (causal) the
// last query blocks see the most keys: they are started first, to shorten the tail.
struct BwdQueryTile {
  int m_block;
  int64_t h, b, hk;
};
__device__ __forceinline__ BwdQueryTile bwd_query_tile(const AttentionParams& p, int num_m_blocks) {
  BwdQueryTile t;
  int64_t bid = blockIdx.x;
  t.m_block = static_cast<int>(bid % num_m_blocks);
  bid /= num_m_blocks;
  t.h = bid % p.heads_q;
  t.b = bid / p.heads_q;
  t.hk = t.h / (p.heads_q / p.heads_kv);
  if (p.window_right >= 0) t.m_block = num_m_blocks - 1 - t.m_block;
  return t;
}

// The steps of a dK/dV CTA whose keys are [k0, k0 + rows_k): every (head of the GQA group, query
// block of Br rows) that can see one of them, step s = (head s / m_count, block m_lo + s %
// m_count), head-major so that each head's rows stream in order.
struct BwdSteps {
  int m_lo, m_count, steps;
};
template <int Br>
__device__ __forceinline__ BwdSteps bwd_steps(const AttentionParams& p, int k0, int rows_k,
                                              int64_t group) {
  const QueryRange qr = visible_queries(p, k0, k0 + rows_k - 1);
  BwdSteps s;
  s.m_lo = qr.lo <= qr.hi ? static_cast<int>(qr.lo / Br) : 0;
  s.m_count = qr.lo <= qr.hi ? static_cast<int>(qr.hi / Br) + 1 - s.m_lo : 0;
  s.steps = static_cast<int>(group) * s.m_count;
  return s;
}

// Global rows from row0 on of one head: Q_i and dO_i (query rows of head h), K_j and V_j (key
// rows of kv head hk). The three families copy their tiles differently (cp.async plans, swizzled
// copies, fp32 tiles) but from the same rows, so the stride arithmetic lives here once.
template <typename Elem>
__device__ __forceinline__ const Elem* head_rows(const void* base, int64_t b, int64_t h,
                                                 int64_t row0, int64_t batch_stride,
                                                 int64_t head_stride, int64_t row_stride) {
  return static_cast<const Elem*>(base) + b * batch_stride + h * head_stride + row0 * row_stride;
}
template <typename Elem>
struct BwdQueryRows {
  const Elem* q;
  const Elem* grad_out;
};
template <typename Elem>
__device__ __forceinline__ BwdQueryRows<Elem> query_rows(const AttentionBwdParams& p, int64_t b,
                                                         int64_t h, int64_t row0) {
  return {head_rows<Elem>(p.q, b, h, row0, p.q_batch_stride, p.q_head_stride, p.q_row_stride),
          head_rows<Elem>(p.grad_out, b, h, row0, p.grad_out_batch_stride, p.grad_out_head_stride,
                          p.grad_out_row_stride)};
}
template <typename Elem>
struct BwdKeyRows {
  const Elem* k;
  const Elem* v;
};
template <typename Elem>
__device__ __forceinline__ BwdKeyRows<Elem> key_rows(const AttentionBwdParams& p, int64_t b,
                                                     int64_t hk, int64_t row0) {
  return {head_rows<Elem>(p.k, b, hk, row0, p.k_batch_stride, p.k_head_stride, p.k_row_stride),
          head_rows<Elem>(p.v, b, hk, row0, p.v_batch_stride, p.v_head_stride, p.v_row_stride)};
}

// The walk without the query blocks at either end whose tiles (bwd_mask_tiles) are hidden for
// every head of the group: a mask shared by the heads (head stride 0) has one class per tile for
// all of them.
template <int Br, int Bc>
__device__ __forceinline__ BwdSteps bwd_shown_steps(const AttentionParams& p,
                                                    const BwdKeyTile& tile, BwdSteps walk,
                                                    int64_t group) {
  const int heads = p.mask_tiles_head_stride != 0 ? static_cast<int>(group) : 1;
  int lo = walk.m_lo, hi = walk.m_lo + walk.m_count;
  trim_hidden_ends(lo, hi, [&](int m) {
    bool shown = false;
    for (int i = 0; i < heads && !shown; ++i)
      shown =
          bwd_tile_class<Br, Bc>(p, tile.b, tile.hk * group + i, m, tile.n_block) != kTileHidden;
    return shown;
  });
  return {lo, hi - lo, static_cast<int>(group) * (hi - lo)};
}

// What a dK/dV CTA of key tile `tile` works on in p (the call, or with per-sequence extents its
// sequence's view): keys [k0, k0 + rows_k) (rows_k <= 0: the block lies past the sequence's keys,
// nothing to write), the (head, query block) steps that see them, and their K/V rows. Shared by
// the three dK/dV kernels.
// kMask (plain_key_block): with a key-padding mask, a block none of whose keys the mask shows
// gets no step (its gradients are zero), and plain_keys says whether every step may take the plain
// elementwise code (false in the other general variants, true in the plain ones); with tile
// classes, the query blocks at either end whose tiles are hidden for every head of the group get
// no step, and step_plain_keys decides per step.
template <typename Elem>
struct BwdKeyBlock {
  int k0, rows_k;
  BwdSteps walk;
  BwdKeyRows<Elem> kv;
  bool plain_keys;
  bool tile_classes;  // the steps take their plain_keys from the mask's tile classes
};
template <typename Elem, int Br, int Bc, bool kGeneral, bool kMask>
__device__ __forceinline__ BwdKeyBlock<Elem> bwd_key_block(const AttentionBwdParams& p,
                                                           const BwdKeyTile& tile) {
  BwdKeyBlock<Elem> kb;
  kb.k0 = tile.n_block * Bc;
  kb.rows_k = min(Bc, static_cast<int>(p.seqlen_k) - kb.k0);
  // The group from p's own heads: the kernels' copy from the parameter bank gave ptxas a
  // worse allocation (sm_90a varlen dK/dV, D = 64: 208 bytes of spill instead of 4).
  const int64_t group = p.heads_q / p.heads_kv;
  kb.walk = bwd_steps<Br>(p, kb.k0, kb.rows_k, group);
  kb.kv = key_rows<Elem>(p, tile.b, tile.hk, kb.k0);
  static_assert(!kMask || kGeneral, "masks take the general variants");
  kb.plain_keys = !kGeneral;
  kb.tile_classes = false;
  if constexpr (kMask) {
    if (key_padding_mask(p)) {
      const KeyMaskVote vote = vote_key_mask<Bc>(p, tile.b, kb.k0, kb.rows_k);
      if (!vote.any) kb.walk.steps = 0;
      kb.plain_keys = vote.all && plain_transform_allowed(p);
    } else if (bwd_mask_tiles(p)) {
      kb.walk = bwd_shown_steps<Br, Bc>(p, tile, kb.walk, group);
      kb.tile_classes = plain_transform_allowed(p);
    }
  }
  return kb;
}

// plain_keys of the dK/dV step over query block m of head h (kb's key block n_block).
template <int Br, int Bc, bool kMask, typename Elem>
__device__ __forceinline__ bool step_plain_keys(const BwdKeyBlock<Elem>& kb,
                                                const AttentionParams& p, int64_t b, int64_t h,
                                                int m, int n_block) {
  if constexpr (kMask) {
    if (kb.tile_classes) return bwd_tile_class<Br, Bc>(p, b, h, m, n_block) == kTileClear;
  }
  return kb.plain_keys;
}

// Starts copying a step's Br rows of lse2 and delta (query rows [r0, r0 + Br) of head h) into
// stage `stage` of sL / sDelta (Br floats each): one 16-byte chunk each for the first Br / 2
// threads. The statistics are padded to whole blocks (kBwdRowPad), so no bounds.
template <int Br>
__device__ __forceinline__ void load_row_stats(float* sL, float* sDelta, int stage,
                                               const AttentionParams& p, const BwdRowStats& st,
                                               int64_t b, int64_t h, int64_t r0, int tid) {
  const int64_t stat = (b * p.heads_q + h) * st.rows_padded + r0;
  if (tid < Br / 4) {
    cp_async_16(smem_addr(sL + stage * Br + 4 * tid), st.lse2 + stat + 4 * tid, 16);
  } else if (tid < Br / 2) {
    const int c = tid - Br / 4;
    cp_async_16(smem_addr(sDelta + stage * Br + 4 * c), st.delta + stat + 4 * c, 16);
  }
}

// Writes a warp's m16 x 8 kDTiles accumulator rows, times mul, as Elem into rows row0.. of a
// D-wide tile_offset tile at shared byte address tile. The 8 rows of one store take 8 distinct
// chunk slots, so the 32 lanes hit 32 banks.
template <typename Elem, int D, int kDTiles>
__device__ __forceinline__ void stage_accumulator_rows(uint32_t tile,
                                                       const float (&acc)[kDTiles][4], float mul,
                                                       int row0, int lane) {
  static_assert(kDTiles == D / 8, "the accumulator spans the tile's columns");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int di = 0; di < kDTiles; ++di)
      sts_32(tile + 2 * (tile_offset<D>(row0 + g + 8 * hh, di) + 2 * t),
             Mma16816<Elem>::pack(acc[di][2 * hh] * mul, acc[di][2 * hh + 1] * mul));
}

// A gradient's rows of one head from `row` on (dQ: query rows, dK / dV: key rows).
template <typename Elem>
__device__ __forceinline__ Elem* grad_rows(void* base, int64_t batch_stride, int64_t head_stride,
                                           int64_t row_stride, int64_t b, int64_t h, int64_t row) {
  return static_cast<Elem*>(base) + b * batch_stride + h * head_stride + row * row_stride;
}

// The dK/dV kernels' epilogue: this warp's rows (from row0 of the block at key k0, valid_rows of
// them) of dV and of dK, the latter times the softmax scale (the scores' gradient was taken
// with respect to scale * q.k). kWhich says which of the two this CTA accumulated; the
// accumulators hold columns from col0 (a multiple of 8: the fp32 kernel's half-head-dim warps).
template <typename Elem, int kWhich, int kDTiles, int kNV, int kNK>
__device__ __forceinline__ void store_dkdv(const AttentionBwdParams& p, int64_t b, int64_t hk,
                                           int k0, const float (&dV)[kNV][4],
                                           const float (&dK)[kNK][4], float scale, int row0,
                                           int valid_rows, int head_dim, int lane, bool vec,
                                           int col0 = 0) {
  if constexpr (kWhich != kBwdOnlyDK)
    store_rows<Elem, kDTiles>(grad_rows<Elem>(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride,
                                              p.grad_v_row_stride, b, hk, k0) +
                                  col0,
                              p.grad_v_row_stride, dV, 1.f, row0, valid_rows, head_dim - col0, lane,
                              vec);
  if constexpr (kWhich != kBwdOnlyDV)
    store_rows<Elem, kDTiles>(grad_rows<Elem>(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride,
                                              p.grad_k_row_stride, b, hk, k0) +
                                  col0,
                              p.grad_k_row_stride, dK, scale, row0, valid_rows, head_dim - col0,
                              lane, vec);
}

// store_dkdv for kGradStoreRows16 gradients (fp16 / bf16), through shared memory: the warp's 16
// rows staged in rows row0.. of D-wide tile_offset tiles at sV and sK (which no warp reads any
// more), then copied out as whole 16-byte chunks. Stored straight from the accumulators, each warp
// store wrote 16 bytes into each of 8 rows, and the Hopper dK/dV kernel's stores held 13 % of its
// stall samples at N = 1k, D = 128 (~6 us a tile; H200, session 48).
template <typename Elem, int kWhich, int D, int kNV, int kNK>
__device__ __forceinline__ void store_dkdv_staged(const AttentionBwdParams& p, int64_t b,
                                                  int64_t hk, int k0, const float (&dV)[kNV][4],
                                                  const float (&dK)[kNK][4], float scale,
                                                  uint32_t sV, uint32_t sK, int row0,
                                                  int valid_rows, int head_dim, int lane) {
  if constexpr (kWhich != kBwdOnlyDK) stage_accumulator_rows<Elem, D>(sV, dV, 1.f, row0, lane);
  if constexpr (kWhich != kBwdOnlyDV) stage_accumulator_rows<Elem, D>(sK, dK, scale, row0, lane);
  __syncwarp();  // the copies read chunks other lanes staged
  const int64_t row = k0 + row0;
  if constexpr (kWhich != kBwdOnlyDK)
    copy_staged_rows16<D, 16>(sV, row0,
                              grad_rows<Elem>(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride,
                                              p.grad_v_row_stride, b, hk, row),
                              p.grad_v_row_stride, valid_rows - row0, head_dim, lane);
  if constexpr (kWhich != kBwdOnlyDV)
    copy_staged_rows16<D, 16>(sK, row0,
                              grad_rows<Elem>(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride,
                                              p.grad_k_row_stride, b, hk, row),
                              p.grad_k_row_stride, valid_rows - row0, head_dim, lane);
}

// The dQ kernels' epilogue: this warp's rows of dQ (query rows from r0 + row0 of head h) times
// the softmax scale, as dK.
template <typename Elem, int kDTiles>
__device__ __forceinline__ void store_dq(const AttentionBwdParams& p, int64_t b, int64_t h, int r0,
                                         const float (&dQ)[kDTiles][4], float scale, int row0,
                                         int valid_rows, int head_dim, int lane, bool vec) {
  store_rows<Elem, kDTiles>(grad_rows<Elem>(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride,
                                            p.grad_q_row_stride, b, h, r0),
                            p.grad_q_row_stride, dQ, scale, row0, valid_rows, head_dim, lane, vec);
}

// store_dq through a staging tile at sQ, as store_dkdv_staged.
template <typename Elem, int D>
__device__ __forceinline__ void store_dq_staged(const AttentionBwdParams& p, int64_t b, int64_t h,
                                                int r0, const float (&dQ)[D / 8][4], float scale,
                                                uint32_t sQ, int row0, int valid_rows, int head_dim,
                                                int lane) {
  stage_accumulator_rows<Elem, D>(sQ, dQ, scale, row0, lane);
  __syncwarp();  // the copy reads chunks other lanes staged
  copy_staged_rows16<D, 16>(sQ, row0,
                            grad_rows<Elem>(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride,
                                            p.grad_q_row_stride, b, h, r0 + row0),
                            p.grad_q_row_stride, valid_rows - row0, head_dim, lane);
}

// transposed_probs_and_grads on a staged mask (bwd_stages_mask): tile holds the step's mask
// tile in shared memory (rows: the step's queries, columns: the key block's keys), so the scores'
// values cost one shared-memory load each instead of a dependent global one. kWindowTest false:
// the window shows the whole block and its keys are real.
template <typename Elem, bool kDK, bool kWindowTest, int NT, int NTD, class MaskTile>
__device__ __forceinline__ void transposed_additive(float (&St)[NT][4], float (&dPt)[NTD][4],
                                                    const AttentionBwdParams& p,
                                                    const ScoreTransform& tf, int64_t r0, int k0,
                                                    const int (&key_row)[2], const float* lse2,
                                                    const float* delta, int t,
                                                    const MaskTile& tile) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int qc = 8 * ni + 2 * t + c;
      const float l2 = lse2[qc], dl = kDK ? delta[qc] : 0.f;
      RowWindow win{0, 0};
      if constexpr (kWindowTest)
        win = row_window(p, r0 + qc < p.seqlen_q ? r0 + qc : p.seqlen_q - 1);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int e = 2 * hh + c;
        const bool shown = !kWindowTest || win.contains(key_row[hh]);
        const float prob = additive_prob(tf, St[ni][e], tile.at(qc, key_row[hh] - k0), shown, l2);
        St[ni][e] = prob;
        if constexpr (kDK) dPt[ni][e] = grad_score(prob, dPt[ni][e], dl);
      }
    }
}

// The dK/dV kernels' step: S^T (keys x queries) becomes P^T in place and, with kDK, dP^T becomes
// dS^T times the soft cap's derivative (dS itself goes to p.grad_mask when it is wanted). Element
// (ni, e): key key_row[e / 2], query r0 + 8 ni + 2 t + e % 2; lse2/delta are the step's Br rows.
// plain_keys: the general path's block may take the plain code (keys_take_plain_path).
// kSoftcapFast (kBwdFastSoftcap variants): blocks the window shows whole take capped_prob.
// kStagedMask (a Hopper dK/dV variant that stages masks): where stage_mask (bwd_stages_mask),
// staged is the step's mask tile in shared memory.
template <typename Elem, bool kGeneral, bool kDK, bool kSoftcapFast = false,
          bool kStagedMask = false, int NT, int NTD, class MaskTile = GlobalMaskValues>
__device__ __forceinline__ void transposed_probs_and_grads(
    float (&St)[NT][4], float (&dPt)[NTD][4], const AttentionBwdParams& p, const ScoreTransform& tf,
    float scale_log2, int64_t b, int64_t h, int64_t r0, int Br, int n_block, int Bc,
    const int (&key_row)[2], const float* lse2, const float* delta, int t, bool plain_keys,
    bool stage_mask = false, const MaskTile& staged = {}) {
  const int Nk = static_cast<int>(p.seqlen_k);
  const int k0 = n_block * Bc;
  const bool window_whole = key_block_unmasked(p, r0, r0 + Br - 1, n_block, Bc) && k0 + Bc <= Nk;
  if constexpr (kSoftcapFast) {
    if (window_whole) {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * ni + 2 * t);
        const float2 dl =
            kDK ? *reinterpret_cast<const float2*>(delta + 8 * ni + 2 * t) : make_float2(0.f, 0.f);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float dcap;
          const float prob = capped_prob(tf, St[ni][e], e & 1 ? l2.y : l2.x, dcap);
          St[ni][e] = prob;
          if constexpr (kDK) dPt[ni][e] = grad_score(prob, dPt[ni][e], e & 1 ? dl.y : dl.x) * dcap;
        }
      }
      return;
    }
  }
  const bool all_visible = (!kGeneral || plain_keys) && window_whole;
  if (all_visible) {
    // Every (query, key) pair of the block is visible and its keys are real: no window compares
    // and no guard for hidden keys (grad_score), only the transform; at D = 64 the elementwise
    // work is as long as the step's wgmma.
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      // Columns 2t and 2t + 1: one 8-byte load each (the rows are cp.async 16-byte destinations).
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * ni + 2 * t);
      const float2 dl =
          kDK ? *reinterpret_cast<const float2*>(delta + 8 * ni + 2 * t) : make_float2(0.f, 0.f);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float prob = exp2f(fmaf(St[ni][e], scale_log2, -(e & 1 ? l2.y : l2.x)));
        St[ni][e] = prob;
        if constexpr (kDK) dPt[ni][e] = prob * (dPt[ni][e] - (e & 1 ? dl.y : dl.x));
      }
    }
    return;
  }
  const int64_t mask_head = b * p.mask_batch_stride + h * p.mask_head_stride;
  float* gmask =
      p.grad_mask ? p.grad_mask + ((b * p.heads_q + h) * p.seqlen_q) * p.seqlen_k : nullptr;
  if constexpr (kStagedMask) {
    if (stage_mask) {
      if (window_whole) {
        transposed_additive<Elem, kDK, false>(St, dPt, p, tf, r0, k0, key_row, lse2, delta, t,
                                              staged);
      } else {
        transposed_additive<Elem, kDK, true>(St, dPt, p, tf, r0, k0, key_row, lse2, delta, t,
                                             staged);
      }
      return;
    }
  }
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int qc = 8 * ni + 2 * t + c;  // query column within the step
      const int64_t i = r0 + qc;
      const float l2 = lse2[qc], dl = kDK ? delta[qc] : 0.f;
      RowWindow win{0, Nk - 1};
      if (!all_visible) win = row_window(p, i < p.seqlen_q ? i : p.seqlen_q - 1);
      const int64_t mask_row =
          mask_head + (i < p.seqlen_q ? i : p.seqlen_q - 1) * p.mask_row_stride;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int e = 2 * hh + c;
        const int j = key_row[hh];
        float prob, dcap = 1.f;
        if constexpr (kGeneral) {
          prob = general_prob<Elem>(p, tf, St[ni][e], mask_row, j, win, l2, dcap);
        } else {
          prob = win.contains(j) ? exp2f(fmaf(St[ni][e], scale_log2, -l2)) : 0.f;
        }
        St[ni][e] = prob;
        if constexpr (kDK) {
          const float ds = grad_score(prob, dPt[ni][e], dl);
          // grad_mask comes only with an additive mask: the general path.
          if (kGeneral && gmask != nullptr && i < p.seqlen_q && j < Nk)
            gmask[i * p.seqlen_k + j] = ds;
          dPt[ni][e] = ds * dcap;
        }
      }
    }
}

// This lane's two query rows of the dQ kernels and their statistics.
struct LaneRows {
  int64_t row[2];
  float lse2[2], delta[2];
  RowWindow win[2];
  int64_t mask_row[2];
};
__device__ __forceinline__ LaneRows lane_rows(const AttentionBwdParams& p, const BwdRowStats& st,
                                              int64_t b, int64_t h, int64_t first_row) {
  LaneRows r;
  const int64_t stat = (b * p.heads_q + h) * st.rows_padded;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    r.row[hh] = first_row + 8 * hh;
    r.lse2[hh] = st.lse2[stat + r.row[hh]];  // padded: rows past Nq read lse2 = +inf
    r.delta[hh] = st.delta[stat + r.row[hh]];
    const int64_t ic = r.row[hh] < p.seqlen_q ? r.row[hh] : p.seqlen_q - 1;
    r.win[hh] = row_window(p, ic);
    r.mask_row[hh] = b * p.mask_batch_stride + h * p.mask_head_stride + ic * p.mask_row_stride;
  }
  return r;
}

// The dQ kernels' step: S (queries x keys of block n) becomes dS times the soft cap's derivative.
// plain_keys as in transposed_probs_and_grads; additive_fast: bwd_additive_fast (kAdditiveFast
// variants); staged: where not null (bwd_stages_mask), the block's mask tile in shared memory.
template <typename Elem, bool kGeneral, bool kSoftcapFast = false, bool kAdditiveFast = false,
          int NT, class MaskTile = GlobalMaskValues>
__device__ __forceinline__ void probs_and_grads(
    float (&S)[NT][4], const float (&dP)[NT][4], const AttentionBwdParams& p,
    const ScoreTransform& tf, float scale_log2, const LaneRows& rows, int64_t r0, int Br, int n,
    int Bc, int t, bool plain_keys, bool additive_fast = false, const MaskTile* staged = nullptr) {
  const bool window_whole = key_block_unmasked(p, r0, r0 + Br - 1, n, Bc);
  if constexpr (kSoftcapFast) {
    if (window_whole) {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          float dcap;
          const float prob = capped_prob(tf, S[ni][e], rows.lse2[hh], dcap);
          S[ni][e] = grad_score(prob, dP[ni][e], rows.delta[hh]) * dcap;
        }
      return;
    }
  }
  const bool all_visible = (!kGeneral || plain_keys) && window_whole;
  const int key0 = n * Bc + 2 * t;
  if (all_visible) {  // as in transposed_probs_and_grads: only the transform
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1;
        const float prob = exp2f(fmaf(S[ni][e], scale_log2, -rows.lse2[hh]));
        S[ni][e] = prob * (dP[ni][e] - rows.delta[hh]);
      }
    return;
  }
  if constexpr (kGeneral && kAdditiveFast) {
    if constexpr (MaskTile::kStaged) {
      if (staged != nullptr) {  // one 32-bit shared-memory load per score pair
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const typename MaskTile::Row row = staged->row(rows.row[hh], t);
#pragma unroll
          for (int ni = 0; ni < NT; ++ni) {
            const float2 values = MaskTile::pair(row, ni, true);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int e = 2 * hh + c, j = key0 + 8 * ni + c;
              const float prob = additive_prob(tf, S[ni][e], c == 0 ? values.x : values.y,
                                               rows.win[hh].contains(j), rows.lse2[hh]);
              S[ni][e] = grad_score(prob, dP[ni][e], rows.delta[hh]);
            }
          }
        }
        return;
      }
    }
    if (additive_fast) {
      const Elem* mask = static_cast<const Elem*>(p.mask);
      const int Nk = static_cast<int>(p.seqlen_k);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1, j = key0 + 8 * ni + (e & 1);
          const float value =
              to_float(mask[rows.mask_row[hh] + min(j, Nk - 1) * p.mask_col_stride]);
          const float prob =
              additive_prob(tf, S[ni][e], value, rows.win[hh].contains(j), rows.lse2[hh]);
          S[ni][e] = grad_score(prob, dP[ni][e], rows.delta[hh]);
        }
      return;
    }
  }
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hh = e >> 1, j = key0 + 8 * ni + (e & 1);
      float prob, dcap = 1.f;
      if constexpr (kGeneral) {
        prob = general_prob<Elem>(p, tf, S[ni][e], rows.mask_row[hh], j, rows.win[hh],
                                  rows.lse2[hh], dcap);
      } else {
        const bool visible = all_visible || rows.win[hh].contains(j);
        prob = visible ? exp2f(fmaf(S[ni][e], scale_log2, -rows.lse2[hh])) : 0.f;
      }
      S[ni][e] = grad_score(prob, dP[ni][e], rows.delta[hh]) * dcap;
    }
}

}  // namespace flashmod::cuda_kernels
