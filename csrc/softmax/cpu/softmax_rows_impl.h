// The row kernels of softmax_cpu.cpp, written once over GCC vector extensions of kLanes fp32
// lanes and included once per instruction set, inside a namespace that defines kLanes (the ISA's
// native width) after kChunk and FM_INLINE. A vector wider than the ISA's registers is not split
// well by GCC: with 16-lane vectors in the AVX2 build every max and select became scalar
// (vmaxss, vcmpltss), and the AVX2 softmax ran at 0.4x torch.softmax.

constexpr int kChunkVecs = kChunk / kLanes;  // vectors per online-normalizer chunk
constexpr float kInf = std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

FM_INLINE vf splat(float v) {
  return vf{} + v;
}
FM_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
FM_INLINE void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
FM_INLINE vf vmax(vf a, vf b) {
  return a > b ? a : b;
}

FM_INLINE vf load_partial(const float* p, int64_t count, float fill) {
  alignas(64) float buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < count ? p[i] : fill;
  return load(buf);
}
FM_INLINE void store_partial(float* p, vf v, int64_t count) {
  alignas(64) float buf[kLanes];
  store(buf, v);
  for (int64_t i = 0; i < count; ++i) p[i] = buf[i];
}

// exp for the arguments softmax produces (x <= 0, or NaN): Cody-Waite reduction to
// r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial (truncation error 5e-9 relative, below
// fp32 rounding).
// Exactly 0 below -87 (so masked -inf elements contribute nothing), NaN in -> NaN out.
FM_INLINE vf vexp(vf x) {
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi bits = ((vi)t - (vi)magic + 127) << 23;  // 2^n built in the exponent field
  const vf res = p * (vf)bits;
  return x < -87.0f ? splat(0.0f) : res;
}

// bf16 rows are read in place, widened as they are loaded.
FM_INLINE vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
FM_INLINE vf load_partial(const c10::BFloat16* p, int64_t count, float fill) {
  alignas(64) float buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < count ? static_cast<float>(p[i]) : fill;
  return load(buf);
}

// Loads lanes [0, count) of x * scale; the other lanes read -inf (after scaling, so a negative
// scale cannot turn the padding into +inf).
template <bool kFull, class In>
FM_INLINE vf load_scaled(const In* x, int64_t count, vf scale) {
  if constexpr (kFull) {
    return load(x) * scale;
  } else {
    const vf v = load_partial(x, count, 0.0f) * scale;
    alignas(64) float lane[kLanes];
    for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
    return load(lane) < static_cast<float>(count) ? v : splat(-kInf);
  }
}

// Pass 1 over one chunk of `len` elements (len == kChunk when kFull).
template <bool kFull, class In>
FM_INLINE void online_chunk(const In* x, float* y, int64_t len, vf scale, vf& m, vf& sum,
                            float* chunk_max) {
  const int nvec = kFull ? kChunkVecs : static_cast<int>((len + kLanes - 1) / kLanes);
  vf cmax = splat(-kInf);
  for (int j = 0; j < nvec; ++j)
    cmax = vmax(cmax, load_scaled<kFull>(x + j * kLanes, len - j * kLanes, scale));
  const vf m_new = vmax(m, cmax);
  // Lanes that have seen only -inf keep base 0, so exp(-inf - base) is 0 rather than NaN.
  const vf base = m_new == -kInf ? splat(0.0f) : m_new;
  // The chunk is summed on its own and then added to the row's running sum: a lane's running sum
  // takes one addition per chunk instead of one per element (a row of 262k elements is 32k
  // elements per AVX2 lane, whose fp32 rounding put the output error at up to 2.5x torch's).
  vf acc = splat(0.0f);
  for (int j = 0; j < nvec; ++j) {
    const vf e = vexp(load_scaled<kFull>(x + j * kLanes, len - j * kLanes, scale) - base);
    if (kFull || (j + 1) * kLanes <= len) {
      store(y + j * kLanes, e);
    } else {
      store_partial(y + j * kLanes, e, len - j * kLanes);
    }
    acc += e;
  }
  sum = sum * vexp(m - base) + acc;
  m = m_new;
  store(chunk_max, m_new);
}

// fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (the rounding carry must not turn it
// into -0).
FM_INLINE vh narrow_bf16(vf v) {
  vu u = (vu)v;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u = v != v ? vu{} + 0x7fc0u : u;
  return __builtin_convertvector(u, vh);
}

