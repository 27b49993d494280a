// CUDA matmul_softmax: out = softmax(scale * a @ b^T + mask) with `out` as the only (B, Ha, M, N)
// buffer.
//
// Fused path (fp16/bf16 at depth <= 256, a multiple of 8; fp32 at depth <= 128, a multiple of 4):
// `out` is written exactly once and never read. A CTA of 4 warps owns kBM rows of one (batch,
// head); each warp keeps the mma fragments of its 16 * kMTiles rows of `a` in registers. The CTA
// walks the columns twice, in tiles of kBN keys that cp.async double-buffers in a swizzled shared
// tile (ptx_ops.h / smem_tile.h, the attention kernel's building blocks):
//   pass 1: logits = a @ b_tile^T on the tensor cores (fp32 accumulators), scaled and masked in
//           registers, folded into each row's online normalizer (max, sum); nothing is stored.
//   pass 2: the same logits are recomputed (the same instructions, so the same fp32 values) and
//           written as exp(x - max) / sum. The 4 lanes of a quad transpose their accumulator words
//           with shuffles so each lane stores 8 consecutive outputs (16 or 32 bytes; a warp's
//           store covers whole 32-byte sectors).
// 16-bit inputs run mma m16n8k16. fp32 runs 3xTF32 (m16n8k8): every operand is split into tf32
// halves x = hi + lo and a.b = a_lo.b_hi + a_hi.b_lo + a_hi.b_hi, which keeps fp32-level error
// (the dropped a_lo.b_lo is ~2^-22 relative). a is split once into registers; each b tile is split
// once per CTA right after it lands (hi in place, lo beside it), not once per warp. fp32 tiles go
// through the 16-bit machinery unchanged: an 8 x 4 fp32 block is an 8 x 8 b16 ldmatrix matrix,
// and the tf32 fragments have the 16-bit fragments' layout with 32-bit elements.
// The pipeline runs through the pass boundary: tile 0 of pass 2 is prefetched during the last
// tile of pass 1. Causal CTAs stop at their diagonal; the columns past it are zero-filled.
//
// Single pass (fp32 at depth 65..128, while 16 rows of logits fit in shared memory; see
// matmul_softmax_rows_kernel): 16-row CTAs compute each logit once, park the rows in shared
// memory and write `out` from there, half the two-pass kernel's 3xTF32 work.
//
// Fallback (other depths or layouts): cuBLAS writes the raw logits into `out` (fp16: scaled;
// logits_into_output on the host), then a normalize kernel scales, masks and normalizes each row
// in place, caching the row in registers (one read, one write) unless it is very long.
#include "../../common/additive_mask.h"
#include "../../common/alignment.h"
#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/ptx_ops.h"
#include "../../common/cuda/smem_tile.h"
#include "softmax_common.cuh"
#include "softmax_launch.cuh"

