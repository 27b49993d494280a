// CPU registration of flashmod::merge_attention: rows in parallel, fp32 math (fp64 for fp64).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../merge_host.h"

namespace flashmod {
namespace {

// Rows per parallel task: enough that a task's work hides the scheduling cost even at small D.
constexpr int64_t kRowsPerTask = 64;

template <typename Elem, typename Acc>
void merge_rows(const MergeParams& p) {
  const int64_t d = p.head_dim;
  at::parallel_for(0, p.rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<Acc> acc(static_cast<size_t>(d));
    Acc weight[kMaxMergeParts];
    for (int64_t r = begin; r < end; ++r) {
      Acc m = -std::numeric_limits<Acc>::infinity();
      bool nan = false;
      for (int i = 0; i < p.parts; ++i) {
        const Acc l = p.lses[i][r];
        nan |= std::isnan(l);
        m = l > m ? l : m;
      }
      Elem* out = static_cast<Elem*>(p.out) + r * d;
      if (nan || m == -std::numeric_limits<Acc>::infinity()) {
        // No partial saw a visible key: the row is empty (0, -inf); a NaN lse stays NaN.
        const Acc fill = nan ? std::numeric_limits<Acc>::quiet_NaN() : Acc(0);
        for (int64_t c = 0; c < d; ++c) out[c] = static_cast<Elem>(fill);
        p.lse[r] =
            nan ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
        continue;
      }
      Acc sum = 0;
      for (int i = 0; i < p.parts; ++i) sum += std::exp(static_cast<Acc>(p.lses[i][r]) - m);
      const Acc lse = m + std::log(sum);
      // Relative to the largest lse, not to the merged one: m + log(sum) rounds to m once |m|
      // dwarfs log(sum) (rows a huge finite additive mask hides, lse ~ -1e9), and the weights
      // exp(lse_i - lse) would then sum to more than 1.
      for (int i = 0; i < p.parts; ++i)
        weight[i] = std::exp(static_cast<Acc>(p.lses[i][r]) - m) / sum;
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int i = 0; i < p.parts; ++i) {
        if (weight[i] == Acc(0)) continue;  // no visible key (or negligible): never read
        const Elem* o = static_cast<const Elem*>(p.outs[i]) + r * d;
        for (int64_t c = 0; c < d; ++c) acc[c] += weight[i] * static_cast<Acc>(o[c]);
      }
      for (int64_t c = 0; c < d; ++c) out[c] = static_cast<Elem>(acc[c]);
      p.lse[r] = static_cast<float>(lse);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> merge_attention_cpu(at::TensorList outs, at::TensorList lses) {
  auto [out, lse] = merge_attention_passes(outs, lses, [](const MergeParams& p) {
    switch (p.dtype) {
      case ScalarKind::kFloat16: merge_rows<c10::Half, float>(p); break;
      case ScalarKind::kBFloat16: merge_rows<c10::BFloat16, float>(p); break;
      case ScalarKind::kFloat64: merge_rows<double, double>(p); break;
      default: merge_rows<float, float>(p); break;
    }
  });
  return {out, lse};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("merge_attention", &flashmod::merge_attention_cpu);
}
