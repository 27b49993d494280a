// CPU kernels of the serving ops: attention_varlen (+ its backward) and attention_kvcache. The
// per-sequence extents live in host memory here, so each batch row runs the dense CPU forward on
// its sequence_view(); nothing is padded. Two host-side fix-ups per row, both O(row) next to the
// attention's O(rows x keys): varlen lse rows are strided by total_q in (Hq, total_q), so a
// row's lse goes through a (Hq, Nq) scratch; a paged row that the decode engine takes (at most 8
// queries) reads its pages in place, any other has its pages gathered into one contiguous K and V
// first (a copy of the keys it reads; the prefill engine takes one row stride).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <limits>

#include "../../common/error_message.h"
#include "../sequence_view.h"
#include "../serve_host.h"
#include "attention_cpu.h"

namespace flashmod {
namespace {

// Output rows of a view whose row sees no key: 0, lse -inf.
void write_empty_rows(const AttentionParams& s) {
  const int64_t bytes = scalar_bytes(s.dtype);
  for (int64_t h = 0; h < s.heads_q; ++h)
    for (int64_t i = 0; i < s.seqlen_q; ++i) {
      std::memset(
          static_cast<char*>(s.out) + (h * s.out_head_stride + i * s.out_row_stride) * bytes, 0,
          s.head_dim * bytes);
      s.lse[h * s.lse_head_stride + i] = -std::numeric_limits<float>::infinity();
    }
}

void run_row(const PreparedServe& r, const AttentionParams& p, int64_t b) {
  AttentionParams s = sequence_view(p, b);
  s.batch = 1;
  s.dropout_batch0 = p.dropout_batch0 + b;  // the view draws as the call's row b
  if (s.seqlen_q <= 0) return;
  if (s.seqlen_k <= 0) return write_empty_rows(s);
  at::Tensor lse_scratch, k_rows, v_rows;
  float* lse_out = s.lse;
  if (s.lse_head_stride != s.seqlen_q) {
    lse_scratch = at::empty({s.heads_q, s.seqlen_q}, at::TensorOptions().dtype(at::kFloat));
    s.lse = lse_scratch.data_ptr<float>();
    s.lse_head_stride = s.seqlen_q;
  }
  const bool paged_done = s.block_table != nullptr && run_attention_cpu_paged(s);
  if (s.block_table != nullptr && !paged_done) {
    const int64_t pages = (s.seqlen_k + s.page_size - 1) / s.page_size;
    const at::Tensor ids =
        at::from_blob(const_cast<int32_t*>(s.block_table), {pages}, at::kInt).to(at::kLong);
    k_rows = r.k.index_select(0, ids).flatten(0, 1);  // (pages * page_size, Hkv, D)
    v_rows = r.v.index_select(0, ids).flatten(0, 1);
    s.k = k_rows.data_ptr(), s.v = v_rows.data_ptr();
    s.k_head_stride = k_rows.stride(1), s.k_row_stride = k_rows.stride(0);
    s.v_head_stride = v_rows.stride(1), s.v_row_stride = v_rows.stride(0);
    s.k_batch_stride = s.v_batch_stride = 0;
    s.block_table = nullptr;
  }
  if (!paged_done) run_attention_cpu(s);
  if (lse_scratch.defined()) {
    for (int64_t h = 0; h < s.heads_q; ++h)
      std::memcpy(lse_out + h * p.lse_head_stride, s.lse + h * s.seqlen_q,
                  s.seqlen_q * sizeof(float));
  }
}

// Rows run one after the other (each spreads over the threads) unless there are enough of them
// to give every thread whole rows.
void run_rows(const PreparedServe& r) {
  const AttentionParams& p = r.params;
  if (p.batch >= 2 * at::get_num_threads()) {
    at::parallel_for(0, p.batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) run_row(r, p, b);
    });
  } else {
    for (int64_t b = 0; b < p.batch; ++b) run_row(r, p, b);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  PreparedServe r =
      prepare_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               scale, is_causal, window_left, window_right, softcap);
  set_varlen_dropout(r.params, "flashmod.attention_varlen", q, dropout_p, rng_state);
  run_rows(r);
  return {r.out, r.lse};
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& block_table,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap) {
  PreparedServe r =
      prepare_attention_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                block_table, scale, is_causal, window_left, window_right, softcap);
  if (r.out.numel() == 0) return {r.out, r.lse};
  if (has_sequence_extents(r.params)) {
    run_rows(r);
  } else if (r.params.seqlen_k == 0) {
    r.out.zero_();
    r.lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    run_attention_cpu(r.params);  // a full, contiguous cache: one dense call
  }
  return {r.out, r.lse};
}

// Backward: the fused CPU backward (attention_backward's) on each sequence's slices, seen as
// (1, H, N, D) views of the packed tensors; its gradients land in the packed gradients' rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool is_causal, int64_t window_left,
    int64_t window_right, double softcap, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  // The forward's checks (shapes, cu_seqlens values, dropout), then the backward's own.
  PreparedServe r =
      prepare_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               scale, is_causal, window_left, window_right, softcap,
                               /*allocate_outputs=*/false);
  constexpr const char* op = "flashmod.attention_varlen_backward";
  set_varlen_dropout(r.params, op, q, dropout_p, rng_state);
  check_varlen_backward_inputs(grad_out, grad_lse, q, out, lse);
  at::Tensor grad_q = at::zeros_like(q), grad_k = at::zeros_like(k), grad_v = at::zeros_like(v);
  const int32_t* cq = r.cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* ck = r.cu_seqlens_k.data_ptr<int32_t>();
  // (N, H, D) rows [start, start + n) as a (1, H, n, D) view.
  auto seq = [](const at::Tensor& t, int64_t start, int64_t n) {
    return t.narrow(0, start, n).unsqueeze(0).transpose(1, 2);
  };
  for (int64_t b = 0; b < r.params.batch; ++b) {
    const int64_t q0 = cq[b], nq = cq[b + 1] - cq[b], k0 = ck[b], nk = ck[b + 1] - ck[b];
    if (nq == 0 || nk == 0) continue;  // no visible pair: every gradient stays 0
    std::optional<at::Tensor> g_lse;
    if (grad_lse.has_value()) g_lse = grad_lse->narrow(1, q0, nq).unsqueeze(0);
    PreparedAttentionBackward s = prepare_attention_backward(
        seq(grad_out, q0, nq), g_lse, seq(q, q0, nq), seq(k, k0, nk), seq(v, k0, nk),
        seq(out, q0, nq), lse.narrow(1, q0, nq).unsqueeze(0), std::nullopt, scale, is_causal,
        /*bottom_right=*/true, window_left, window_right, softcap, /*compute_grad_mask=*/false);
    set_varlen_dropout(s.params, op, q, dropout_p, rng_state);
    s.params.dropout_batch0 = r.params.dropout_batch0 + b;  // the view draws as the call's row b
    run_attention_backward_cpu(s);
    seq(grad_q, q0, nq).copy_(s.grad_q);
    seq(grad_k, k0, nk).copy_(s.grad_k);
    seq(grad_v, k0, nk).copy_(s.grad_v);
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("attention_varlen", &flashmod::attention_varlen_cpu);
  m.impl("attention_varlen_backward", &flashmod::attention_varlen_backward_cpu);
  m.impl("attention_kvcache", &flashmod::attention_kvcache_cpu);
}
