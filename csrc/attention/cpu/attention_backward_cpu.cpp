// CPU registration of flashmod::attention_backward: FlashAttention-2's backward, tiled, on the
// CPU's BLAS (ATen's matrix product, single-threaded inside each task) for the five tile products
// and plain loops for the elementwise steps.
//
// One task per (batch, kv head): it owns dK/dV of that head and dQ of the query heads of its GQA
// group, so every gradient element is summed by one thread in one fixed order (bitwise the same
// on every run, at any thread count) and nothing needs atomics or a reduction pass. Within a task,
// key blocks K_j (Bc rows) are the outer loop: dK_j, dV_j stay in a small tile until every query
// block that sees K_j was visited; dQ_i is summed over j in the fp32 row buffer of its head. Each
// score tile is recomputed exactly once: P_ij = exp(S_ij - lse_i) from the saved lse.
//
// Memory per thread: the kv head's K and V widened to the math type, the group's Q, dO and dQ
// (O(N D)), and a few Br x Bc tiles; never an Nq x Nk matrix.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../attention_host.h"

namespace flashmod {
namespace {

// Tile shape. 64 x 64 keeps the score tiles (four Br x Bc buffers) in L2 next to the K_j/V_j
// tiles at D = 128, while each product is large enough for the BLAS kernels to run at speed.
constexpr int64_t kBr = 64;
constexpr int64_t kBc = 64;

// A row-major matrix in one of the task's buffers as a tensor view (no copy).
template <typename T>
at::Tensor matrix_view(const T* ptr, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(ptr), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, beta 0 or 1, through ATen's matrix
// product: inside at::parallel_for it runs single-threaded on the CPU's BLAS kernels, and for a
// fixed shape it sums in a fixed order.
template <typename T>
void gemm_rows(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
               int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const at::Tensor lhs = trans_a ? matrix_view(a, k, m, lda).t() : matrix_view(a, m, k, lda);
  const at::Tensor rhs = trans_b ? matrix_view(b, n, k, ldb).t() : matrix_view(b, k, n, ldb);
  at::Tensor out = matrix_view(c, m, n, ldc);
  if (beta == T(0)) {
    at::mm_out(out, lhs, rhs);
    if (alpha != T(1)) out.mul_(alpha);
  } else {
    out.addmm_(lhs, rhs, beta, alpha);
  }
}

template <typename T, typename Elem>
void widen_rows(const Elem* src, int64_t row_stride, int64_t rows, int64_t d, T* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = static_cast<T>(src[r * row_stride + c]);
}

template <typename T, typename Elem>
void narrow_rows(const T* src, int64_t rows, int64_t d, Elem* dst, int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * row_stride + c] = static_cast<Elem>(src[r * d + c]);
}

// The query rows [lo, hi) that can see any key of [j0, j1) under the window rule of
// AttentionParams (key j visible to query i iff i + off - wl <= j <= i + off + wr).
std::pair<int64_t, int64_t> visible_query_rows(const AttentionParams& p, int64_t j0, int64_t j1) {
  int64_t lo = 0, hi = p.seqlen_q;
  if (p.window_right >= 0) lo = std::max(lo, j0 - p.diag_offset - p.window_right);
  if (p.window_left >= 0) hi = std::min(hi, j1 - 1 - p.diag_offset + p.window_left + 1);
  return {lo, std::max(lo, hi)};
}

template <typename Elem, typename T>
struct BackwardTask {
  const AttentionBwdParams& p;
  const T scale, softcap;

  // S_ij -> the row's final logits in place (scale, softcap, mask; -inf where invisible), and
  // with softcap the tanh factor 1 - t^2 into dtanh.
  void masked_logits(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols, T* s,
                     T* dtanh) const {
    const T neg_inf = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      T* srow = s + r * kBc;
      T* trow = dtanh + r * kBc;
      const int64_t diag = i + p.diag_offset;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = j0 + c;
        T x = srow[c] * scale;
        if (softcap > 0) {
          const T t = std::tanh(x / softcap);
          x = softcap * t;
          trow[c] = 1 - t * t;
        }
        bool visible = (p.window_left < 0 || j >= diag - p.window_left) &&
                       (p.window_right < 0 || j <= diag + p.window_right);
        if (visible && p.mask_kind != MaskKind::kNone) {
          const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride +
                              i * p.mask_row_stride + j * p.mask_col_stride;
          switch (p.mask_kind) {
            case MaskKind::kBool: visible = static_cast<const uint8_t*>(p.mask)[off] != 0; break;
            case MaskKind::kAdditiveF32: x += static_cast<const float*>(p.mask)[off]; break;
            default: x += static_cast<T>(static_cast<const Elem*>(p.mask)[off]); break;
          }
        }
        srow[c] = visible ? x : neg_inf;
      }
    }
  }

