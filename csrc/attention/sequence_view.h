// One batch row of a variable-length / KV-cache call, seen as the dense single-sequence call the
// kernels already handle. Torch-free and __host__ __device__: the CPU glue calls it per sequence
// with host pointers, the CUDA kernels call it once at the start of a CTA with device pointers.
#pragma once

#include <cstdint>

#include "../common/host_device.h"
#include "attention_params.h"

namespace flashmod {

// Bytes of one element of q/k/v/out and of the mask (the params hold untyped pointers).
FLASHMOD_HD int64_t scalar_bytes(ScalarKind kind) {
  return kind == ScalarKind::kFloat64 ? 8 : kind == ScalarKind::kFloat32 ? 4 : 2;
}
FLASHMOD_HD int64_t mask_bytes(const AttentionParams& p) {
  return p.mask_kind == MaskKind::kBool          ? 1
         : p.mask_kind == MaskKind::kAdditiveF32 ? 4
                                                 : scalar_bytes(p.dtype);
}

// True when p carries per-sequence extents (attention_params.h) and needs sequence_view().
FLASHMOD_HD bool has_sequence_extents(const AttentionParams& p) {
  return p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr ||
         p.kv_batch_idx != nullptr || p.block_table != nullptr;
}

// The query side of a packed row: rows [start, start + len) of q/out, lse columns from start.
FLASHMOD_HD void view_packed_queries(AttentionParams& s, const AttentionParams& p, int64_t start,
                                     int64_t len) {
  s.seqlen_q = len;
  s.q = static_cast<const char*>(p.q) + start * p.q_row_stride * scalar_bytes(p.dtype);
  s.out = static_cast<char*>(p.out) + start * p.out_row_stride * scalar_bytes(p.dtype);
  s.lse = p.lse + start;
}

// The key side of a packed row: rows [start, start + len) of k/v.
FLASHMOD_HD void view_packed_keys(AttentionParams& s, const AttentionParams& p, int64_t start,
                                  int64_t len) {
  s.seqlen_k = len;
  s.k = static_cast<const char*>(p.k) + start * p.k_row_stride * scalar_bytes(p.dtype);
  s.v = static_cast<const char*>(p.v) + start * p.v_row_stride * scalar_bytes(p.dtype);
}

// What every view ends with: no batch strides left, and the row's own causal alignment.
FLASHMOD_HD void finish_view(AttentionParams& s, const AttentionParams& p) {
  s.q_batch_stride = s.out_batch_stride = s.lse_batch_stride = s.mask_batch_stride = 0;
  s.k_batch_stride = s.v_batch_stride = 0;
  // GQA-packed decode rows (pos_period > 0) hold pos_period query positions.
  const int64_t positions = p.pos_period > 0 ? p.pos_period : s.seqlen_q;
  s.diag_offset = p.bottom_right ? s.seqlen_k - positions : 0;
}

// A packed (cu_seqlens) row from its extents, read beforehand: the view sequence_view gives
// without its loads of cu_seqlens_q / cu_seqlens_k.
FLASHMOD_HD AttentionParams packed_view(const AttentionParams& p, int64_t q_start, int64_t q_len,
                                        int64_t k_start, int64_t k_len) {
  AttentionParams s = p;
  view_packed_queries(s, p, q_start, q_len);
  view_packed_keys(s, p, k_start, k_len);
  finish_view(s, p);
  return s;
}

// The params of batch row b alone: every batch offset is applied to the pointers and every batch
// stride is 0 (so indexing with any batch index, 0 or b, lands on row b), seqlen_q / seqlen_k are
// the row's own lengths and diag_offset is the row's. batch is left alone: grids and workspaces
// sized from it keep their meaning. Paged K/V: k and v stay the page pools' bases, block_table
// points at row b's page list, and kv_row_offset() resolves a key row.
FLASHMOD_HD AttentionParams sequence_view(const AttentionParams& p, int64_t b) {
  AttentionParams s = p;
  if (!has_sequence_extents(p)) return s;
  if (p.cu_seqlens_q != nullptr) {
    const int64_t start = p.cu_seqlens_q[b];
    view_packed_queries(s, p, start, p.cu_seqlens_q[b + 1] - start);
  } else {
    s.q = static_cast<const char*>(p.q) + b * p.q_batch_stride * scalar_bytes(p.dtype);
    s.out = static_cast<char*>(p.out) + b * p.out_batch_stride * scalar_bytes(p.dtype);
    s.lse = p.lse + b * p.lse_batch_stride;
  }
  if (p.cu_seqlens_k != nullptr) {
    const int64_t start = p.cu_seqlens_k[b];
    view_packed_keys(s, p, start, p.cu_seqlens_k[b + 1] - start);
  } else if (p.block_table != nullptr) {
    s.block_table = p.block_table + b * p.block_table_batch_stride;
  } else {
    const int64_t kb = p.kv_batch_idx != nullptr ? p.kv_batch_idx[b] : b;
    s.k = static_cast<const char*>(p.k) + kb * p.k_batch_stride * scalar_bytes(p.dtype);
    s.v = static_cast<const char*>(p.v) + kb * p.v_batch_stride * scalar_bytes(p.dtype);
  }
  if (p.seqused_k != nullptr) s.seqlen_k = p.seqused_k[b] + p.seqlen_new;
  if (p.k_new != nullptr) {
    s.k_new = static_cast<const char*>(p.k_new) + b * p.kn_batch_stride * scalar_bytes(p.dtype);
    s.v_new = static_cast<const char*>(p.v_new) + b * p.vn_batch_stride * scalar_bytes(p.dtype);
    s.kn_batch_stride = s.vn_batch_stride = 0;
  }
  if (p.mask != nullptr) {
    s.mask = static_cast<const char*>(p.mask) + b * p.mask_batch_stride * mask_bytes(p);
  }
  finish_view(s, p);
  return s;
}

// The backward's view of batch row b of a variable-length call: sequence_view for the forward's
// fields, and the gradients placed like the tensors they belong to (grad_out and grad_q like q,
// grad_k and grad_v like k, grad_lse like lse).
FLASHMOD_HD AttentionBwdParams sequence_view_bwd(const AttentionBwdParams& p, int64_t b) {
  AttentionBwdParams s = p;
  static_cast<AttentionParams&>(s) = sequence_view(p, b);
  const int64_t bytes = scalar_bytes(p.dtype);
  if (p.cu_seqlens_q != nullptr) {
    const int64_t start = p.cu_seqlens_q[b];
    s.grad_out = static_cast<const char*>(p.grad_out) + start * p.grad_out_row_stride * bytes;
    s.grad_q = static_cast<char*>(p.grad_q) + start * p.grad_q_row_stride * bytes;
    if (p.grad_lse != nullptr) s.grad_lse = p.grad_lse + start;
    s.grad_out_batch_stride = s.grad_q_batch_stride = 0;
  }
  if (p.cu_seqlens_k != nullptr) {
    const int64_t start = p.cu_seqlens_k[b];
    s.grad_k = static_cast<char*>(p.grad_k) + start * p.grad_k_row_stride * bytes;
    s.grad_v = static_cast<char*>(p.grad_v) + start * p.grad_v_row_stride * bytes;
    s.grad_k_batch_stride = s.grad_v_batch_stride = 0;
  }
  return s;
}

// Element offset of key row j (kv head 0) from k of a view from sequence_view, paged or not,
// with k's strides (k_page_stride, k_row_stride); v: the same with v's.
FLASHMOD_HD int64_t kv_row_offset(const AttentionParams& s, int64_t j, int64_t page_stride,
                                  int64_t row_stride) {
  if (s.block_table == nullptr) return j * row_stride;
  const int64_t page = s.block_table[j / s.page_size];
  return page * page_stride + (j % s.page_size) * row_stride;
}

}  // namespace flashmod
