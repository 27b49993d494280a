// CPU forward: FlashAttention's tiled online softmax. fp32/fp16/bf16 run the vectorized kernel
// of engine_prefill.h / engine_decode.h, compiled per instruction set and picked at run time; fp64
// (used for gradcheck, not for speed) runs the scalar loop below.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../attention_host.h"
#include "attention_cpu.h"
#include "kernel.h"

namespace flashmod {
namespace {

// AMX needs the kernel's permission to use the tile data state (Linux 5.16+), once per process.
bool amx_usable() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("avx512bf16")) {
    return false;
  }
#ifdef __linux__
  constexpr long kArchReqXcompPerm = 0x1023, kXFeatureXTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXFeatureXTileData) == 0;
#else
  return false;
#endif
}

// The widest kernel this CPU (and OS) supports. FLASHMOD_CPU_ISA=amx|avx512|avx2|baseline forces
// one, so that every variant can be tested on one machine; a name that is unknown or that this CPU
// cannot run is an error, never a silent fall back to the slowest kernel.
const cpu::KernelInfo& pick_kernel() {
  static const cpu::KernelInfo* kernel = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    const bool amx = avx512 && amx_usable();
    const std::string want = env_text("FLASHMOD_CPU_ISA");
    if (want.empty()) {
      if (amx) return &cpu::kAmxBf16Kernel;
      if (avx512) return &cpu::kAvx512Kernel;
      if (avx2) return &cpu::kAvx2Kernel;
      return &cpu::kBaselineKernel;
    }
    std::string usable = "baseline";
    if (avx2) usable = "avx2, " + usable;
    if (avx512) usable = "avx512, " + usable;
    if (amx) usable = "amx, " + usable;
    if (want == "amx" && amx) return &cpu::kAmxBf16Kernel;
    if (want == "avx512" && avx512) return &cpu::kAvx512Kernel;
    if (want == "avx2" && avx2) return &cpu::kAvx2Kernel;
    if (want == "baseline") return &cpu::kBaselineKernel;
    const bool known = want == "amx" || want == "avx512" || want == "avx2";
    TORCH_CHECK(false,
                error_message("FLASHMOD_CPU_ISA='", want, "' ",
                              known ? "is not supported by this CPU" : "is not a known ISA",
                              "; allowed: amx, avx512, avx2, baseline; this CPU runs: ", usable));
    return &cpu::kBaselineKernel;
  }();
  return *kernel;
}

// Decode: at most kDecodeMaxQueries queries per head. When the (batch, kv head, row chunk) tasks
// cannot keep every thread busy in equal shares, the visible keys are cut into splits whose
// partial softmax states are merged in split order: the result depends on the shape and the
// thread count only, never on scheduling. FLASHMOD_CPU_DECODE=0 leaves every call to the prefill
// engine.
constexpr int64_t kDecodeMaxQueries = 8;
constexpr int64_t kMinKeysPerSplit = 512;

bool attention_cpu_decode(const cpu::KernelInfo& kernel, const AttentionParams& p) {
  if (!env_flag("FLASHMOD_CPU_DECODE", true) || p.dropout_rng != nullptr) return false;
  if (p.seqlen_q > kDecodeMaxQueries || p.head_dim % kernel.vector_width != 0) return false;
  const int64_t tasks = p.batch * p.heads_kv * cpu::decode_chunks(p);
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  const int64_t max_splits = std::max<int64_t>(1, p.seqlen_k / kMinKeysPerSplit);
  while (splits < max_splits && (tasks * splits) % threads != 0 && tasks * splits < 4 * threads) {
    ++splits;
  }
  if (splits == 1) {
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      kernel.decode_run(p, 1, nullptr, begin, end);
    });
    return true;
  }
  at::Tensor partial =
      at::empty({cpu::decode_partial_floats(p, splits)}, at::TensorOptions().dtype(at::kFloat));
  float* part = partial.data_ptr<float>();
  at::parallel_for(0, tasks * splits, 1, [&](int64_t begin, int64_t end) {
    kernel.decode_run(p, splits, part, begin, end);
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    kernel.decode_merge(p, splits, part, begin, end);
  });
  return true;
}

void attention_cpu_vectorized(const AttentionParams& p) {
  const cpu::KernelInfo& kernel = pick_kernel();
  if (attention_cpu_decode(kernel, p)) return;
  const int64_t shared_bytes = kernel.shared_bytes ? kernel.shared_bytes(p) : 0;
  at::Tensor shared;
  if (shared_bytes > 0) {
    shared = at::empty({shared_bytes}, at::TensorOptions().dtype(at::kByte));
    at::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
      kernel.prepare(p, shared.data_ptr(), begin, end);
    });
  }
  const void* shared_ptr = shared_bytes > 0 ? shared.data_ptr() : nullptr;
  const int64_t row_blocks = (p.seqlen_q + kernel.block_rows - 1) / kernel.block_rows;
  at::parallel_for(0, p.batch * p.heads_q * row_blocks, 1,
                   [&](int64_t begin, int64_t end) { kernel.run(p, shared_ptr, begin, end); });
}

// fp64: the same blocked online softmax with scalar loops.
// max that propagates a NaN from either side (std::max keeps its first operand): a NaN score must
// reach the row's sum, not be dropped by the running maximum.
inline double nan_max(double a, double b) {
  return (a > b || a != a) ? a : b;
}

