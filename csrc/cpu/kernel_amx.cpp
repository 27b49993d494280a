// bf16 on AMX (Sapphire Rapids and later): S_ij and P_ij V_j on the tile unit, the online softmax
// on AVX-512 as in kernel_impl.h. Every other dtype and shape runs the AVX-512 engine.
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

// Br = 64 queries: the per-task packing of V_j and the tile loads of K_j serve twice as many
// queries as with 32 (bf16 N=1024 D=128: +X% measured). The fp32/fp16 engine in this TU then
// uses 4 keys x 4 vectors = 16 accumulators.
constexpr int kNV = 4, kKB = 4, kRB = 4, kDV = 4;

#include "kernel_impl.h"

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
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// S_ij^T = K_j Q_i^T with K_j rows as the A operand straight from memory (no packing) and Q_i^T
// in pair layout (packed once per task), so S_ij lands key-major like the vector engine's. Q_i
// is not pre-scaled (bf16 would round it); the scores are scaled in fp32 after the product.
template <class Tag>
struct AmxEngine {
  static bool supports(const AttentionParams& p) { return p.head_dim % 32 == 0; }

  // QT as uint32 pairs: [d / 2][query], row stride Br.
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
                     float scale, Workspace& ws) {
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
    const vf s = splat(scale);
    for (int64_t i = 0; i < cols * kBr; i += kW) storeu(ws.S + i, loadu(ws.S + i) * s);
  }

  // O_i = diag(alpha) O_i + P_ij V_j: P_ij is transposed to query-major bf16 (the A operand), V_j
  // interleaved into row pairs (the B operand); the block's product joins O_i in fp32.
  static void pv(const uint16_t* V_j, int64_t ldv, int64_t cols, int64_t D, int64_t /*Dp*/,
                 int64_t rows, Workspace& ws) {
    if (cols < kBc) std::memset(ws.S + cols * kBr, 0, sizeof(float) * (kBc - cols) * kBr);
    auto* P = reinterpret_cast<uint16_t*>(ws.Pb);  // [query][key], row stride Bc
    const __m512i key_rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(kBr));
    const int64_t rows32 = (rows + 31) / 32 * 32, cols32 = (cols + 31) / 32 * 32;
    for (int64_t r = 0; r < rows32; ++r) {
      for (int64_t c = 0; c < cols32; c += 32) {
        const __m512 lo = _mm512_i32gather_ps(key_rows, ws.S + c * kBr + r, 4);
        const __m512 hi = _mm512_i32gather_ps(key_rows, ws.S + (c + 16) * kBr + r, 4);
        _mm512_storeu_si512(P + r * kBc + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    // V pairs: Vp[c / 2][d] = (V[c][d], V[c + 1][d]), row stride 2 D bf16.
    auto* Vp = reinterpret_cast<uint16_t*>(ws.V);
    const __m512i first = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                            0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                            0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                            0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t c = 0; c < cols32; c += 2) {
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = c < cols ? _mm512_loadu_si512(V_j + c * ldv + d) : zero;
        const __m512i b = c + 1 < cols ? _mm512_loadu_si512(V_j + (c + 1) * ldv + d) : zero;
        _mm512_storeu_si512(Vp + c * D + 2 * d, _mm512_permutex2var_epi16(a, first, b));
        _mm512_storeu_si512(Vp + c * D + 2 * d + 32, _mm512_permutex2var_epi16(a, second, b));
      }
    }
    memory_barrier();
    for (int64_t r = 0; r < rows32; r += 32) {
      for (int64_t d = 0; d < D; d += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < cols32; c += 32) {
          _tile_loadd(4, P + r * kBc + c, kBc * 2);
          _tile_loadd(5, P + (r + 16) * kBc + c, kBc * 2);
          _tile_loadd(6, Vp + c * D + 2 * d, D * 4);
          _tile_loadd(7, Vp + c * D + 2 * d + 32, D * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* Ot = ws.Ot + r * D + d;
        _tile_stored(0, Ot, D * 4);
        _tile_stored(1, Ot + 16, D * 4);
        _tile_stored(2, Ot + 16 * D, D * 4);
        _tile_stored(3, Ot + 16 * D + 16, D * 4);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const vf a = splat(ws.alpha[r]);
      float* o = ws.O + r * D;
      const float* t = ws.Ot + r * D;
      for (int64_t d = 0; d < D; d += kW) storeu(o + d, fmadd(loadu(o + d), a, loadu(t + d)));
    }
  }
};

void run_tasks_amx(const AttentionParams& p, int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  run_tasks_with<AmxEngine>(p, begin, end);
  _tile_release();
}

}  // namespace

const KernelInfo kAmxBf16Kernel = {"amx-bf16", kBr, &run_tasks_amx};

}  // namespace flashmod::cpu
