// The CPU forward (FlashAttention's algorithm), written once over GCC vector extensions and
// compiled once per instruction set. Included by kernel_<isa>.cpp inside an anonymous namespace,
// after it defined:
//   kW                 lanes of one fp32 vector
//   vf, vi             vectors of kW floats / int32s
//   splat(s)           s in every lane
//   fmadd(a, b, c)     a * b + c, fused where the ISA has FMA
//   load_f16(p)        kW fp16 values at p widened to fp32
//   load_bf16(p)       kW bf16 values at p widened to fp32 (GCC's __builtin_convertvector of 16-bit
//                      lanes splits into half-width widenings and an insert: 6 instructions a load
//                      instead of 2 on AVX-512 and AVX2)
//   load_u8(p)         kW bytes at p widened to int32 (GCC's __builtin_convertvector widens
//                      them one by one through scalar registers)
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
  static vf load(const uint16_t* p) { return load_bf16(p); }
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
// Transposes a kW x kW block held as kW vectors (lane l of v[i] becomes lane i of v[l]). Stage kH
// swaps bit kH of the vector index with bit kH of the lane index, one two-input shuffle per
// vector: kW log2(kW) shuffles for kW * kW elements.
template <int kH, int... L>
constexpr vi butterfly_low(std::integer_sequence<int, L...>) {
  return vi{((L & kH) ? kW + (L ^ kH) : L)...};
}
template <int kH, int... L>
constexpr vi butterfly_high(std::integer_sequence<int, L...>) {
  return vi{((L & kH) ? kW + L : (L ^ kH))...};
}
template <int kH = 1, class V>
inline void transpose_block(V (&v)[kW]) {
  if constexpr (kH < kW) {
    constexpr vi low = butterfly_low<kH>(std::make_integer_sequence<int, kW>());
    constexpr vi high = butterfly_high<kH>(std::make_integer_sequence<int, kW>());
#pragma GCC unroll 16
    for (int i = 0; i < kW; ++i) {
      if (i & kH) continue;
      const V a = v[i], b = v[i ^ kH];
      v[i] = __builtin_shuffle(a, b, low);
      v[i ^ kH] = __builtin_shuffle(a, b, high);
    }
    transpose_block<2 * kH>(v);
  }
}

// Lane j of the result: the sum of v[j]'s lanes, for all kW vectors at once. Stage kH adds the
// lanes that differ in bit kH of pairs of vectors merged into one (the butterflies above), so
// after log2(kW) stages lane j holds vector j's sum: kW - 1 adds and 2 (kW - 1) shuffles. v is
// overwritten.
template <int kH = 1, class V>
inline V fold_lanes(V (&v)[kW]) {
  if constexpr (kH == kW) {
    return v[0];
  } else {
    constexpr vi low = butterfly_low<kH>(std::make_integer_sequence<int, kW>());
    constexpr vi high = butterfly_high<kH>(std::make_integer_sequence<int, kW>());
#pragma GCC unroll 16
    for (int m = 0; m < kW / kH / 2; ++m) {
      const V a = v[2 * m], b = v[2 * m + 1];
      v[m] = __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
    }
    return fold_lanes<2 * kH>(v);
  }
}

// A row's end of the online softmax, from its running max m and sum l: l == 0 means no visible
// key (out 0, lse -inf); a NaN or +inf among the visible scores leaves l NaN (exp(NaN) and
// exp(inf - inf) are NaN and stay in the sum), and the row's out and lse come out NaN, as in
// SDPA's math. inv_l: what the accumulator is multiplied by (0 for an empty row).
inline float finish_inv_l(float l) {
  return l == 0.0f ? 0.0f : 1.0f / l;
}
inline float finish_lse(float m, float l) {
  return l == 0.0f ? kNegInf : m + logf(l);
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
// must contribute nothing, and the clamp keeps 2^n normal (no denormal stalls). NaN stays NaN (the
// clamp is written so that it passes NaN through): a NaN score must poison its row's sum, which
// is how a row with a NaN among its visible scores comes out NaN (see finish_row).
inline vf exp_neg(vf x) {
  const vf xc = x < splat(-80.0f) ? splat(-80.0f) : x;
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
  // fp16/bf16 K and V of one (batch, kv head) widened to fp32 (Nk x Dp each), kept while this
  // thread's tasks stay on that head; see VecEngine::bind_kv.
  float* wide_kv = nullptr;
  int64_t wide_kv_floats = 0;
  const void* wide_k = nullptr;  // the K and V rows widened into wide_kv, or null: none bound
  const void* wide_v = nullptr;
  int64_t wide_rows = 0;

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
  ~Workspace() {
    std::free(base);
    std::free(wide_kv);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};
