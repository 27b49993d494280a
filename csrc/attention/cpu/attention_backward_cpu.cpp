// CPU backward of flashmod::attention: FlashAttention-2's recomputation. Per (Br x Bc) tile,
// P = exp(S - lse) from the saved lse, D_i = rowsum(dO_i o O_i) - grad_lse_i, then
//   dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P o (dP - D_i) (o (1 - tanh^2) under softcap),
//   dK_j += scale dS^T Q_i,  dQ_i += scale dS K_j.
// The five products run through the BLAS torch links (sgemm_/dgemm_, single-threaded inside
// at::parallel_for); on AMD CPUs with AVX-512 the fp32 products of whole tiles run on oneDNN's
// micro-kernel as ATen exposes it (at::native::cpublas::brgemm), with the task's K, V, Q and dO
// also held transposed so that every product is a plain row-major one (brgemm_products); bf16 on
// AMX CPUs runs on MKL's bf16 GEMM on the tensors themselves (P and dS rounded to bf16 for the
// gradient products, as the GPU kernels have them). The elementwise part is plain loops the
// compiler vectorizes.
//
// Determinism: one task is one (batch, kv head) and owns every gradient row it writes (dQ of its
// query group, dK/dV of its kv head), walking key blocks, q heads and query blocks in a fixed
// order. The result is bitwise the same on every run and at any thread count.
// Memory: O(tile) per thread, plus the task's rows: widened to fp32 (fp16/bf16), and with
// oneDNN's kernel transposed, with its dK, dV accumulators.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../common/cpu_blas.h"
#include "../../common/knobs.h"
#include "../attention_host.h"
#include "attention_cpu.h"
#include "kernel.h"

// Vector-extension types are passed between always-inlined helpers only; the ABI note GCC emits
// for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace flashmod {
namespace {

// Whether fp32 products take oneDNN's micro-kernel (what torch's own CPU flash attention calls; it
// falls back to torch's gemm where oneDNN has no kernel for the CPU) rather than the BLAS's sgemm:
// on AMD CPUs that run the AVX-512 forward, where MKL does not run its AVX-512 code (1 thread,
// 128^3 fp32 products on a Zen 5: 257 GFLOP/s against MKL's 104). Not on AVX2: there it was
// mixed against MKL's (fwd + bwd 0.90-1.11x, GQA the slowest; the Zen 5 forced to AVX2), and not
// on Intel CPUs, whose MKL runs AVX-512 (not measured against it). FLASHMOD_CPU_BWD_BRGEMM=1 / 0
// forces it on / off. cpu-backward.md (session 37) has the numbers. A torch whose ATen lacks the
// fp32 form keeps sgemm.
#ifdef CPUBLAS_BRGEMM_F32F32F32
constexpr bool kHaveBrgemm = true;
#else
constexpr bool kHaveBrgemm = false;
#endif
bool brgemm_products() {
  static const bool by_default = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && std::string(cpu::kernel_name()) == "avx512";
  }();
  return kHaveBrgemm && env_flag("FLASHMOD_CPU_BWD_BRGEMM", by_default);
}

// Row-major fp32 C (m x n) = A (m x k) B (k x n), plus C if accumulate. whole: a whole tile, on
// oneDNN's kernel; partial tiles on the BLAS. ATen compiles one oneDNN kernel per shape and
// leading dimensions and keeps it for the thread's lifetime, so only whole tiles, whose shapes
// and leading dimensions are fixed for a model (Br, Bc, D, the tensors' row strides), go there:
// tails of every length (varlen batches bring many) would each compile and keep one more.
void plain_product(bool whole, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  if (whole) {
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
    return;
  }
#endif
  matmul_rows<float>(false, false, m, n, k, 1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, ldc);
}

// dst (cols x rows, row stride ldd) = factor * src^T (rows x cols, row stride lds), in blocks of
// 16 x 16 so that both sides stay in cache lines they already hold.
template <typename From, typename To>
void transpose_rows(const From* src, int64_t lds, int64_t rows, int64_t cols, float factor, To* dst,
                    int64_t ldd) {
  constexpr int64_t kBlock = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = std::min(rows, r0 + kBlock);
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c)
          dst[c * ldd + r] = static_cast<To>(factor * static_cast<float>(src[r * lds + c]));
      }
    }
  }
}

// The products of a tile on whichever operands the task holds: acc_t rows (BLAS) or bf16 ones.
template <typename acc_t>
void tile_product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, acc_t alpha,
                  const acc_t* a, int64_t lda, const acc_t* b, int64_t ldb, acc_t beta, acc_t* c,
                  int64_t ldc) {
  matmul_rows<acc_t>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void tile_product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb,
                  float beta, float* c, int64_t ldc) {
  matmul_rows_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// rows x cols of fp32 src (row stride src_ld) rounded to bf16 (nearest even; NaN stays NaN) into
// dst (row stride dst_ld): P and dS as operands of the bf16 gradient products. Only called where
// the CPU has AMX, hence AVX512-BF16.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void round_rows_to_bf16(
    const float* src, int64_t src_ld, c10::BFloat16* dst, int64_t dst_ld, int64_t rows,
    int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * src_ld;
    auto* out = reinterpret_cast<uint16_t*>(dst + r * dst_ld);
    for (int64_t c = 0; c < cols; c += 32) {
      const int64_t left = cols - c;
      const __mmask32 keep = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), in + c);
      const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), in + c + 16);
      const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
      _mm512_mask_storeu_epi16(out + c, keep, (__m512i)both);
    }
  }
}