namespace flashmod::cuda {
namespace {

using cuda_kernels::cp_async_commit;
using cuda_kernels::cp_async_wait;
using cuda_kernels::LaneTileOffsets;
using cuda_kernels::ldmatrix_x4;
using cuda_kernels::lds_128;
using cuda_kernels::Mma16816;
using cuda_kernels::mma_3xtf32;
using cuda_kernels::smem_addr;
using cuda_kernels::split_tf32;
using cuda_kernels::sts_128;
using cuda_kernels::TileCopyPlan;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxDepth = 256;
constexpr int kMaxDepthF32 = 128;  // 3xTF32: a's two halves must fit in registers

// x with the mask element at offset `off` applied: -inf where a bool mask is false or an additive
// value hides the key (additive_mask.h); else plus the value times `unit` (which converts it to
// x's units).
template <typename T>
__device__ __forceinline__ float apply_mask(float x, const MatmulSoftmaxParams& p, int64_t off,
                                            float unit) {
  float value;
  switch (p.mask_kind) {
    case MaskKind::kBool: return static_cast<const uint8_t*>(p.mask)[off] ? x : -INFINITY;
    case MaskKind::kAdditive: value = to_float(static_cast<const T*>(p.mask)[off]); break;
    case MaskKind::kAdditiveF32: value = static_cast<const float*>(p.mask)[off]; break;
    default: return x;
  }
  return mask_value_hides(value) ? -INFINITY : x + value * unit;
}

// Scale, causal and mask of logit (i, j) of the CTA's (batch, head); -inf when j is not visible.
template <typename T>
__device__ __forceinline__ float masked_logit(float raw, const MatmulSoftmaxParams& p, int64_t b,
                                              int64_t h, int64_t i, int64_t j) {
  if (p.causal && j > i) return -INFINITY;
  const int64_t off = b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_row_stride +
                      j * p.mask_col_stride;
  return apply_mask<T>(raw * static_cast<float>(p.scale), p, off, 1.0f);
}

// exp2(x - m), where a max of -inf (nothing visible yet) counts as 0 so -inf - -inf is no NaN.
__device__ __forceinline__ float exp2_from(float x, float m) {
  return exp2f(x - (m == -INFINITY ? 0.0f : m));
}

// Online normalizer in base-2 units: (m, s) absorbs (m2, s2).
__device__ __forceinline__ void merge2(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  s = s * exp2_from(m, mn) + s2 * exp2_from(m2, mn);
  m = mn;
}

// The CTA's (batch, head) and first row. Row blocks vary fastest, so the CTAs running together
// share their b head in L2. Causal: the last row blocks see the most columns; start them first to
// shorten the tail.
struct CtaRows {
  int64_t bh, b, h, hb, row0;
  __device__ __forceinline__ CtaRows(const MatmulSoftmaxParams& p, int rows_per_cta) {
    const int64_t m_blocks = (p.rows + rows_per_cta - 1) / rows_per_cta;
    int64_t m_block = blockIdx.x % m_blocks;
    bh = blockIdx.x / m_blocks;
    if (p.causal) m_block = m_blocks - 1 - m_block;
    b = bh / p.heads_a, h = bh % p.heads_a, hb = h / (p.heads_a / p.heads_b);
    row0 = m_block * rows_per_cta;
  }
  // a's first row and b's head as 16-bit units: the tile copies move 16-byte chunks whatever T.
  template <typename T>
  __device__ __forceinline__ const uint16_t* a(const MatmulSoftmaxParams& p) const {
    return reinterpret_cast<const uint16_t*>(static_cast<const T*>(p.a) + b * p.a_batch_stride +
                                             h * p.a_head_stride + row0 * p.a_row_stride);
  }
  template <typename T>
  __device__ __forceinline__ const uint16_t* b_head(const MatmulSoftmaxParams& p) const {
    return reinterpret_cast<const uint16_t*>(static_cast<const T*>(p.b) + b * p.b_batch_stride +
                                             hb * p.b_head_stride);
  }
};

// a's kBM rows (row width kRowHalves 16-bit units, `depth` of them real) -> shared -> the mma
// fragments of this warp's MT m16 tiles from row warp_row0, kept in registers. 3xTF32 (kSplit):
// af gets the tf32 hi halves and af_lo the lo halves. Ends with a barrier: shared memory is free.
template <int kBM, int kRowHalves, int kThreads, bool kSplit, int MT, int KS, int MTL, int KSL>
__device__ __forceinline__ void load_a_fragments(uint32_t (&af)[MT][KS][4],
                                                 uint32_t (&af_lo)[MTL][KSL][4], uint32_t s_base,
                                                 const uint16_t* A, int64_t a_row_stride,
                                                 int valid_rows, int depth, int warp_row0) {
  const int lane = threadIdx.x % 32;
  const int lm_mat = lane >> 3, lm_row = lane & 7;  // ldmatrix: lanes 8i..8i+7 address matrix i
  const TileCopyPlan<kBM, kRowHalves, kThreads> a_copy(threadIdx.x, depth);
  a_copy.load(s_base, A, a_row_stride, valid_rows);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const LaneTileOffsets<kRowHalves> a_off(warp_row0 + lm_row + (lm_mat & 1) * 8, lm_mat >> 1);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      ldmatrix_x4(af[mi][ks], s_base + 2 * a_off.at(mi * 16, ks));
      if constexpr (kSplit) {
#pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32(af[mi][ks][e], af[mi][ks][e], af_lo[mi][ks][e]);
      }
    }
  __syncthreads();  // the a area now takes the b tiles
}

// Accumulator tiles (lane g, t: rows g and g + 8 of each m16 tile, columns 2t, 2t + 1 of each n8
// tile) of rows first_row + [0, 16 MT) and columns c0 + [0, 8 NT) -> logits in base-2 units. A
// tile past N or across the causal diagonal of some row hides the columns past each row's last
// visible one (all of them for rows past M); a mask is read per element. The same tile always
// takes the same branches, so recomputing it gives the same values.
template <typename T, bool kMasked, int MT, int NT>
__device__ __forceinline__ void scale_and_mask(float (&acc)[MT][NT][4],
                                               const MatmulSoftmaxParams& p, const CtaRows& cta,
                                               int64_t first_row, int64_t c0, float c2) {
  constexpr int kCols = 8 * NT;
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int64_t M = p.rows, N = p.cols;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] *= c2;
  if (c0 + kCols > N || (p.causal && c0 + kCols - 1 > first_row)) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t i = first_row + mi * 16 + g + 8 * hh;
        int64_t end = N - c0;
        if (p.causal && i + 1 - c0 < end) end = i + 1 - c0;
        const int visible = i >= M || end < 0 ? 0 : end > kCols ? kCols : static_cast<int>(end);
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (ni * 8 + 2 * t + e >= visible) acc[mi][ni][2 * hh + e] = -INFINITY;
      }
  }
  if constexpr (kMasked) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t i = first_row + mi * 16 + g + 8 * hh;
        if (i >= M) continue;
        const int64_t row_off =
            cta.b * p.mask_batch_stride + cta.h * p.mask_head_stride + i * p.mask_row_stride;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = acc[mi][ni][2 * hh + e];
            const int64_t j = c0 + ni * 8 + 2 * t + e;
            if (x != -INFINITY) x = apply_mask<T>(x, p, row_off + j * p.mask_col_stride, kLog2e);
          }
      }
  }
}

// Folds a tile of base-2 logits into the lane's share of each row's (max, sum).
template <int MT, int NT>
__device__ __forceinline__ void fold_tile(const float (&acc)[MT][NT][4], float (&row_m)[MT][2],
                                          float (&row_s)[MT][2]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
        mx = fmaxf(mx, fmaxf(acc[mi][ni][2 * hh], acc[mi][ni][2 * hh + 1]));
      const float mn = fmaxf(row_m[mi][hh], mx);
      float sum = 0.0f;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
        sum += exp2_from(acc[mi][ni][2 * hh], mn) + exp2_from(acc[mi][ni][2 * hh + 1], mn);
      row_s[mi][hh] = row_s[mi][hh] * exp2_from(row_m[mi][hh], mn) + sum;
      row_m[mi][hh] = mn;
    }
}

