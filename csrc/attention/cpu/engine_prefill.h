// The prefill engine: tasks of Br queries against their visible key blocks (see engine_common.h
// for the layout). Included by kernel_<isa>.cpp after engine_common.h.

// S[KB keys x Br queries] = K (KB rows, stride ldk) . Q_i^T. KB * kNV accumulators stay in
// registers; each step loads kNV vectors of Q_i^T and broadcasts KB elements of K.
template <int KB>
inline void scores_block(const float* QT, const float* K, int64_t ldk, int64_t D, float* S) {
  vf acc[KB][kNV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf q[kNV];
#pragma GCC unroll 8
    for (int nv = 0; nv < kNV; ++nv) q[nv] = loadu(QT + d * kBr + nv * kW);
#pragma GCC unroll 16
    for (int kb = 0; kb < KB; ++kb) {
      const vf k = splat(K[kb * ldk + d]);
#pragma GCC unroll 8
      for (int nv = 0; nv < kNV; ++nv) acc[kb][nv] = fmadd(k, q[nv], acc[kb][nv]);
    }
  }
#pragma GCC unroll 16
  for (int kb = 0; kb < KB; ++kb) {
#pragma GCC unroll 8
    for (int nv = 0; nv < kNV; ++nv) storeu(S + kb * kBr + nv * kW, acc[kb][nv]);
  }
}

// The cols x Br block of S: whole register blocks, then the tail key by key halving.
inline void scores(const float* QT, const float* K, int64_t ldk, int64_t D, int64_t cols,
                   float* S) {
  int64_t c = 0;
  for (; c + kKB <= cols; c += kKB) scores_block<kKB>(QT, K + c * ldk, ldk, D, S + c * kBr);
  for (; c + 4 <= cols; c += 4) scores_block<4>(QT, K + c * ldk, ldk, D, S + c * kBr);
  for (; c + 2 <= cols; c += 2) scores_block<2>(QT, K + c * ldk, ldk, D, S + c * kBr);
  for (; c < cols; ++c) scores_block<1>(QT, K + c * ldk, ldk, D, S + c * kBr);
}

// S_ij for a task of at most kW queries (decode): dot products along D, one horizontal sum per
// score, instead of Br lanes of which all but `rows` would be padding. Lanes rows .. kW are 0;
// they are zeroed by a vector store before the scalar ones (a vector built lane by lane in
// registers stalled on store forwarding, a quarter of the decode time). K is widened as it is
// loaded: with one query per key there is no reuse that a widened tile would serve.
template <class Tag>
void scores_few_rows(const float* Qr, int64_t Dp, const typename Tag::storage* K, int64_t ldk,
                     int64_t D, int64_t cols, int64_t rows, float* S) {
  for (int64_t c = 0; c < cols; ++c) {
    const auto* k = K + c * ldk;
    float* s = S + c * kBr;
    storeu(s, splat(0.0f));
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = Qr + r * Dp;
      vf acc0 = splat(0.0f), acc1 = acc0;
      int64_t d = 0;
      for (; d + 2 * kW <= D; d += 2 * kW) {
        acc0 = fmadd(Tag::load(k + d), loadu(q + d), acc0);
        acc1 = fmadd(Tag::load(k + d + kW), loadu(q + d + kW), acc1);
      }
      if (d + kW <= D) {
        acc0 = fmadd(Tag::load(k + d), loadu(q + d), acc0);
        d += kW;
      }
      float dot = hsum(acc0 + acc1);
      for (; d < D; ++d) dot += Tag::to_float(k[d]) * q[d];
      s[r] = dot;
    }
  }
}