// The elementwise part of a tile row, compiled per instruction set and picked by the forward's
// kernel choice (FLASHMOD_CPU_ISA included). The scalar exp loop this replaced did not vectorize
// at all (GCC: "control flow in loop"), so the exponentials ran one by one; here they are written
// over vectors of W floats, the ISA's register width. Only the always-inlined members below are
// compiled for the target (a whole-TU #pragma GCC target would compile torch's inline functions
// for AVX too, see kernel.h).
struct RowOps {
  void (*probs)(float* s, int64_t n, float lse);                     // s = exp(s - lse)
  void (*dscores)(float* dp, const float* p, int64_t n, float d_i);  // dp = p (dp - d_i)
  // dropout's keep bits of query i's keys [c0, c0 + cols) (cpu::DropoutLanes, keep_row)
  void (*keep_row)(const DropoutState& d, int64_t bh, int64_t i, int64_t c0, int64_t cols,
                   uint8_t* keep);
};

template <int W>
struct VecRows {
  typedef float vf __attribute__((vector_size(4 * W)));
  typedef int32_t vi __attribute__((vector_size(4 * W)));

  // e^x with a relative error of ~2 ulp; -inf and anything below -87.3 (whose e^x is no normal
  // fp32) give exactly 0.
  static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vf lo = vf{} - 87.3f, shift = vf{} + 12582912.0f;
    const vf clamped = x > lo ? x : lo;
    const vf t = clamped * 1.44269504088896341f + shift;
    const vf n = t - shift;
    const vf r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    vf poly = vf{} + 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    poly = poly * r * r + r + 1.0f;
    const vi bits = (vi)poly + (((vi)t - (vi)shift) << 23);
    return x < lo ? vf{} : (vf)bits;
  }
  // f on whole vectors of x (and y), then on the tail through a zero-padded copy.
  template <class F>
  static inline __attribute__((always_inline)) void rows(float* x, const float* y, int64_t n, F f) {
    int64_t c = 0;
    vf a, b;
    for (; c + W <= n; c += W) {
      std::memcpy(&a, x + c, sizeof a);
      std::memcpy(&b, y + c, sizeof b);
      a = f(a, b);
      std::memcpy(x + c, &a, sizeof a);
    }
    if (c < n) {
      float xa[W] = {}, ya[W] = {};
      std::memcpy(xa, x + c, (n - c) * sizeof(float));
      std::memcpy(ya, y + c, (n - c) * sizeof(float));
      std::memcpy(&a, xa, sizeof a);
      std::memcpy(&b, ya, sizeof b);
      a = f(a, b);
      std::memcpy(x + c, &a, (n - c) * sizeof(float));
    }
  }
  static inline __attribute__((always_inline)) void probs(float* s, int64_t n, float lse) {
    rows(s, s, n, [lse](vf v, vf) __attribute__((always_inline)) { return vexp(v - lse); });
  }
  static inline __attribute__((always_inline)) void dscores(float* dp, const float* p, int64_t n,
                                                            float d_i) {
    rows(dp, p, n, [d_i](vf d, vf pv) __attribute__((always_inline)) { return pv * (d - d_i); });
  }
};

#define FLASHMOD_BWD_ROW_OPS(SUFFIX, TARGET, W)                                           \
  TARGET void probs_##SUFFIX(float* s, int64_t n, float lse) {                            \
    VecRows<W>::probs(s, n, lse);                                                         \
  }                                                                                       \
  TARGET void dscores_##SUFFIX(float* dp, const float* p, int64_t n, float d_i) {         \
    VecRows<W>::dscores(dp, p, n, d_i);                                                   \
  }                                                                                       \
  TARGET void keep_row_##SUFFIX(const DropoutState& d, int64_t bh, int64_t i, int64_t c0, \
                                int64_t cols, uint8_t* keep) {                            \
    cpu::DropoutLanes<W>::keep_row(d, bh, i, c0, cols, keep);                             \
  }
FLASHMOD_BWD_ROW_OPS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"))), 16)
FLASHMOD_BWD_ROW_OPS(avx2, __attribute__((target("avx2,fma"))), 8)
FLASHMOD_BWD_ROW_OPS(baseline, , 4)
#undef FLASHMOD_BWD_ROW_OPS

const RowOps& row_ops() {
  static const RowOps ops = [] {
    const std::string isa = cpu::kernel_name();
    if (isa == cpu::kAmxKernelName || isa == "avx512")
      return RowOps{probs_avx512, dscores_avx512, keep_row_avx512};
    if (isa == "avx2") return RowOps{probs_avx2, dscores_avx2, keep_row_avx2};
    return RowOps{probs_baseline, dscores_baseline, keep_row_baseline};
  }();
  return ops;
}

// Tile of Br queries x Bc keys.
constexpr int64_t Br = 128, Bc = 128;

// Reads the additive mask element at off as acc_t, whatever its storage.
template <typename acc_t, typename scalar_t>
acc_t mask_value(const AttentionParams& p, int64_t off) {
  if (p.mask_kind == MaskKind::kAdditiveF32) return static_cast<const float*>(p.mask)[off];
  return static_cast<acc_t>(static_cast<const scalar_t*>(p.mask)[off]);
}

