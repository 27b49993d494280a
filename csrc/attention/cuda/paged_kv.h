// K/V tile loads of the forward kernels, dense and per-sequence K/V (varlen, KV caches, paged
// caches): the tile copy (TileCopyPlan, Sw128TileCopy) with each key row's address resolved
// through its page (sequence_view.h: kv_row_offset), and the rows of the fused KV-cache append
// taken from the new keys/values.
#pragma once

#include <cstdint>

#include "../../common/cuda/bulk_copy_ops.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "../../common/cuda/tma_ops.h"
#include "../sequence_view.h"
#include "entry_points.h"

namespace flashmod::cuda_kernels {

// How a kernel finds K/V rows: kDense (params as they are), kSequences (per-sequence extents,
// contiguous K/V: varlen, cache lengths), kBlockPages (pages holding whole key blocks: one
// block-table lookup per block) or kRowPages (pages smaller than or misaligned with a key block:
// one lookup per row). Separate kernel variants because each step costs registers: bf16,
// D = 128 prefill on sm_80 spills 4 / 44 / 160 / 288 bytes (stores) in that order.
enum KvAddressing : int { kDense = 0, kSequences = 1, kBlockPages = 2, kRowPages = 3 };

inline KvAddressing kv_addressing(const AttentionParams& p, int key_block) {
  if (!has_sequence_extents(p)) return kDense;
  if (p.block_table == nullptr) return kSequences;
  return p.page_size % key_block == 0 ? kBlockPages : kRowPages;
}

// Copies key rows [first_key, first_key + valid_rows) of one kv head (base: the pool, or the
// sequence's K/V, plus the head's offset) into the smem tile at smem_base, zero-filling the rest,
// like Plan::load (kDense tiles use Plan::load itself: load_kv_tile). kSequences and kBlockPages
// only: the tile's rows are one run of rows (kBlockPages: first_key starts a key block, which
// lies in one page); kRowPages tiles go through load_cached_rows_by_page.
template <KvAddressing kAddr, class Plan, typename Elem>
__device__ __forceinline__ void load_kv_block(const Plan& plan, uint32_t smem_base,
                                              const Elem* base, const AttentionParams& s,
                                              int64_t first_key, int64_t page_stride,
                                              int64_t row_stride, int valid_rows) {
  static_assert(kAddr == kSequences || kAddr == kBlockPages, "one run of rows per tile");
  if constexpr (kAddr == kSequences) {
    plan.load(smem_base, base + first_key * row_stride, row_stride, valid_rows);
  } else {
    plan.load(smem_base, base + kv_row_offset(s, first_key, page_stride, row_stride), row_stride,
              valid_rows);
  }
}

// Where the rows of a K/V tile come from when they are not one run of rows: the K and V bases of
// the kv head (the pool's, when paged) and, for the fused append, the new rows' bases and the
// key index where they start (keys >= new_from are rows key - new_from of k_new / v_new).
template <typename Elem>
struct KvRowSources {
  const Elem* k;
  const Elem* v;
  const Elem* k_new;
  const Elem* v_new;
  int new_from;
};

// K and V rows [first_key, first_key + valid_rows) of a tile that holds no appended keys, for
// pages smaller than a key block (kRowPages), zero-filling the rest. Each thread's rows step by the
// plan's row step, so within a page its K and V sources advance by a constant; it reads the block
// table and recomputes them only where its next row lies in another page (with 16-token pages and
// 8-row steps every other row, at the same step in every thread). K and V share the entry, read
// through the read-only path (the kernel never writes the table). Looking each row's page up and
// recomputing its 64-bit offsets (load_rows_with_new_keys' walk) made a 16k-token decode step
// execute 43 % more instructions than the contiguous cache's, 4.4 % slower on the same addresses
// (Nsight Compute, H100, session 17). Walking by page: the same speed on an H100, +2.5-4 % at
// 16k-64k-token caches on an H200, whose faster memory leaves the instructions exposed (session
// 18).
template <class Plan, typename Elem>
__device__ __forceinline__ void load_cached_rows_by_page(const Plan& plan, uint32_t sk, uint32_t sv,
                                                         const Elem* k, const Elem* v,
                                                         const AttentionParams& s, int first_key,
                                                         int valid_rows) {
  if (!plan.active) return;
  const uint32_t page_size = static_cast<uint32_t>(s.page_size);
  const uint32_t j0 = static_cast<uint32_t>(first_key + plan.row0);
  // One page before the first row's: the first step of the walk seeks it.
  uint32_t page_idx = j0 / page_size - 1;
  uint32_t in_page = j0 - page_idx * page_size;
  const Elem *ks = k, *vs = v;
  const int64_t k_step = Plan::kRowStep * s.k_row_stride, v_step = Plan::kRowStep * s.v_row_stride;
  if (plan.src_bytes == 0) valid_rows = 0;  // a chunk past head_dim: zeros only
  // Not unrolled past one swizzle period: unrolled, each step's copy of the seek made the decode
  // kernel's code outgrow the instruction cache (4544 -> 5504 SASS instructions).
#pragma unroll 1
  for (int it0 = 0; it0 < Plan::kIters; it0 += Plan::kPeriod) {
#pragma unroll
    for (int ip = 0; ip < Plan::kPeriod; ++ip) {
      const int it = it0 + ip, row = plan.row0 + it * Plan::kRowStep;
      const bool valid = row < valid_rows;
      if (in_page >= page_size) {
        do {  // more than one page per step only for pages shorter than the row step
          in_page -= page_size;
          ++page_idx;
        } while (in_page >= page_size);
        // A row past the valid ones reads no entry (the table may end before the tile does).
        const int64_t page = valid ? __ldg(s.block_table + page_idx) : 0;
        ks = k + page * s.k_page_stride + in_page * s.k_row_stride + plan.col;
        vs = v + page * s.v_page_stride + in_page * s.v_row_stride + plan.col;
      }
      const uint32_t off = plan.soff[ip] + it * Plan::kStepBytes;  // chunk_offset(it)
      const int bytes = valid ? plan.src_bytes : 0;
      cp_async_16(sk + off, valid ? ks : k, bytes);
      cp_async_16(sv + off, valid ? vs : v, bytes);
      in_page += Plan::kRowStep;
      ks += k_step;
      vs += v_step;
    }
  }
}

// K and V rows [first_key, first_key + valid_rows) row by row into the smem tiles at sk / sv
// (zero-filling the rest), for the one tile of a fused-append decode step that holds new keys when
// pages are smaller than a key block (kRowPages): keys from src.new_from on come from the new
// keys/values. Each thread walks its rows with one 32-bit division per tile, stepping (page, row
// in page) by the plan's row step: a 64-bit divide and remainder per row and per tensor, as
// kv_row_offset does, was most of the instructions of a 16-token-page decode step. K and V share
// the row's block-table entry, read once through the read-only path.
template <class Plan, typename Elem>
__device__ __forceinline__ void load_rows_with_new_keys(const Plan& plan, uint32_t sk, uint32_t sv,
                                                        const KvRowSources<Elem>& src,
                                                        const AttentionParams& s, int first_key,
                                                        int valid_rows) {
  if (!plan.active) return;
  const uint32_t page_size = static_cast<uint32_t>(s.page_size);
  // Block-table index and row in page of this thread's row.
  const uint32_t j0 = static_cast<uint32_t>(first_key + plan.row0);
  uint32_t page_idx = j0 / page_size;
  uint32_t in_page = j0 - page_idx * page_size;
#pragma unroll
  for (int it = 0; it < Plan::kIters; ++it) {
    const int row = plan.row0 + it * Plan::kRowStep;
    const int j = first_key + row;
    const bool valid = row < valid_rows && plan.src_bytes > 0;
    // Selects, not branches: one straight copy loop (the decode kernel's code has to fit the
    // instruction cache). A row past the valid ones copies zero bytes from any address.
    const bool cached = valid && j < src.new_from;
    const int64_t page = cached ? __ldg(s.block_table + page_idx) : 0;
    const Elem* ks = src.k + page * s.k_page_stride + in_page * s.k_row_stride + plan.col;
    const Elem* vs = src.v + page * s.v_page_stride + in_page * s.v_row_stride + plan.col;
    if (valid && !cached) {
      ks = src.k_new + (j - src.new_from) * s.kn_row_stride + plan.col;
      vs = src.v_new + (j - src.new_from) * s.vn_row_stride + plan.col;
    }
    if (!valid) ks = src.k, vs = src.v;
    const int bytes = valid ? plan.src_bytes : 0;
    cp_async_16(sk + plan.chunk_offset(it), ks, bytes);
    cp_async_16(sv + plan.chunk_offset(it), vs, bytes);
    in_page += Plan::kRowStep;
    while (in_page >= page_size) in_page -= page_size, ++page_idx;
  }
}

// Key block n of kBc rows (cut at s.seqlen_k) of K and V into the smem tiles at sk / sv,
// zero-filling the rest, for every KvAddressing. Both forward kernels (fwd_sm80_kernel.h,
// fwd_sm90_kernel.h) load through it, so which copy serves which addressing is decided once and a
// change to the paging reaches both. kNewRows (decode with the fused append): keys from
// src.new_from on come from the new keys/values, through the same copy loop as the cache's rows
// (TileCopyPlan::load_two_sources) or, with row pages, the same per-row walk.
template <KvAddressing kAddr, bool kNewRows, int kBc, class Plan, typename Elem>
__device__ __forceinline__ void load_kv_tile(const Plan& plan, uint32_t sk, uint32_t sv,
                                             const KvRowSources<Elem>& src,
                                             const AttentionParams& s, int n) {
  const int valid = min(kBc, static_cast<int>(s.seqlen_k) - n * kBc);
  const int64_t row0 = static_cast<int64_t>(n) * kBc;
  if constexpr (kAddr == kRowPages) {
    // The tile that holds the appended keys (one per sequence) walks its rows one by one; every
    // other tile page by page.
    if (kNewRows && src.new_from < n * kBc + valid)
      load_rows_with_new_keys(plan, sk, sv, src, s, n * kBc, valid);
    else
      load_cached_rows_by_page(plan, sk, sv, src.k, src.v, s, n * kBc, valid);
  } else if constexpr (kAddr != kDense && kNewRows) {
    // Rows before new_from from the cache (one run: kSequences, or one page: kBlockPages), the
    // rest from the new keys/values (none when the call appends nothing: new_from = seqlen_k).
    const int cache_rows = max(0, min(valid, src.new_from - n * kBc));
    int64_t k_off = row0 * s.k_row_stride, v_off = row0 * s.v_row_stride;
    if constexpr (kAddr == kBlockPages) {
      // One table entry for K and V; 32-bit (kv_row_offset's 64-bit division is ~70 instructions).
      k_off = v_off = 0;
      if (cache_rows > 0) {
        const uint32_t first = static_cast<uint32_t>(n * kBc);
        const uint32_t size = static_cast<uint32_t>(s.page_size);
        const uint32_t page_idx = first / size;
        const int64_t page = __ldg(s.block_table + page_idx), in_page = first - page_idx * size;
        k_off = page * s.k_page_stride + in_page * s.k_row_stride;
        v_off = page * s.v_page_stride + in_page * s.v_row_stride;
      }
    }
    // Tile row r is new row n * kBc + r - new_from (only rows past cache_rows read it).
    const int64_t first_new = row0 - src.new_from;
    const Elem* k_tail = src.k_new != nullptr ? src.k_new + first_new * s.kn_row_stride : src.k;
    const Elem* v_tail = src.v_new != nullptr ? src.v_new + first_new * s.vn_row_stride : src.v;
    if (cache_rows == valid) {  // every tile but the new keys' one: the plain copy loop
      plan.load(sk, src.k + k_off, s.k_row_stride, valid);
      plan.load(sv, src.v + v_off, s.v_row_stride, valid);
    } else {
      plan.load_two_sources(sk, src.k + k_off, s.k_row_stride, k_tail, s.kn_row_stride, cache_rows,
                            valid);
      plan.load_two_sources(sv, src.v + v_off, s.v_row_stride, v_tail, s.vn_row_stride, cache_rows,
                            valid);
    }
  } else if constexpr (kAddr != kDense) {
    load_kv_block<kAddr>(plan, sk, src.k, s, row0, s.k_page_stride, s.k_row_stride, valid);
    load_kv_block<kAddr>(plan, sv, src.v, s, row0, s.v_page_stride, s.v_row_stride, valid);
  } else {
    plan.load(sk, src.k + row0 * s.k_row_stride, s.k_row_stride, valid);
    plan.load(sv, src.v + row0 * s.v_row_stride, s.v_row_stride, valid);
  }
}

// Key block n of K and V (kBc rows, every one a cached row of the sequence: no appended key, none
// past its end) of a paged cache with pages of maps.box_rows < kBc rows (kRowPages) through the
// copy engine into the smem tiles at sk / sv, in the column-block layout that the maps' 128-byte
// swizzle writes (smem_tile.h: tile_offset with kColBlockRows = kBc; sk and sv 1024-byte aligned).
// One warp issues it: lane l reads the block-table entry of page l of the block and issues its
// boxes (one per 64 columns and tensor), having announced their bytes on bar (one arrival per
// page), so the table reads are in flight together (one thread reading them in turn, each before
// its boxes, was 1-2 % slower than the cp.async walk). Against that walk
// (load_cached_rows_by_page: a table read, a seek and two 16-byte copies per row and thread), a
// 16k-token decode step at 16-token pages executed 36 % fewer instructions (ncu, H100, with one
// thread issuing every box: 63.3 M -> 40.8 M).
template <int kBc, int kHeadDim>
__device__ __forceinline__ void load_kv_pages_tma(const KvTensorMaps& maps, uint32_t sk,
                                                  uint32_t sv, const AttentionParams& s, int hk,
                                                  int n, uint32_t bar, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kColBlocks = kHeadDim / 64;
  static_assert(kHeadDim % 64 == 0, "whole 64-column boxes");
  const int box = maps.box_rows, r = lane * box;
  if (r >= kBc) return;
  const int key = n * kBc + r;
  const int idx = key / box;  // box = page size: row 0 of a page
  const int page = __ldg(s.block_table + idx);
  mbarrier_arrive_expect_tx(bar, 2u * kColBlocks * box * 128);
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    const uint32_t dst = cb * kBc * 128 + r * 128;
    tma_load_4d(sk + dst, &maps.k, cb * 64, 0, hk, page, bar);
    tma_load_4d(sv + dst, &maps.v, cb * 64, 0, hk, page, bar);
  }
#endif  // other targets never take this path (the decode kernel's kKvTma)
}