// O[r .. r+kRB, dcol .. dcol+DV*kW] = alpha * O + P^T(cols keys) V. The block's sum starts from
// zero and joins O once: summing all Nk terms into O one by one doubled the fp32 error at
// Nk=4096 compared with a BLAS P V (measured 2.7x plain attention's max error before, see notes).
template <int RB, int DV>
inline void pv_block(const float* P, const float* V, int64_t ldv, int64_t cols, const float* alpha,
                     float* O, int64_t ldo) {
  vf acc[RB][DV] = {};
  for (int64_t c = 0; c < cols; ++c) {
    vf p[RB];
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; ++rb) p[rb] = splat(P[c * kBr + rb]);
#pragma GCC unroll 8
    for (int dv = 0; dv < DV; ++dv) {
      const vf v = loadu(V + c * ldv + dv * kW);
#pragma GCC unroll 8
      for (int rb = 0; rb < RB; ++rb) acc[rb][dv] = fmadd(p[rb], v, acc[rb][dv]);
    }
  }
#pragma GCC unroll 8
  for (int rb = 0; rb < RB; ++rb) {
    const vf a = splat(alpha[rb]);
#pragma GCC unroll 8
    for (int dv = 0; dv < DV; ++dv) {
      float* o = O + rb * ldo + dv * kW;
      storeu(o, fmadd(loadu(o), a, acc[rb][dv]));
    }
  }
}

template <int DV>
inline void pv_rows(const float* P, const float* V, int64_t ldv, int64_t cols, const float* alpha,
                    float* O, int64_t ldo, int64_t rows) {
  int64_t r = 0;
  for (; r + kRB <= rows; r += kRB) {
    pv_block<kRB, DV>(P + r, V, ldv, cols, alpha + r, O + r * ldo, ldo);
  }
  if (r + 4 <= rows) {  // Br = 64 with kRB = 6 leaves 4
    pv_block<4, DV>(P + r, V, ldv, cols, alpha + r, O + r * ldo, ldo);
    r += 4;
  }
  for (; r + 2 <= rows; r += 2) pv_block<2, DV>(P + r, V, ldv, cols, alpha + r, O + r * ldo, ldo);
  // An odd kRB (AVX2's 3) leaves one row of an even count.
  if (r < rows) pv_block<1, DV>(P + r, V, ldv, cols, alpha + r, O + r * ldo, ldo);
}

// O_i = diag(alpha) O_i + P_ij V_j over the first `rows` (rounded up to even) rows, Dp columns.
inline void pv(const float* P, const float* V, int64_t ldv, int64_t cols, const float* alpha,
               float* O, int64_t Dp, int64_t rows) {
  rows = (rows + 1) / 2 * 2;
  int64_t d = 0;
  for (; d + kDV * kW <= Dp; d += kDV * kW)
    pv_rows<kDV>(P, V + d, ldv, cols, alpha, O + d, Dp, rows);
  switch ((Dp - d) / kW) {
    case 3: pv_rows<3>(P, V + d, ldv, cols, alpha, O + d, Dp, rows); break;
    case 2: pv_rows<2>(P, V + d, ldv, cols, alpha, O + d, Dp, rows); break;
    case 1: pv_rows<1>(P, V + d, ldv, cols, alpha, O + d, Dp, rows); break;
    default: break;
  }
}