// A 16-bit mask entry as fp32, exactly, by integer operations and selects that GCC vectorizes
// (c10's conversions, compiled here for baseline x86-64, keep a branch or a call per value).
// (widened(float): an fp32 mask of fp64 queries.)
inline float widened(float v) {
  return v;
}
inline float widened(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widened(c10::Half v) {
  const uint32_t magnitude = v.x & 0x7fffu, sign = static_cast<uint32_t>(v.x & 0x8000u) << 16;
  // Normal values rebiased (15 -> 127), infinities and NaNs to the top exponent, subnormals (a
  // 10-bit integer times 2^-24) exactly through an integer conversion.
  const uint32_t normal = (magnitude << 13) + ((127u - 15u) << 23);
  const uint32_t special = (magnitude << 13) | 0x7f800000u;
  const float tiny = static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f;
  uint32_t tiny_bits;
  std::memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
  const uint32_t bits = sign | (magnitude < 0x400u     ? tiny_bits
                                : magnitude >= 0x7c00u ? special
                                                       : normal);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Adds mask entries m[0], m[cs], ... (cols of them) into a row of logits, -inf where an entry
// hides its key (bool false, additive values at or below kHidingMaskValue). Both sides are computed
// and then selected, so that GCC vectorizes the contiguous loop: as branches (GCC keeps them for a
// float compare that may trap, hence no-trapping-math here; nothing reads the FP exception flags),
// a mask with a quarter of its keys hidden at random took the backward from 36 to 60 ms (fp32,
// AVX2, B 2, H 8, N 1024, D 64). 16-bit entries (bf16, fp16 masks) are widened in a loop of their
// own first (widened): with c10's conversion inside, GCC left the select a branch, and the same
// mask took the bf16 backward from 39 to 57 ms and fp16 from 43 to 71 (Zen 5, session 61).
template <typename acc_t, typename Stored>
__attribute__((optimize("no-trapping-math"))) void add_mask_row(acc_t* __restrict s_row,
                                                                const Stored* __restrict m,
                                                                int64_t cs, int64_t cols) {
  constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  if constexpr (std::is_same_v<Stored, uint8_t> || std::is_same_v<Stored, acc_t>) {
    auto masked = [](acc_t s, Stored entry) {
      if constexpr (std::is_same_v<Stored, uint8_t>) {
        return entry != 0 ? s : neg_inf;
      } else {
        const acc_t sum = s + entry;
        return entry <= static_cast<acc_t>(kHidingMaskValue) ? neg_inf : sum;
      }
    };
    if (cs == 1) {
      for (int64_t c = 0; c < cols; ++c) s_row[c] = masked(s_row[c], m[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) s_row[c] = masked(s_row[c], m[c * cs]);
    }
  } else {
    constexpr int64_t kChunk = 64;
    acc_t values[kChunk];
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      for (int64_t c = 0; c < n; ++c) values[c] = static_cast<acc_t>(widened(m[(c0 + c) * cs]));
      add_mask_row(s_row + c0, values, 1, n);
    }
  }
}

// True when the mask hides every (query, key) pair of queries r0 .. r0 + rows - 1 and keys
// c0 .. c0 + cols - 1 of (b, h) (bool false, additive values at or below kHidingMaskValue): such a
// tile adds nothing (P = 0, dS = 0), so its matmuls are skipped and the hidden half of a causal
// mask or a padded batch's padding costs nothing. A key-padding mask (query stride 0) is read once
// per key; a tile with a visible pair usually ends the scan at its first entry.
template <typename acc_t, typename scalar_t>
bool mask_hides_tile(const AttentionParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                     int64_t c0, int64_t cols) {
  if (p.mask_kind == MaskKind::kNone) return false;
  const int64_t base = b * p.mask_batch_stride + h * p.mask_head_stride + r0 * p.mask_row_stride +
                       c0 * p.mask_col_stride;
  const int64_t distinct_rows = p.mask_row_stride == 0 ? 1 : rows;
  for (int64_t r = 0; r < distinct_rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t off = base + r * p.mask_row_stride + c * p.mask_col_stride;
      const bool hides = p.mask_kind == MaskKind::kBool
                             ? !static_cast<const uint8_t*>(p.mask)[off]
                             : mask_value_hides(mask_value<acc_t, scalar_t>(p, off));
      if (!hides) return false;
    }
  }
  return true;
}

// Br x Bc acc_t buffers at the head of a task's scratch: S, dP, T, dropout's multipliers and
// dropped P, and with bf16 products (op_t bf16) the room for P and dS rounded to bf16.
template <typename acc_t, typename op_t>
constexpr int64_t kTileBuffers = std::is_same_v<op_t, acc_t> ? 5 : 6;

// Products on fp32 operands (fp32 tensors, or fp16/bf16 rows widened) that take oneDNN's
// micro-kernel: the task then holds, as panels of D rows with fixed leading dimensions (so that
// whole tiles are a model's few fixed shapes, plain_product), K^T and V^T (a D x Bc panel per key
// block), every Q^T and dO^T of its group (a D x Br panel per query block), dK^T and dV^T as
// accumulators (D x Bc per key block), and a D x Br pair of tile copies of Q_i^T, dO_i^T for query
// blocks that do not start on a panel's first row (under a window or causal bound).
template <typename acc_t, typename op_t>
bool transposed_operands() {
  return std::is_same_v<acc_t, float> && std::is_same_v<op_t, float> && brgemm_products();
}
int64_t transposed_elements(const AttentionBwdParams& p) {
  const int64_t key_blocks = (p.seqlen_k + Bc - 1) / Bc, query_blocks = (p.seqlen_q + Br - 1) / Br;
  const int64_t group = p.heads_q / p.heads_kv;
  return (4 * key_blocks * Bc + 2 * group * query_blocks * Br + 2 * Br) * p.head_dim;
}

// scalar_t: the tensors' element type; acc_t: the math (float, double for fp64); op_t: the
// products' operands, acc_t (fp16/bf16 rows widened once per task) or bf16 (the tensors as they
// are; bf16_products_usable).
// transposed: transposed_operands, read once per call.
template <typename scalar_t, typename acc_t, typename op_t = acc_t>
void backward_task(const AttentionBwdParams& p, int64_t task, bool transposed, acc_t* scratch) {
  constexpr bool widen = !std::is_same_v<scalar_t, acc_t>;
  constexpr bool widen_operands = widen && std::is_same_v<op_t, acc_t>;
  // Products on fp32 operands: the only ones that may take oneDNN's kernel (transposed).
  constexpr bool fp32_products = std::is_same_v<acc_t, float> && std::is_same_v<op_t, float>;
  static_assert(std::is_same_v<op_t, acc_t> || std::is_same_v<op_t, scalar_t>, "operands");
  const int64_t D = p.head_dim, Nq = p.seqlen_q, Nk = p.seqlen_k;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
  const acc_t scale = static_cast<acc_t>(p.scale), softcap = static_cast<acc_t>(p.softcap);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  // Tile buffers first, then (fp16/bf16) the widened rows of this task.
  acc_t* S = scratch;         // Br x Bc: scores, then P
  acc_t* dP = S + Br * Bc;    // Br x Bc: dP, then dS
  acc_t* T = dP + Br * Bc;    // Br x Bc: tanh(raw / softcap)
  acc_t* Z = T + Br * Bc;     // Br x Bc: dropout's multipliers (scale where kept, else 0)
  acc_t* Pd = Z + Br * Bc;    // Br x Bc: P o Z, dV's operand under dropout
  acc_t* low = Pd + Br * Bc;  // op_t = bf16: Br x Bc floats' room for P and dS in bf16
  acc_t* delta =
      scratch + kTileBuffers<acc_t, op_t> * Br * Bc;  // group x Nq: rowsum(dO o O) - grad_lse
  acc_t* flipped = delta + group * Nq;                // transposed rows (transposed_operands)
  acc_t* wide = flipped + (transposed ? transposed_elements(p) : 0);
  // P and dS as the gradient products' A operand: the acc_t tiles, or their bf16 copies.
  op_t* low_p = reinterpret_cast<op_t*>(low);
  op_t* low_ds = low_p + Br * Bc;
  const op_t* P_op = low_p;
  const op_t* dS_op = low_ds;
  // Dropout (dropout_draws.h): dV takes P o Z, and dS = P o (dP o Z - delta) (delta = rowsum(dO o
  // O) already holds the dropped O).
  const bool dropout = p.dropout_rng != nullptr;
  const DropoutState drop = dropout ? dropout_state(p) : DropoutState{};
  const acc_t drop_scale = static_cast<acc_t>(p.dropout_scale);
  std::vector<uint8_t> keep(dropout ? Bc : 0);
  if constexpr (std::is_same_v<op_t, acc_t>) P_op = dropout ? Pd : S, dS_op = dP;

  const auto* Kin = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const auto* Vin = static_cast<const scalar_t*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  auto* dKout =
      static_cast<scalar_t*>(p.grad_k) + b * p.grad_k_batch_stride + hk * p.grad_k_head_stride;
  auto* dVout =
      static_cast<scalar_t*>(p.grad_v) + b * p.grad_v_batch_stride + hk * p.grad_v_head_stride;
  auto q_of = [&](int64_t g) {
    return static_cast<const scalar_t*>(p.q) + b * p.q_batch_stride +
           (hk * group + g) * p.q_head_stride;
  };
  auto dout_of = [&](int64_t g) {
    return static_cast<const scalar_t*>(p.grad_out) + b * p.grad_out_batch_stride +
           (hk * group + g) * p.grad_out_head_stride;
  };
  auto out_of = [&](int64_t g) {
    return static_cast<const scalar_t*>(p.out) + b * p.out_batch_stride +
           (hk * group + g) * p.out_head_stride;
  };
  auto dq_of = [&](int64_t g) {
    return static_cast<scalar_t*>(p.grad_q) + b * p.grad_q_batch_stride +
           (hk * group + g) * p.grad_q_head_stride;
  };

  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* dO = dout_of(g);
    const scalar_t* O = out_of(g);
    const int64_t row0 = (b * p.heads_q + hk * group + g) * Nq;
    for (int64_t i = 0; i < Nq; ++i) {
      const scalar_t* o_row = O + i * p.out_row_stride;
      const scalar_t* do_row = dO + i * p.grad_out_row_stride;
      acc_t sum = 0;
      for (int64_t d = 0; d < D; ++d) {
        sum += static_cast<acc_t>(do_row[d]) * static_cast<acc_t>(o_row[d]);
      }
      delta[g * Nq + i] = sum - (p.grad_lse ? static_cast<acc_t>(p.grad_lse[row0 + i]) : acc_t(0));
    }
  }

  // Operand rows in op_t, gradients in acc_t. fp32/fp64 read the tensors in place and accumulate
  // into the (zeroed) gradients; fp16/bf16 accumulate into acc_t rows narrowed at the end, and
  // widen the task's operand rows once unless the products take them as they are.
  const op_t *K, *V;
  acc_t *dK, *dV;
  int64_t k_ld, v_ld, dk_ld, dv_ld, q_ld, do_ld, dq_ld;
  std::vector<const op_t*> Q(group), dO(group);
  std::vector<acc_t*> dQ(group);
  if constexpr (widen_operands) {
    auto widen_rows = [&](const scalar_t* src, int64_t stride, int64_t rows, acc_t* dst) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) dst[r * D + d] = static_cast<acc_t>(src[r * stride + d]);
      }
    };
    acc_t* next = wide;
    auto take = [&](int64_t rows) {
      acc_t* t = next;
      next += rows * D;
      return t;
    };
    acc_t* k_wide = take(Nk);
    acc_t* v_wide = take(Nk);
    widen_rows(Kin, p.k_row_stride, Nk, k_wide);
    widen_rows(Vin, p.v_row_stride, Nk, v_wide);
    K = k_wide, V = v_wide;
    dK = take(Nk), dV = take(Nk);
    std::fill(dK, dK + 2 * Nk * D, acc_t(0));  // dK and dV are adjacent
    for (int64_t g = 0; g < group; ++g) {
      acc_t* q_wide = take(Nq);
      acc_t* do_wide = take(Nq);
      widen_rows(q_of(g), p.q_row_stride, Nq, q_wide);
      widen_rows(dout_of(g), p.grad_out_row_stride, Nq, do_wide);
      Q[g] = q_wide, dO[g] = do_wide;
      dQ[g] = take(Nq);
      std::fill(dQ[g], dQ[g] + Nq * D, acc_t(0));
    }
    k_ld = v_ld = dk_ld = dv_ld = q_ld = do_ld = dq_ld = D;
  } else if constexpr (widen) {  // bf16 operands in place, acc_t gradients
    K = Kin, V = Vin;
    dK = wide, dV = wide + Nk * D;
    std::fill(dK, dK + 2 * Nk * D, acc_t(0));
    for (int64_t g = 0; g < group; ++g) {
      Q[g] = q_of(g), dO[g] = dout_of(g);
      dQ[g] = wide + (2 * Nk + g * Nq) * D;
      std::fill(dQ[g], dQ[g] + Nq * D, acc_t(0));
    }
    k_ld = p.k_row_stride, v_ld = p.v_row_stride, q_ld = p.q_row_stride;
    do_ld = p.grad_out_row_stride;
    dk_ld = dv_ld = dq_ld = D;
  } else {
    K = reinterpret_cast<const acc_t*>(Kin), V = reinterpret_cast<const acc_t*>(Vin);
    dK = reinterpret_cast<acc_t*>(dKout), dV = reinterpret_cast<acc_t*>(dVout);
    for (int64_t g = 0; g < group; ++g) {
      Q[g] = reinterpret_cast<const acc_t*>(q_of(g));
      dO[g] = reinterpret_cast<const acc_t*>(dout_of(g));
      dQ[g] = reinterpret_cast<acc_t*>(dq_of(g));
    }
    k_ld = p.k_row_stride, v_ld = p.v_row_stride, dk_ld = p.grad_k_row_stride;
    dv_ld = p.grad_v_row_stride, q_ld = p.q_row_stride, do_ld = p.grad_out_row_stride;
    dq_ld = p.grad_q_row_stride;
  }

  // fp32 products on oneDNN's kernel: row-major operands only, so K^T, V^T, Q^T, dO^T once per
  // task (panels, transposed_operands), dK^T, dV^T accumulated in place of dK, dV (turned back at
  // the end), and dS used unscaled (dK and dQ scaled once at the end).
  const int64_t key_blocks = (Nk + Bc - 1) / Bc, query_blocks = (Nq + Br - 1) / Br;
  acc_t* KT = flipped;                    // key block j: D x Bc at KT + j D Bc
  acc_t* VT = KT + key_blocks * D * Bc;   // the same for V
  acc_t* dKT = VT + key_blocks * D * Bc;  // dK^T, then dV^T: the same panels
  acc_t* dVT = dKT + key_blocks * D * Bc;
  // Head g's query block b: D x Br at QT(g) + b D Br, then dO's.
  auto QT = [&](int64_t g) { return dVT + key_blocks * D * Bc + 2 * g * query_blocks * D * Br; };
  auto dOT = [&](int64_t g) { return QT(g) + query_blocks * D * Br; };
  acc_t* qt_tile = QT(group);  // Q_i^T, dO_i^T of a query block off the panels' rows
  acc_t* dot_tile = qt_tile + D * Br;
  if constexpr (fp32_products) {
    if (transposed) {
      for (int64_t j = 0; j < key_blocks; ++j) {
        const int64_t cols = std::min(Bc, Nk - j * Bc);
        transpose_rows(K + j * Bc * k_ld, k_ld, cols, D, 1.0f, KT + j * D * Bc, Bc);
        transpose_rows(V + j * Bc * v_ld, v_ld, cols, D, 1.0f, VT + j * D * Bc, Bc);
      }
      std::fill(dKT, dKT + 2 * key_blocks * D * Bc, 0.0f);  // dK^T and dV^T are adjacent
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t qb = 0; qb < query_blocks; ++qb) {
          const int64_t rows = std::min(Br, Nq - qb * Br);
          transpose_rows(Q[g] + qb * Br * q_ld, q_ld, rows, D, 1.0f, QT(g) + qb * D * Br, Br);
          transpose_rows(dO[g] + qb * Br * do_ld, do_ld, rows, D, 1.0f, dOT(g) + qb * D * Br, Br);
        }
      }
    }
  }

  const int64_t off = p.diag_offset, wl = p.window_left, wr = p.window_right;
  const bool has_mask = p.mask_kind != MaskKind::kNone;
  const bool capped = softcap > 0;
  // Row i of a score tile (key columns c0 .. c0 + cols) -> its logits: scale, softcap (tanh kept in
  // t_row for the gradient), mask, window; -inf where the key is not visible. window_inside: the
  // tile lies inside the band, so the window needs no per-element test.
  auto logits_row = [&](int64_t h, int64_t i, int64_t c0, int64_t cols, bool window_inside,
                        acc_t* s_row, acc_t* t_row) {
    if (capped) {
      for (int64_t c = 0; c < cols; ++c) {
        const acc_t t = std::tanh(s_row[c] * scale / softcap);
        t_row[c] = t;
        s_row[c] = softcap * t;
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) s_row[c] *= scale;
    }
    if (has_mask) {
      const int64_t base = b * p.mask_batch_stride + h * p.mask_head_stride +
                           i * p.mask_row_stride + c0 * p.mask_col_stride;
      if (p.mask_kind == MaskKind::kBool) {
        add_mask_row(s_row, static_cast<const uint8_t*>(p.mask) + base, p.mask_col_stride, cols);
      } else if (p.mask_kind == MaskKind::kAdditiveF32) {
        add_mask_row(s_row, static_cast<const float*>(p.mask) + base, p.mask_col_stride, cols);
      } else {
        add_mask_row(s_row, static_cast<const scalar_t*>(p.mask) + base, p.mask_col_stride, cols);
      }
    }
    if (!window_inside) {
      const int64_t lo = wl >= 0 ? i + off - wl - c0 : 0;
      const int64_t hi = wr >= 0 ? i + off + wr - c0 : cols - 1;
      for (int64_t c = 0; c < cols; ++c) {
        if (c < lo || c > hi) s_row[c] = neg_inf;
      }
    }
  };

  // The saved lse is fp32 even for fp64 inputs, and its rounding (~1e-7 relative) would scale
  // every fp64 gradient of the row by as much. For fp64 the lse over the keys this call sees is
  // recomputed and replaces the saved one where the saved one is that value rounded to fp32 (within
  // one fp32 spacing of it); where they differ more, the caller passed the lse of a larger key set
  // (ring attention's merged lse, with these keys one share of it), and the saved value is the
  // right one. (A relative 4e-6 bound took a share holding all but 1e-3 of a row's mass at lse
  // ~1000 for the row: the ring's fp64 dq came out 13 % off.)
  std::vector<acc_t> lse_rows(group * Nq);
  for (int64_t g = 0; g < group; ++g) {
    const float* saved = p.lse + (b * p.heads_q + hk * group + g) * Nq;
    for (int64_t i = 0; i < Nq; ++i) lse_rows[g * Nq + i] = static_cast<acc_t>(saved[i]);
  }
  if constexpr (std::is_same_v<acc_t, double>) {
    std::vector<acc_t> row_max(Br), row_sum(Br);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      for (int64_t r0 = 0; r0 < Nq; r0 += Br) {
        const int64_t rows = std::min(Br, Nq - r0);
        std::fill(row_max.begin(), row_max.end(), neg_inf);
        std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
        for (int64_t c0 = 0; c0 < Nk; c0 += Bc) {
          const int64_t cols = std::min(Bc, Nk - c0);
          tile_product(false, true, rows, cols, D, acc_t(1), Q[g] + r0 * q_ld, q_ld, K + c0 * k_ld,
                       k_ld, acc_t(0), S, Bc);
          for (int64_t r = 0; r < rows; ++r) {
            acc_t* s_row = S + r * Bc;
            logits_row(h, r0 + r, c0, cols, false, s_row, T + r * Bc);
            acc_t block_max = neg_inf;
            for (int64_t c = 0; c < cols; ++c) block_max = std::max(block_max, s_row[c]);
            if (block_max == neg_inf) continue;
            const acc_t m = std::max(row_max[r], block_max);
            acc_t sum = 0;
            for (int64_t c = 0; c < cols; ++c) sum += std::exp(s_row[c] - m);
            row_sum[r] = row_sum[r] * std::exp(row_max[r] - m) + sum;
            row_max[r] = m;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          acc_t& saved = lse_rows[g * Nq + r0 + r];
          if (saved == neg_inf || row_max[r] == neg_inf) continue;
          const acc_t exact = row_max[r] + std::log(row_sum[r]);
          const float rounded = static_cast<float>(saved);
          const acc_t spacing = std::ldexp(acc_t(1), std::ilogb(rounded) - 23);
          if (std::abs(exact - saved) <= spacing) saved = exact;
        }
      }
    }
  }

  for (int64_t c0 = 0; c0 < Nk; c0 += Bc) {
    const int64_t cols = std::min(Bc, Nk - c0), c_last = c0 + cols - 1;
    // Query rows whose window reaches this key block: i + off - wl <= c_last, i + off + wr >= c0.
    int64_t i_begin = 0, i_end = Nq;
    if (wr >= 0) i_begin = std::max<int64_t>(0, c0 - off - wr);
    if (wl >= 0) i_end = std::min<int64_t>(Nq, c_last - off + wl + 1);
    for (int64_t g = 0; g < group; ++g) {
      const acc_t* lse = lse_rows.data() + g * Nq;
      const int64_t h = hk * group + g;
      for (int64_t r0 = i_begin; r0 < i_end; r0 += Br) {
        const int64_t rows = std::min(Br, i_end - r0), r_last = r0 + rows - 1;
        if (mask_hides_tile<acc_t, scalar_t>(p, b, h, r0, rows, c0, cols)) continue;
        const op_t* Qi = Q[g] + r0 * q_ld;
        const op_t* dOi = dO[g] + r0 * do_ld;
        // Transposed operands: whole tiles on oneDNN's kernel; Q_i^T (D x rows, row stride Br).
        const bool whole = rows == Br && cols == Bc;
        const acc_t* qt_of_tile = nullptr;
        if constexpr (fp32_products) {
          if (transposed)
            plain_product(whole, rows, cols, D, Qi, q_ld, KT + c0 * D, Bc, false, S, Bc);
        }
        if (!transposed) {
          tile_product(false, true, rows, cols, D, acc_t(1), Qi, q_ld, K + c0 * k_ld, k_ld,
                       acc_t(0), S, Bc);
        }
        // Window bounds only matter on tiles the diagonal band's edges cross.
        const bool window_inside =
            (wr < 0 || c_last <= r0 + off + wr) && (wl < 0 || c0 >= r_last + off - wl);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r0 + r;
          acc_t* s_row = S + r * Bc;
          const acc_t row_lse = lse[i];
          if (row_lse == neg_inf) {  // no visible key: P = 0, gradients 0
            std::fill(s_row, s_row + cols, acc_t(0));
            continue;
          }
          logits_row(h, i, c0, cols, window_inside, s_row, T + r * Bc);
          if (row_lse != row_lse) {
            // The forward made this row NaN (a NaN or +inf visible score): P is NaN on its visible
            // keys and 0 on hidden ones, as autograd of the masked math has it. Off the hot loop.
            for (int64_t c = 0; c < cols; ++c)
              s_row[c] = s_row[c] == neg_inf ? acc_t(0) : std::numeric_limits<acc_t>::quiet_NaN();
            continue;
          }
          if constexpr (std::is_same_v<acc_t, float>) {
            row_ops().probs(s_row, cols, row_lse);
          } else {
            for (int64_t c = 0; c < cols; ++c) s_row[c] = std::exp(s_row[c] - row_lse);
          }
        }
        if (dropout) {
          for (int64_t r = 0; r < rows; ++r) {
            row_ops().keep_row(drop, dropout_head_index(p, b, h), r0 + r, c0, cols, keep.data());
            for (int64_t c = 0; c < cols; ++c) {
              Z[r * Bc + c] = keep[c] ? drop_scale : acc_t(0);
              Pd[r * Bc + c] = S[r * Bc + c] * Z[r * Bc + c];
            }
          }
        }
        if constexpr (!std::is_same_v<op_t, acc_t>)
          round_rows_to_bf16(dropout ? Pd : S, Bc, low_p, Bc, rows, cols);
        if constexpr (fp32_products) {
          if (transposed) {
            // Q_i^T and dO_i^T: the panels where the block starts on a panel's first row, else
            // tile copies (a window or causal bound moved its start).
            const bool on_panel = r0 % Br == 0;
            const float* qt = on_panel ? QT(g) + r0 * D : qt_tile;
            const float* dot = on_panel ? dOT(g) + r0 * D : dot_tile;
            if (!on_panel) {
              transpose_rows(Qi, q_ld, rows, D, 1.0f, qt_tile, Br);
              transpose_rows(dOi, do_ld, rows, D, 1.0f, dot_tile, Br);
            }
            plain_product(whole, D, cols, rows, dot, Br, P_op, Bc, true, dVT + c0 * D, Bc);
            plain_product(whole, rows, cols, D, dOi, do_ld, VT + c0 * D, Bc, false, dP, Bc);
            qt_of_tile = qt;
          }
        }
        if (!transposed) {
          tile_product(true, false, cols, D, rows, acc_t(1), P_op, Bc, dOi, do_ld, acc_t(1),
                       dV + c0 * dv_ld, dv_ld);
          tile_product(false, true, rows, cols, D, acc_t(1), dOi, do_ld, V + c0 * v_ld, v_ld,
                       acc_t(0), dP, Bc);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const acc_t d_i = delta[g * Nq + r0 + r];
          acc_t* dp_row = dP + r * Bc;
          const acc_t* p_row = S + r * Bc;
          if (dropout) {
            for (int64_t c = 0; c < cols; ++c) dp_row[c] *= Z[r * Bc + c];
          }
          if (d_i !=
              d_i) {  // a NaN row: hidden keys (P = 0) keep dS = 0, as autograd of the masked math
            for (int64_t c = 0; c < cols; ++c)
              dp_row[c] = p_row[c] == acc_t(0) ? acc_t(0) : p_row[c] * (dp_row[c] - d_i);
          } else if constexpr (std::is_same_v<acc_t, float>) {
            row_ops().dscores(dp_row, p_row, cols, d_i);
          } else {
            for (int64_t c = 0; c < cols; ++c) dp_row[c] = p_row[c] * (dp_row[c] - d_i);
          }
          if (p.grad_mask) {  // dL/d(score after the mask): before softcap's tanh factor
            float* gm = p.grad_mask + ((b * p.heads_q + h) * Nq + r0 + r) * Nk + c0;
            for (int64_t c = 0; c < cols; ++c) gm[c] = static_cast<float>(dp_row[c]);
          }
          if (capped) {
            const acc_t* t_row = T + r * Bc;
            for (int64_t c = 0; c < cols; ++c) dp_row[c] *= acc_t(1) - t_row[c] * t_row[c];
          }
        }
        if constexpr (!std::is_same_v<op_t, acc_t>)
          round_rows_to_bf16(dP, Bc, low_ds, Bc, rows, cols);
        if constexpr (fp32_products) {
          if (transposed) {
            plain_product(whole, D, cols, rows, qt_of_tile, Br, dS_op, Bc, true, dKT + c0 * D, Bc);
            plain_product(whole, rows, D, cols, dS_op, Bc, K + c0 * k_ld, k_ld, true,
                          dQ[g] + r0 * dq_ld, dq_ld);
          }
        }
        if (!transposed) {
          tile_product(true, false, cols, D, rows, scale, dS_op, Bc, Qi, q_ld, acc_t(1),
                       dK + c0 * dk_ld, dk_ld);
          tile_product(false, false, rows, D, cols, scale, dS_op, Bc, K + c0 * k_ld, k_ld, acc_t(1),
                       dQ[g] + r0 * dq_ld, dq_ld);
        }
      }
    }
  }

  if (transposed) {  // dK, dV back to rows; the scale dK and dQ were accumulated without
    for (int64_t j = 0; j < key_blocks; ++j) {
      const int64_t cols = std::min(Bc, Nk - j * Bc);
      transpose_rows(dKT + j * D * Bc, Bc, D, cols, static_cast<float>(scale), dK + j * Bc * dk_ld,
                     dk_ld);
      transpose_rows(dVT + j * D * Bc, Bc, D, cols, 1.0f, dV + j * Bc * dv_ld, dv_ld);
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < Nq; ++i) {
        acc_t* row = dQ[g] + i * dq_ld;
        for (int64_t d = 0; d < D; ++d) row[d] *= scale;
      }
    }
  }

  if constexpr (widen) {
    auto narrow_rows = [&](const acc_t* src, int64_t rows, scalar_t* dst, int64_t stride) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) dst[r * stride + d] = static_cast<scalar_t>(src[r * D + d]);
      }
    };
    narrow_rows(dK, Nk, dKout, p.grad_k_row_stride);
    narrow_rows(dV, Nk, dVout, p.grad_v_row_stride);
    for (int64_t g = 0; g < group; ++g) narrow_rows(dQ[g], Nq, dq_of(g), p.grad_q_row_stride);
  }
}

