#include "serve_host.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../common/error_message.h"
#include "../common/scalar_kind_of.h"
#include "attention_host.h"

namespace flashmod {
namespace {

void check_dtype(const char* prefix, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const char* k_name, const char* v_name) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      error_message(prefix, "q must be float32, float16, bfloat16 or float64, got ", dtype));
  TORCH_CHECK(k.scalar_type() == dtype, error_message(prefix, k_name, " must have q's dtype ",
                                                      dtype, ", got ", k.scalar_type()));
  TORCH_CHECK(v.scalar_type() == dtype, error_message(prefix, v_name, " must have q's dtype ",
                                                      dtype, ", got ", v.scalar_type()));
  TORCH_CHECK(k.device() == q.device(), error_message(prefix, k_name, " must be on q's device ",
                                                      q.device(), ", got ", k.device()));
  TORCH_CHECK(v.device() == q.device(), error_message(prefix, v_name, " must be on q's device ",
                                                      q.device(), ", got ", v.device()));
}

// An int32 index tensor of the given rank (and, where want >= 0, size of dim 0) on q's device.
void check_index(const char* prefix, const char* name, const at::Tensor& t, int64_t rank,
                 int64_t want, const char* want_text, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == at::kInt,
              error_message(prefix, name, " must be int32, got ", t.scalar_type()));
  TORCH_CHECK(t.dim() == rank, error_message(prefix, name, " must be a ", rank, "-D tensor, got a ",
                                             t.dim(), "-D tensor of shape ", t.sizes()));
  TORCH_CHECK(want < 0 || t.size(0) == want,
              error_message(prefix, name, " must have ", want_text, " = ", want,
                            " entries in dim 0, got ", t.size(0)));
  TORCH_CHECK(t.device() == q.device(), error_message(prefix, name, " must be on q's device ",
                                                      q.device(), ", got ", t.device()));
}

// Values of cu_seqlens, checked where they can be read without a device sync (CPU): starts at 0,
// never decreases, ends at the packed total, and no sequence is longer than max_seqlen.
void check_cu_seqlens_values(const char* prefix, const char* name, const at::Tensor& cu,
                             int64_t total, const char* total_name, int64_t max_seqlen,
                             const char* max_name) {
  if (!cu.device().is_cpu()) return;
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK(c[0] == 0, error_message(prefix, name, "[0] must be 0, got ", c[0]));
  for (int64_t i = 0; i + 1 < n; ++i) {
    TORCH_CHECK(c[i + 1] >= c[i],
                error_message(prefix, name, " must be non-decreasing, got ", name, "[", i,
                              "] = ", c[i], " > ", name, "[", i + 1, "] = ", c[i + 1]));
    TORCH_CHECK(c[i + 1] - c[i] <= max_seqlen,
                error_message(prefix, "sequence ", i, " of ", name, " has length ", c[i + 1] - c[i],
                              ", more than ", max_name, " = ", max_seqlen));
  }
  TORCH_CHECK(c[n - 1] == total, error_message(prefix, name, "[-1] must equal ", total_name, " = ",
                                               total, ", got ", c[n - 1]));
}

