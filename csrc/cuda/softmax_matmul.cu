// CUDA matmul_softmax: out = softmax(scale * a @ b^T + mask) with `out` as the only (B, Ha, M, N)
// buffer.
//
// Fused path (fp16/bf16, depth <= 256 and a multiple of 8): a CTA of 4 warps owns 64 rows of one
// (batch, head); each warp keeps its 16 rows of `a` as WMMA fragments in registers for the whole
// kernel. The CTA walks the columns in tiles of 32 keys staged in shared memory; tensor cores
// (wmma m16n16k16, fp32 accumulate) give each warp a 16 x 32 logit tile, which its lanes scale,
// mask, fold into the per-row online normalizer (max, sum) and write raw into `out`; the next
// tile's global loads are issued before that work so they overlap it. After the last tile every
// warp re-reads its own rows (fresh in L2) and rewrites them as probabilities.
// Causal CTAs stop at their diagonal; the columns past it are written as zeros in the second pass.
//
// Fallback (fp32, other depths or layouts): cuBLAS writes the raw logits into `out`
// (logits_into_output on the host), then normalize_logits_kernel scales, masks and normalizes
// each row in place.
#include <mma.h>

#include "softmax_common.cuh"
#include "softmax_launch.cuh"

namespace flashmod::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBM = 16 * kWarps;  // rows per CTA: 16 per warp
constexpr int kBN = 32;           // columns per tile: two 16-wide WMMA tiles per warp
constexpr int kPad = 16;          // elements of padding per shared row: keeps WMMA's 32-byte alignment
constexpr int kScratchLd = kBN + 4;
constexpr int kMaxDepth = 256;

// Scale, causal and mask of logit (i, j) of the CTA's (batch, head); -inf when j is not visible.
template <typename T>
__device__ __forceinline__ float masked_logit(float raw, const MatmulSoftmaxParams& p, int64_t b, int64_t h,
                                              int64_t i, int64_t j) {
  if (p.causal && j > i) return -INFINITY;
  float x = raw * static_cast<float>(p.scale);
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_row_stride + j * p.mask_col_stride;
    switch (p.mask_kind) {
      case MaskKind::kBool: x = static_cast<const uint8_t*>(p.mask)[off] ? x : -INFINITY; break;
      case MaskKind::kAdditive: x += to_float(static_cast<const T*>(p.mask)[off]); break;
      case MaskKind::kAdditiveF32: x += static_cast<const float*>(p.mask)[off]; break;
      case MaskKind::kNone: break;
    }
  }
  return x;
}

