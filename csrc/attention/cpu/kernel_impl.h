// The CPU forward (FlashAttention's algorithm), written once over GCC vector extensions and
// compiled once per instruction set. Included by kernel_<isa>.cpp inside an anonymous namespace,
// after it defined:
//   kW                 lanes of one fp32 vector
//   vf, vi             vectors of kW floats / int32s
//   splat(s)           s in every lane
//   fmadd(a, b, c)     a * b + c, fused where the ISA has FMA
//   load_f16(p)        kW fp16 values at p widened to fp32
//   hsum(v)            the sum of v's lanes
//   kNV, kKB, kRB, kDV register tile shapes: Br = kNV * kW queries per task, kKB keys per
//                      score register block, kRB rows x kDV vectors per P V register block
//   kBc                keys per block
//
// Layout: the task owns Br = kNV * kW queries. Q_i is packed transposed (D x Br, pre-scaled), so
// S_ij is computed as K_j Q_i^T with the queries in the vector lanes: the row max, exp and row
// sum of the online softmax are then plain lane-wise vector operations (no horizontal
// reductions), and each K_j element is a broadcast operand. P V_j broadcasts P entries over rows
// of V_j. K_j and V_j are read in place for fp32 inputs and widened into fp32 tiles otherwise.
// Tasks with at most kW queries (decode) take dot products along D instead.
//
// run_task is the loop over key blocks; an engine (VecEngine here, AmxEngine in kernel_amx.cpp)
// supplies the packing of Q_i, S_ij, the softmax, P_ij V_j and the final division by l.

constexpr int64_t kBr = kNV * kW;
static_assert(kBr % 2 == 0, "the P V row tail works in pairs of rows");

constexpr float kNegInf = -__builtin_inff();

struct F32 {
  using storage = float;
  static float to_float(float x) { return x; }
  static float from_float(float x) { return x; }
  static vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
};

struct BF16 {
  using storage = uint16_t;
  static float to_float(uint16_t x) {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {  // round to nearest even, NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  static vf load(const uint16_t* p) {
    using vh = uint16_t __attribute__((vector_size(kW * 2)));
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
  }
};

struct F16 {
  using storage = uint16_t;
  static float to_float(uint16_t x) {
    _Float16 h;
    std::memcpy(&h, &x, 2);
    return float(h);
  }
  static uint16_t from_float(float f) {
    const _Float16 h = _Float16(f);
    uint16_t x;
    std::memcpy(&x, &h, 2);
    return x;
  }
  static vf load(const uint16_t* p) { return load_f16(p); }
};

inline vf loadu(const float* p) {
  return F32::load(p);
}
inline void storeu(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
inline vf vmax(vf a, vf b) {
  return a > b ? a : b;
}
inline int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t max64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return min64(max64(x, lo), hi);
}

// e^x for x <= 0 (or -inf), about 1 ulp. exp(-80) ~ 2e-35 is below fp32 resolution next to
// the row maximum's exp(0) = 1, so everything under -80 becomes an exact 0: masked scores (-inf)
// must contribute nothing, and the clamp keeps 2^n normal (no denormal stalls).
inline vf exp_neg(vf x) {
  const vf xc = vmax(x, splat(-80.0f));
  // n = round(x / ln 2) by the 1.5 * 2^23 trick; its low mantissa bits then hold n.
  const vf magic = splat(12582912.0f);
  const vf t = fmadd(xc, splat(1.44269504088896341f), magic);
  const vf n = t - magic;
  // Cody-Waite: r = x - n ln2 in two steps so r keeps full precision.
  vf r = fmadd(n, splat(-0.693145751953125f), xc);
  r = fmadd(n, splat(-1.428606765330187e-6f), r);
  // Taylor to r^7: the truncation error is < 6e-9 relative on |r| <= ln2 / 2.
  vf e = splat(1.0f / 5040);
  e = fmadd(e, r, splat(1.0f / 720));
  e = fmadd(e, r, splat(1.0f / 120));
  e = fmadd(e, r, splat(1.0f / 24));
  e = fmadd(e, r, splat(1.0f / 6));
  e = fmadd(e, r, splat(0.5f));
  e = fmadd(e, r, splat(1.0f));
  e = fmadd(e, r, splat(1.0f));
  const vi pow2n = (((vi)t - (vi)magic) + 127) << 23;
  const vf y = e * (vf)pow2n;
  return x < splat(-80.0f) ? splat(0.0f) : y;
}

// Per-thread buffers, 64-byte aligned, sized for one task. The layouts are the vector engine's;
// the AMX engine (kernel_amx.cpp) reuses the same slots with the layouts it documents.
struct Workspace {
  float* QT;                     // D x Br: Q_i^T * scale
  float* S;                      // Bc x Br: S_ij, then P_ij, key-major
  float* O;                      // Br x Dp: unnormalized output accumulator
  float* K;                      // Bc x D: K_j widened to fp32 (fp16/bf16 inputs)
  float* V;                      // Bc x Dp: V_j widened to fp32 and zero-padded to whole vectors
  float* alpha;                  // Br: exp(m_old - m_new) of the last key block
  float* m;                      // Br: running max of the scaled scores
  float* l;                      // Br: running sum of exp(score - m)
  float* Pb;                     // Br x Bc bf16: P_ij for the AMX engine
  float* Qr;                     // kW x Dp: Q_i * scale row-major, for at most kW queries
  const void* shared = nullptr;  // KernelInfo::prepare's output
  int64_t seqlen_k = 0;
  void* base;