// Turns S_ij (cols x Br) into P_ij = exp(scale S_ij - m_new) in place and updates m, l; alpha
// gets exp(m_old - m_new) for rescaling O_i. scale > 0 (the engines whose scores come unscaled
// fold the scale in here for free). A query whose keys so far are all masked keeps m = -inf; it
// then subtracts 0 instead, so every exponent is -inf (giving 0), never NaN.
inline void online_softmax(float* S, int64_t cols, int64_t rows, float scale, float* m, float* l,
                           float* alpha) {
  for (int64_t nv = 0; nv * kW < rows; ++nv) {
    float* s = S + nv * kW;
    vf mx0 = splat(kNegInf), mx1 = mx0;  // two chains: the max's latency dominates otherwise
    int64_t c = 0;
    for (; c + 2 <= cols; c += 2) {
      mx0 = vmax(mx0, loadu(s + c * kBr));
      mx1 = vmax(mx1, loadu(s + (c + 1) * kBr));
    }
    if (c < cols) mx0 = vmax(mx0, loadu(s + c * kBr));
    const vf m_old = loadu(m + nv * kW);
    const vf m_new = vmax(m_old, vmax(mx0, mx1) * splat(scale));
    const vf m_use = m_new == splat(kNegInf) ? splat(0.0f) : m_new;
    const vf a = exp_neg(m_old - m_use), neg_m = -m_use, sc = splat(scale);
    vf sum0 = splat(0.0f), sum1 = sum0;
    for (c = 0; c + 2 <= cols; c += 2) {
      const vf p0 = exp_neg(fmadd(loadu(s + c * kBr), sc, neg_m));
      const vf p1 = exp_neg(fmadd(loadu(s + (c + 1) * kBr), sc, neg_m));
      storeu(s + c * kBr, p0);
      storeu(s + (c + 1) * kBr, p1);
      sum0 += p0;
      sum1 += p1;
    }
    if (c < cols) {
      const vf p0 = exp_neg(fmadd(loadu(s + c * kBr), sc, neg_m));
      storeu(s + c * kBr, p0);
      sum0 += p0;
    }
    storeu(l + nv * kW, fmadd(loadu(l + nv * kW), a, sum0 + sum1));
    storeu(m + nv * kW, m_new);
    storeu(alpha + nv * kW, a);
  }
}

// Widens rows x D elements (row stride ld) into dst (row stride ldd), zero-filling columns
// D .. ldd so that whole vectors can be read.
template <class Tag>
void widen_rows(const typename Tag::storage* src, int64_t ld, int64_t rows, int64_t D, float* dst,
                int64_t ldd) {
  for (int64_t c = 0; c < rows; ++c) {
    const auto* s = src + c * ld;
    float* o = dst + c * ldd;
    int64_t d = 0;
    for (; d + kW <= D; d += kW) storeu(o + d, Tag::load(s + d));
    for (; d < D; ++d) o[d] = Tag::to_float(s[d]);
    for (; d < ldd; ++d) o[d] = 0.0f;
  }
}

// Bytes per mask entry: bool, q's dtype (kAdditive) or fp32 (kAdditiveF32).
template <class Tag>
constexpr int64_t mask_elem_bytes(MaskKind kind) {
  return kind == MaskKind::kBool       ? 1
         : kind == MaskKind::kAdditive ? sizeof(typename Tag::storage)
                                       : 4;
}

// Calls f with the mask kind as a compile-time constant (std::integral_constant), for a mask
// tensor.
template <class F>
decltype(auto) with_mask_kind(MaskKind kind, F&& f) {
  switch (kind) {
    case MaskKind::kBool: return f(std::integral_constant<MaskKind, MaskKind::kBool>{});
    case MaskKind::kAdditive: return f(std::integral_constant<MaskKind, MaskKind::kAdditive>{});
    default: return f(std::integral_constant<MaskKind, MaskKind::kAdditiveF32>{});
  }
}

// kW mask entries of one query row from `m` on, as additive biases: the entry itself, -inf where
// it hides its key (bool false, or an additive value at or below kHidingMaskValue). NaN stays NaN.
template <class Tag, MaskKind kKind>
inline vf mask_biases(const uint8_t* m) {
  if constexpr (kKind == MaskKind::kBool) {
    return load_u8(m) != 0 ? splat(0.0f) : splat(kNegInf);
  } else {
    const vf value = kKind == MaskKind::kAdditive
                         ? Tag::load(reinterpret_cast<const typename Tag::storage*>(m))
                         : loadu(reinterpret_cast<const float*>(m));
    return value <= splat(kHidingMaskValue) ? splat(kNegInf) : value;
  }
}

// One mask entry at `m` as an additive bias, as mask_biases does for kW of them.
template <class Tag>
inline float mask_bias(const AttentionParams& p, const uint8_t* m) {
  if (p.mask_kind == MaskKind::kBool) return *m ? 0.0f : kNegInf;
  float value;
  if (p.mask_kind == MaskKind::kAdditive) {
    typename Tag::storage stored;
    std::memcpy(&stored, m, sizeof stored);
    value = Tag::to_float(stored);
  } else {
    std::memcpy(&value, m, sizeof value);
  }
  return mask_value_hides(value) ? kNegInf : value;
}