// Each row's summary is split over the 4 lanes of its quad: afterwards every lane holds the merge.
template <int MT>
__device__ __forceinline__ void merge_quad(float (&row_m)[MT][2], float (&row_s)[MT][2]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, row_m[mi][hh], offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, row_s[mi][hh], offset);
        merge2(row_m[mi][hh], row_s[mi][hh], m2, s2);
      }
}

// Compile-time shape of the fused kernel for one element type and depth bucket (kDepth = depth
// rounded up to 32/64/128/256; the columns past the real depth are zero-filled in shared memory).
template <typename T, int kDepth_>
struct FusedShape {
  static constexpr int kDepth = kDepth_;
  // fp32 runs 3xTF32: a's fragments come in two halves (twice the registers, so one m16 tile per
  // warp and depth <= 128), and a stage holds b's hi tile then its lo tile.
  static constexpr bool kSplit = sizeof(T) == 4;
  // Row width in 16-bit units, as smem_tile.h and ldmatrix see it: they only move 16-byte chunks,
  // and an fp32 k-step of 8 spans the same two chunks as a 16-bit k-step of 16.
  static constexpr int kRowHalves = kDepth * static_cast<int>(sizeof(T)) / 2;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // m16 tiles per warp. Two tiles make each ldmatrix of b feed 4 mma (shared-memory bandwidth
  // matches the tensor cores); at 16-bit depth 256 their a fragments would take 128 registers.
  static constexpr int kMTiles = !kSplit && kDepth <= 128 ? 2 : 1;
  static constexpr int kBM = 16 * kMTiles * kWarps;  // rows per CTA
  // Columns per tile; fp32 past depth 32 takes 32 (its a halves leave no room for 32 more
  // accumulators at 3 CTAs/SM).
  static constexpr int kBN = kRowHalves <= (kSplit ? 64 : 128) ? 64 : 32;
  static constexpr int kNTiles = kBN / 8;  // n8 accumulator tiles per warp
  static constexpr int kKSteps = kRowHalves / 16;
  static constexpr int kTileBytes = kBN * kRowHalves * 2;  // one tile of b
  static constexpr int kStageBytes = (kSplit ? 2 : 1) * kTileBytes;
  static constexpr int kABytes = kBM * kRowHalves * 2;  // a, staged once to load the fragments
  // a is read into registers before the first b tile is issued, so the two share the space.
  static constexpr int kSmemBytes = kABytes > 2 * kStageBytes ? kABytes : 2 * kStageBytes;
  // CTAs per SM that ptxas must fit in the register file: the most it reaches without spills on
  // sm_80 and sm_90a (at 16-bit depth 128 the a fragments and accumulators alone take 128
  // registers; fp32 depth 128 keeps 128 registers of a halves).
  static constexpr int kMinBlocks = kDepth == 128 ? 2 : kDepth == 256 ? 4 : 3;
  static_assert(kNTiles % 4 == 0, "stores transpose groups of 4 n8 tiles within a quad");
  static_assert(!kSplit || kDepth <= kMaxDepthF32, "3xTF32 a fragments in registers");
};

// 3xTF32: replaces the fp32 chunks of a b tile that this thread copied by their tf32 hi halves and
// writes the lo halves lo_offset bytes further on. Only the thread's own cp.async chunks, so its
// own wait suffices; the barrier that follows publishes both. One split per CTA, not per warp.
template <class Plan>
__device__ __forceinline__ void split_copied_chunks(const Plan& plan, uint32_t tile,
                                                    uint32_t lo_offset) {
  if (!plan.active) return;
#pragma unroll
  for (int it = 0; it < Plan::kIters; ++it) {
    const uint32_t addr = tile + plan.chunk_offset(it);
    uint32_t x[4], hi[4], lo[4];
    lds_128(x, addr);
#pragma unroll
    for (int e = 0; e < 4; ++e) split_tf32(x[e], hi[e], lo[e]);
    sts_128(addr, hi);
    sts_128(addr + lo_offset, lo);
  }
}

// 32-bit words of one accumulator pair (two adjacent outputs) in T: 1 for 16-bit, 2 for fp32.
template <typename T>
constexpr int kPairWords = static_cast<int>(sizeof(T)) / 2;

template <typename T>
__device__ __forceinline__ void pack_pair(float x0, float x1, uint32_t (&w)[kPairWords<T>]) {
  if constexpr (sizeof(T) == 4) {
    w[0] = __float_as_uint(x0), w[1] = __float_as_uint(x1);
  } else {
    w[0] = Mma16816<T>::pack(x0, x1);
  }
}

// The quad (4 lanes sharing an accumulator row) holds 4 n8 tiles of one row, lane t words
// w[q] = columns 8q + 2t, +1 of tile q (kW words per pair). Afterwards lane t holds tile t:
// w[s] = columns 8t + 2s, +1, i.e. 8 consecutive outputs. Two butterfly stages over the lane
// bits; all lanes take part.
template <int kW>
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4][kW], int t) {
  const bool b0 = t & 1, b1 = t & 2;
#pragma unroll
  for (int x = 0; x < 2; ++x)
#pragma unroll
    for (int c = 0; c < kW; ++c) {
      const uint32_t got = __shfl_xor_sync(0xffffffffu, b0 ? w[2 * x][c] : w[2 * x + 1][c], 1);
      if (b0) {
        w[2 * x][c] = got;
      } else {
        w[2 * x + 1][c] = got;
      }
    }
#pragma unroll
  for (int x = 0; x < 2; ++x)
#pragma unroll
    for (int c = 0; c < kW; ++c) {
      const uint32_t got = __shfl_xor_sync(0xffffffffu, b1 ? w[x][c] : w[2 + x][c], 2);
      if (b1) {
        w[x][c] = got;
      } else {
        w[2 + x][c] = got;
      }
    }
}