// y = softmax(scale * x) in fp32 (y may be x), or, for bf16 rows (In = c10::BFloat16, with out16),
// x read and widened in place, the first pass's exponentials in y as scratch and the result
// written to out16 in bf16 by the second pass: separate widening and narrowing sweeps over an
// fp32 copy of the row had held bf16 rows at 0.98-1.05x torch.softmax on AVX2.
template <class In>
FM_INLINE void softmax_row_impl(const In* x, float* y, int64_t n, float scale_s, float* chunk_max,
                                c10::BFloat16* out16 = nullptr) {
  const vf scale = splat(scale_s);
  vf m = splat(-kInf), sum = splat(0.0f);
  int64_t c = 0, k0 = 0;
  for (; k0 + kChunk <= n; k0 += kChunk, ++c)
    online_chunk<true>(x + k0, y + k0, kChunk, scale, m, sum, chunk_max + c * kLanes);
  if (k0 < n) online_chunk<false>(x + k0, y + k0, n - k0, scale, m, sum, chunk_max + c * kLanes);

  // Merge the 16 lane summaries: S = sum over lanes of sum_l * exp(m_l - M).
  alignas(64) float lane[kLanes];
  store(lane, m);
  float M = -kInf;
  for (float v : lane) M = std::max(M, v);
  store(lane, M == -kInf ? sum : sum * vexp(m - M));
  float S = 0.0f;
  for (float v : lane) S += v;
  if (M == -kInf && S == 0.0f) {  // every element is -inf: documented to give zeros
    if (out16 != nullptr) {
      std::memset(out16, 0, sizeof(c10::BFloat16) * n);
    } else {
      std::memset(y, 0, sizeof(float) * n);
    }
    return;
  }
  // NaN anywhere has made S NaN, so the whole row comes out NaN below.
  const vf vM = splat(M), inv = splat(1.0f / S);
  for (int64_t k = 0, ci = 0; k < n; k += kChunk, ++ci) {
    const vf f = vexp(load(chunk_max + ci * kLanes) - vM) * inv;
    const int64_t len = std::min(kChunk, n - k);
    int64_t j = 0;
    if (out16 != nullptr) {
      for (; j + kLanes <= len; j += kLanes) {
        const vh h = narrow_bf16(load(y + k + j) * f);
        std::memcpy(out16 + k + j, &h, sizeof h);
      }
      if (j < len) {
        const vh h = narrow_bf16(load_partial(y + k + j, len - j, 0.0f) * f);
        std::memcpy(out16 + k + j, &h, sizeof(c10::BFloat16) * (len - j));
      }
      continue;
    }
    for (; j + kLanes <= len; j += kLanes) store(y + k + j, load(y + k + j) * f);
    if (j < len) store_partial(y + k + j, load_partial(y + k + j, len - j, 0.0f) * f, len - j);
  }
}

// Rows along a non-last dimension: up to 16 neighbouring rows (consecutive `inner` positions) ride
// in the vector lanes, so each load is one contiguous run; element d of the rows is at
// x + d * stride. Online normalizer over groups of 8 elements (one rescale per group), then a
// second pass writes.
FM_INLINE void softmax_strided_impl(const float* x, float* y, int64_t n, int64_t stride,
                                    int64_t lanes) {
  constexpr int64_t kGroup = 8;
  auto get = [&](int64_t d) {
    return lanes == kLanes ? load(x + d * stride) : load_partial(x + d * stride, lanes, 0.0f);
  };
  vf m = splat(-kInf), sum = splat(0.0f);
  for (int64_t d0 = 0; d0 < n; d0 += kGroup) {
    const int64_t d1 = std::min(n, d0 + kGroup);
    vf gmax = splat(-kInf);
    for (int64_t d = d0; d < d1; ++d) gmax = vmax(gmax, get(d));
    const vf m_new = vmax(m, gmax);
    const vf base = m_new == -kInf ? splat(0.0f) : m_new;
    vf acc = splat(0.0f);  // the group on its own first, as online_chunk does
    for (int64_t d = d0; d < d1; ++d) acc += vexp(get(d) - base);
    sum = sum * vexp(m - base) + acc;
    m = m_new;
  }
  // Lanes of only -inf have sum 0 and write exp(-inf - 0) * 1 = 0; a NaN sum makes its lane NaN.
  const vf base = m == -kInf ? splat(0.0f) : m;
  const vf inv = splat(1.0f) / (sum == 0.0f ? splat(1.0f) : sum);
  for (int64_t d = 0; d < n; ++d) {
    const vf e = vexp(get(d) - base) * inv;
    if (lanes == kLanes) {
      store(y + d * stride, e);
    } else {
      store_partial(y + d * stride, e, lanes);
    }
  }
}

FM_INLINE void bf16_to_f32_impl(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

FM_INLINE void f32_to_bf16_impl(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vh h = narrow_bf16(load(src + i));
    std::memcpy(dst + i, &h, sizeof h);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

// Up to kMaxLanes neighbouring strided rows, kLanes at a time.
FM_INLINE void softmax_strided_groups(const float* x, float* y, int64_t n, int64_t stride,
                                      int64_t lanes) {
  for (int64_t l0 = 0; l0 < lanes; l0 += kLanes) {
    softmax_strided_impl(x + l0, y + l0, n, stride, std::min<int64_t>(kLanes, lanes - l0));
  }
}