// S += bias lane-wise, -inf where the bias is -inf (a hidden key stays hidden whatever its score:
// NaN or +inf included, as add_mask_value).
inline vf add_biases(vf s, vf bias) {
  return bias == splat(kNegInf) ? splat(kNegInf) : s + bias;
}
inline void add_bias(float& s, float bias) {
  s = bias == kNegInf ? kNegInf : s + bias;
}

// The mask's entries for queries r0 .. r0+rows and keys c0 .. c0+cols added into S (key-major,
// queries in the lanes), for masks whose keys are contiguous (column stride 1, the layout of every
// mask a user builds) and whose rows differ. Mask rows run along the keys while S's vectors run
// along the queries, so kW x kW blocks are loaded row by row and transposed in registers
// (transpose_block); scalar, the strided pass cost more than the attention without a mask (bf16 on
// AMX: 2.4 ms -> 8.8 ms for 8 heads of 1024 x 1024, torch's 3.5 ms). Rows past `rows` read the last
// row again (their lanes are discarded); columns past the last whole block go scalar.
template <class Tag, MaskKind kKind>
void add_mask_rows_transposed(const AttentionParams& p, const uint8_t* base, int64_t rows,
                              int64_t cols, float* S) {
  constexpr int64_t elem_bytes = mask_elem_bytes<Tag>(kKind);
  const int64_t whole = cols / kW * kW;
  for (int64_t rb = 0; rb < rows; rb += kW) {
    for (int64_t cb = 0; cb < whole; cb += kW) {
      vf block[kW];
#pragma GCC unroll 16
      for (int i = 0; i < kW; ++i) {
        const int64_t r = min64(rb + i, rows - 1);
        block[i] = mask_biases<Tag, kKind>(base + (r * p.mask_row_stride + cb) * elem_bytes);
      }
      transpose_block(block);
#pragma GCC unroll 16
      for (int j = 0; j < kW; ++j) {
        float* s = S + (cb + j) * kBr + rb;
        storeu(s, add_biases(loadu(s), block[j]));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = base + r * p.mask_row_stride * elem_bytes;
    for (int64_t c = whole; c < cols; ++c)
      add_bias(S[c * kBr + r], mask_bias<Tag>(p, row + c * elem_bytes));
  }
}

// True when the mask hides every (query, key) pair of queries r0 .. r0+rows and keys c0 .. c0+cols
// (bool false or additive values at or below kHidingMaskValue): the tile is skipped, matmuls
// included, so the hidden half of a causal mask or a padded batch's padding costs nothing. Reads
// kW entries at a time and stops at the first visible row; scalar, the check of a hidden AMX tile
// took longer than computing it.
template <class Tag, MaskKind kKind>
bool mask_hides_tile_of(const AttentionParams& p, const uint8_t* base, int64_t rows, int64_t cols) {
  constexpr int64_t elem_bytes = mask_elem_bytes<Tag>(kKind);
  const int64_t rs = p.mask_row_stride, cs = p.mask_col_stride;
  const int64_t whole = cs == 1 ? cols / kW * kW : 0;
  for (int64_t r = 0; r < (rs == 0 ? 1 : rows); ++r) {
    const uint8_t* row = base + r * rs * elem_bytes;
    vi visible = vi{} != 0;  // all lanes false
    for (int64_t c = 0; c < whole; c += kW)
      visible |= mask_biases<Tag, kKind>(row + c * elem_bytes) != splat(kNegInf);
    for (int lane = 0; lane < kW; ++lane) {
      if (visible[lane]) return false;
    }
    for (int64_t c = whole; c < cols; ++c) {
      if (mask_bias<Tag>(p, row + c * cs * elem_bytes) != kNegInf) return false;
    }
  }
  return true;
}

// The mask's first entry for queries from r0 and keys from c0 of (b, h), as bytes.
template <class Tag>
const uint8_t* mask_tile_base(const AttentionParams& p, int64_t b, int64_t h, int64_t r0,
                              int64_t c0) {
  return static_cast<const uint8_t*>(p.mask) + (b * p.mask_batch_stride + h * p.mask_head_stride +
                                                r0 * p.mask_row_stride + c0 * p.mask_col_stride) *
                                                   mask_elem_bytes<Tag>(p.mask_kind);
}

template <class Tag>
bool mask_hides_tile(const AttentionParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                     int64_t c0, int64_t cols) {
  if (p.mask_kind == MaskKind::kNone) return false;
  const uint8_t* base = mask_tile_base<Tag>(p, b, h, r0, c0);
  return with_mask_kind(p.mask_kind, [&](auto kind) {
    return mask_hides_tile_of<Tag, decltype(kind)::value>(p, base, rows, cols);
  });
}

// Applies the soft cap, the mask and the window to S_ij (before the softmax) for queries
// r0 .. r0+rows and keys c0 .. c0+cols.
template <class Tag>
void transform_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                      int64_t c0, int64_t cols, bool window_interior, float* S) {
  if (p.softcap > 0) {
    const float cap = static_cast<float>(p.softcap), inv_cap = 1.0f / cap;
    for (int64_t i = 0; i < cols * kBr; ++i) S[i] = cap * tanhf(S[i] * inv_cap);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t elem_bytes = mask_elem_bytes<Tag>(p.mask_kind);
    const int64_t rs = p.mask_row_stride, cs = p.mask_col_stride;
    const uint8_t* base = mask_tile_base<Tag>(p, b, h, r0, c0);
    if (rs == 0) {
      // One mask row for every query (a key-padding mask): one bias per key, splat over the lanes.
      for (int64_t c = 0; c < cols; ++c) {
        const vf bias = splat(mask_bias<Tag>(p, base + c * cs * elem_bytes));
        float* s = S + c * kBr;
        for (int64_t i = 0; i < kBr; i += kW) storeu(s + i, add_biases(loadu(s + i), bias));
      }
    } else if (cs == 1) {
      with_mask_kind(p.mask_kind, [&](auto kind) {
        add_mask_rows_transposed<Tag, decltype(kind)::value>(p, base, rows, cols, S);
      });
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* row = base + r * rs * elem_bytes;
        for (int64_t c = 0; c < cols; ++c)
          add_bias(S[c * kBr + r], mask_bias<Tag>(p, row + c * cs * elem_bytes));
      }
    }
  }
  if (!window_interior) {
    // Key j sees queries i with j - off - wr <= i <= j - off + wl: one run of lanes per key.
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t j = c0 + c - p.diag_offset - r0;
      const int64_t lo = p.window_right >= 0 ? clamp64(j - p.window_right, 0, kBr) : 0;
      const int64_t hi = p.window_left >= 0 ? clamp64(j + p.window_left + 1, 0, kBr) : kBr;
      float* s = S + c * kBr;
      for (int64_t r = 0; r < kBr; ++r) {
        if (r < lo || r >= hi) s[r] = kNegInf;
      }
    }
  }
}