template <typename T, int kDepth, bool kMasked>
__global__ void __launch_bounds__(FusedShape<T, kDepth>::kThreads,
                                  FusedShape<T, kDepth>::kMinBlocks)
    matmul_softmax_fused_kernel(const MatmulSoftmaxParams p) {
  using Shape = FusedShape<T, kDepth>;
  constexpr bool kSplit = Shape::kSplit;
  constexpr int kThreads = Shape::kThreads, kBM = Shape::kBM, kBN = Shape::kBN;
  constexpr int kRowHalves = Shape::kRowHalves, kHalves = sizeof(T) / 2;
  constexpr int MT = Shape::kMTiles, NT = Shape::kNTiles, KS = Shape::kKSteps;
  constexpr int kPW = kPairWords<T>;
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t M = p.rows, N = p.cols;
  const CtaRows cta(p, kBM);
  const int64_t row0 = cta.row0;
  const uint16_t* B = cta.b_head<T>(p);
  const int64_t b_row_stride = kHalves * p.b_row_stride;
  T* O = static_cast<T*>(p.out) + cta.bh * M * N;
  const int depth = kHalves * static_cast<int>(p.depth);
  const uint32_t s_base = smem_addr(smem);

  // a's rows -> mma fragments, kept in registers for both passes.
  const int lm_mat = lane >> 3, lm_row = lane & 7;  // ldmatrix: lanes 8i..8i+7 address matrix i
  const int warp_row0 = warp * MT * 16;
  // 3xTF32: af holds the hi halves, af_lo the lo halves.
  uint32_t af[MT][KS][4], af_lo[kSplit ? MT : 1][kSplit ? KS : 1][4];
  load_a_fragments<kBM, kRowHalves, kThreads, kSplit>(
      af, af_lo, s_base, cta.a<T>(p), kHalves * p.a_row_stride,
      static_cast<int>(M - row0 < kBM ? M - row0 : kBM), depth, warp_row0);

  const TileCopyPlan<kBN, kRowHalves, kThreads> b_copy(tid, depth);
  const LaneTileOffsets<kRowHalves> b_off(lm_row + (lm_mat >> 1) * 8, lm_mat & 1);
  const int64_t n_end = p.causal ? (row0 + kBM < N ? row0 + kBM : N) : N;
  const int64_t tiles = (n_end + kBN - 1) / kBN;
  auto load_b = [&](int64_t tile, int stage) {
    const int64_t n0 = tile * kBN;
    b_copy.load(s_base + stage * Shape::kStageBytes, B + n0 * b_row_stride, b_row_stride,
                static_cast<int>(N - n0 < kBN ? N - n0 : kBN));
    cp_async_commit();
  };

  // Accumulator coordinates: row g (+8), columns 2t, 2t+1 of each n8 tile.
  const int g = lane >> 2, t = lane & 3;
  const int64_t first_row = row0 + warp_row0;  // this warp's first row
  const float c2 = static_cast<float>(p.scale) * kLog2e;
  constexpr int kVec = 16 / sizeof(T);  // outputs per 16-byte store
  const bool vec_store = N % kVec == 0;
  // Row (mi, hh)'s normalizer in base-2 units: max and sum in pass 1; in pass 2 the exponent base
  // and 1 / sum.
  float row_m[MT][2], row_s[MT][2];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) row_m[mi][hh] = -INFINITY, row_s[mi][hh] = 0.0f;

  load_b(0, 0);
  const int64_t steps = 2 * tiles;  // pass 1, then pass 2 over the same tiles
  for (int64_t step = 0; step < steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    const bool pass2 = step >= tiles;
    const int64_t n0 = (pass2 ? step - tiles : step) * kBN;
    cp_async_wait<0>();
    const uint32_t s_tile = s_base + stage * Shape::kStageBytes;
    if constexpr (kSplit) split_copied_chunks(b_copy, s_tile, Shape::kTileBytes);
    // Publishes this step's tile, and every warp is done with the other stage (the previous step).
    __syncthreads();
    if (step + 1 < steps) load_b(step + 1 < tiles ? step + 1 : step + 1 - tiles, stage ^ 1);

    float acc[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4(bf, s_tile + 2 * b_off.at(np * 16, ks));
        if constexpr (kSplit) {
          uint32_t bl[4];
          ldmatrix_x4(bl, s_tile + Shape::kTileBytes + 2 * b_off.at(np * 16, ks));
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            mma_3xtf32(acc[mi][2 * np], af[mi][ks], af_lo[mi][ks], bf[0], bf[1], bl[0], bl[1]);
            mma_3xtf32(acc[mi][2 * np + 1], af[mi][ks], af_lo[mi][ks], bf[2], bf[3], bl[2], bl[3]);
          }
        } else {
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            Mma16816<T>::run(acc[mi][2 * np], af[mi][ks], bf[0], bf[1]);
            Mma16816<T>::run(acc[mi][2 * np + 1], af[mi][ks], bf[2], bf[3]);
          }
        }
      }

    scale_and_mask<T, kMasked>(acc, p, cta, first_row, n0, c2);
    if (!pass2) {
      fold_tile(acc, row_m, row_s);
      continue;
    }

    if (step == tiles) {
      merge_quad(row_m, row_s);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          row_s[mi][hh] = inv_sum(row_m[mi][hh], row_s[mi][hh]);  // 0 with nothing visible
          if (row_m[mi][hh] == -INFINITY) row_m[mi][hh] = 0.0f;
        }
    }

