// CPU forward: tiled online softmax (FlashAttention's forward) over a block of Br queries
// against blocks of Bc keys, parallel over (batch, head, query block).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../attention_host.h"

namespace flashmod {
namespace {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename scalar_t>
void attention_cpu_impl(const AttentionParams& p) {
  using acc_t = typename Acc<scalar_t>::type;
  constexpr int64_t Br = 32, Bc = 64;
  const int64_t D = p.head_dim, Nq = p.seqlen_q, Nk = p.seqlen_k;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t Tr = (Nq + Br - 1) / Br;
  const acc_t scale = static_cast<acc_t>(p.scale), softcap = static_cast<acc_t>(p.softcap);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  at::parallel_for(0, p.batch * p.heads_q * Tr, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> O_i(Br * D), S_ij(Br * Bc), m(Br), l(Br);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i_block = task % Tr, h = (task / Tr) % p.heads_q, b = task / (Tr * p.heads_q);
      const int64_t hk = h / group;
      const auto* Q = static_cast<const scalar_t*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const auto* K = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
      const auto* V = static_cast<const scalar_t*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
      auto* O = static_cast<scalar_t*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
      float* lse = p.lse + (b * p.heads_q + h) * Nq;
      const int64_t r0 = i_block * Br, rows = std::min(Br, Nq - r0);
      std::fill(O_i.begin(), O_i.end(), acc_t(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), acc_t(0));
      for (int64_t c0 = 0; c0 < Nk; c0 += Bc) {
        const int64_t cols = std::min(Bc, Nk - c0);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r0 + r;
          const scalar_t* q_row = Q + i * p.q_row_stride;
          acc_t row_max = neg_inf;
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t j = c0 + c;
            bool visible = (p.window_left < 0 || j >= i + p.diag_offset - p.window_left) &&
                           (p.window_right < 0 || j <= i + p.diag_offset + p.window_right);
            acc_t s = neg_inf;
            if (visible) {
              const scalar_t* k_row = K + j * p.k_row_stride;
              acc_t dot = 0;
              for (int64_t d = 0; d < D; ++d) dot += acc_t(q_row[d]) * acc_t(k_row[d]);
              s = dot * scale;
              if (softcap > 0) s = softcap * std::tanh(s / softcap);
              if (p.mask_kind != MaskKind::kNone) {
                const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride +
                                    i * p.mask_row_stride + j * p.mask_col_stride;
                if (p.mask_kind == MaskKind::kBool) {
                  if (!static_cast<const uint8_t*>(p.mask)[off]) s = neg_inf;
                } else if (p.mask_kind == MaskKind::kAdditive) {
                  s += acc_t(static_cast<const scalar_t*>(p.mask)[off]);
                } else {
                  s += acc_t(static_cast<const float*>(p.mask)[off]);
                }
              }
            }
            S_ij[r * Bc + c] = s;
            row_max = std::max(row_max, s);
          }
          // Online softmax: rescale what was accumulated for earlier key blocks.
          const acc_t m_new = std::max(m[r], row_max);
          if (m_new == neg_inf) continue;  // every key so far is masked: nothing to add
          const acc_t alpha = std::exp(m[r] - m_new);
          acc_t* o_row = &O_i[r * D];
          for (int64_t d = 0; d < D; ++d) o_row[d] *= alpha;
          acc_t row_sum = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const acc_t pij = std::exp(S_ij[r * Bc + c] - m_new);
            row_sum += pij;
            if (pij == acc_t(0)) continue;
            const scalar_t* v_row = V + (c0 + c) * p.v_row_stride;
            for (int64_t d = 0; d < D; ++d) o_row[d] += pij * acc_t(v_row[d]);
          }
          l[r] = l[r] * alpha + row_sum;
          m[r] = m_new;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r;
        scalar_t* o_out = O + i * p.out_row_stride;
        const bool empty = l[r] == acc_t(0);  // all keys masked: out = 0, lse = -inf
        const acc_t inv_l = empty ? acc_t(0) : acc_t(1) / l[r];
        for (int64_t d = 0; d < D; ++d) o_out[d] = static_cast<scalar_t>(O_i[r * D + d] * inv_l);
        lse[i] = empty ? -std::numeric_limits<float>::infinity()
                       : static_cast<float>(m[r] + std::log(l[r]));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 std::optional<double> scale, bool is_causal,
                                                 bool bottom_right, int64_t window_left,
                                                 int64_t window_right, double softcap) {
  PreparedAttention prepared = prepare_attention(q, k, v, attn_mask, scale, is_causal, bottom_right,
                                                 window_left, window_right, softcap);
  if (!nothing_to_compute(prepared)) {
    const AttentionParams& p = prepared.params;
    switch (p.dtype) {
      case ScalarKind::kFloat32: attention_cpu_impl<float>(p); break;
      case ScalarKind::kFloat64: attention_cpu_impl<double>(p); break;
      case ScalarKind::kFloat16: attention_cpu_impl<at::Half>(p); break;
      case ScalarKind::kBFloat16: attention_cpu_impl<at::BFloat16>(p); break;
    }
  }
  return {prepared.out, prepared.lse};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) { m.impl("attention", &flashmod::attention_cpu); }
