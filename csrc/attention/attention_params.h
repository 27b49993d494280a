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
  // q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D); out: (B, Hq, Nq, D); lse: (B, Hq, Nq) contiguous
  // fp32.
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