#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t i = first_row + mi * 16 + g + 8 * hh;
#pragma unroll
        for (int q4 = 0; q4 < NT / 4; ++q4) {
          uint32_t w[4][kPW];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float* x = acc[mi][4 * q4 + q] + 2 * hh;
            pack_pair<T>(exp2f(x[0] - row_m[mi][hh]) * row_s[mi][hh],
                         exp2f(x[1] - row_m[mi][hh]) * row_s[mi][hh], w[q]);
          }
          quad_transpose(w, t);
          const int64_t j = n0 + q4 * 32 + t * 8;
          if (i >= M || j >= N) continue;
          T* dst = O + i * N + j;
          uint32_t f[4 * kPW];  // the lane's 8 outputs in order, as words
#pragma unroll
          for (int k = 0; k < 4 * kPW; ++k) f[k] = w[k / kPW][k % kPW];
          if (vec_store) {
#pragma unroll
            for (int v = 0; v < kPW; ++v)
              if (j + v * kVec < N)
                reinterpret_cast<uint4*>(dst)[v] =
                    make_uint4(f[4 * v], f[4 * v + 1], f[4 * v + 2], f[4 * v + 3]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              if (j + e >= N) continue;
              if constexpr (kSplit) {
                reinterpret_cast<uint32_t*>(dst)[e] = f[e];
              } else {
                // The (e % 2)-th half of word e / 2 (pack puts the first in the low bits).
                reinterpret_cast<uint16_t*>(dst)[e] =
                    static_cast<uint16_t>(f[e / 2] >> (16 * (e % 2)));
              }
            }
          }
        }
      }
  }

  // Causal: the columns past the CTA's last computed tile are invisible to all its rows.
  const int64_t z0 = tiles * kBN;
  if (z0 < N) {
    for (int r = 0; r < MT * 16 && first_row + r < M; ++r) {
      T* dst = O + (first_row + r) * N;
      if (vec_store) {
        for (int64_t j = z0 + lane * kVec; j < N; j += 32 * kVec)
          *reinterpret_cast<uint4*>(dst + j) = make_uint4(0, 0, 0, 0);
      } else {
        for (int64_t j = z0 + lane; j < N; j += 32) dst[j] = from_float<T>(0.0f);
      }
    }
  }
}

// Single pass (fp32, depth 65..128, rows that fit in shared memory): a CTA of 8 warps owns 16 rows
// (one m16 tile: every warp holds all of a's fragments, hi and lo) and the warps split each tile's
// 256 columns, 32 each. Each b element is read by one warp only, so warps split their own
// fragments into tf32 halves in registers and a stage holds raw fp32: 256 columns x 32 depth
// (32 KB), double-buffered, 4 stages per tile. Each tile's logits are computed once, scaled and
// masked, folded into the lanes' (max, sum) and parked in shared memory (16 x ~N fp32); after the
// last tile the warps merge their normalizers and every warp rewrites 2 rows from shared memory
// into `out` with 16-byte stores. Half the tensor-core work of the two-pass kernel; the logits
// are the same instructions on the same values, so they match it bit for bit.
struct RowsShape {
  static constexpr int kDepth = 128;
  static constexpr int kRows = 16;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kNTiles = 4;  // n8 accumulator tiles per warp
  static constexpr int kWarpCols = 8 * kNTiles;
  static constexpr int kBN = kWarps * kWarpCols;  // columns per tile
  static constexpr int kKSteps = kDepth / 8;
  static constexpr int kChunkHalves = 64;                    // a stage's depth: 32 fp32
  static constexpr int kChunkKSteps = kChunkHalves / 16;     // k-steps per stage
  static constexpr int kChunks = 2 * kDepth / kChunkHalves;  // stages per tile
  static constexpr int kStageBytes = kBN * kChunkHalves * 2;
  static constexpr int kRedOffset = 2 * kStageBytes;  // per-warp row normalizers
  static constexpr int kLogitsOffset = kRedOffset + kWarps * kRows * 2 * 4;
  static_assert(kChunks % 2 == 0, "a tile's stages start on stage 0");
  static_assert(kRows * kDepth * 4 <= 2 * kStageBytes, "a is staged in the b stages");
  // Row stride of the logits in floats: = 8 mod 32, so the float2 stores of a half-warp (rows
  // g = 0..3 x columns 2t, t = 0..3) hit 32 distinct banks; a multiple of 4 for float4 reads.
  __host__ __device__ static int64_t logit_stride(int64_t n) {
    return (n + kBN - 1) / kBN * kBN + 8;
  }
  static int64_t smem_bytes(int64_t n) { return kLogitsOffset + kRows * logit_stride(n) * 4; }
};

