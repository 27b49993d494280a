// Host-side preparation of the serving ops, shared by CPU and CUDA: attention_varlen (packed
// ragged batches, flash-attn's varlen layout) and attention_kvcache (decode against a cache,
// appending new keys/values in place, optionally paged). Checks, outputs and an AttentionParams
// whose per-sequence extents the kernels resolve with sequence_view() (sequence_view.h).
// flashmod/ops.py's register_fake mirrors every check.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "attention_params.h"

namespace flashmod {

struct PreparedServe {
  at::Tensor out;  // varlen: (total_q, Hq, D); kvcache: (B, Sq, Hq, D); q's dtype and layout
  at::Tensor lse;  // varlen: (Hq, total_q); kvcache: (B, Hq, Sq); fp32, contiguous
  // What params points into, kept alive: the (fixed-up) inputs and the per-row extents.
  at::Tensor q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, kv_batch_idx, block_table;
  AttentionParams params;
};

// q (total_q, Hq, D), k/v (total_k, Hkv, D), cu_seqlens_q/k int32 (batch + 1) on q's device.
// max_seqlen_q/k bound every sequence (the CUDA grid is sized from them; checked on CPU, where
// the values are read without a device sync). Causal is bottom-right per sequence.
PreparedServe prepare_attention_varlen(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                       int64_t max_seqlen_k, std::optional<double> scale,
                                       bool is_causal, int64_t window_left, int64_t window_right,
                                       double softcap, bool allocate_outputs = true);

// attention_varlen's dropout into p (set_dropout's checks): none at dropout_p = 0, else rng_state
// is required. Sequence b's draws are those of batch row b of a dense call (its queries and keys
// counted from the sequence's first): the CUDA kernels' sequence views keep the call's row index,
// and the CPU's per-sequence calls set dropout_batch0.
void set_varlen_dropout(AttentionParams& p, const char* op, const at::Tensor& q, double dropout_p,
                        const std::optional<at::Tensor>& rng_state);

// attention_varlen_backward's checks beyond the forward's (prepare_attention_varlen, called with
// allocate_outputs = false): out and grad_out shaped like q, lse fp32 (Hq, total_q), grad_lse
// shaped like lse. Shared by the CPU and CUDA registrations.
void check_varlen_backward_inputs(const at::Tensor& grad_out,
                                  const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                  const at::Tensor& out, const at::Tensor& lse);

// q (B, Sq, Hq, D); caches (B_cache, S_cache, Hkv, D), or (pages, page_size, Hkv, D) with
// block_table (B, max_pages) int32; k/v (B, S_new, Hkv, D) optional new tokens, written into the
// caches at cache_seqlens (int32 (B)) before the attention, which then covers
// cache_seqlens + S_new keys per row (all S_cache / max_pages * page_size without
// cache_seqlens). cache_batch_idx (int32 (B)) picks each row's cache row (contiguous caches).
// append_here: the append and seqused_k (cache_seqlens + S_new) are done here with index ops (no
// host sync); otherwise nothing is written and seqused_k is cache_seqlens itself (the old lengths):
// the caller appends (CUDA: inside the decode kernel, or one append kernel that also writes the
// new lengths) before or while the attention runs.
PreparedServe prepare_attention_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& block_table,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap, bool append_here = true);

}  // namespace flashmod
