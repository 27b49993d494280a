// Which fused kernels run the fp16/bf16 backward (after its row statistics), shared by the dense
// op (attention_backward_cuda.cpp) and the variable-length one (serve_backward_cuda.cpp): the
// Hopper (wgmma) kernels where the build has them for the head dim, in the tile that
// FLASHMOD_BWD_SM90_TILE names or the default one, else the portable mma.sync kernels. Both
// families take per-sequence extents (sequence_view_bwd) themselves.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../sequence_view.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "host_alignment.h"

namespace flashmod {

// The row of kBwdSm90Tiles to run for padded head dim d: the one FLASHMOD_BWD_SM90_TILE names, or
// the default tile when it is unset. A name with no build for d is an error listing those built.
inline int bwd_sm90_tile(const char* op, int d, const AttentionBwdParams& p,
                         const cuda_kernels::BwdRowStats& st) {
  const std::string name = env_text("FLASHMOD_BWD_SM90_TILE");
  const int additive = cuda_kernels::bwd_sm90_additive_tile(d);
  if (name.empty() && additive >= 0 && cuda_kernels::bwd_additive_fast(p, st)) return additive;
  const int tile = cuda_kernels::find_tile(cuda_kernels::kBwdSm90Tiles, name.c_str(), d);
  if (tile < 0) {
    std::string built;
    for (const cuda_kernels::KernelTile& t : cuda_kernels::kBwdSm90Tiles)
      if (t.head_dim == d) built += (built.empty() ? "" : ", ") + std::string(t.name);
    TORCH_CHECK(false, error_message(op, ": FLASHMOD_BWD_SM90_TILE=", name,
                                     " names no Hopper backward tile for head dim ", d,
                                     "; expected one of: ", built));
  }
  return tile;
}

// Queries a key sees, on average: all of them without a window, about half under a one-sided
// bound (causal), the band's width under a two-sided one.
inline int64_t bwd_queries_per_key(const AttentionBwdParams& p) {
  const bool left = p.window_left >= 0, right = p.window_right >= 0;
  if (left && right) return std::min(p.seqlen_q, p.window_left + p.window_right + 1);
  return left || right ? p.seqlen_q / 2 : p.seqlen_q;
}

// Whether the backward adds dQ up by atomics (bwd_fused_dq; not bitwise reproducible):
// FLASHMOD_BWD_FUSED_DQ=1 (the default) where it is the faster, with
// torch.use_deterministic_algorithms off; 0 never; 2 wherever bwd_fused_dq allows (tests, whose
// fixture turns deterministic algorithms on to poison allocations, and measurements).
// Where it is the faster: H100, bf16, D = 128, B * N = 16k, forward + backward against the
// seven-matmul kernels in one process (design log, session 29; sessions 28's kernel times agree):
//   no window: N = 1k +2.4 % (GQA 32/8 +4 %), 2k +6 %, 4k-16k +8-11 % (GQA 4k +8 %);
//   causal: 1k -7 % (GQA -8 %), 2k -1 %, 4k +4 % (GQA +0.6 %), 8k-16k +7-10 %;
//   causal band of 1024 queries: -4 % at 4k and 16k.
// Re-measured after sessions 30-31 sped up both paths (H200, same process, fused / seven matmuls):
// no window 1k 1.06, 2k 1.10, 4k-16k 1.13-1.15 (GQA 1k 1.09, 4k 1.14); causal 1k 0.96, 2k 1.01,
// 4k 1.08, 8k-16k 1.11-1.13 (GQA 1k 0.97, 4k 1.05); causal band of 1024 queries 1.00-1.01. The
// rule stands; causal 2k and the bands are ties either way.
// D = 64 (steps of 128 queries; H100, bf16, B * N = 16k, same process, session 32), fused / seven
// matmuls: no window 1k 0.97, 2k 1.03, 4k 1.06, 8k 1.11, 16k 1.08; causal 1k 0.86, 2k 0.95, 4k
// 1.02, 8k 1.07, 16k 1.13.
// Session 47 (H200, the sums now cleared by the statistics kernel; same process, two rounds each,
// fused / seven matmuls): D = 128 no window 1k 1.07, 2k 1.11-1.12, 4k 1.13, 8k-16k 1.14-1.15;
// causal 1k 0.95, 2k 1.02 / 1.02, 4k 1.08, 8k-16k 1.11-1.14. D = 64 no window 1k 0.99, 2k 1.04,
// 4k 1.06, 8k 1.08, 16k 1.10; causal 1k 0.88, 2k 0.96, 4k 1.03-1.04, 8k 1.08, 16k 1.11.
// A key's walk over its queries carries the adds' fixed costs, so the rule is the queries a key
// sees: at D = 128 >= 1024, whether or not a bound halves them (causal 2k, 1024 a key on average,
// was a tie until session 47 and is now the fused variant's by 2 %; a causal band of 1024 is a
// tie); at D = 64, a step of twice the queries with the same fixed costs, >= 2048; and >= 1024
// keys (only square shapes were measured).
// Session 50 (H200, bf16, same process, after session 49's deferred fences sped the D = 64 fused
// kernel up by 7 % and this session's overlap the D = 128 one by 3 %), fused / seven matmuls:
// D = 64 no window 1k 1.025, 2k-16k 1.09-1.16; causal 1k 0.91, 2k 1.005, 4k-16k 1.09-1.17; D = 128
// causal 1k 0.975, everything else from 1.05. So D = 64 now takes the fused variant from 1024
// queries a key too (causal 2k is a tie); D = 128's rule stands.
// Under dropout the dQ kernel draws every keep bit again, which the fused variant does not
// (H200, bf16, p = 0.1, same process, session 41, fused / seven matmuls): D = 128 no window 1k
// 1.11 (GQA 32/8 1.14), 4k 1.18 (1.19); causal 1k 1.01 (1.02), 4k 1.14 (1.13); D = 64 no window
// 1k 1.05, 4k 1.12; causal 1k 0.96, 4k 1.10. So >= 512 queries a key at D = 128, window or not,
// and >= 1024 at D = 64.
inline int64_t fused_dq_min_queries(int padded_head_dim, bool dropout) {
  if (padded_head_dim == 64) return 1024;
  return dropout ? 512 : 1024;
}
constexpr int64_t kBwdFusedDQMinKeys = 1024;
// Packed rows (a variable-length call) take the rule at their mean lengths (max_seqlen bounds
// every sequence, the totals say what a typical one walks). The dQ kernel's per-sequence variant
// loads by cp.async, so the fused variant wins wider there. Measured on an H200 (bf16, H * D =
// 2048, B 8 / 16, ragged lengths, the fused variant forced against the dQ kernel in one process,
// sessions 45-46), fused / dQ kernel:
//   D = 128, no band: non-causal 1.13-1.26, causal 1.06-1.22 at mean lengths 1267-4667, so from
//     a mean of kBwdFusedDQMinKeys keys whatever a one-sided bound leaves a key;
//   D = 128, two-sided band (mean 3928-4667; causal rows (W, 0)): 256 queries a key 0.91, 511-512
//     0.99, 1023-1024 1.08, 2047 1.15-1.17: from 768, between the tie and the win;
//   D = 64, no band: non-causal 1.04 at means 1267-1409, 1.12 at 2257-2548, 1.12-1.17 at
//     3928-4667; causal 0.95, 1.04-1.05, 1.10-1.13: from 1024 queries a key (causal: half);
//   D = 64, two-sided band: 512 queries a key 0.89, 1023 0.98: 2048 without dropout (the dense
//     rule then; not re-measured since the deferred fences), 1024 under it.
inline int64_t packed_fused_dq_min_queries(int padded_head_dim, bool band, bool dropout) {
  const int64_t dense = fused_dq_min_queries(padded_head_dim, dropout);
  if (padded_head_dim == 128) return band ? std::min<int64_t>(768, dense) : 0;
  return band && !dropout ? 2048 : dense;
}

// FLASHMOD_BWD_FUSED_DQ: 0 never, 1 (the default) by each path's rule and never under
// torch.use_deterministic_algorithms, 2 wherever the kernels can.
inline int64_t fused_dq_knob() {
  const int64_t knob = env_int("FLASHMOD_BWD_FUSED_DQ", 1);
  TORCH_CHECK(knob >= 0 && knob <= 2,
              error_message("FLASHMOD_BWD_FUSED_DQ must be 0, 1 or 2, got ", knob));
  return knob;
}

inline bool fused_dq_wanted(const AttentionBwdParams& p, int padded_head_dim) {
  const int64_t knob = fused_dq_knob();
  if (knob != 1) return knob == 2;
  if (at::globalContext().deterministicAlgorithms()) return false;
  AttentionBwdParams typical = p;
  const bool packed = p.cu_seqlens_q != nullptr && p.batch > 0;
  if (packed) {
    typical.seqlen_q = p.packed_rows_q / p.batch;
    typical.seqlen_k = p.packed_rows_k / p.batch;
  }
  if (typical.seqlen_k < kBwdFusedDQMinKeys) return false;
  const bool dropout = p.dropout_rng != nullptr;
  if (packed) {
    const bool band = p.window_left >= 0 && p.window_right >= 0;
    return bwd_queries_per_key(typical) >=
           packed_fused_dq_min_queries(padded_head_dim, band, dropout);
  }
  return bwd_queries_per_key(typical) >= fused_dq_min_queries(padded_head_dim, dropout);
}

// Whether the fp32 (3xTF32) backward adds dQ from its dK/dV kernel (BwdRowStats::tf32_fused_dq;
// past head dim 128 from its dK launch), by the FLASHMOD_BWD_FUSED_DQ rule without a length bound:
// forward + backward against the dQ kernel beside dK/dV, H200, session 53, 1.14-1.27x at B 4, H 16,
// N 1k / 4k, D 64 / 128, causal and not, 1.11-1.23x at N = 128-512 and 8k, 1.12-1.18x at
// D = 160 / 256.
inline bool tf32_fused_dq_wanted() {
  const int64_t knob = fused_dq_knob();
  return knob == 2 || (knob == 1 && !at::globalContext().deterministicAlgorithms());
}

// BwdRowStats::tf32_wide_smem and tf32_pairs from FLASHMOD_BWD_TF32_WIDE: 1 (default) the widest
// tiles the current device's opt-in shared memory per block takes; 0 the A100 tiles, 2 no warp
// pairs (tests run those tiles on Hopper with them).
inline void choose_tf32_tiles(cuda_kernels::BwdRowStats& st) {
  const int64_t knob = env_int("FLASHMOD_BWD_TF32_WIDE", 1);
  TORCH_CHECK(knob >= 0 && knob <= 2,
              error_message("FLASHMOD_BWD_TF32_WIDE must be 0, 1 or 2, got ", knob));
  st.tf32_wide_smem = knob == 0 ? 0 : cuda::device_smem_optin();
  st.tf32_pairs = knob != 2;
}

// The stream the backward's dQ kernel runs on beside the dK/dV launch (BwdRowStats::dq_stream): one
// of the c10 pool's, or nullptr under FLASHMOD_BWD_DQ_BESIDE=0 (after dK/dV on the call's stream).
// Called under the op's device guard.
inline cudaStream_t dq_beside_stream(const at::TensorOptions& options) {
  if (!env_flag("FLASHMOD_BWD_DQ_BESIDE", true)) return nullptr;
  return c10::cuda::getStreamFromPool(false, options.device().index()).stream();
}

// The row statistics (cuda_kernels::run_attention_bwd_rowstats into st's buffers), then dK/dV and
// dQ of fp16/bf16 p, after classifying a mask tensor's tiles
// (cuda_kernels::classify_bwd_mask_tiles; FLASHMOD_BWD_MASK_TILES=0 leaves every tile mixed) in
// workspace memory of `options`' device. The fused dQ's sums are zeroed by the statistics' kernel
// (a memset of their own: 30 us of a 1.09 ms training step, H200, B 16, H 16, N 1k, D 128; session
// 47). An unsupported head dim is an error naming op.
inline cudaError_t run_fused_backward(const char* op, AttentionBwdParams p,
                                      const cuda_kernels::BwdRowStats& st,
                                      const at::TensorOptions& options, cudaStream_t stream) {
  TorchWorkspace workspace(options, stream);  // the mask's tile classes, freed in stream order
  const int portable = cuda_kernels::padded_head_dim(cuda_kernels::kBwdSm80HeadDims, p.head_dim);
  const int padded = sm90_widened_head_dim(cuda_kernels::kBwdSm90HeadDims, p.head_dim, portable);
  const int key = cuda_kernels::variant_key(p.dtype, padded);
  const bool sm90 =
      sm90_kernels_usable() && cuda_kernels::has_head_dim(cuda_kernels::kBwdSm90HeadDims, padded);
  // Tile indices are below 64 (tools/gen_kernels.py checks). Variable-length and dropout calls
  // run the default tile, the only one built with their variants (bwd_sm90_launch.h).
  const int tile = !sm90 ? 0
                   : has_sequence_extents(p) || p.dropout_rng != nullptr
                       ? cuda_kernels::find_tile(cuda_kernels::kBwdSm90Tiles, "", padded)
                       : bwd_sm90_tile(op, padded, p, st);
  cuda_kernels::BwdRowStats run_st = st;
  run_st.defer_fences = env_flag("FLASHMOD_BWD_DEFERRED_FENCES", true);
  run_st.fused_overlap = env_flag("FLASHMOD_BWD_FUSED_OVERLAP", true);
  run_st.dq_stream = dq_beside_stream(options);
  int64_t sum_floats = 0;
  if (sm90 && cuda_kernels::kBwdSm90Tiles[tile].is_default &&
      cuda_kernels::bwd_fused_dq(p, padded) && fused_dq_wanted(p, padded)) {
    sum_floats = cuda_kernels::dq_sums_floats(p, st, padded);
    const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
    run_st.dq_accum = static_cast<float*>(ws.alloc(ws.ctx, sum_floats * sizeof(float)));
    if (run_st.dq_accum == nullptr) return cudaErrorMemoryAllocation;
  }
  cudaError_t err = cuda_kernels::run_attention_bwd_rowstats(p, run_st, stream, sum_floats);
  if (err != cudaSuccess) return err;
  if (p.mask_kind != MaskKind::kNone && env_flag("FLASHMOD_BWD_MASK_TILES", true)) {
    err = cuda_kernels::classify_bwd_mask_tiles(p, workspace.hooks(), stream);
    if (err != cudaSuccess) return err;
  }
  if (sm90) {
    switch (key * 64 + tile) {
#define FLASHMOD_BWD_SM90_CASE(Elem, kind, D, T)                \
  case cuda_kernels::variant_key(ScalarKind::kind, D) * 64 + T: \
    return cuda_kernels::run_attention_bwd_sm90<Elem, D, T>(p, run_st, stream);
      FLASHMOD_BWD_SM90_VARIANTS(FLASHMOD_BWD_SM90_CASE)
#undef FLASHMOD_BWD_SM90_CASE
    }
  }
  // The portable kernels read none of run_st's Hopper fields (sums, fences, overlap); their dQ
  // kernel runs beside dK/dV too.
  switch (cuda_kernels::variant_key(p.dtype, portable)) {
#define FLASHMOD_BWD_CASE(Elem, kind, D)               \
  case cuda_kernels::variant_key(ScalarKind::kind, D): \
    return cuda_kernels::run_attention_bwd<Elem, D>(p, run_st, stream);
    FLASHMOD_BWD_SM80_VARIANTS(FLASHMOD_BWD_CASE)
#undef FLASHMOD_BWD_CASE
  }
  TORCH_CHECK(false, error_message(op, ": unsupported head_dim ", p.head_dim));
}

}  // namespace flashmod