template <bool kMasked>
__global__ void __launch_bounds__(RowsShape::kThreads, 1)
    matmul_softmax_rows_kernel(const MatmulSoftmaxParams p) {
  using Shape = RowsShape;
  constexpr int kRows = Shape::kRows, kBN = Shape::kBN, NT = Shape::kNTiles;
  constexpr int KS = Shape::kKSteps, CKS = Shape::kChunkKSteps, kCH = Shape::kChunkHalves;
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t M = p.rows, N = p.cols;
  const CtaRows cta(p, kRows);
  const int64_t row0 = cta.row0;
  const uint16_t* B = cta.b_head<float>(p);
  const int64_t b_row_stride = 2 * p.b_row_stride;
  float* O = static_cast<float*>(p.out) + cta.bh * M * N;
  const int depth = 2 * static_cast<int>(p.depth);
  const uint32_t s_base = smem_addr(smem);
  auto* red = reinterpret_cast<float*>(smem + Shape::kRedOffset);
  auto* logits = reinterpret_cast<float*>(smem + Shape::kLogitsOffset);
  const int stride = static_cast<int>(Shape::logit_stride(N));

  uint32_t af[1][KS][4], af_lo[1][KS][4];
  load_a_fragments<kRows, 2 * Shape::kDepth, Shape::kThreads, true>(
      af, af_lo, s_base, cta.a<float>(p), 2 * p.a_row_stride,
      static_cast<int>(M - row0 < kRows ? M - row0 : kRows), depth, 0);

  const int64_t n_end = p.causal ? (row0 + kRows < N ? row0 + kRows : N) : N;
  const int64_t tiles = (n_end + kBN - 1) / kBN;
  // Stage `chunk % 2` <- depth [chunk * 32, +32) of the tile's rows (past the depth: zeros).
  auto load_b = [&](int64_t tile, int chunk) {
    const int64_t n0 = tile * kBN;
    const TileCopyPlan<kBN, kCH, Shape::kThreads> copy(tid, depth - chunk * kCH);
    copy.load(s_base + (chunk % 2) * Shape::kStageBytes, B + n0 * b_row_stride + chunk * kCH,
              b_row_stride, static_cast<int>(N - n0 < kBN ? N - n0 : kBN));
    cp_async_commit();
  };
  const int lm_mat = lane >> 3, lm_row = lane & 7;
  const LaneTileOffsets<kCH> b_off(lm_row + (lm_mat >> 1) * 8, lm_mat & 1);
  const int g = lane >> 2, t = lane & 3;
  const float c2 = static_cast<float>(p.scale) * kLog2e;
  float row_m[1][2] = {{-INFINITY, -INFINITY}}, row_s[1][2] = {{0.0f, 0.0f}};

  load_b(0, 0);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    float acc[1][NT][4];
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][ni][e] = 0.0f;
#pragma unroll
    for (int chunk = 0; chunk < Shape::kChunks; ++chunk) {
      cp_async_wait<0>();
      // Publishes this chunk, and every warp is done with the other stage (the previous chunk).
      __syncthreads();
      if (chunk + 1 < Shape::kChunks) {
        load_b(tile, chunk + 1);
      } else if (tile + 1 < tiles) {
        load_b(tile + 1, 0);
      }
      const uint32_t s_tile = s_base + (chunk % 2) * Shape::kStageBytes;
#pragma unroll
      for (int ks = 0; ks < CKS; ++ks)
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bf[4], bl[4];
          ldmatrix_x4(bf, s_tile + 2 * b_off.at(warp * Shape::kWarpCols + np * 16, ks));
#pragma unroll
          for (int e = 0; e < 4; ++e) split_tf32(bf[e], bf[e], bl[e]);
          const int k = chunk * CKS + ks;
          mma_3xtf32(acc[0][2 * np], af[0][k], af_lo[0][k], bf[0], bf[1], bl[0], bl[1]);
          mma_3xtf32(acc[0][2 * np + 1], af[0][k], af_lo[0][k], bf[2], bf[3], bl[2], bl[3]);
        }
    }
    const int c0 = static_cast<int>(tile * kBN) + warp * Shape::kWarpCols;
    scale_and_mask<float, kMasked>(acc, p, cta, row0, c0, c2);
    fold_tile(acc, row_m, row_s);
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<float2*>(logits + (g + 8 * hh) * stride + c0 + ni * 8 + 2 * t) =
            make_float2(acc[0][ni][2 * hh], acc[0][ni][2 * hh + 1]);
  }

  merge_quad(row_m, row_s);
  if (t == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float* r = red + 2 * (warp * kRows + g + 8 * hh);
      r[0] = row_m[0][hh], r[1] = row_s[0][hh];
    }
  }
  __syncthreads();

  // Warp w writes rows 2w, 2w + 1. Columns past the last computed tile (causal) are zeros.
  const int64_t n_comp = tiles * kBN < N ? tiles * kBN : N;
  const bool vec_store = N % 4 == 0;
#pragma unroll 1
  for (int r = warp * (kRows / Shape::kWarps); r < (warp + 1) * (kRows / Shape::kWarps); ++r) {
    const int64_t i = row0 + r;
    if (i >= M) break;
    float m = red[2 * r], s = red[2 * r + 1];
    for (int w = 1; w < Shape::kWarps; ++w)
      merge2(m, s, red[2 * (w * kRows + r)], red[2 * (w * kRows + r) + 1]);
    const float inv = inv_sum(m, s);  // 0 for a row with nothing visible
    if (m == -INFINITY) m = 0.0f;
    const float* x = logits + r * stride;
    float* dst = O + i * N;
    if (vec_store) {
      for (int64_t j = 4 * lane; j < N; j += 128) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (j < n_comp) {
          const float4 l = *reinterpret_cast<const float4*>(x + j);
          v = make_float4(exp2f(l.x - m) * inv, exp2f(l.y - m) * inv, exp2f(l.z - m) * inv,
                          exp2f(l.w - m) * inv);
        }
        __stcs(reinterpret_cast<float4*>(dst + j), v);  // streamed: keep L2 for b
      }
    } else {
      for (int64_t j = lane; j < N; j += 32)
        __stcs(dst + j, j < n_comp ? exp2f(x[j] - m) * inv : 0.0f);
    }
  }
}