// The generic engine: fp32 register-blocked micro-kernels on widened tiles.
template <class Tag>
struct VecEngine {
  using T = typename Tag::storage;
  static constexpr bool kIsF32 = sizeof(T) == 4;

  static bool supports(const AttentionParams&) { return true; }
  static constexpr bool kScaledScores = true;  // the scale is in QT

  static void pack_q(const T* Q, int64_t ldq, int64_t rows, int64_t D, float scale, Workspace& ws) {
    if (rows <= kW) {  // scores_few_rows
      const int64_t Dp = (D + kW - 1) / kW * kW;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < Dp; ++d) {
          ws.Qr[r * Dp + d] = d < D ? Tag::to_float(Q[r * ldq + d]) * scale : 0.0f;
        }
      }
      return;
    }
    for (int64_t r = 0; r < kBr; ++r) {
      if (r < rows) {
        const T* q = Q + r * ldq;
        for (int64_t d = 0; d < D; ++d) ws.QT[d * kBr + r] = Tag::to_float(q[d]) * scale;
      } else {
        for (int64_t d = 0; d < D; ++d) ws.QT[d * kBr + r] = 0.0f;
      }
    }
  }

  // fp16/bf16 K and V of one (batch, kv head), all Nk rows, widened into ws.wide_kv (K then V,
  // row stride Dp) once per thread and head: widening each key block in every task repeated the
  // same conversion for each of the head's Nq / Br query blocks, 5-8% of the bf16 forward on AVX2
  // (Br = 16 then; measured in benchmarks/results/design/cpu-attention.md). Heads beyond
  // kWideKvMaxFloats keep the per-block widening.
  static constexpr int64_t kWideKvMaxFloats = int64_t(8) << 20;  // 32 MiB per thread
  static void bind_kv(const T* K, int64_t ldk, const T* V, int64_t ldv, int64_t Nk, int64_t D,
                      int64_t Dp, int64_t rows, Workspace& ws) {
    if constexpr (kIsF32) {
      return;
    } else {
      const int64_t floats = 2 * Nk * Dp;
      if (rows <= kW || floats > kWideKvMaxFloats || ldk <= 0 || ldv <= 0) {
        ws.wide_k = ws.wide_v = nullptr;
        return;
      }
      if (ws.wide_k == K && ws.wide_v == V) return;
      if (floats > ws.wide_kv_floats) {
        std::free(ws.wide_kv);
        ws.wide_kv = static_cast<float*>(std::aligned_alloc(64, (floats + 15) / 16 * 64));
        ws.wide_kv_floats = floats;
      }
      widen_rows<Tag>(K, ldk, Nk, D, ws.wide_kv, Dp);
      widen_rows<Tag>(V, ldv, Nk, D, ws.wide_kv + Nk * Dp, Dp);
      ws.wide_k = K, ws.wide_v = V;
      ws.wide_rows = Nk;
    }
  }
  // Row `first` of the widened copy of src (K or V bound by bind_kv), or null if none is bound.
  static const float* bound_rows(const Workspace& ws, const T* rows, int64_t ld, int64_t Dp,
                                 bool is_v) {
    const T* base = static_cast<const T*>(is_v ? ws.wide_v : ws.wide_k);
    if (base == nullptr) return nullptr;
    return ws.wide_kv + (is_v ? ws.wide_rows * Dp : 0) + (rows - base) / ld * Dp;
  }

  // fp32 K_j is read in place.
  static void scores(const T* K_j, int64_t ldk, int64_t cols, int64_t D, int64_t rows,
                     float /*scale: in QT*/, Workspace& ws) {
    if (rows <= kW) {
      scores_few_rows<Tag>(ws.Qr, (D + kW - 1) / kW * kW, K_j, ldk, D, cols, rows, ws.S);
    } else if constexpr (kIsF32) {
      ::flashmod::cpu::scores(ws.QT, reinterpret_cast<const float*>(K_j), ldk, D, cols, ws.S);
    } else if (const float* Kw = bound_rows(ws, K_j, ldk, (D + kW - 1) / kW * kW, false)) {
      ::flashmod::cpu::scores(ws.QT, Kw, (D + kW - 1) / kW * kW, D, cols, ws.S);
    } else {
      widen_rows<Tag>(K_j, ldk, cols, D, ws.K, D);
      ::flashmod::cpu::scores(ws.QT, ws.K, D, D, cols, ws.S);
    }
  }

  static void softmax(int64_t cols, int64_t rows, float scale, Workspace& ws) {
    online_softmax(ws.S, cols, rows, scale, ws.m, ws.l, ws.alpha);
  }

  // fp32 V_j is read in place when whole vectors of a row stay inside the row.
  static void pv(const T* V_j, int64_t ldv, int64_t /*kv_head*/, int64_t /*c0*/, int64_t cols,
                 int64_t D, int64_t Dp, int64_t rows, Workspace& ws) {
    if (kIsF32 && Dp == D) {
      ::flashmod::cpu::pv(ws.S, reinterpret_cast<const float*>(V_j), ldv, cols, ws.alpha, ws.O, Dp,
                          rows);
    } else if (const float* Vw = kIsF32 ? nullptr : bound_rows(ws, V_j, ldv, Dp, true)) {
      ::flashmod::cpu::pv(ws.S, Vw, Dp, cols, ws.alpha, ws.O, Dp, rows);
    } else {
      widen_rows<Tag>(V_j, ldv, cols, D, ws.V, Dp);
      ::flashmod::cpu::pv(ws.S, ws.V, Dp, cols, ws.alpha, ws.O, Dp, rows);
    }
  }

  // out rows r0 .. r0+rows = O_i / l.
  static void finalize(const Workspace& ws, T* out, int64_t ldo, int64_t rows, int64_t D,
                       int64_t Dp) {
    for (int64_t r = 0; r < rows; ++r) {
      const float l = ws.l[r];
      const bool empty = l == 0.0f;  // no visible key: out = 0; NaN l: NaN out (finish_lse)
      T* o = out + r * ldo;
      const float* acc = ws.O + r * Dp;
      if constexpr (kIsF32) {  // a division rounds once, a multiply by 1/l twice
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : acc[d] / l;
      } else {  // ... which fp16/bf16 rounding swamps, and divisions are slow
        const float inv_l = finish_inv_l(l);
        for (int64_t d = 0; d < D; ++d) o[d] = Tag::from_float(acc[d] * inv_l);
      }
    }
  }
};