// Last-dim-contiguous copy of an input the op only reads.
at::Tensor rows_contiguous(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

PreparedServe prepare_attention_varlen(const at::Tensor& q_in, const at::Tensor& k_in,
                                       const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                       int64_t max_seqlen_k, std::optional<double> scale,
                                       bool is_causal, int64_t window_left, int64_t window_right,
                                       double softcap, bool allocate_outputs) {
  constexpr const char* prefix = "flashmod.attention_varlen: ";
  for (auto [name, t] : {std::pair{"q", &q_in}, std::pair{"k", &k_in}, std::pair{"v", &v_in}}) {
    TORCH_CHECK(
        t->dim() == 3,
        error_message(prefix, name, " must be a 3-D tensor (total_tokens, heads, head_dim), got a ",
                      t->dim(), "-D tensor of shape ", t->sizes()));
  }
  check_dtype(prefix, q_in, k_in, v_in, "k", "v");
  TORCH_CHECK(q_in.size(2) > 0,
              error_message(prefix, "q's head_dim must be positive, got ", q_in.size(2)));
  TORCH_CHECK(k_in.size(2) == q_in.size(2) && v_in.size(2) == q_in.size(2),
              error_message(prefix, "k and v must have q's head_dim ", q_in.size(2), ", got k ",
                            k_in.size(2), " and v ", v_in.size(2)));
  TORCH_CHECK(v_in.size(0) == k_in.size(0) && v_in.size(1) == k_in.size(1),
              error_message(prefix, "v must have k's (total_k, heads) = (", k_in.size(0), ", ",
                            k_in.size(1), "), got (", v_in.size(0), ", ", v_in.size(1), ")"));
  TORCH_CHECK(
      k_in.size(1) > 0 && q_in.size(1) % k_in.size(1) == 0,
      error_message(prefix, "q's heads must be a multiple of k's heads (GQA/MQA), got q heads ",
                    q_in.size(1), " and k/v heads ", k_in.size(1)));
  check_index(prefix, "cu_seqlens_q", cu_seqlens_q, 1, -1, "", q_in);
  TORCH_CHECK(cu_seqlens_q.numel() >= 1,
              error_message(prefix, "cu_seqlens_q must have batch + 1 >= 1 entries, got 0"));
  check_index(prefix, "cu_seqlens_k", cu_seqlens_k, 1, cu_seqlens_q.numel(),
              "cu_seqlens_q's length (batch + 1)", q_in);
  TORCH_CHECK(max_seqlen_q >= 0,
              error_message(prefix, "max_seqlen_q must be >= 0, got ", max_seqlen_q));
  TORCH_CHECK(max_seqlen_k >= 0,
              error_message(prefix, "max_seqlen_k must be >= 0, got ", max_seqlen_k));
  check_attention_options(prefix, scale, window_left, window_right, softcap);

  PreparedServe r;
  r.cu_seqlens_q = cu_seqlens_q.contiguous();
  r.cu_seqlens_k = cu_seqlens_k.contiguous();
  check_cu_seqlens_values(prefix, "cu_seqlens_q", r.cu_seqlens_q, q_in.size(0), "q.size(0)",
                          max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens_values(prefix, "cu_seqlens_k", r.cu_seqlens_k, k_in.size(0), "k.size(0)",
                          max_seqlen_k, "max_seqlen_k");

  r.q = rows_contiguous(q_in);
  r.k = rows_contiguous(k_in);
  r.v = rows_contiguous(v_in);
  if (allocate_outputs) {
    r.out = at::empty_like(r.q);
    r.lse = at::empty({r.q.size(1), r.q.size(0)}, r.q.options().dtype(at::kFloat));
  }

  AttentionParams& p = r.params;
  p.batch = r.cu_seqlens_q.numel() - 1;
  p.heads_q = r.q.size(1);
  p.heads_kv = r.k.size(1);
  p.seqlen_q = max_seqlen_q;
  p.seqlen_k = max_seqlen_k;
  p.head_dim = r.q.size(2);
  p.q = r.q.data_ptr();
  p.k = r.k.data_ptr();
  p.v = r.v.data_ptr();
  if (allocate_outputs) {
    p.out = r.out.data_ptr();
    p.lse = r.lse.data_ptr<float>();
    p.out_head_stride = r.out.stride(1), p.out_row_stride = r.out.stride(0);
  }
  p.q_head_stride = r.q.stride(1), p.q_row_stride = r.q.stride(0);
  p.k_head_stride = r.k.stride(1), p.k_row_stride = r.k.stride(0);
  p.v_head_stride = r.v.stride(1), p.v_row_stride = r.v.stride(0);
  p.lse_batch_stride = 0, p.lse_head_stride = r.q.size(0);
  p.cu_seqlens_q = r.cu_seqlens_q.data_ptr<int32_t>();
  p.cu_seqlens_k = r.cu_seqlens_k.data_ptr<int32_t>();
  p.packed_rows_q = r.q.size(0), p.packed_rows_k = r.k.size(0);
  set_window(p, is_causal, window_left, window_right);
  p.bottom_right = true;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.softcap = softcap;
  p.dtype = scalar_kind_of(r.q.scalar_type());
  return r;
}

void set_varlen_dropout(AttentionParams& p, const char* op, const at::Tensor& q, double dropout_p,
                        const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0,
              error_message(op, ": dropout_p must be a probability in [0, 1], got ", dropout_p));
  if (dropout_p == 0.0) return;
  TORCH_CHECK(rng_state.has_value(),
              error_message(op, ": dropout_p = ", dropout_p,
                            " > 0 needs rng_state (a contiguous (2,) int64 tensor), got None"));
  set_dropout(p, op, q, dropout_p, *rng_state);
}

void check_varlen_backward_inputs(const at::Tensor& grad_out,
                                  const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                  const at::Tensor& out, const at::Tensor& lse) {
  constexpr const char* prefix = "flashmod.attention_varlen_backward: ";
  TORCH_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes(),
              error_message(prefix, "out and grad_out must have q's shape ", q.sizes(),
                            ", got out ", out.sizes(), " and grad_out ", grad_out.sizes()));
  const std::vector<int64_t> lse_shape{q.size(1), q.size(0)};
  TORCH_CHECK(
      lse.sizes() == c10::IntArrayRef(lse_shape) && lse.scalar_type() == at::kFloat,
      error_message(prefix, "lse must be float32 of shape (heads, total_q) = ",
                    c10::IntArrayRef(lse_shape), ", got ", lse.scalar_type(), " ", lse.sizes()));
  TORCH_CHECK(!grad_lse.has_value() || grad_lse->sizes() == lse.sizes(),
              error_message(prefix, "grad_lse must have lse's shape ", lse.sizes(), ", got ",
                            grad_lse.has_value() ? grad_lse->sizes() : lse.sizes()));
}