// Logit j (< the row's visible limit) of row i as the fallback's normalizers see it: without a
// mask tensor the scale alone, which keeps the per-element mask offsets out of the loops.
template <typename T, bool kMasked>
__device__ __forceinline__ float fallback_logit(float raw, const MatmulSoftmaxParams& p, int64_t b,
                                                int64_t h, int64_t i, int64_t j) {
  if constexpr (kMasked) return masked_logit<T>(raw, p, b, h, i, j);
  return raw * static_cast<float>(p.scale);
}

// Fallback normalize, rows up to kRowThreads * kPacks * kVec long: each of a row's kRowThreads
// threads caches its packs of the row (scaled and masked, fp32) in registers, so `out` is read
// once and written once. A block of kThreads takes kThreads / kRowThreads rows: rows of one warp
// need no block barrier, and four of them keep a 128-thread block busy (H200, fp32 rows of 512:
// a 128-thread block a row left the normalize at ~2.3 TB/s against torch softmax's ~3.4).
constexpr int kPacks = 4;

template <typename T, int kVec, int kThreads, bool kMasked, int kRowThreads = kThreads>
__global__ void __launch_bounds__(kThreads) normalize_cached_kernel(const MatmulSoftmaxParams p) {
  constexpr int kWarps = kRowThreads / 32;  // a row's warps
  static_assert(kRowThreads % 32 == 0 && kThreads % kRowThreads == 0 &&
                    (kWarps == 1 || kRowThreads == kThreads),
                "whole warps a row; a row of several warps has the block to itself");
  __shared__ float warp_m[kWarps], warp_s[kWarps];
  constexpr bool kBlockRow = kRowThreads == kThreads;
  const int64_t M = p.rows, N = p.cols;
  // A block's own row takes no index arithmetic before its loads (nor a bound: the grid is the
  // rows).
  const int64_t row =
      kBlockRow ? int64_t(blockIdx.x)
                : blockIdx.x * int64_t(kThreads / kRowThreads) + threadIdx.x / kRowThreads;
  if constexpr (!kBlockRow) {
    if (row >= p.batch * p.heads_a * M) return;  // whole warps: the last block's spare rows
  }
  const unsigned t = kBlockRow ? threadIdx.x : threadIdx.x % kRowThreads;
  const int64_t i = row % M, h = (row / M) % p.heads_a, b = row / (M * p.heads_a);
  const int64_t limit = p.causal ? (i + 1 < N ? i + 1 : N) : N;
  T* o = static_cast<T*>(p.out) + row * N;
  float v[kPacks][kVec];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t j0 = (int64_t(k) * kRowThreads + t) * kVec;
    Pack<T, kVec> pk;
    if (j0 < limit) pk = *reinterpret_cast<const Pack<T, kVec>*>(o + j0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      v[k][e] = j0 + e < limit ? fallback_logit<T, kMasked>(to_float(pk.v[e]), p, b, h, i, j0 + e)
                               : -INFINITY;
      m = fmaxf(m, v[k][e]);
    }
  }
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) s += exp_from(v[k][e], m);
  warp_merge(m, s);
  if constexpr (kWarps > 1) {
    if (t % 32 == 0) warp_m[t / 32] = m, warp_s[t / 32] = s;
    __syncthreads();  // every warp's (m, s) stored before any warp merges them
    m = warp_m[0], s = warp_s[0];
    for (int w = 1; w < kWarps; ++w) merge(m, s, warp_m[w], warp_s[w]);
  }
  const float inv = inv_sum(m, s);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t j0 = (int64_t(k) * kRowThreads + t) * kVec;
    if (j0 >= N) break;
    Pack<T, kVec> pk;
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      pk.v[e] = from_float<T>(j0 + e < limit ? exp_from(v[k][e], m) * inv : 0.0f);
    *reinterpret_cast<Pack<T, kVec>*>(o + j0) = pk;
  }
}

// Fallback normalize for longer rows: one pass for the normalizer, one to rewrite.
template <typename T, bool kMasked>
__global__ void __launch_bounds__(256) normalize_logits_kernel(const MatmulSoftmaxParams p) {
  __shared__ float warp_m[8], warp_s[8];
  const int64_t M = p.rows, N = p.cols;
  const int64_t row = blockIdx.x, i = row % M, h = (row / M) % p.heads_a, b = row / (M * p.heads_a);
  const int64_t limit = p.causal ? (i + 1 < N ? i + 1 : N) : N;
  T* o = static_cast<T*>(p.out) + row * N;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < limit; j += blockDim.x) {
    const float x = fallback_logit<T, kMasked>(to_float(o[j]), p, b, h, i, j);
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
    o[j] = from_float<T>(
        j < limit ? exp_from(fallback_logit<T, kMasked>(to_float(o[j]), p, b, h, i, j), m) * inv
                  : 0.0f);
}

