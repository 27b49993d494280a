// bf16 on AMX (Sapphire Rapids and later): S_ij and P_ij V_j on the tile unit, the online softmax
// on AVX-512 as in engine_prefill.h. Every other dtype and shape runs the AVX-512 engine.
//
// All eight tiles are 16 rows x 64 bytes: C tiles hold 16 x 16 fp32, A tiles 16 rows x 32 bf16,
// B tiles 16 rows of 16 bf16 pairs, B[k/2][n] = (X[k][n], X[k+1][n]) for the K x N operand X.
// Tiles 0-3 accumulate a 2 x 2 block of C, 4-5 hold A, 6-7 hold B.
#include <immintrin.h>

#include "kernel.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")

namespace flashmod::cpu {
namespace {

#include "simd_avx512.h"

// Br = 64 queries: the per-task work on K_j and V_j serves twice as many queries as with 32 (with
// Br = 32 the bf16 ratio to torch at N=1024 was 0.64-0.76 non-causal, with 64 0.87-0.96; noisy
// machine). The fp32/fp16 engine in this TU then blocks 6 keys x 4 vectors for the scores and
// 6 rows x 4 vectors for P V: 24 accumulators, 10 loads per 24 FMAs instead of 8 per 16 (no
// measurable change: that engine is FMA-bound here).
constexpr int kNV = 4, kKB = 6, kRB = 6, kDV = 4;
// Bc = 256: fewer loads and stores of the O_i tiles per product. bf16 geomean ratio to torch over
// N=1024-2048, D=64/128, causal or not (2 threads): Bc=64 1.00, 128 1.11, 256 1.16-1.17. fp32
// (same engine constants) did not move.
constexpr int64_t kBc = 256;

#include "engine_common.h"
#include "engine_decode.h"
#include "engine_prefill.h"

static_assert(kBr % 32 == 0 && kBc % 32 == 0, "the tiles below work on 32 x 32 blocks");

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile loads are asm without a memory operand: stores that fill a tile's source must be
// complete (not kept in registers or sunk) before them.
inline void memory_barrier() {
  asm volatile("" ::: "memory");
}

// e^x for x <= 0 (or -inf) to ~2e-6 relative, for P_ij that is rounded to bf16 (4e-3) next:
// Taylor to r^5 instead of r^7 and vscalefps for the 2^n, 11 instead of 17 operations. Below
// -80 gives exactly 0, NaN stays NaN, as exp_neg (max_ps returns its second operand, x, for a NaN;
// the unordered compare keeps a NaN lane live).
inline vf exp_neg_for_bf16(vf x) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-80.0f), (__m512)x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-6f), r);
  __m512 e = _mm512_set1_ps(1.0f / 120);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  const __mmask16 live = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-80.0f), _CMP_NLT_UQ);
  return (vf)_mm512_maskz_scalef_ps(live, e, n);
}

// Row stride of V^T in the shared buffer: a key chunk of 32 starting anywhere below Nk stays
// inside the row, and rows start 64-byte aligned.
inline int64_t transposed_v_stride(int64_t Nk) {
  return (Nk + 32 + 31) / 32 * 32;
}

// S_ij^T = K_j Q_i^T with K_j rows as the A operand straight from memory (no packing) and Q_i^T
// in pair layout (packed once per task), so S_ij lands key-major like the vector engine's. Q_i
// is not pre-scaled (bf16 would round it); the softmax scales the fp32 scores.
template <class Tag>
struct AmxEngine {
  // Decode-sized query counts go to the vector engine's dot products: transposing V for them
  // would cost as much as the attention.
  // Not dropout: its softmax writes P straight into the bf16 operand of P V.
  static bool supports(const AttentionParams& p) {
    return p.head_dim % 32 == 0 && p.seqlen_q > kW && p.dropout_rng == nullptr;
  }
  static constexpr bool kScaledScores = false;
  // K is read in bf16 by the tiles and V comes transposed from prepare: nothing to widen.
  static void bind_kv(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                      int64_t, Workspace&) {}