// Whether bf16 calls take their products on bf16 operands (MKL's bf16 GEMM): where the forward
// runs its AMX kernel (FLASHMOD_CPU_ISA included), so MKL has the tile unit too and the rounding of
// P and dS is AVX512-BF16's. H = 8, N = 2048, D = 128, 2 threads: see the design log.
bool bf16_products_usable() {
  static const bool usable =
      cblas_gemm_bf16bf16f32 != nullptr && std::string(cpu::kernel_name()) == cpu::kAmxKernelName;
  return usable;
}

template <typename scalar_t, typename acc_t, typename op_t = acc_t>
void backward_cpu(const AttentionBwdParams& p) {
  constexpr int64_t kTileElements = kTileBuffers<acc_t, op_t> * Br * Bc;
  const int64_t group = p.heads_q / p.heads_kv;
  int64_t per_task = kTileElements + group * p.seqlen_q;
  const bool transposed = transposed_operands<acc_t, op_t>();
  if (transposed) per_task += transposed_elements(p);
  if constexpr (std::is_same_v<op_t, acc_t> && !std::is_same_v<scalar_t, acc_t>) {
    per_task += (4 * p.seqlen_k + 3 * group * p.seqlen_q) * p.head_dim;  // operands widened
  } else if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    per_task += (2 * p.seqlen_k + group * p.seqlen_q) * p.head_dim;  // the gradients only
  }
  at::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(per_task);
    for (int64_t task = begin; task < end; ++task)
      backward_task<scalar_t, acc_t, op_t>(p, task, transposed, scratch.data());
  });
}