PreparedServe prepare_attention_kvcache(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& block_table,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap, bool append_here) {
  constexpr const char* prefix = "flashmod.attention_kvcache: ";
  const bool paged = block_table.has_value();
  const char* cache_shape = paged ? "(num_blocks, page_size, heads_k, head_dim)"
                                  : "(batch_cache, seqlen_cache, heads_k, head_dim)";
  TORCH_CHECK(
      q_in.dim() == 4,
      error_message(prefix, "q must be a 4-D tensor (batch, seqlen_q, heads, head_dim), got a ",
                    q_in.dim(), "-D tensor of shape ", q_in.sizes()));
  for (auto [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}}) {
    TORCH_CHECK(t->dim() == 4,
                error_message(prefix, name, " must be a 4-D tensor ", cache_shape, ", got a ",
                              t->dim(), "-D tensor of shape ", t->sizes()));
    // Written in place: a copy would lose the append.
    TORCH_CHECK(t->stride(-1) == 1, error_message(prefix, name,
                                                  " must have stride 1 in its last dimension "
                                                  "(it is updated in place), got strides ",
                                                  t->strides()));
  }
  check_dtype(prefix, q_in, k_cache, v_cache, "k_cache", "v_cache");
  const int64_t B = q_in.size(0), Sq = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(D > 0, error_message(prefix, "q's head_dim must be positive, got ", D));
  TORCH_CHECK(k_cache.size(3) == D && v_cache.size(3) == D,
              error_message(prefix, "k_cache and v_cache must have q's head_dim ", D,
                            ", got k_cache ", k_cache.size(3), " and v_cache ", v_cache.size(3)));
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(),
              error_message(prefix, "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
                            v_cache.sizes()));
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0,
              error_message(prefix,
                            "q's heads must be a multiple of k_cache's heads (GQA/MQA), got q "
                            "heads ",
                            Hq, " and k_cache heads ", Hkv));
  TORCH_CHECK(k_new.has_value() == v_new.has_value(),
              error_message(prefix, "k and v must be given together, got ",
                            k_new.has_value() ? "k without v" : "v without k"));
  int64_t s_new = 0;
  if (k_new.has_value()) {
    TORCH_CHECK(cache_seqlens.has_value(),
                error_message(prefix, "appending k/v needs cache_seqlens (where to write them)"));
    for (auto [name, t] : {std::pair{"k", &*k_new}, std::pair{"v", &*v_new}}) {
      TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(2) == Hkv && t->size(3) == D,
                  error_message(prefix, name,
                                " must have shape (batch, seqlen_new, heads_k, "
                                "head_dim) = (",
                                B, ", *, ", Hkv, ", ", D, "), got ", t->sizes()));
      TORCH_CHECK(t->scalar_type() == q_in.scalar_type(),
                  error_message(prefix, name, " must have q's dtype ", q_in.scalar_type(), ", got ",
                                t->scalar_type()));
      TORCH_CHECK(t->device() == q_in.device(),
                  error_message(prefix, name, " must be on q's device ", q_in.device(), ", got ",
                                t->device()));
    }
    TORCH_CHECK(v_new->size(1) == k_new->size(1),
                error_message(prefix, "v must have k's seqlen_new ", k_new->size(1), ", got ",
                              v_new->size(1)));
    s_new = k_new->size(1);
  }
  int64_t capacity = k_cache.size(1);  // keys a batch row can hold
  if (paged) {
    check_index(prefix, "block_table", *block_table, 2, B, "q's batch", q_in);
    TORCH_CHECK(!cache_batch_idx.has_value(),
                error_message(prefix,
                              "cache_batch_idx cannot be combined with block_table "
                              "(a block_table row already names each sequence's pages)"));
    TORCH_CHECK(k_cache.size(1) > 0, error_message(prefix,
                                                   "k_cache's page_size (dim 1) must be "
                                                   "positive, got ",
                                                   k_cache.size(1)));
    capacity = block_table->size(1) * k_cache.size(1);
  } else {
    TORCH_CHECK(cache_batch_idx.has_value() || k_cache.size(0) == B,
                error_message(prefix, "k_cache must have q's batch ", B,
                              " rows (or pass cache_batch_idx), got ", k_cache.size(0)));
  }
  if (cache_seqlens.has_value())
    check_index(prefix, "cache_seqlens", *cache_seqlens, 1, B, "q's batch", q_in);
  if (cache_batch_idx.has_value())
    check_index(prefix, "cache_batch_idx", *cache_batch_idx, 1, B, "q's batch", q_in);
  check_attention_options(prefix, scale, window_left, window_right, softcap);

  PreparedServe r;
  // Values, where reading them costs no device sync: every write and read stays in the cache,
  // and no appended token lands where another batch row (or the row itself, elsewhere) reads.
  if (q_in.device().is_cpu()) {
    std::vector<int64_t> used(B, capacity);  // keys each row reads: cache_seqlens[b] + s_new
    if (cache_seqlens.has_value()) {
      const at::Tensor c = cache_seqlens->contiguous();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = c.data_ptr<int32_t>()[b];
        TORCH_CHECK(n >= 0 && n + s_new <= capacity,
                    error_message(prefix, "cache_seqlens[", b, "] = ", n, " plus the ", s_new,
                                  " new tokens must fit the cache's ", capacity,
                                  " slots per row (and be >= 0)"));
        used[b] = n + s_new;
      }
    }
    if (cache_batch_idx.has_value()) {
      const at::Tensor c = cache_batch_idx->contiguous();
      const int32_t* idx = c.data_ptr<int32_t>();
      std::vector<int64_t> first_row(k_cache.size(0), -1);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t i = idx[b];
        TORCH_CHECK(i >= 0 && i < k_cache.size(0),
                    error_message(prefix, "cache_batch_idx[", b, "] = ", i,
                                  " is not a row of k_cache (", k_cache.size(0), " rows)"));
        // Rows may share a cache row to read it, not to append to it.
        TORCH_CHECK(s_new == 0 || first_row[i] < 0,
                    error_message(prefix, "cache_batch_idx[", first_row[i],
                                  "] and cache_batch_idx[", b, "] are both ", i,
                                  ": appending k/v needs a cache row of its own per batch row"));
        first_row[i] = b;
      }
    }
    if (paged) {
      // Only the pages a row reads are looked up (the columns past them may hold anything, e.g.
      // -1 padding); a page the append writes to must be read by no other row or column.
      const at::Tensor t = block_table->contiguous();
      const int32_t* bt = t.data_ptr<int32_t>();
      const int64_t page = k_cache.size(1), columns = t.size(1);
      std::vector<int32_t> readers(k_cache.size(0), 0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < (used[b] + page - 1) / page; ++j) {
          const int32_t e = bt[b * columns + j];
          TORCH_CHECK(e >= 0 && e < k_cache.size(0),
                      error_message(prefix, "block_table entry ", e, " (row ", b, ", column ", j,
                                    ") is not a page of k_cache (", k_cache.size(0), " pages)"));
          ++readers[e];
        }
      }
      for (int64_t b = 0; b < B && s_new > 0; ++b) {
        for (int64_t j = (used[b] - s_new) / page; j < (used[b] + page - 1) / page; ++j) {
          const int32_t e = bt[b * columns + j];
          TORCH_CHECK(
              readers[e] == 1,
              error_message(prefix, "block_table row ", b, " appends to page ", e, " (column ", j,
                            "), which other rows or columns also read: "
                            "a page written by the append must be the row's own"));
        }
      }
    }
  }

  // The append: token t of row b goes to slot cache_seqlens[b] + t of the row's cache (through
  // its page list when paged). Index ops only, so it is stream-ordered and graph-capturable.
  if (append_here && s_new > 0) {
    const auto long_opts = q_in.options().dtype(at::kLong);
    const at::Tensor pos =
        cache_seqlens->to(at::kLong).unsqueeze(1) + at::arange(s_new, long_opts).unsqueeze(0);
    at::Tensor rows, slots;
    if (paged) {
      rows = block_table->to(at::kLong).gather(1, at::floor_divide(pos, k_cache.size(1)));
      slots = at::remainder(pos, k_cache.size(1));
    } else {
      rows =
          (cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong) : at::arange(B, long_opts))
              .unsqueeze(1)
              .expand({B, s_new});
      slots = pos;
    }
    // index_put_ on the caches themselves (not a copy): the schema declares them mutated.
    at::Tensor kc = k_cache, vc = v_cache;
    kc.index_put_({rows, slots}, *k_new);
    vc.index_put_({rows, slots}, *v_new);
  }

  r.q = rows_contiguous(q_in);
  r.k = k_cache;
  r.v = v_cache;
  r.out = at::empty_like(r.q);
  r.lse = at::empty({B, Hq, Sq}, r.q.options().dtype(at::kFloat));
  if (cache_seqlens.has_value()) {
    r.seqused_k = append_here ? (*cache_seqlens + s_new).to(at::kInt).contiguous()
                              : cache_seqlens->contiguous();
  }
  if (cache_batch_idx.has_value()) r.kv_batch_idx = cache_batch_idx->contiguous();
  if (paged) r.block_table = block_table->contiguous();

  AttentionParams& p = r.params;
  p.batch = B;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.seqlen_q = Sq;
  p.seqlen_k = capacity;
  p.head_dim = D;
  p.q = r.q.data_ptr();
  p.k = r.k.data_ptr();
  p.v = r.v.data_ptr();
  p.out = r.out.data_ptr();
  p.lse = r.lse.data_ptr<float>();
  p.q_batch_stride = r.q.stride(0), p.q_head_stride = r.q.stride(2), p.q_row_stride = r.q.stride(1);
  p.k_batch_stride = r.k.stride(0), p.k_head_stride = r.k.stride(2), p.k_row_stride = r.k.stride(1);
  p.v_batch_stride = r.v.stride(0), p.v_head_stride = r.v.stride(2), p.v_row_stride = r.v.stride(1);
  p.out_batch_stride = r.out.stride(0), p.out_head_stride = r.out.stride(2);
  p.out_row_stride = r.out.stride(1);
  p.lse_batch_stride = Hq * Sq, p.lse_head_stride = Sq;
  if (r.seqused_k.defined()) p.seqused_k = r.seqused_k.data_ptr<int32_t>();
  if (r.kv_batch_idx.defined()) p.kv_batch_idx = r.kv_batch_idx.data_ptr<int32_t>();
  if (paged) {
    p.block_table = r.block_table.data_ptr<int32_t>();
    p.block_table_batch_stride = r.block_table.stride(0);
    p.page_size = k_cache.size(1);
    p.k_page_stride = p.k_batch_stride, p.v_page_stride = p.v_batch_stride;
    p.k_batch_stride = p.v_batch_stride = 0;
  }
  set_window(p, is_causal, window_left, window_right);
  p.bottom_right = true;
  p.diag_offset = p.seqlen_k - p.seqlen_q;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.softcap = softcap;
  p.dtype = scalar_kind_of(r.q.scalar_type());
  return r;
}

}  // namespace flashmod
