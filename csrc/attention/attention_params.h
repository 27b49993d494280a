// The plain description of one attention call that every backend kernel receives.
//
// No torch headers here on purpose: the CUDA translation units include only this file,
// so nvcc can compile (and report registers/spills for) them on a machine without torch
// or a GPU. csrc/attention/attention_host.cpp fills it after the shared checks passed.
#pragma once

#include <cstdint>

#include "../common/scalar_kinds.h"

namespace flashmod {

struct AttentionParams {
  // q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D); out: (B, Hq, Nq, D); lse: (B, Hq, Nq) fp32 (strides
  // below; contiguous for dense calls).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  // Optional mask, viewed as (B, Hq, Nq, Nk) through strides; broadcast dimensions have stride 0.
  const void* mask = nullptr;

  // Element strides for (batch, head, row); the last dimension always has stride 1.
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;  // heads_q % heads_kv == 0; q-head h reads kv-head h / (heads_q / heads_kv)
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;

  // Key j is visible to query i iff
  //   (window_left  < 0 || j >= i + diag_offset - window_left) &&
  //   (window_right < 0 || j <= i + diag_offset + window_right) && mask(i, j).
  // Causal attention is window_right == 0. diag_offset is Nk - Nq for bottom-right
  // alignment (flash-attn, KV-cache decode) and 0 for top-left (SDPA's is_causal).
  int64_t window_left = -1;
  int64_t window_right = -1;
  int64_t diag_offset = 0;
  // GQA packing (CUDA decode path only): when > 0, the g query heads of a kv group were folded
  // into one head of g * pos_period rows, head-major, so row i is query position i % pos_period
  // and the window rule above applies to that position. 0: row i is position i.
  int64_t pos_period = 0;

  // Double so the fp64 CPU path keeps full precision; kernels narrow them to their accumulator
  // type.
  double scale = 1.0;    // multiplies q·k before the soft cap
  double softcap = 0.0;  // > 0: score = softcap * tanh(score / softcap); the mask is added after

  ScalarKind dtype = ScalarKind::kFloat32;
  MaskKind mask_kind = MaskKind::kNone;

