// How the decode path shapes its work, from the params alone (host code, no CUDA calls): GQA row
// packing, the key blocks a call can see, and the split-KV count. attention_cuda.cpp packs;
// fwd_sm80_launch.h picks the splits.
#pragma once

#include <cstdint>

#include "../attention_params.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {

// GQA packing: folds the g = heads_q / heads_kv query heads of each kv head into one head of
// g * seqlen_q rows (head-major: row r is q head hk * g + r / seqlen_q at position r % seqlen_q),
// so each kv head's K/V is streamed once per tile instead of once per q head. Only through
// strides (no copy): needs one row stride that steps through the packed rows of q and of out,
// i.e. seqlen_q == 1 or head stride == seqlen_q * row stride, and no mask tensor (its rows are
// per q head). lse is (B, Hq, Nq), which is already the packed layout (g heads of Nq rows make
// one head of g * Nq rows). Returns false and leaves p alone when it does not apply.
inline bool pack_gqa_rows(AttentionParams& p) {
  const int64_t g = p.heads_q / p.heads_kv, nq = p.seqlen_q;
  if (g <= 1 || p.mask_kind != MaskKind::kNone || nq > kDecodeMaxNq) return false;
  auto packed_row_stride = [nq](int64_t head_stride, int64_t row_stride) -> int64_t {
    if (nq == 1) return head_stride;
    return head_stride == nq * row_stride ? row_stride : -1;
  };
  const int64_t q_rs = packed_row_stride(p.q_head_stride, p.q_row_stride);
  const int64_t o_rs = packed_row_stride(p.out_head_stride, p.out_row_stride);
  if (q_rs < 0 || o_rs < 0) return false;
  p.q_row_stride = q_rs, p.q_head_stride *= g;
  p.out_row_stride = o_rs, p.out_head_stride *= g;
  p.pos_period = nq;
  p.lse_head_stride *= g;
  p.seqlen_q = g * nq;
  p.heads_q = p.heads_kv;
  return true;
}

// Key blocks the query positions can see at all (an estimate for the split heuristic: the union
// over positions of the window rule).
inline int64_t decode_key_blocks(const AttentionParams& p, int bc) {
  const int64_t positions = p.pos_period > 0 ? p.pos_period : p.seqlen_q;
  int64_t lo = 0, hi = p.seqlen_k;
  if (p.window_left >= 0 && p.diag_offset - p.window_left > lo) lo = p.diag_offset - p.window_left;
  if (p.window_right >= 0 && p.diag_offset + positions + p.window_right < hi)
    hi = p.diag_offset + positions + p.window_right;
  return hi > lo ? (hi - lo + bc - 1) / bc : 1;
}

// Split-KV heuristic. A decode grid has one CTA per (query block, head): often far fewer than
// the SMs, so most of HBM's bandwidth idles while each CTA walks all of Nk. Splitting every CTA's
// key blocks into `splits` runs multiplies the grid, but each split adds fixed costs (its Q load
// and pipeline fill, a partial to write, and a share of the combine). Measured on an H100
// (tools/decode_splits.py, cold L2, bf16, Hq 32 / Hkv 8, D 128, Nq 1, B 1-16, Nk 1k-64k;
// benchmarks/results/2026-11-26-h100-decode-splits-session20.txt), with the combine spread over
// a warp's lanes (split_combine.h, session 19):
// - every resident CTA's slot (`slots`, two per SM) is worth filling: B 2 at 4k-64k, B 4 and 8
//   at 1k-64k ran best, or within 1 % of it, on slots / ctas splits. The rule before (one CTA per
//   SM unless each split streamed >= 32 key blocks, tuned when the combine read the splits one
//   after another) left B 4 at 1k-4k and B 8 at 1k 4-5 % slower, B 1 at 1k 19 %;
// - but no more than 2 sqrt(key blocks) splits: B 1 at 4k ran 16 splits 6 % faster than 32, at 1k
//   8 splits 18 % faster than 32;
// - each split keeps >= kMinBlocksPerSplit key blocks (128 keys);
// - where the grid already holds more CTAs than half the SMs, the second slot pays only for
//   splits of >= 16 key blocks: B 16 at 1k ran one split 6 % faster than two, at 2k-4k two
//   within 1.5 % or ahead (`2026-11-26-h100-decode-splits-b8-16-session20.txt`).
// The count depends on the shapes alone, never on the K/V layout, so a paged cache gives bitwise
// the contiguous cache's result. splits <= kMaxSplits bounds the workspace and the combine's
// warp. Last, the count is evened out: with per = ceil(blocks / splits) blocks each,
// ceil(blocks / per) splits cover them with no empty split.
constexpr int64_t kMinBlocksPerSplit = 2;
constexpr int64_t kMaxSplits = 128;
inline int choose_splits(int64_t ctas, int64_t key_blocks, int64_t sms, int64_t slots) {
  if (ctas <= 0 || ctas >= slots) return 1;
  int64_t root = 1;  // ceil(sqrt(key_blocks))
  while (root * root < key_blocks) ++root;
  int64_t s = slots / ctas;
  if (2 * ctas > sms && key_blocks < 16 * s) s = 1;
  if (s > 2 * root) s = 2 * root;
  if (s > key_blocks / kMinBlocksPerSplit) s = key_blocks / kMinBlocksPerSplit;
  if (s > kMaxSplits) s = kMaxSplits;
  if (s <= 1) return 1;
  const int64_t per = (key_blocks + s - 1) / s;
  return static_cast<int>((key_blocks + per - 1) / per);
}

}  // namespace flashmod::cuda_kernels