// Until the copies of the stage's round with this parity have landed (every thread that reads
// the tile waits itself: the mbarrier makes the copy engine's writes visible to it).
__device__ __forceinline__ void wait_kv_tma(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  mbarrier_wait(bar, parity);
#endif
}

// The fused append's writes: the seqlen_new new rows of kv head hk (of the view s) into the
// cache slots [seqlen_k - seqlen_new, seqlen_k) of its row, through the block table when paged.
// One CTA per (batch row, kv head) calls it; 16-byte copies (cache and new rows are 16-byte
// aligned and head_dim % 8 == 0: the host checks both). 32-bit index math, and the page lookup
// only in the paged variants: with 64-bit divisions (by the chunk count and the page size) it was
// 1700 of the 7200 instructions of the KV-cache decode kernel, whose code then no longer fit the
// instruction cache (ncu: 24 % of its warps' stalls waiting for instructions, 6.5 us a call;
// benchmarks/results/design/cuda-serving.md, session 11).
template <typename Elem, int kThreads, int kHeadDim, KvAddressing kAddr>
__device__ __forceinline__ void append_new_rows(const AttentionParams& s, int64_t hk, int tid) {
  constexpr int kChunks = kHeadDim / 8;  // per row; those past head_dim copy nothing
  const int head_dim = static_cast<int>(s.head_dim);
  const int rows = static_cast<int>(s.seqlen_new);
  const int first = static_cast<int>(s.seqlen_k - s.seqlen_new);
  // The cache is the op's in-place output; params carry it as the (read-only) K/V input.
  auto* kc = const_cast<Elem*>(static_cast<const Elem*>(s.k)) + hk * s.k_head_stride;
  auto* vc = const_cast<Elem*>(static_cast<const Elem*>(s.v)) + hk * s.v_head_stride;
  const Elem* kn = static_cast<const Elem*>(s.k_new) + hk * s.kn_head_stride;
  const Elem* vn = static_cast<const Elem*>(s.v_new) + hk * s.vn_head_stride;
#pragma unroll 1
  for (int i = tid; i < rows * kChunks; i += kThreads) {
    const int t = i / kChunks, c = 8 * (i % kChunks);
    if (c >= head_dim) continue;
    const int j = first + t;
    int64_t k_off, v_off;
    if constexpr (kAddr == kBlockPages || kAddr == kRowPages) {
      const int page_size = static_cast<int>(s.page_size);
      const int in_page = j % page_size;
      const int64_t page = s.block_table[j / page_size];
      k_off = page * s.k_page_stride + in_page * s.k_row_stride;
      v_off = page * s.v_page_stride + in_page * s.v_row_stride;
    } else {
      k_off = j * s.k_row_stride;
      v_off = j * s.v_row_stride;
    }
    *reinterpret_cast<uint4*>(kc + k_off + c) =
        *reinterpret_cast<const uint4*>(kn + t * s.kn_row_stride + c);
    *reinterpret_cast<uint4*>(vc + v_off + c) =
        *reinterpret_cast<const uint4*>(vn + t * s.vn_row_stride + c);
  }
}

}  // namespace flashmod::cuda_kernels
