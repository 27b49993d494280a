// The decode engine (few queries per head). Included by kernel_<isa>.cpp after engine_common.h.

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

// 16-bit bf16 rows are read 2 kW values (kW 32-bit lanes) at a time: each lane's low half shifted
// up is its even value as a float, its high half masked is the odd one. That is two integer
// instructions for 2 kW values, where widening kW at a time takes a shuffle and a shift per kW
// (on AVX2 the shifts share the two FMA ports). The values come out deinterleaved (the evens,
// then the odds, of each 2 kW block), so for bf16 the decode holds q and O in that order and
// restores D's order where a row leaves the task (pair_pos). A last lone kW block of D is read
// as it is. fp32 and fp16 read two plain vectors: their order and arithmetic are unchanged.
template <class Tag>
constexpr bool kSplitPairs = std::is_same_v<Tag, BF16>;

template <class Tag>
inline void load_pair(const typename Tag::storage* p, vf& a, vf& b) {
  if constexpr (kSplitPairs<Tag>) {
    vi u;
    std::memcpy(&u, p, sizeof u);
    a = (vf)(u << 16);
    b = (vf)(u & int32_t(-65536));
  } else {
    a = Tag::load(p);
    b = Tag::load(p + kW);
  }
}

// Where element d of a D-vector sits in the order load_pair produces.
template <class Tag>
inline int64_t pair_pos(int64_t d, int64_t D) {
  const int64_t blk = d / (2 * kW) * (2 * kW), i = d - blk;
  if (!kSplitPairs<Tag> || blk + 2 * kW > D) return d;
  return blk + (i & 1) * kW + i / 2;
}

// Where a key block's K or V rows are: equally strided (contiguous caches), or one pointer per row
// (a paged cache's rows, resolved through its block table once per block). Row j of the block is
// rows[j]; the kernels below read through either with the same arithmetic, so a paged cache gives
// the contiguous one's results bit for bit.
template <class T>
struct StridedRows {
  const T* base;
  int64_t ld;
  const T* operator[](int64_t j) const { return base + j * ld; }
  StridedRows from(int64_t j) const { return {base + j * ld, ld}; }
};
template <class T>
struct PointerRows {
  const T* const* ptrs;
  const T* operator[](int64_t j) const { return ptrs[j]; }
  PointerRows from(int64_t j) const { return {ptrs + j}; }
};