// prepared's gradients (zeroed: prepare_zeroed) by the fused kernels.
void run_backward_cpu(const PreparedAttentionBackward& prepared) {
  const AttentionBwdParams& p = prepared.params;
  // BLAS takes 32-bit leading dimensions; offsets along them are 64-bit pointer arithmetic.
  for (auto [name, stride] :
       {std::pair{"q", p.q_row_stride}, std::pair{"k", p.k_row_stride},
        std::pair{"v", p.v_row_stride}, std::pair{"grad_out", p.grad_out_row_stride}}) {
    TORCH_CHECK(stride <= std::numeric_limits<int>::max(), "flashmod.attention_backward: on CPU, ",
                name, "'s row stride (stride(2)) must be at most 2^31 - 1 elements, got ", stride);
  }
  if (prepared.grad_q.numel() > 0 && prepared.grad_k.numel() > 0) {
    switch (p.dtype) {
      case ScalarKind::kFloat32: backward_cpu<float, float>(p); break;
      case ScalarKind::kFloat64: backward_cpu<double, double>(p); break;
      case ScalarKind::kFloat16: backward_cpu<c10::Half, float>(p); break;
      case ScalarKind::kBFloat16:
        if (bf16_products_usable()) {
          backward_cpu<c10::BFloat16, float, c10::BFloat16>(p);
        } else {
          backward_cpu<c10::BFloat16, float>(p);
        }
        break;
    }
  }
}

}  // namespace