  // Logits -> P_ij = exp(logit - lse_i) in place. A row without visible keys has lse = -inf:
  // its probabilities are 0, not exp(nan).
  static void probs(int64_t rows, int64_t cols, const T* lse, T* s) {
    const T neg_inf = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      T* srow = s + r * kBc;
      const T l = lse[r];
      for (int64_t c = 0; c < cols; ++c)
        srow[c] = l != neg_inf && srow[c] != neg_inf ? std::exp(srow[c] - l) : T(0);
    }
  }

  // The saved lse is fp32 even for fp64 inputs: its rounding (~1e-7 relative) would scale every
  // fp64 gradient of the row by that much. So for fp64 the lse of the keys this call sees is
  // recomputed and replaces the saved one where both agree to fp32 precision. Where they differ
  // more, the caller passed the lse of a larger key set (e.g. ring attention's merged lse, with
  // these keys one share of it), and the saved value is the right one.
  void refine_lse(int64_t b, int64_t h, const T* q_head, const T* k_head, T* lse, T* s,
                  T* dtanh) const {
    const int64_t nq = p.seqlen_q, nk = p.seqlen_k, d = p.head_dim;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    for (int64_t i0 = 0; i0 < nq; i0 += kBr) {
      const int64_t rows = std::min(kBr, nq - i0);
      T m[kBr], l[kBr];
      std::fill(m, m + kBr, neg_inf);
      std::fill(l, l + kBr, T(0));
      for (int64_t j0 = 0; j0 < nk; j0 += kBc) {
        const int64_t cols = std::min(kBc, nk - j0);
        gemm_rows<T>(false, true, rows, cols, d, T(1), q_head + i0 * d, d, k_head + j0 * d, d, T(0),
                     s, kBc);
        masked_logits(b, h, i0, rows, j0, cols, s, dtanh);
        for (int64_t r = 0; r < rows; ++r) {
          T block_max = neg_inf;
          for (int64_t c = 0; c < cols; ++c) block_max = std::max(block_max, s[r * kBc + c]);
          if (block_max == neg_inf) continue;
          const T new_m = std::max(m[r], block_max);
          T sum = 0;
          for (int64_t c = 0; c < cols; ++c) sum += std::exp(s[r * kBc + c] - new_m);
          l[r] = l[r] * std::exp(m[r] - new_m) + sum;
          m[r] = new_m;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const T saved = lse[i0 + r];
        if (saved == neg_inf || m[r] == neg_inf) continue;
        const T exact = m[r] + std::log(l[r]);
        if (std::abs(exact - saved) <= 4e-6 * std::max(T(1), std::abs(saved))) lse[i0 + r] = exact;
      }
    }
  }

  void run(int64_t b, int64_t hk) const {
    const int64_t group = p.heads_q / p.heads_kv, d = p.head_dim;
    const int64_t nq = p.seqlen_q, nk = p.seqlen_k;
    std::vector<T> k(nk * d), v(nk * d), q(group * nq * d), dout(group * nq * d);
    std::vector<T> dq(group * nq * d, T(0)), delta(group * nq), lse(group * nq);
    widen_rows(static_cast<const Elem*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride,
               p.k_row_stride, nk, d, k.data());
    widen_rows(static_cast<const Elem*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride,
               p.v_row_stride, nk, d, v.data());
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      widen_rows(static_cast<const Elem*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride,
                 p.q_row_stride, nq, d, q.data() + g * nq * d);
      const Elem* go = static_cast<const Elem*>(p.grad_out) + b * p.grad_out_batch_stride +
                       h * p.grad_out_head_stride;
      widen_rows(go, p.grad_out_row_stride, nq, d, dout.data() + g * nq * d);
      // D_i = rowsum(dO_i o O_i) - grad_lse_i: the only place O enters.
      const Elem* o =
          static_cast<const Elem*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
      const float* glse = p.grad_lse ? p.grad_lse + (b * p.heads_q + h) * nq : nullptr;
      for (int64_t i = 0; i < nq; ++i) {
        T acc = 0;
        const T* dorow = dout.data() + (g * nq + i) * d;
        for (int64_t c = 0; c < d; ++c)
          acc += dorow[c] * static_cast<T>(o[i * p.out_row_stride + c]);
        delta[g * nq + i] = acc - (glse ? static_cast<T>(glse[i]) : T(0));
      }
      const float* saved_lse = p.lse + (b * p.heads_q + h) * nq;
      for (int64_t i = 0; i < nq; ++i) lse[g * nq + i] = static_cast<T>(saved_lse[i]);
    }

    std::vector<T> s(kBr * kBc), dp(kBr * kBc), dtanh(kBr * kBc), dk(kBc * d), dv(kBc * d);
    if constexpr (std::is_same_v<T, double>) {
      for (int64_t g = 0; g < group; ++g)
        refine_lse(b, hk * group + g, q.data() + g * nq * d, k.data(), lse.data() + g * nq,
                   s.data(), dtanh.data());
    }
    for (int64_t j0 = 0; j0 < nk; j0 += kBc) {
      const int64_t cols = std::min(kBc, nk - j0);
      std::fill(dk.begin(), dk.end(), T(0));
      std::fill(dv.begin(), dv.end(), T(0));
      const T* kj = k.data() + j0 * d;
      const T* vj = v.data() + j0 * d;
      const auto [row_lo, row_hi] = visible_query_rows(p, j0, j0 + cols);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        for (int64_t i0 = row_lo; i0 < row_hi; i0 += kBr) {
          const int64_t rows = std::min(kBr, row_hi - i0);
          const T* qi = q.data() + (g * nq + i0) * d;
          const T* doi = dout.data() + (g * nq + i0) * d;
          // S_ij = Q_i K_j^T, then P_ij = exp(score - lse_i).
          gemm_rows<T>(false, true, rows, cols, d, T(1), qi, d, kj, d, T(0), s.data(), kBc);
          masked_logits(b, h, i0, rows, j0, cols, s.data(), dtanh.data());
          probs(rows, cols, lse.data() + g * nq + i0, s.data());
          // dV_j += P_ij^T dO_i
          gemm_rows<T>(true, false, cols, d, rows, T(1), s.data(), kBc, doi, d, T(1), dv.data(), d);
          // dP_ij = dO_i V_j^T
          gemm_rows<T>(false, true, rows, cols, d, T(1), doi, d, vj, d, T(0), dp.data(), kBc);
          // dS_ij = P_ij o (dP_ij - D_i), times d(softcap)/d(score); scale folds into the products.
          for (int64_t r = 0; r < rows; ++r) {
            const T di = delta[g * nq + i0 + r];
            T* dsrow = dp.data() + r * kBc;
            const T* prow = s.data() + r * kBc;
            for (int64_t c = 0; c < cols; ++c) dsrow[c] = prow[c] * (dsrow[c] - di);
            if (softcap > 0)
              for (int64_t c = 0; c < cols; ++c) dsrow[c] *= dtanh[r * kBc + c];
          }
          // dK_j += scale dS_ij^T Q_i;  dQ_i += scale dS_ij K_j
          gemm_rows<T>(true, false, cols, d, rows, scale, dp.data(), kBc, qi, d, T(1), dk.data(),
                       d);
          gemm_rows<T>(false, false, rows, d, cols, scale, dp.data(), kBc, kj, d, T(1),
                       dq.data() + (g * nq + i0) * d, d);
        }
      }
      narrow_rows(dk.data(), cols, d,
                  static_cast<Elem*>(p.grad_k) + b * p.grad_k_batch_stride +
                      hk * p.grad_k_head_stride + j0 * p.grad_k_row_stride,
                  p.grad_k_row_stride);
      narrow_rows(dv.data(), cols, d,
                  static_cast<Elem*>(p.grad_v) + b * p.grad_v_batch_stride +
                      hk * p.grad_v_head_stride + j0 * p.grad_v_row_stride,
                  p.grad_v_row_stride);
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      narrow_rows(
          dq.data() + g * nq * d, nq, d,
          static_cast<Elem*>(p.grad_q) + b * p.grad_q_batch_stride + h * p.grad_q_head_stride,
          p.grad_q_row_stride);
    }
  }
};

template <typename Elem, typename T>
void backward_all_heads(const AttentionBwdParams& p) {
  const BackwardTask<Elem, T> task{p, static_cast<T>(p.scale), static_cast<T>(p.softcap)};
  at::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) task.run(t / p.heads_kv, t % p.heads_kv);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap) {
  PreparedAttentionBackward prepared =
      prepare_attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale, is_causal,
                                 bottom_right, window_left, window_right, softcap);
  const AttentionBwdParams& p = prepared.params;
  // Every task writes all of its gradients (zeros where no key or query exists).
  if (prepared.grad_q.numel() + prepared.grad_k.numel() > 0) {
    switch (p.dtype) {
      case ScalarKind::kFloat16: backward_all_heads<c10::Half, float>(p); break;
      case ScalarKind::kBFloat16: backward_all_heads<c10::BFloat16, float>(p); break;
      case ScalarKind::kFloat64: backward_all_heads<double, double>(p); break;
      default: backward_all_heads<float, float>(p); break;
    }
  }
  return {prepared.grad_q, prepared.grad_k, prepared.grad_v};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("attention_backward", &flashmod::attention_backward_cpu);
}