// acc[r][0..DV) += sum_c P[r][c] V_c[col0..] over `cols` keys; then O_r = alpha_r O_r + acc_r.
template <class Tag, int R, int DV, class Rows>
inline void decode_pv_block(const float* P, const Rows& V, int64_t col0, int64_t cols,
                            const float* alpha, float* O, int64_t ldo) {
  vf acc[R][DV] = {};
  for (int64_t c = 0; c < cols; ++c) {
    vf pr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pr[r] = splat(P[r * kDecBc + c]);
    if constexpr (kSplitPairs<Tag>) {
#pragma GCC unroll 8
      for (int dv = 0; dv + 1 < DV; dv += 2) {
        vf v0, v1;
        load_pair<Tag>(V[c] + col0 + dv * kW, v0, v1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][dv] = fmadd(pr[r], v0, acc[r][dv]);
          acc[r][dv + 1] = fmadd(pr[r], v1, acc[r][dv + 1]);
        }
      }
      if constexpr (DV % 2 == 1) {  // the lone last kW block of D (pair_pos leaves it in order)
        const vf v = Tag::load(V[c] + col0 + (DV - 1) * kW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][DV - 1] = fmadd(pr[r], v, acc[r][DV - 1]);
      }
    } else {
#pragma GCC unroll 8
      for (int dv = 0; dv < DV; ++dv) {
        const vf v = Tag::load(V[c] + col0 + dv * kW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][dv] = fmadd(pr[r], v, acc[r][dv]);
      }
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

template <class Tag, int R, class Rows>
inline void decode_pv_rows(const float* P, const Rows& V, int64_t cols, const float* alpha,
                           float* O, int64_t D) {
  // bf16 (V read in pairs): R x kDVd accumulators beside R broadcasts and a pair of V vectors, 16
  // in AVX-512's 32 registers, 8 in the 16 of AVX2 and SSE (16 spilled there). fp32 and fp16 keep
  // the block they had (8 or 4 vectors a row): with the pair loop and that block fp32 GQA lost
  // 5-15 % on AVX2, and with the pair loop and the smaller block fp32 Nq 4 lost 7 %.
  constexpr int kAcc = kW == 16 ? 16 : 8;
  constexpr int kDVd = kSplitPairs<Tag> ? (kAcc / R < 8 ? kAcc / R : 8) : (R <= 2 ? 8 : 4);
  static_assert(!kSplitPairs<Tag> || kDVd % 2 == 0, "whole pairs, so blocks keep pair_pos's order");
  int64_t d = 0;
  for (; d + kDVd * kW <= D; d += kDVd * kW)
    decode_pv_block<Tag, R, kDVd>(P, V, d, cols, alpha, O + d, D);
  for (; d + 2 * kW <= D; d += 2 * kW) decode_pv_block<Tag, R, 2>(P, V, d, cols, alpha, O + d, D);
  for (; d < D; d += kW) decode_pv_block<Tag, R, 1>(P, V, d, cols, alpha, O + d, D);
}

// q . k over D (a multiple of kW), k in Tag's storage, q in load_pair's order: two accumulators,
// then one horizontal sum.
template <class Tag>
inline float dot_row(const typename Tag::storage* k, const float* q, int64_t D) {
  vf acc0 = splat(0.0f), acc1 = acc0;
  int64_t d = 0;
  for (; d + 2 * kW <= D; d += 2 * kW) {
    vf k0, k1;
    load_pair<Tag>(k + d, k0, k1);
    acc0 = fmadd(k0, loadu(q + d), acc0);
    acc1 = fmadd(k1, loadu(q + d + kW), acc1);
  }
  if (d < D) acc0 = fmadd(Tag::load(k + d), loadu(q + d), acc0);
  return hsum(acc0 + acc1);
}

// The scores of kW key rows (k[0..kW)) against q (in load_pair's order): one
// accumulator per key, then the kW accumulators folded lane into lane (fold_lanes), so the kW
// horizontal sums share their shuffles: 3 (kW - 1) instructions instead of kW reductions of
// log2(kW) shuffles and adds each. Lane j of the result is key j's score.
template <class Tag, class Rows>
inline vf dot_keys(const Rows& k, const float* q, int64_t D) {
  vf acc[kW];
#pragma GCC unroll 16
  for (int j = 0; j < kW; ++j) acc[j] = splat(0.0f);
  int64_t d = 0;
  for (; d + 2 * kW <= D; d += 2 * kW) {
    const vf q0 = loadu(q + d), q1 = loadu(q + d + kW);
#pragma GCC unroll 16
    for (int j = 0; j < kW; ++j) {
      vf k0, k1;
      load_pair<Tag>(k[j] + d, k0, k1);
      acc[j] = fmadd(k1, q1, fmadd(k0, q0, acc[j]));
    }
  }
  if (d < D) {
    const vf q0 = loadu(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < kW; ++j) acc[j] = fmadd(Tag::load(k[j] + d), q0, acc[j]);
  }
  return fold_lanes(acc);
}

// kW key rows (k[0..kW)) widened to floats into buf, kW x D (D a multiple of kW), in load_pair's
// order.
template <class Tag, class Rows>
inline void widen_keys(const Rows& k, int64_t D, float* buf) {
  for (int j = 0; j < kW; ++j) {
    int64_t d = 0;
    for (; d + 2 * kW <= D; d += 2 * kW) {
      vf k0, k1;
      load_pair<Tag>(k[j] + d, k0, k1);
      storeu(buf + j * D + d, k0);
      storeu(buf + j * D + d + kW, k1);
    }
    if (d < D) storeu(buf + j * D + d, Tag::load(k[j] + d));
  }
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
  // Paged K/V (a sequence view with a block table, serve_cpu.cpp): each key block's rows are
  // looked up once into k_ptrs / v_ptrs.
  const bool paged = p.block_table != nullptr;
  // (Rounded to 64 bytes, so the pointer arrays after the floats are aligned.)
  const size_t floats = (kDecRows * (kDecBc + 2 * D + 8) + kW * D + 15) / 16 * 16;
  void* mem = std::aligned_alloc(64, sizeof(float) * floats + 2 * kDecBc * sizeof(const T*));
  float* S = static_cast<float*>(mem);  // kDecRows x kDecBc
  float* Qs = S + kDecRows * kDecBc;    // kDecRows x D, scaled
  float* O = Qs + kDecRows * D;         // kDecRows x D
  float* Kf = O + kDecRows * D;         // kW x D: kW 16-bit key rows widened
  const T** k_ptrs = reinterpret_cast<const T**>(static_cast<float*>(mem) + floats);
  const T** v_ptrs = k_ptrs + kDecBc;
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
      for (int64_t d = 0; d < D; ++d) Qs[r * D + pair_pos<Tag>(d, D)] = Tag::to_float(q[d]) * scale;
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
      // One key block, its K and V rows read through krows / vrows (StridedRows or PointerRows).
      // Inlined into both calls: as a called function the contiguous cache's step ran 1-3 %
      // longer on AVX2 (bf16, 1k keys; this machine's A/B, session 35).
      auto block = [&](const auto& krows, const auto& vrows) __attribute__((always_inline)) {
        // Scores, kW keys at a time (dot_keys), the last cols % kW one by one. With several rows
        // 16-bit key rows are widened once for all of them (widened per row, their conversions
        // outnumbered the products); a lone row reads them as they are (the round trip through Kf
        // cost it 5-10 %).
        const int64_t whole = cols / kW * kW;
        const bool widen = sizeof(T) == 2 && rows > 1;
        for (int64_t c = 0; c < whole; c += kW) {
          if (widen) {
            widen_keys<Tag>(krows.from(c), D, Kf);
            for (int64_t r = 0; r < rows; ++r)
              storeu(S + r * kDecBc + c, dot_keys<F32>(StridedRows<float>{Kf, D}, Qs + r * D, D));
          } else {
            for (int64_t r = 0; r < rows; ++r)
              storeu(S + r * kDecBc + c, dot_keys<Tag>(krows.from(c), Qs + r * D, D));
          }
        }
        for (int64_t c = whole; c < cols; ++c) {
          for (int64_t r = 0; r < rows; ++r)
            S[r * kDecBc + c] = dot_row<Tag>(krows[c], Qs + r * D, D);
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
                for (int64_t c = 0; c < cols; ++c) add_mask_value(s[c], Tag::to_float(mk[c * cs]));
              } else {
                const auto* mk = static_cast<const float*>(p.mask) + base;
                for (int64_t c = 0; c < cols; ++c) add_mask_value(s[c], mk[c * cs]);
              }
            }
          }
          const int64_t diag = is[r] + p.diag_offset;
          if (p.window_left >= 0) {
            for (int64_t c = 0; c < cols && c0 + c < diag - p.window_left; ++c) s[c] = kNegInf;
          }
          if (p.window_right >= 0) {
            for (int64_t c = max64(0, diag + p.window_right + 1 - c0); c < cols; ++c)
              s[c] = kNegInf;
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
          decode_pv_rows<Tag, 4>(S + r * kDecBc, vrows, cols, alpha + r, O + r * D, D);
        }
        for (; r + 2 <= rows; r += 2) {
          decode_pv_rows<Tag, 2>(S + r * kDecBc, vrows, cols, alpha + r, O + r * D, D);
        }
        if (r < rows) {
          decode_pv_rows<Tag, 1>(S + r * kDecBc, vrows, cols, alpha + r, O + r * D, D);
        }
      };
      if (paged) {  // the block table row of this sequence view (sequence_view.h)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t j = c0 + c, page_idx = j / p.page_size;
          const int64_t page = p.block_table[page_idx], in_page = j - page_idx * p.page_size;
          k_ptrs[c] = K + page * p.k_page_stride + in_page * p.k_row_stride;
          v_ptrs[c] = V + page * p.v_page_stride + in_page * p.v_row_stride;
        }
        block(PointerRows<T>{k_ptrs}, PointerRows<T>{v_ptrs});
      } else {
        block(StridedRows<T>{K + c0 * p.k_row_stride, p.k_row_stride},
              StridedRows<T>{V + c0 * p.v_row_stride, p.v_row_stride});
      }
    }
    if (splits > 1) {
      float* part = partial + task * kDecRows * (D + 2);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) part[r * (D + 2) + d] = O[r * D + pair_pos<Tag>(d, D)];
        part[r * (D + 2) + D] = m[r];
        part[r * (D + 2) + D + 1] = l[r];
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* o = static_cast<T*>(p.out) + b * p.out_batch_stride + hs[r] * p.out_head_stride +
             is[r] * p.out_row_stride;
      const bool empty = l[r] == 0.0f;  // NaN l (a NaN or +inf score): NaN out and lse
      if constexpr (sizeof(T) == 4) {
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : O[r * D + pair_pos<Tag>(d, D)] / l[r];
      } else {
        const float inv_l = finish_inv_l(l[r]);
        for (int64_t d = 0; d < D; ++d)
          o[d] = Tag::from_float(O[r * D + pair_pos<Tag>(d, D)] * inv_l);
      }
      p.lse[(b * p.heads_q + hs[r]) * Nq + is[r]] = finish_lse(m[r], l[r]);
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
      // A split whose sum is NaN makes Lsum NaN (0 * NaN too): the row comes out NaN.
      const bool empty = Lsum == 0.0f;
      if constexpr (sizeof(T) == 4) {
        for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : acc[d] / Lsum;
      } else {
        const float inv_l = finish_inv_l(Lsum);
        for (int64_t d = 0; d < D; ++d) o[d] = Tag::from_float(acc[d] * inv_l);
      }
      p.lse[(b * p.heads_q + h) * Nq + i] = finish_lse(M, Lsum);
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