void run_attention_backward_cpu(PreparedAttentionBackward& prepared) {
  // The kernel accumulates: fp32/fp64 straight into the gradients. Rows no key reaches (and all of
  // an empty problem) stay 0.
  prepared.grad_q.zero_();
  prepared.grad_k.zero_();
  prepared.grad_v.zero_();
  run_backward_cpu(prepared);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap,
    bool compute_grad_mask) {
  PreparedAttentionBackward prepared = prepare_attention_backward(
      grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale, is_causal, bottom_right, window_left,
      window_right, softcap, compute_grad_mask);
  run_attention_backward_cpu(prepared);
  return {prepared.grad_q, prepared.grad_k, prepared.grad_v, prepared.grad_mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_dropout_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const at::Tensor& rng_state) {
  PreparedAttentionBackward prepared =
      prepare_attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale, is_causal,
                                 bottom_right, window_left, window_right, softcap, false);
  set_dropout(prepared.params, "flashmod.attention_backward", q, dropout_p, rng_state);
  run_attention_backward_cpu(prepared);
  return {prepared.grad_q, prepared.grad_k, prepared.grad_v};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CPU, m) {
  m.impl("attention_backward", &flashmod::attention_backward_cpu);
  m.impl("attention_dropout_backward", &flashmod::attention_dropout_backward_cpu);
}