  Workspace(int64_t D, int64_t Dp) {
    const int64_t sizes[] = {D * kBr, kBc * kBr, kBr * Dp, kBc * D,       kBc * Dp,
                             kBr,     kBr,       kBr,      kBr * kBc / 2, kW * Dp};
    static_assert(sizeof(sizes) / sizeof(sizes[0]) == 10, "one size per slot");
    int64_t total = 0;
    for (int64_t s : sizes) total += (s + 15) / 16 * 16;
    base = std::aligned_alloc(64, total * sizeof(float));
    float* cursor = static_cast<float*>(base);
    float** slots[] = {&QT, &S, &O, &K, &V, &alpha, &m, &l, &Pb, &Qr};
    for (int i = 0; i < 10; ++i) {
      *slots[i] = cursor;
      cursor += (sizes[i] + 15) / 16 * 16;
    }
  }
  ~Workspace() { std::free(base); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

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
  for (; r < rows; r += 2) pv_block<2, DV>(P + r, V, ldv, cols, alpha + r, O + r * ldo, ldo);
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
    const int64_t base = b * p.mask_batch_stride + h * p.mask_head_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = base + (r0 + r) * p.mask_row_stride + c0 * p.mask_col_stride;
      const int64_t cs = p.mask_col_stride;
      float* s = S + r;
      if (p.mask_kind == MaskKind::kBool) {
        const auto* mk = static_cast<const uint8_t*>(p.mask) + row;
        for (int64_t c = 0; c < cols; ++c) {
          if (!mk[c * cs]) s[c * kBr] = kNegInf;
        }
      } else if (p.mask_kind == MaskKind::kAdditive) {
        const auto* mk = static_cast<const typename Tag::storage*>(p.mask) + row;
        for (int64_t c = 0; c < cols; ++c) s[c * kBr] += Tag::to_float(mk[c * cs]);
      } else {
        const auto* mk = static_cast<const float*>(p.mask) + row;
        for (int64_t c = 0; c < cols; ++c) s[c * kBr] += mk[c * cs];
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

  // fp32 K_j is read in place.
  static void scores(const T* K_j, int64_t ldk, int64_t cols, int64_t D, int64_t rows,
                     float /*scale: in QT*/, Workspace& ws) {
    if (rows <= kW) {
      scores_few_rows<Tag>(ws.Qr, (D + kW - 1) / kW * kW, K_j, ldk, D, cols, rows, ws.S);
    } else if constexpr (kIsF32) {
      ::flashmod::cpu::scores(ws.QT, reinterpret_cast<const float*>(K_j), ldk, D, cols, ws.S);
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
      const bool empty = !(l > 0.0f);  // no visible key: out = 0
      T* o = out + r * ldo;
      const float* acc = ws.O + r * Dp;
      if constexpr (kIsF32) {  // a division rounds once, a multiply by 1/l twice
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : acc[d] / l;
      } else {  // ... which fp16/bf16 rounding swamps, and divisions are slow
        const float inv_l = empty ? 0.0f : 1.0f / l;
        for (int64_t d = 0; d < D; ++d) o[d] = Tag::from_float(acc[d] * inv_l);
      }
    }
  }
};

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

  // Keys outside every row's window are never visited; blocks wholly inside it skip the test.
  const int64_t diag_first = r0 + off, diag_last = r0 + rows - 1 + off;
  const int64_t lo = p.window_left >= 0 ? max64(0, diag_first - p.window_left) : 0;
  const int64_t hi = p.window_right >= 0 ? min64(Nk, diag_last + p.window_right + 1) : Nk;
  for (int64_t c0 = lo; c0 < hi; c0 += kBc) {
    const int64_t cols = min64(kBc, hi - c0);
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
    Engine<Tag>::pv(V + c0 * p.v_row_stride, p.v_row_stride, b * p.heads_kv + hk, c0, cols, D, Dp,
                    rows, ws);
  }

  Engine<Tag>::finalize(ws, O + r0 * p.out_row_stride, p.out_row_stride, rows, D, Dp);
  for (int64_t r = 0; r < rows; ++r) {
    const float l = ws.l[r];
    lse[r0 + r] = l > 0.0f ? ws.m[r] + logf(l) : kNegInf;  // no visible key: -inf
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

// ---------------------------------------------------------------------------------------------
// Decode: few queries (KernelInfo::decode_rows and below). A task is up to kDecRows query rows of
// one (batch, kv head): every query head of the GQA group and every query position, so K_j and V_j
// are read once per group. Scores are row-major (keys in the lanes), so the softmax runs on whole
// vectors; P V broadcasts one P entry per (row, key) and reads V rows widened in registers. The
// visible key range may be cut into `splits` parts run as separate tasks: each leaves an
// unnormalized (O, m, l) that decode_merge combines in split order (deterministic).

constexpr int64_t kDecRows = kDecodeRows;
constexpr int64_t kDecBc = 256;  // keys per block

struct DecodeLayout {
  int64_t rows_total, chunks, lo, hi, split_len;
};

inline DecodeLayout decode_layout(const AttentionParams& p, int64_t splits) {
  DecodeLayout L;
  L.rows_total = (p.heads_q / p.heads_kv) * p.seqlen_q;
  L.chunks = (L.rows_total + kDecRows - 1) / kDecRows;
  const int64_t Nk = p.seqlen_k, off = p.diag_offset;
  L.lo = p.window_left >= 0 ? clamp64(off - p.window_left, 0, Nk) : 0;
  L.hi = p.window_right >= 0 ? clamp64(p.seqlen_q - 1 + off + p.window_right + 1, 0, Nk) : Nk;
  if (L.hi < L.lo) L.hi = L.lo;
  const int64_t n = L.hi - L.lo;
  L.split_len = (n + splits - 1) / splits;
  L.split_len = (L.split_len + kW - 1) / kW * kW;
  if (L.split_len == 0) L.split_len = kW;
  return L;
}

// acc[r][0..DV) += sum_c P[r][c] V_c over `cols` keys; then O_r = alpha_r O_r + acc_r.
template <class Tag, int R, int DV>
inline void decode_pv_block(const float* P, const typename Tag::storage* V, int64_t ldv,
                            int64_t cols, const float* alpha, float* O, int64_t ldo) {
  vf acc[R][DV] = {};
  for (int64_t c = 0; c < cols; ++c) {
    vf pr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pr[r] = splat(P[r * kDecBc + c]);
#pragma GCC unroll 8
    for (int dv = 0; dv < DV; ++dv) {
      const vf v = Tag::load(V + c * ldv + dv * kW);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][dv] = fmadd(pr[r], v, acc[r][dv]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const vf a = splat(alpha[r]);
#pragma GCC unroll 8
    for (int dv = 0; dv < DV; ++dv) {
      float* o = O + r * ldo + dv * kW;
      storeu(o, fmadd(loadu(o), a, acc[r][dv]));
    }
  }
}

template <class Tag, int R>
inline void decode_pv_rows(const float* P, const typename Tag::storage* V, int64_t ldv,
                           int64_t cols, const float* alpha, float* O, int64_t D) {
  constexpr int kDVd = R <= 2 ? 8 : 4;
  int64_t d = 0;
  for (; d + kDVd * kW <= D; d += kDVd * kW)
    decode_pv_block<Tag, R, kDVd>(P, V + d, ldv, cols, alpha, O + d, D);
  for (; d + 2 * kW <= D; d += 2 * kW)
    decode_pv_block<Tag, R, 2>(P, V + d, ldv, cols, alpha, O + d, D);
  for (; d < D; d += kW) decode_pv_block<Tag, R, 1>(P, V + d, ldv, cols, alpha, O + d, D);
}

// Decode tasks [begin, end) of batch * heads_kv * chunks * splits (split fastest). With splits >
// 1, `partial` receives per task kDecRows x (D + 2) floats: O unnormalized, then m, then l.
template <class Tag>
void decode_tasks(const AttentionParams& p, int64_t splits, float* partial, int64_t begin,
                  int64_t end) {
  using T = typename Tag::storage;
  const int64_t D = p.head_dim, Nq = p.seqlen_q, group = p.heads_q / p.heads_kv;
  const DecodeLayout L = decode_layout(p, splits);
  const float scale = static_cast<float>(p.scale);
  void* mem = std::aligned_alloc(64, sizeof(float) * (kDecRows * (kDecBc + 2 * D + 8)));
  float* S = static_cast<float*>(mem);  // kDecRows x kDecBc
  float* Qs = S + kDecRows * kDecBc;    // kDecRows x D, scaled
  float* O = Qs + kDecRows * D;         // kDecRows x D
  float m[kDecRows], l[kDecRows], alpha[kDecRows];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t split = task % splits, chunk = (task / splits) % L.chunks;
    const int64_t bk = task / (splits * L.chunks), b = bk / p.heads_kv, hk = bk % p.heads_kv;
    const int64_t rr0 = chunk * kDecRows, rows = min64(kDecRows, L.rows_total - rr0);
    const T* K = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
    const T* V = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
    int64_t hs[kDecRows], is[kDecRows];
    int64_t row_lo = L.hi, row_hi = L.lo;  // union of the rows' windows
    for (int64_t r = 0; r < rows; ++r) {
      hs[r] = hk * group + (rr0 + r) / Nq;
      is[r] = (rr0 + r) % Nq;
      const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + hs[r] * p.q_head_stride +
                   is[r] * p.q_row_stride;
      for (int64_t d = 0; d < D; ++d) Qs[r * D + d] = Tag::to_float(q[d]) * scale;
      m[r] = kNegInf;
      l[r] = 0.0f;
      const int64_t diag = is[r] + p.diag_offset;
      row_lo = min64(row_lo, p.window_left >= 0 ? max64(L.lo, diag - p.window_left) : L.lo);
      row_hi = max64(row_hi, p.window_right >= 0 ? min64(L.hi, diag + p.window_right + 1) : L.hi);
    }
    std::memset(O, 0, sizeof(float) * kDecRows * D);
    const int64_t s_lo = max64(row_lo, L.lo + split * L.split_len);
    const int64_t s_hi = min64(row_hi, L.lo + (split + 1) * L.split_len);
    const bool plain = p.softcap <= 0 && p.mask_kind == MaskKind::kNone;
    for (int64_t c0 = s_lo; c0 < s_hi; c0 += kDecBc) {
      const int64_t cols = min64(kDecBc, s_hi - c0), colsp = (cols + kW - 1) / kW * kW;
      // Scores.
      for (int64_t c = 0; c < cols; ++c) {
        const T* k = K + (c0 + c) * p.k_row_stride;
        for (int64_t r = 0; r < rows; ++r) {
          const float* q = Qs + r * D;
          vf acc0 = splat(0.0f), acc1 = acc0;
          int64_t d = 0;
          for (; d + 2 * kW <= D; d += 2 * kW) {
            acc0 = fmadd(Tag::load(k + d), loadu(q + d), acc0);
            acc1 = fmadd(Tag::load(k + d + kW), loadu(q + d + kW), acc1);
          }
          if (d < D) acc0 = fmadd(Tag::load(k + d), loadu(q + d), acc0);
          S[r * kDecBc + c] = hsum(acc0 + acc1);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = S + r * kDecBc;
        for (int64_t c = cols; c < colsp; ++c) s[c] = kNegInf;
        if (!plain) {
          if (p.softcap > 0) {
            const float cap = static_cast<float>(p.softcap), inv_cap = 1.0f / cap;
            for (int64_t c = 0; c < cols; ++c) s[c] = cap * tanhf(s[c] * inv_cap);
          }
          if (p.mask_kind != MaskKind::kNone) {
            const int64_t cs = p.mask_col_stride;
            const int64_t base = b * p.mask_batch_stride + hs[r] * p.mask_head_stride +
                                 is[r] * p.mask_row_stride + c0 * cs;
            if (p.mask_kind == MaskKind::kBool) {
              const auto* mk = static_cast<const uint8_t*>(p.mask) + base;
              for (int64_t c = 0; c < cols; ++c) {
                if (!mk[c * cs]) s[c] = kNegInf;
              }
            } else if (p.mask_kind == MaskKind::kAdditive) {
              const auto* mk = static_cast<const T*>(p.mask) + base;
              for (int64_t c = 0; c < cols; ++c) s[c] += Tag::to_float(mk[c * cs]);
            } else {
              const auto* mk = static_cast<const float*>(p.mask) + base;
              for (int64_t c = 0; c < cols; ++c) s[c] += mk[c * cs];
            }
          }
        }
        const int64_t diag = is[r] + p.diag_offset;
        if (p.window_left >= 0) {
          for (int64_t c = 0; c < cols && c0 + c < diag - p.window_left; ++c) s[c] = kNegInf;
        }
        if (p.window_right >= 0) {
          for (int64_t c = max64(0, diag + p.window_right + 1 - c0); c < cols; ++c) s[c] = kNegInf;
        }
        // Online softmax over whole vectors of keys.
        vf mx0 = splat(kNegInf), mx1 = mx0;
        int64_t c = 0;
        for (; c + 2 * kW <= colsp; c += 2 * kW) {
          mx0 = vmax(mx0, loadu(s + c));
          mx1 = vmax(mx1, loadu(s + c + kW));
        }
        if (c < colsp) mx0 = vmax(mx0, loadu(s + c));
        mx0 = vmax(mx0, mx1);
        float bm = mx0[0];
        for (int i = 1; i < kW; ++i) bm = bm > mx0[i] ? bm : mx0[i];
        const float m_new = m[r] > bm ? m[r] : bm;
        const float m_use = m_new == kNegInf ? 0.0f : m_new;
        const vf neg_m = splat(-m_use);
        vf sum0 = splat(0.0f), sum1 = sum0;
        for (c = 0; c + 2 * kW <= colsp; c += 2 * kW) {
          const vf p0 = exp_neg(loadu(s + c) + neg_m), p1 = exp_neg(loadu(s + c + kW) + neg_m);
          storeu(s + c, p0);
          storeu(s + c + kW, p1);
          sum0 += p0;
          sum1 += p1;
        }
        if (c < colsp) {
          const vf p0 = exp_neg(loadu(s + c) + neg_m);
          storeu(s + c, p0);
          sum0 += p0;
        }
        const float a = exp_neg(splat(m[r] - m_use))[0];
        l[r] = l[r] * a + hsum(sum0 + sum1);
        m[r] = m_new;
        alpha[r] = a;
      }
      // P V.
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        decode_pv_rows<Tag, 4>(S + r * kDecBc, V + c0 * p.v_row_stride, p.v_row_stride, cols,
                               alpha + r, O + r * D, D);
      }
      for (; r + 2 <= rows; r += 2) {
        decode_pv_rows<Tag, 2>(S + r * kDecBc, V + c0 * p.v_row_stride, p.v_row_stride, cols,
                               alpha + r, O + r * D, D);
      }
      if (r < rows) {
        decode_pv_rows<Tag, 1>(S + r * kDecBc, V + c0 * p.v_row_stride, p.v_row_stride, cols,
                               alpha + r, O + r * D, D);
      }
    }
    if (splits > 1) {
      float* part = partial + task * kDecRows * (D + 2);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(part + r * (D + 2), O + r * D, sizeof(float) * D);
        part[r * (D + 2) + D] = m[r];
        part[r * (D + 2) + D + 1] = l[r];
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* o = static_cast<T*>(p.out) + b * p.out_batch_stride + hs[r] * p.out_head_stride +
             is[r] * p.out_row_stride;
      const bool empty = !(l[r] > 0.0f);
      if constexpr (sizeof(T) == 4) {
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : O[r * D + d] / l[r];
      } else {
        const float inv_l = empty ? 0.0f : 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) o[d] = Tag::from_float(O[r * D + d] * inv_l);
      }
      p.lse[(b * p.heads_q + hs[r]) * Nq + is[r]] = empty ? kNegInf : m[r] + logf(l[r]);
    }
  }
  std::free(mem);
}

// Combines the splits of decode chunks [begin, end) of batch * heads_kv * chunks, in split order.
template <class Tag>
void decode_merge_chunks(const AttentionParams& p, int64_t splits, const float* partial,
                         int64_t begin, int64_t end) {
  using T = typename Tag::storage;
  const int64_t D = p.head_dim, Nq = p.seqlen_q, group = p.heads_q / p.heads_kv;
  const DecodeLayout L = decode_layout(p, splits);
  float* acc = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * ((D + 15) / 16 * 16)));
  for (int64_t ct = begin; ct < end; ++ct) {
    const int64_t chunk = ct % L.chunks, bk = ct / L.chunks;
    const int64_t b = bk / p.heads_kv, hk = bk % p.heads_kv;
    const int64_t rr0 = chunk * kDecRows, rows = min64(kDecRows, L.rows_total - rr0);
    const float* part0 = partial + ct * splits * kDecRows * (D + 2);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = hk * group + (rr0 + r) / Nq, i = (rr0 + r) % Nq;
      float M = kNegInf;
      for (int64_t s = 0; s < splits; ++s) {
        const float ms = part0[(s * kDecRows + r) * (D + 2) + D];
        M = M > ms ? M : ms;
      }
      const float m_use = M == kNegInf ? 0.0f : M;
      float Lsum = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        const float* ps = part0 + (s * kDecRows + r) * (D + 2);
        const float w = exp_neg(splat(ps[D] - m_use))[0];
        Lsum += w * ps[D + 1];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * ps[d];
      }
      T* o = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
             i * p.out_row_stride;
      const bool empty = !(Lsum > 0.0f);
      if constexpr (sizeof(T) == 4) {
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : acc[d] / Lsum;
      } else {
        const float inv_l = empty ? 0.0f : 1.0f / Lsum;
        for (int64_t d = 0; d < D; ++d) o[d] = Tag::from_float(acc[d] * inv_l);
      }
      p.lse[(b * p.heads_q + h) * Nq + i] = empty ? kNegInf : M + logf(Lsum);
    }
  }
  std::free(acc);
}

void decode_run(const AttentionParams& p, int64_t splits, float* partial, int64_t begin,
                int64_t end) {
  switch (p.dtype) {
    case ScalarKind::kFloat32: decode_tasks<F32>(p, splits, partial, begin, end); break;
    case ScalarKind::kBFloat16: decode_tasks<BF16>(p, splits, partial, begin, end); break;
    case ScalarKind::kFloat16: decode_tasks<F16>(p, splits, partial, begin, end); break;
    case ScalarKind::kFloat64: break;
  }
}

void decode_merge(const AttentionParams& p, int64_t splits, const float* partial, int64_t begin,
                  int64_t end) {
  switch (p.dtype) {
    case ScalarKind::kFloat32: decode_merge_chunks<F32>(p, splits, partial, begin, end); break;
    case ScalarKind::kBFloat16: decode_merge_chunks<BF16>(p, splits, partial, begin, end); break;
    case ScalarKind::kFloat16: decode_merge_chunks<F16>(p, splits, partial, begin, end); break;
    case ScalarKind::kFloat64: break;
  }
}