// Tiles of a row-major matrix move to shared memory in two steps, so the global loads of the next
// b tile can be in flight while the tensor cores work on the current one: load_tile reads rows
// [0, count) x [0, depth) into registers, one uint4 (8 elements) per slot, zero-filling rows past
// `count` and columns past `depth` (zeros add nothing to the dot products); store_tile writes them
// as kRows x kDepth with row pitch kLd. Needs depth % 8 == 0 and 16-byte aligned rows.
template <int kRows, int kDepth>
struct Tile {
  static constexpr int kChunks = kDepth / 8;  // uint4 per row
  static constexpr int kPerThread = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "tile must split evenly over the CTA");
  uint4 chunk[kPerThread];

  template <typename T>
  __device__ __forceinline__ void load(const T* src, int64_t row_stride, int64_t count, int64_t depth) {
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int c = t * kThreads + threadIdx.x, r = c / kChunks, k = (c % kChunks) * 8;
      chunk[t] = r < count && k < depth ? *reinterpret_cast<const uint4*>(src + r * row_stride + k)
                                        : make_uint4(0, 0, 0, 0);
    }
  }

  template <int kLd, typename T>
  __device__ __forceinline__ void store(T* dst) const {
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int c = t * kThreads + threadIdx.x, r = c / kChunks, k = (c % kChunks) * 8;
      *reinterpret_cast<uint4*>(dst + r * kLd + k) = chunk[t];
    }
  }
};

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kThreads) matmul_softmax_fused_kernel(const MatmulSoftmaxParams p) {
  constexpr int kDepth = 16 * kKSteps;
  constexpr int kLd = kDepth + kPad;
  constexpr int kSmemA = kBM * kLd * sizeof(T);
  constexpr int kSmemTile = kBN * kLd * sizeof(T);
  constexpr int kSmemB = kSmemTile + kWarps * 16 * kScratchLd * sizeof(float);
  // The a-staging area and the (b tile, logit scratch) pair are never live at the same time.
  __shared__ __align__(128) unsigned char smem[kSmemA > kSmemB ? kSmemA : kSmemB];

  const int64_t M = p.rows, N = p.cols, K = p.depth;
  const int64_t bh = blockIdx.y, b = bh / p.heads_a, h = bh % p.heads_a;
  const int64_t hb = h / (p.heads_a / p.heads_b);
  const T* A = static_cast<const T*>(p.a) + b * p.a_batch_stride + h * p.a_head_stride;
  const T* B = static_cast<const T*>(p.b) + b * p.b_batch_stride + hb * p.b_head_stride;
  T* O = static_cast<T*>(p.out) + bh * M * N;
  const int64_t row0 = int64_t(blockIdx.x) * kBM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  T* s_tile = reinterpret_cast<T*>(smem);
  {
    Tile<kBM, kDepth> a_tile;
    a_tile.load(A + row0 * p.a_row_stride, p.a_row_stride, M - row0, K);
    a_tile.template store<kLd>(s_tile);
  }
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> frag_a[kKSteps];
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) wmma::load_matrix_sync(frag_a[ks], s_tile + warp * 16 * kLd + ks * 16, kLd);
  __syncthreads();  // shared memory now holds b tiles

  float* scratch = reinterpret_cast<float*>(smem + kSmemTile) + warp * 16 * kScratchLd;
  const int my_row = lane / 2, my_col = (lane % 2) * 16;  // each lane: 16 columns of one row
  const int64_t i = row0 + warp * 16 + my_row;
  const bool row_ok = i < M;
  const bool vec_store = N % 8 == 0;
  float m = -INFINITY, s = 0.0f;
  const int64_t n_end = p.causal ? (row0 + kBM < N ? row0 + kBM : N) : N;

  Tile<kBN, kDepth> b_tile;
  b_tile.load(B, p.b_row_stride, N, K);
  for (int64_t n0 = 0; n0 < n_end; n0 += kBN) {
    b_tile.template store<kLd>(s_tile);
    __syncthreads();
    if (n0 + kBN < n_end) b_tile.load(B + (n0 + kBN) * p.b_row_stride, p.b_row_stride, N - n0 - kBN, K);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) wmma::fill_fragment(acc[c], 0.0f);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        // b's rows are the columns of b^T: a col-major K x 16 operand with pitch kLd.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> frag_b;
        wmma::load_matrix_sync(frag_b, s_tile + c * 16 * kLd + ks * 16, kLd);
        wmma::mma_sync(acc[c], frag_a[ks], frag_b, acc[c]);
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) wmma::store_matrix_sync(scratch + c * 16, acc[c], kScratchLd, wmma::mem_row_major);
    __syncwarp();

    float v[16];
    float tile_max = -INFINITY;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const int64_t j = n0 + my_col + q;
      v[q] = row_ok && j < N ? masked_logit<T>(scratch[my_row * kScratchLd + my_col + q], p, b, h, i, j) : -INFINITY;
      // The second pass sees the logit rounded to T (it is stored in `out`); the summary must
      // describe the same numbers, or the row would not sum to 1.
      v[q] = to_float(from_float<T>(v[q]));
      tile_max = fmaxf(tile_max, v[q]);
    }
    float tile_sum = 0.0f;