void attention_cpu_fp64(const AttentionParams& p) {
  constexpr int64_t Br = 32, Bc = 64;
  const int64_t D = p.head_dim, Nq = p.seqlen_q, Nk = p.seqlen_k;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t Tr = (Nq + Br - 1) / Br;
  const double scale = p.scale, softcap = p.softcap;
  const double neg_inf = -std::numeric_limits<double>::infinity();

  at::parallel_for(0, p.batch * p.heads_q * Tr, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> O_i(Br * D), S_ij(Br * Bc), m(Br), l(Br);
    std::vector<uint8_t> keep(Bc);
    const DropoutState drop = p.dropout_rng != nullptr ? dropout_state(p) : DropoutState{};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i_block = task % Tr, h = (task / Tr) % p.heads_q, b = task / (Tr * p.heads_q);
      const int64_t hk = h / group;
      const auto* Q = static_cast<const double*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const auto* K = static_cast<const double*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
      const auto* V = static_cast<const double*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
      auto* O = static_cast<double*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
      float* lse = p.lse + (b * p.heads_q + h) * Nq;
      const int64_t r0 = i_block * Br, rows = std::min(Br, Nq - r0);
      std::fill(O_i.begin(), O_i.end(), 0.0);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.0);
      for (int64_t c0 = 0; c0 < Nk; c0 += Bc) {
        const int64_t cols = std::min(Bc, Nk - c0);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r0 + r;
          const double* q_row = Q + i * p.q_row_stride;
          double row_max = neg_inf;
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t j = c0 + c;
            bool visible = (p.window_left < 0 || j >= i + p.diag_offset - p.window_left) &&
                           (p.window_right < 0 || j <= i + p.diag_offset + p.window_right);
            double s = neg_inf;
            if (visible) {
              const double* k_row = K + j * p.k_row_stride;
              double dot = 0;
              for (int64_t d = 0; d < D; ++d) dot += q_row[d] * k_row[d];
              s = dot * scale;
              if (softcap > 0) s = softcap * std::tanh(s / softcap);
              if (p.mask_kind != MaskKind::kNone) {
                const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride +
                                    i * p.mask_row_stride + j * p.mask_col_stride;
                if (p.mask_kind == MaskKind::kBool) {
                  if (!static_cast<const uint8_t*>(p.mask)[off]) s = neg_inf;
                } else {  // additive masks of fp64 inputs are fp64
                  add_mask_value(s, static_cast<const double*>(p.mask)[off]);
                }
              }
            }
            S_ij[r * Bc + c] = s;
            row_max = nan_max(row_max, s);
          }
          // Online softmax: rescale what was accumulated for earlier key blocks.
          const double m_new = nan_max(m[r], row_max);
          if (m_new == neg_inf) continue;  // every key so far is masked: nothing to add
          const double alpha = std::exp(m[r] - m_new);
          double* o_row = &O_i[r * D];
          for (int64_t d = 0; d < D; ++d) o_row[d] *= alpha;
          // Dropout (dropout_draws.h) on what P V adds, after the row sum took P.
          if (p.dropout_rng != nullptr)
            keep_row(drop, dropout_head_index(p, b, h), i, c0, cols, keep.data());
          double row_sum = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const double pij = std::exp(S_ij[r * Bc + c] - m_new);
            row_sum += pij;
            const double weight =
                p.dropout_rng == nullptr ? pij : (keep[c] ? pij * p.dropout_scale : 0.0);
            if (weight == 0.0) continue;
            const double* v_row = V + (c0 + c) * p.v_row_stride;
            for (int64_t d = 0; d < D; ++d) o_row[d] += weight * v_row[d];
          }
          l[r] = l[r] * alpha + row_sum;
          m[r] = m_new;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r;
        double* o_out = O + i * p.out_row_stride;
        // All keys masked: out = 0, lse = -inf. A NaN or +inf visible score made m or l NaN, and
        // with it the row's out and lse, as in SDPA's math.
        const bool empty = l[r] == 0.0;
        const double inv_l = empty ? 0.0 : 1.0 / l[r];
        for (int64_t d = 0; d < D; ++d) o_out[d] = O_i[r * D + d] * inv_l;
        lse[i] = empty ? -std::numeric_limits<float>::infinity()
                       : static_cast<float>(m[r] + std::log(l[r]));
      }
    }
  });
}

}  // namespace

void run_attention_cpu(const AttentionParams& p) {
  if (p.dtype == ScalarKind::kFloat64) {
    attention_cpu_fp64(p);
  } else {
    attention_cpu_vectorized(p);
  }
}

bool run_attention_cpu_paged(const AttentionParams& p) {
  return p.dtype != ScalarKind::kFloat64 && attention_cpu_decode(pick_kernel(), p);
}

namespace {

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 std::optional<double> scale, bool is_causal,
                                                 bool bottom_right, int64_t window_left,
                                                 int64_t window_right, double softcap) {
  PreparedAttention prepared = prepare_attention(q, k, v, attn_mask, scale, is_causal, bottom_right,
                                                 window_left, window_right, softcap);
  if (!nothing_to_compute(prepared)) {
    run_attention_cpu(prepared.params);
  }
  return {prepared.out, prepared.lse};
}

// Dropout runs the prefill kernels (not the decode or AMX ones) of every dtype.
std::tuple<at::Tensor, at::Tensor> attention_dropout_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const at::Tensor& rng_state) {
  PreparedAttention prepared = prepare_attention(q, k, v, attn_mask, scale, is_causal, bottom_right,
                                                 window_left, window_right, softcap);
  set_dropout(prepared.params, "flashmod.attention", q, dropout_p, rng_state);
  if (!nothing_to_compute(prepared)) {
    run_attention_cpu(prepared.params);
  }
  return {prepared.out, prepared.lse};
}

}  // namespace

const char* cpu::kernel_name() {
  return pick_kernel().name;
}

}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("attention", &flashmod::attention_cpu);
  m.impl("attention_dropout", &flashmod::attention_dropout_cpu);
}