  // QT holds Q_i^T as bf16 pairs: [d / 2][query] uint32, row stride Br. K holds K_j when the
  // block is cut short, V the rounded output in finalize; O is O_i^T (D x Br).
  static void pack_q(const uint16_t* Q, int64_t ldq, int64_t rows, int64_t D, float /*scale*/,
                     Workspace& ws) {
    auto* qv = reinterpret_cast<uint32_t*>(ws.QT);
    for (int64_t r = 0; r < kBr; ++r) {
      const uint16_t* q = Q + r * ldq;
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        uint32_t pair = 0;
        if (r < rows) std::memcpy(&pair, q + 2 * dp, 4);
        qv[dp * kBr + r] = pair;
      }
    }
  }

  static void scores(const uint16_t* K_j, int64_t ldk, int64_t cols, int64_t D, int64_t rows,
                     float /*scale: applied by the softmax*/, Workspace& ws) {
    const uint16_t* src = K_j;
    int64_t ld = ldk;
    if (cols < kBc) {  // the tile loads read whole 16-row groups: stay inside K
      auto* kpad = reinterpret_cast<uint16_t*>(ws.K);
      for (int64_t c = 0; c < kBc; ++c) {
        if (c < cols) {
          std::memcpy(kpad + c * D, K_j + c * ldk, D * 2);
        } else {
          std::memset(kpad + c * D, 0, D * 2);
        }
      }
      src = kpad, ld = D;
    }
    memory_barrier();
    const auto* qv = reinterpret_cast<const uint32_t*>(ws.QT);
    for (int64_t c = 0; c < cols; c += 32) {
      const uint16_t* k = src + c * ld;
      for (int64_t r = 0; r < rows; r += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < D; d += 32) {
          _tile_loadd(4, k + d, ld * 2);
          _tile_loadd(5, k + 16 * ld + d, ld * 2);
          _tile_loadd(6, qv + d / 2 * kBr + r, kBr * 4);
          _tile_loadd(7, qv + d / 2 * kBr + r + 16, kBr * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* S = ws.S + c * kBr + r;
        _tile_stored(0, S, kBr * 4);
        _tile_stored(1, S + 16, kBr * 4);
        _tile_stored(2, S + 16 * kBr, kBr * 4);
        _tile_stored(3, S + 16 * kBr + 16, kBr * 4);
      }
    }
  }

  // online_softmax, writing P_ij as bf16 key pairs (the B operand of P V below) instead of fp32:
  // Pp[c / 2][r] = (P[c][r], P[c + 1][r]), row stride 2 Br bf16. Saves a store and reload of
  // P_ij (9% of the time at N=1024 D=64).
  static void softmax(int64_t cols, int64_t rows, float scale, Workspace& ws) {
    const int64_t rows32 = (rows + 31) / 32 * 32, cols32 = (cols + 31) / 32 * 32;
    float* S = ws.S;
    for (int64_t i = cols * kBr; i < cols32 * kBr; i += kW) storeu(S + i, splat(kNegInf));
    const vf sc = splat(scale);
    vf neg_m[kNV], sum[kNV];
    for (int64_t nv = 0; nv < rows32 / kW; ++nv) {
      const float* s = S + nv * kW;
      vf mx0 = splat(kNegInf), mx1 = mx0;
      for (int64_t c = 0; c < cols32; c += 2) {
        mx0 = vmax(mx0, loadu(s + c * kBr));
        mx1 = vmax(mx1, loadu(s + (c + 1) * kBr));
      }
      const vf m_old = loadu(ws.m + nv * kW);
      const vf m_new = vmax(m_old, vmax(mx0, mx1) * sc);
      const vf m_use = m_new == splat(kNegInf) ? splat(0.0f) : m_new;
      storeu(ws.alpha + nv * kW, exp_neg(m_old - m_use));
      storeu(ws.m + nv * kW, m_new);
      neg_m[nv] = -m_use;
      sum[nv] = splat(0.0f);
    }
    auto* Pp = reinterpret_cast<uint16_t*>(ws.Pb);
    const __m512i first =
        _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                          0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                          0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t c = 0; c < cols32; c += 2) {
      const float* s0 = S + c * kBr;
      const float* s1 = s0 + kBr;
      uint16_t* pp = Pp + c * kBr;
      for (int64_t r = 0; r < rows32; r += 32) {
        const int64_t nv = r / kW;
        const vf p00 = exp_neg_for_bf16(fmadd(loadu(s0 + r), sc, neg_m[nv]));
        const vf p01 = exp_neg_for_bf16(fmadd(loadu(s0 + r + 16), sc, neg_m[nv + 1]));
        const vf p10 = exp_neg_for_bf16(fmadd(loadu(s1 + r), sc, neg_m[nv]));
        const vf p11 = exp_neg_for_bf16(fmadd(loadu(s1 + r + 16), sc, neg_m[nv + 1]));
        sum[nv] += p00 + p10;
        sum[nv + 1] += p01 + p11;
        const __m512i a = (__m512i)_mm512_cvtne2ps_pbh((__m512)p01, (__m512)p00);
        const __m512i b = (__m512i)_mm512_cvtne2ps_pbh((__m512)p11, (__m512)p10);
        _mm512_storeu_si512(pp + 2 * r, _mm512_permutex2var_epi16(a, first, b));
        _mm512_storeu_si512(pp + 2 * r + 32, _mm512_permutex2var_epi16(a, second, b));
      }
    }
    for (int64_t nv = 0; nv < rows32 / kW; ++nv) {
      storeu(ws.l + nv * kW, fmadd(loadu(ws.l + nv * kW), loadu(ws.alpha + nv * kW), sum[nv]));
    }
  }

  // O_i^T = V_j^T P_ij^T, so that neither operand needs a transpose per task: V^T is the A
  // operand, transposed once per call by prepare_amx; P_ij^T comes from the softmax in key
  // pairs, the B operand's layout. O_i is kept transposed (D x Br), so its rescaling by alpha is
  // lane-wise too.
  static void pv(const uint16_t* /*V_j*/, int64_t /*ldv*/, int64_t kv_head, int64_t c0,
                 int64_t cols, int64_t D, int64_t /*Dp*/, int64_t rows, Workspace& ws) {
    const int64_t rows32 = (rows + 31) / 32 * 32, cols32 = (cols + 31) / 32 * 32;
    const auto* Pp = reinterpret_cast<const uint16_t*>(ws.Pb);
    // O_i accumulates in the tiles directly (loaded and stored per block); a fp32 sum of fp32
    // block products loses nothing next to the bf16 output. Rescaling by alpha is needed only
    // when some row's maximum moved, which becomes rare after the first blocks.
    const __mmask16 moved = _mm512_cmpneq_ps_mask(_mm512_loadu_ps(ws.alpha), _mm512_set1_ps(1.0f));
    bool rescale = moved != 0;
    for (int64_t r = 16; r < rows32; r += 16) {
      rescale |= _mm512_cmpneq_ps_mask(_mm512_loadu_ps(ws.alpha + r), _mm512_set1_ps(1.0f)) != 0;
    }
    if (rescale) {
      for (int64_t d = 0; d < D; ++d) {
        float* o = ws.O + d * kBr;
        for (int64_t r = 0; r < rows32; r += kW) storeu(o + r, loadu(o + r) * loadu(ws.alpha + r));
      }
    }
    memory_barrier();
    const int64_t ldvt = transposed_v_stride(ws.seqlen_k);
    const uint16_t* Vt = static_cast<const uint16_t*>(ws.shared) + kv_head * D * ldvt + c0;
    for (int64_t d = 0; d < D; d += 32) {
      for (int64_t r = 0; r < rows32; r += 32) {
        float* O = ws.O + d * kBr + r;
        _tile_loadd(0, O, kBr * 4);
        _tile_loadd(1, O + 16, kBr * 4);
        _tile_loadd(2, O + 16 * kBr, kBr * 4);
        _tile_loadd(3, O + 16 * kBr + 16, kBr * 4);
        for (int64_t c = 0; c < cols32; c += 32) {
          _tile_loadd(4, Vt + d * ldvt + c, ldvt * 2);
          _tile_loadd(5, Vt + (d + 16) * ldvt + c, ldvt * 2);
          _tile_loadd(6, Pp + c * kBr + 2 * r, kBr * 4);
          _tile_loadd(7, Pp + c * kBr + 2 * r + 32, kBr * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, O, kBr * 4);
        _tile_stored(1, O + 16, kBr * 4);
        _tile_stored(2, O + 16 * kBr, kBr * 4);
        _tile_stored(3, O + 16 * kBr + 16, kBr * 4);
      }
    }
  }

  // O_i^T is normalized and rounded lane-wise, then transposed 16 bits at a time: the scalar
  // fp32 path (one rounding per element with a NaN test) took 10% of the time at N=1024 D=128.
  static void finalize(const Workspace& ws, uint16_t* out, int64_t ldo, int64_t rows, int64_t D,
                       int64_t /*Dp*/) {
    const int64_t rows16 = (rows + 15) / 16 * 16;
    alignas(64) float inv_l[kBr];
    for (int64_t r = 0; r < rows16; ++r) inv_l[r] = finish_inv_l(ws.l[r]);
    auto* rounded = reinterpret_cast<uint16_t*>(ws.V);  // D x Br bf16
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t r = 0; r < rows16; r += 16) {
        const __m512 o =
            _mm512_mul_ps(_mm512_loadu_ps(ws.O + d * kBr + r), _mm512_loadu_ps(inv_l + r));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + d * kBr + r),
                            (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t d = 0; d < D; ++d) out[r * ldo + d] = rounded[d * kBr + r];
    }
  }
};