// Dropout on P_ij (cols x Br, the softmax's layout) after the row sums took it
// (dropout_draws.h): query r0 + r keeps key c0 + c or gets 0. Vector units draw with the queries
// in the lanes, P's own layout; the baseline (4 lanes: scalar draws) a row of keys at a time.
inline void drop_probabilities(const DropoutState& d, int64_t bh, int64_t r0, int64_t rows,
                               int64_t c0, int64_t cols, float* S) {
  if constexpr (kW >= 8) {
    DropoutLanes<kW>::drop_query_lanes(d, bh, r0, rows, c0, cols, S, kBr);
  } else {
    uint8_t keep[kBc];
    for (int64_t r = 0; r < rows; ++r) {
      DropoutLanes<kW>::keep_row(d, bh, r0 + r, c0, cols, keep);
      for (int64_t c = 0; c < cols; ++c) S[c * kBr + r] = keep[c] ? S[c * kBr + r] * d.scale : 0.0f;
    }
  }
}

// One task: queries r0 .. r0+Br of one (batch, head) against all its visible keys.
template <class Tag, template <class> class Engine>
void run_task(const AttentionParams& p, int64_t task, Workspace& ws) {
  using T = typename Tag::storage;
  const int64_t D = p.head_dim, Dp = (D + kW - 1) / kW * kW;
  const int64_t Nq = p.seqlen_q, Nk = p.seqlen_k, off = p.diag_offset;
  const int64_t Tr = (Nq + kBr - 1) / kBr;
  const int64_t bh = task / Tr, t = task % Tr;
  // A thread runs a contiguous range of tasks; alternating early and late query blocks gives each
  // range a similar share of causal work.
  const int64_t i_block = t % 2 == 0 ? t / 2 : Tr - 1 - t / 2;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
  const int64_t r0 = i_block * kBr, rows = min64(kBr, Nq - r0);

  const T* Q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* K = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* V = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  T* O = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
  float* lse = p.lse + (b * p.heads_q + h) * Nq;

  const float scale = static_cast<float>(p.scale);
  Engine<Tag>::pack_q(Q + r0 * p.q_row_stride, p.q_row_stride, rows, D, scale, ws);
  for (int64_t r = 0; r < kBr; ++r) {
    ws.m[r] = kNegInf;
    ws.l[r] = 0.0f;
  }
  std::memset(ws.O, 0, sizeof(float) * kBr * Dp);
  Engine<Tag>::bind_kv(K, p.k_row_stride, V, p.v_row_stride, Nk, D, Dp, rows, ws);
  const DropoutState drop = p.dropout_rng != nullptr ? dropout_state(p) : DropoutState{};

  // Keys outside every row's window are never visited; blocks wholly inside it skip the test.
  const int64_t diag_first = r0 + off, diag_last = r0 + rows - 1 + off;
  const int64_t lo = p.window_left >= 0 ? max64(0, diag_first - p.window_left) : 0;
  const int64_t hi = p.window_right >= 0 ? min64(Nk, diag_last + p.window_right + 1) : Nk;
  for (int64_t c0 = lo; c0 < hi; c0 += kBc) {
    const int64_t cols = min64(kBc, hi - c0);
    if (mask_hides_tile<Tag>(p, b, h, r0, rows, c0, cols)) continue;
    Engine<Tag>::scores(K + c0 * p.k_row_stride, p.k_row_stride, cols, D, rows, scale, ws);
    const bool interior = (p.window_left < 0 || c0 >= diag_last - p.window_left) &&
                          (p.window_right < 0 || c0 + cols - 1 <= diag_first + p.window_right);
    // The soft cap and masks apply to scaled scores, and a scale <= 0 would flip the maximum:
    // then the scale is applied first, else the softmax folds it in.
    const float score_scale = Engine<Tag>::kScaledScores ? 1.0f : scale;
    if (p.softcap > 0 || p.mask_kind != MaskKind::kNone || !interior || !(score_scale > 0.0f)) {
      if (score_scale != 1.0f) {
        for (int64_t i = 0; i < cols * kBr; i += kW)
          storeu(ws.S + i, loadu(ws.S + i) * splat(scale));
      }
      transform_scores<Tag>(p, b, h, r0, rows, c0, cols, interior, ws.S);
      Engine<Tag>::softmax(cols, rows, 1.0f, ws);
    } else {
      Engine<Tag>::softmax(cols, rows, score_scale, ws);
    }
    if (p.dropout_rng != nullptr)
      drop_probabilities(drop, dropout_head_index(p, b, h), r0, rows, c0, cols, ws.S);
    Engine<Tag>::pv(V + c0 * p.v_row_stride, p.v_row_stride, b * p.heads_kv + hk, c0, cols, D, Dp,
                    rows, ws);
  }

  Engine<Tag>::finalize(ws, O + r0 * p.out_row_stride, p.out_row_stride, rows, D, Dp);
  for (int64_t r = 0; r < rows; ++r) {
    lse[r0 + r] = finish_lse(ws.m[r], ws.l[r]);
  }
}

// Runs tasks [begin, end); bf16 goes to BF16Engine where it supports the shape.
template <template <class> class BF16Engine>
void run_tasks_with(const AttentionParams& p, const void* shared, int64_t begin, int64_t end) {
  const int64_t Dp = (p.head_dim + kW - 1) / kW * kW;
  Workspace ws(p.head_dim, Dp);
  ws.shared = shared;
  ws.seqlen_k = p.seqlen_k;
  const bool bf16_engine = BF16Engine<BF16>::supports(p);
  for (int64_t task = begin; task < end; ++task) {
    switch (p.dtype) {
      case ScalarKind::kFloat32: run_task<F32, VecEngine>(p, task, ws); break;
      case ScalarKind::kBFloat16:
        if (bf16_engine) {
          run_task<BF16, BF16Engine>(p, task, ws);
        } else {
          run_task<BF16, VecEngine>(p, task, ws);
        }
        break;
      case ScalarKind::kFloat16: run_task<F16, VecEngine>(p, task, ws); break;
      case ScalarKind::kFloat64: break;  // the glue runs fp64 on its own path
    }
  }
}