#pragma unroll
    for (int q = 0; q < 16; ++q) tile_sum += exp_from(v[q], tile_max);
    merge(m, s, tile_max, tile_sum);

    if (row_ok) {  // the raw (scaled, masked) logits, normalized in place below
      const int64_t j0 = n0 + my_col;
      T* dst = O + i * N + j0;
      if (vec_store && j0 + 16 <= N) {
        alignas(16) T packed[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) packed[q] = from_float<T>(v[q]);  // exact: v is already in T
        reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(packed)[0];
        reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(packed)[1];
      } else {
        for (int q = 0; q < 16 && j0 + q < N; ++q) dst[q] = from_float<T>(v[q]);
      }
    }
    __syncthreads();  // the next tile overwrites s_tile and scratch
  }

  // Each row's summary is split over two lanes; merge them, then normalize the warp's 16 rows.
  merge(m, s, __shfl_xor_sync(0xffffffffu, m, 1), __shfl_xor_sync(0xffffffffu, s, 1));
  __syncwarp();  // the raw logits this warp wrote are visible to all its lanes
  for (int r = 0; r < 16; ++r) {
    const int64_t row = row0 + warp * 16 + r;
    if (row >= M) break;  // uniform across the warp
    const float row_m = __shfl_sync(0xffffffffu, m, 2 * r), inv = inv_sum(row_m, __shfl_sync(0xffffffffu, s, 2 * r));
    const int64_t limit = p.causal ? (row + 1 < N ? row + 1 : N) : N;
    T* dst = O + row * N;
    if (vec_store) {
      for (int64_t j = int64_t(lane) * 8; j < N; j += 32 * 8) {
        alignas(16) T packed[8];
        if (j < limit) *reinterpret_cast<uint4*>(packed) = *reinterpret_cast<const uint4*>(dst + j);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          packed[q] = from_float<T>(j + q < limit ? exp_from(to_float(packed[q]), row_m) * inv : 0.0f);
        *reinterpret_cast<uint4*>(dst + j) = *reinterpret_cast<const uint4*>(packed);
      }
    } else {
      for (int64_t j = lane; j < N; j += 32) dst[j] = from_float<T>(j < limit ? exp_from(to_float(dst[j]), row_m) * inv : 0.0f);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256) normalize_logits_kernel(const MatmulSoftmaxParams p) {
  __shared__ float warp_m[8], warp_s[8];
  const int64_t M = p.rows, N = p.cols;
  const int64_t row = blockIdx.x, i = row % M, h = (row / M) % p.heads_a, b = row / (M * p.heads_a);
  const int64_t limit = p.causal ? (i + 1 < N ? i + 1 : N) : N;
  T* o = static_cast<T*>(p.out) + row * N;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < limit; j += blockDim.x) {
    const float x = masked_logit<T>(to_float(o[j]), p, b, h, i, j);
    const float mn = fmaxf(m, x);
    s = s * exp_from(m, mn) + exp_from(x, mn);
    m = mn;
  }
  warp_merge(m, s);
  if (threadIdx.x % 32 == 0) warp_m[threadIdx.x / 32] = m, warp_s[threadIdx.x / 32] = s;
  __syncthreads();
  m = warp_m[0], s = warp_s[0];
  for (int w = 1; w < blockDim.x / 32; ++w) merge(m, s, warp_m[w], warp_s[w]);
  const float inv = inv_sum(m, s);
  // Each thread rewrites exactly the elements it read, so reading and writing in place is safe.
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x)
    o[j] = from_float<T>(j < limit ? exp_from(masked_logit<T>(to_float(o[j]), p, b, h, i, j), m) * inv : 0.0f);
}

template <typename T, int kKSteps>
void launch_fused(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.rows + kBM - 1) / kBM), static_cast<unsigned>(p.batch * p.heads_a));
  matmul_softmax_fused_kernel<T, kKSteps><<<grid, kThreads, 0, stream>>>(p);
}

template <typename T>
void launch_fused_typed(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  if (p.depth <= 32) {
    launch_fused<T, 2>(p, stream);
  } else if (p.depth <= 64) {
    launch_fused<T, 4>(p, stream);
  } else if (p.depth <= 128) {
    launch_fused<T, 8>(p, stream);
  } else {
    launch_fused<T, 16>(p, stream);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

bool launch_matmul_softmax_fused(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  const bool half = p.dtype == ScalarKind::kFloat16 || p.dtype == ScalarKind::kBFloat16;
  // 16-byte loads of a's and b's rows need every row start 16-byte aligned.
  const bool layout_ok = p.depth % 8 == 0 && p.depth <= kMaxDepth && aligned16(p.a) && aligned16(p.b) &&
                         aligned16(p.out) && p.a_row_stride % 8 == 0 && p.a_head_stride % 8 == 0 &&
                         p.a_batch_stride % 8 == 0 && p.b_row_stride % 8 == 0 && p.b_head_stride % 8 == 0 &&
                         p.b_batch_stride % 8 == 0;
  if (!half || !layout_ok || p.batch * p.heads_a > 65535) return false;
  if (p.dtype == ScalarKind::kFloat16) {
    launch_fused_typed<__half>(p, stream);
  } else {
    launch_fused_typed<__nv_bfloat16>(p, stream);
  }
  return true;
}

void launch_normalize_logits_in_place(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_a * p.rows;
  switch (p.dtype) {
    case ScalarKind::kFloat32: normalize_logits_kernel<float><<<static_cast<unsigned>(rows), 256, 0, stream>>>(p); break;
    case ScalarKind::kFloat16: normalize_logits_kernel<__half><<<static_cast<unsigned>(rows), 256, 0, stream>>>(p); break;
    case ScalarKind::kBFloat16: normalize_logits_kernel<__nv_bfloat16><<<static_cast<unsigned>(rows), 256, 0, stream>>>(p); break;
    case ScalarKind::kFloat64: break;  // rejected by the host checks before any launch
  }
}

}  // namespace flashmod::cuda