// A fused launch; false, launching nothing and clearing the error, where it cannot run (too many
// blocks, or the device refuses the shared memory past 48 KB): the caller falls back.
template <typename Kernel>
bool launch_or_fall_back(Kernel kernel, int64_t blocks, int threads, int64_t smem,
                         const MatmulSoftmaxParams& p, cudaStream_t stream) {
  if (launch_kernel(kernel, blocks, threads, smem, stream, p) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

template <typename T, int kDepth>
bool launch_fused(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  using Shape = FusedShape<T, kDepth>;
  const auto kernel = p.mask_kind == MaskKind::kNone ? matmul_softmax_fused_kernel<T, kDepth, false>
                                                     : matmul_softmax_fused_kernel<T, kDepth, true>;
  // fp32 stages (b's hi and lo tiles) pass the 48 KB of shared memory a launch gets by default.
  return launch_or_fall_back(kernel, (p.rows + Shape::kBM - 1) / Shape::kBM * p.batch * p.heads_a,
                             Shape::kThreads, Shape::kSmemBytes, p, stream);
}

// The longest rows the single-pass kernel takes: what the device's shared memory per block allows,
// or p.single_pass_max_cols when set (FLASHMOD_MMSM_SINGLE_PASS_MAX_N: tests force either path; 0
// disables it).
int64_t single_pass_max_cols(const MatmulSoftmaxParams& p) {
  if (p.single_pass_max_cols >= 0) return p.single_pass_max_cols;
  const int optin = cuda::device_smem_optin();
  if (optin == 0) return 0;
  int64_t n = (optin - RowsShape::kLogitsOffset) / (RowsShape::kRows * 4) - 8;
  n = n / RowsShape::kBN * RowsShape::kBN;  // logit_stride(n) * 16 * 4 fits
  return n > 0 ? n : 0;
}

bool launch_single_pass(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  if (p.cols > single_pass_max_cols(p)) return false;
  const auto kernel = p.mask_kind == MaskKind::kNone ? matmul_softmax_rows_kernel<false>
                                                     : matmul_softmax_rows_kernel<true>;
  return launch_or_fall_back(
      kernel, (p.rows + RowsShape::kRows - 1) / RowsShape::kRows * p.batch * p.heads_a,
      RowsShape::kThreads, RowsShape::smem_bytes(p.cols), p, stream);
}

template <typename T>
bool launch_fused_typed(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  if (p.depth <= 32) return launch_fused<T, 32>(p, stream);
  if (p.depth <= 64) return launch_fused<T, 64>(p, stream);
  if (sizeof(T) == 4 && p.depth <= RowsShape::kDepth && launch_single_pass(p, stream)) return true;
  if (p.depth <= 128) return launch_fused<T, 128>(p, stream);
  if constexpr (sizeof(T) == 4) {
    return false;  // excluded by the caller (kMaxDepthF32)
  } else {
    return launch_fused<T, 256>(p, stream);
  }
}

// A warp per row, four to a block, where a row fits a warp's registers; else a block per row: the
// row cached in registers where it fits 512 threads, else read twice.
template <typename T, int kVec, bool kMasked>
cudaError_t launch_normalize_rows(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_a * p.rows;
  if (p.cols <= 32 * kPacks * kVec && p.normalize_warp_rows)
    return launch_kernel(normalize_cached_kernel<T, kVec, 128, kMasked, 32>, (rows + 3) / 4, 128, 0,
                         stream, p);
  if (p.cols <= 128 * kPacks * kVec)
    return launch_kernel(normalize_cached_kernel<T, kVec, 128, kMasked>, rows, 128, 0, stream, p);
  if (p.cols <= 512 * kPacks * kVec)
    return launch_kernel(normalize_cached_kernel<T, kVec, 512, kMasked>, rows, 512, 0, stream, p);
  return launch_kernel(normalize_logits_kernel<T, kMasked>, rows, 256, 0, stream, p);
}

template <typename T, int kVec>
cudaError_t launch_normalize_rows(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  return p.mask_kind == MaskKind::kNone ? launch_normalize_rows<T, kVec, false>(p, stream)
                                        : launch_normalize_rows<T, kVec, true>(p, stream);
}

template <typename T>
cudaError_t launch_normalize(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.cols % kVec == 0 && aligned16(p.out);
  return vec ? launch_normalize_rows<T, kVec>(p, stream) : launch_normalize_rows<T, 1>(p, stream);
}

}  // namespace

bool launch_matmul_softmax_fused(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  if (p.dtype == ScalarKind::kFloat64) return false;
  const bool f32 = p.dtype == ScalarKind::kFloat32;
  // 16-byte loads of a's and b's rows need every row start 16-byte aligned: v elements.
  const int64_t v = f32 ? 4 : 8;
  const bool layout_ok = p.depth % v == 0 && p.depth <= (f32 ? kMaxDepthF32 : kMaxDepth) &&
                         aligned16(p.a) && aligned16(p.b) && aligned16(p.out) &&
                         p.a_row_stride % v == 0 && p.a_head_stride % v == 0 &&
                         p.a_batch_stride % v == 0 && p.b_row_stride % v == 0 &&
                         p.b_head_stride % v == 0 && p.b_batch_stride % v == 0;
  if (!layout_ok) return false;
  if (f32) return launch_fused_typed<float>(p, stream);
  if (p.dtype == ScalarKind::kFloat16) return launch_fused_typed<__half>(p, stream);
  return launch_fused_typed<__nv_bfloat16>(p, stream);
}

cudaError_t launch_normalize_logits_in_place(const MatmulSoftmaxParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarKind::kFloat32: return launch_normalize<float>(p, stream);
    case ScalarKind::kFloat16: return launch_normalize<__half>(p, stream);
    case ScalarKind::kBFloat16: return launch_normalize<__nv_bfloat16>(p, stream);
    case ScalarKind::kFloat64: break;  // rejected by the host checks before any launch
  }
  return cudaSuccess;
}

}  // namespace flashmod::cuda