bool uses_transposed_v(const AttentionParams& p) {
  return p.dtype == ScalarKind::kBFloat16 && AmxEngine<BF16>::supports(p);
}

int64_t shared_bytes_amx(const AttentionParams& p) {
  if (!uses_transposed_v(p)) return 0;
  return p.batch * p.heads_kv * p.head_dim * transposed_v_stride(p.seqlen_k) * 2;
}

// V^T per kv-head: D rows of Nk keys, zero-padded to transposed_v_stride.
void prepare_amx(const AttentionParams& p, void* shared, int64_t begin, int64_t end) {
  if (!uses_transposed_v(p)) return;
  const int64_t D = p.head_dim, Nk = p.seqlen_k, ldvt = transposed_v_stride(Nk);
  for (int64_t kv_head = begin; kv_head < end; ++kv_head) {
    const int64_t b = kv_head / p.heads_kv, hk = kv_head % p.heads_kv;
    const auto* V = static_cast<const uint16_t*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
    uint16_t* Vt = static_cast<uint16_t*>(shared) + kv_head * D * ldvt;
    // 16 x 16 blocks keep both the rows read and the rows written in L1.
    for (int64_t c = 0; c < Nk; c += 16) {
      for (int64_t d = 0; d < D; d += 16) {
        for (int64_t cc = c; cc < min64(c + 16, Nk); ++cc) {
          for (int64_t dd = d; dd < d + 16; ++dd) Vt[dd * ldvt + cc] = V[cc * p.v_row_stride + dd];
        }
      }
    }
    for (int64_t d = 0; d < D; ++d) std::memset(Vt + d * ldvt + Nk, 0, (ldvt - Nk) * 2);
  }
}

void run_tasks_amx(const AttentionParams& p, const void* shared, int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  run_tasks_with<AmxEngine>(p, shared, begin, end);
  _tile_release();
}

}  // namespace

const KernelInfo kAmxBf16Kernel = {kAmxKernelName, kBr, &shared_bytes_amx, &prepare_amx,
                                   &run_tasks_amx, kW,  &decode_run,       &decode_merge};

}  // namespace flashmod::cpu