  // lse's element strides for (batch, head); its rows are contiguous. Dense calls: (Hq * Nq,
  // Nq). Variable-length calls: (0, total_q), lse being flash-attn's (Hq, total_q).
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Per-sequence extents (all optional; int32, on the kernel's device). With any of them set,
  // batch, seqlen_q and seqlen_k above are upper bounds (grid sizing), and a kernel turns
  // (params, batch row b) into the dense view of that row alone with sequence_view() (in
  // sequence_view.h) at the start of its work. There diag_offset is per row: seqlen_k - seqlen_q
  // of the row when bottom_right (flash-attn's alignment), else 0.
  //   cu_seqlens_q / cu_seqlens_k (batch + 1): packed rows. Row b's queries (keys) are rows
  //     [cu[b], cu[b+1]) of q/out (k/v); the batch strides of packed tensors are 0.
  //   seqused_k (batch): only keys [0, seqused_k[b]) of row b exist (a KV cache's valid length;
  //     plus seqlen_new appended keys with k_new, below).
  //   kv_batch_idx (batch): row b reads the K/V of cache row kv_batch_idx[b] (default b).
  //   block_table (batch, block_table_batch_stride): paged K/V. k/v are then (pages, page_size,
  //     Hkv, D) pools stepping k_page_stride / v_page_stride elements per page (their batch
  //     strides are 0); key j of row b lives in page
  //     block_table[b * block_table_batch_stride + j / page_size] at row j % page_size.
  //   packed_rows_q / packed_rows_k: with cu_seqlens, the rows of packed q/out (k/v), i.e. the
  //     tensors' extents (tensor maps bound their loads by these).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t packed_rows_q = 0, packed_rows_k = 0;
  const int32_t* seqused_k = nullptr;
  const int32_t* kv_batch_idx = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int64_t page_size = 0;
  int64_t k_page_stride = 0, v_page_stride = 0;
  // The KV-cache append fused into the CUDA decode kernel: with k_new set (seqused_k is then the
  // cache's old lengths), row b has seqused_k[b] + seqlen_new keys, and keys from seqused_k[b] on
  // are rows of k_new / v_new (B, seqlen_new, Hkv, D; element strides below), which the kernel
  // reads from there and also writes into the cache slots they belong to.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t kn_batch_stride = 0, kn_head_stride = 0, kn_row_stride = 0;
  int64_t vn_batch_stride = 0, vn_head_stride = 0, vn_row_stride = 0;
  int64_t seqlen_new = 0;
  bool bottom_right = true;

  // CUDA, with a mask tensor: the class of every (query block, key block) tile of it at the
  // launched kernel's Br x Bc (cuda/mask_tiles.h: hidden, clear or mixed), filled by a pre-pass on
  // the launch's stream; mask_tiles_br / _bc say which tile shape, and a kernel of another shape
  // ignores them. Tile (m, n) of (b, h) is mask_tiles[b * mask_tiles_batch_stride +
  // h * mask_tiles_head_stride + m * mask_tiles_k_blocks + n] (strides 0 where the mask
  // broadcasts).
  const uint8_t* mask_tiles = nullptr;
  int64_t mask_tiles_batch_stride = 0, mask_tiles_head_stride = 0, mask_tiles_k_blocks = 0;
  int32_t mask_tiles_br = 0, mask_tiles_bc = 0;

  // Dropout on the probabilities (dense calls: the CUDA sm_80 kernels and the CPU ones;
  // dropout_draws.h): the call's two int64 random words on the kernel's device (read there: no
  // host sync), or nullptr for none. A 16-bit draw keeps its probability
  // iff >= dropout_threshold (round(dropout_p * 2^16)); a kept probability is multiplied by
  // dropout_scale (1 / (1 - dropout_p); 0 at dropout_p = 1; double for the fp64 CPU path).
  const int64_t* dropout_rng = nullptr;
  uint32_t dropout_threshold = 0;
  double dropout_scale = 1.0;
  // The call's batch row that this params' row 0 is, as the draws number rows: a CPU view of one
  // variable-length sequence runs as a batch of its own (serve_cpu.cpp), yet draws as row b of the
  // call. 0 elsewhere (the CUDA kernels see the call's own row index).
  int64_t dropout_batch0 = 0;
};

// The backward's description: the forward's fields (q, k, v, out, lse, mask, window, scale,
// softcap) plus the incoming gradients and the outputs. out is read, not written.
struct AttentionBwdParams : AttentionParams {
  const void* grad_out = nullptr;   // (B, Hq, Nq, D), q's dtype
  const float* grad_lse = nullptr;  // (B, Hq, Nq) contiguous fp32, or nullptr (zero)
  void* grad_q = nullptr;           // (B, Hq, Nq, D), q's dtype
  void* grad_k = nullptr;           // (B, Hkv, Nk, D), k's dtype: summed over the query group
  void* grad_v = nullptr;           // (B, Hkv, Nk, D), v's dtype: summed over the query group
  int64_t grad_out_batch_stride = 0, grad_out_head_stride = 0, grad_out_row_stride = 0;
  int64_t grad_q_batch_stride = 0, grad_q_head_stride = 0, grad_q_row_stride = 0;
  int64_t grad_k_batch_stride = 0, grad_k_head_stride = 0, grad_k_row_stride = 0;
  int64_t grad_v_batch_stride = 0, grad_v_head_stride = 0, grad_v_row_stride = 0;
  // Optional (attention_backward's compute_grad_mask): (B, Hq, Nq, Nk) contiguous fp32, receives
  // dL/d(score after the mask) at every visible (query, key) pair and 0 elsewhere; the caller
  // reduces it over the mask's broadcast dimensions. nullptr: not wanted.
  float* grad_mask = nullptr;
};

}  // namespace flashmod
