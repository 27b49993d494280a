// Plain descriptions of one softmax / matmul_softmax call, as every backend kernel receives them.
//
// No torch headers (the CUDA translation units include only this file, so nvcc compiles them on a
// machine without torch or a GPU). csrc/softmax/softmax_host.cpp fills them after the shared
// checks.
#pragma once

#include <cstdint>

#include "../common/scalar_kinds.h"

namespace flashmod {

// Test and benchmark switches of the CUDA softmax (README's knob table), read through
// csrc/common/knobs.h by the host glue (softmax_cuda.cpp); the defaults are what users get.
struct SoftmaxCudaKnobs {
  bool trace = false;      // FLASHMOD_SOFTMAX_TRACE=1: print each long row's launch path to stderr
  bool stream = true;      // FLASHMOD_SOFTMAX_STREAM=0: no sm_90 stream path
  int stream_cluster = 0;  // FLASHMOD_SOFTMAX_STREAM_CLUSTER=c: that stream-path cluster size
};

// softmax over one dimension of a contiguous tensor viewed as (outer, dim_size, inner): element
// (o, d, i) lives at (o * dim_size + d) * inner + i, and each (o, i) pair is one independent row of
// dim_size elements with stride `inner`. inner == 1 is the common last-dimension case.
struct SoftmaxParams {
  const void* x = nullptr;
  void* y = nullptr;  // same shape and dtype as x, contiguous
  int64_t outer = 0;
  int64_t dim_size = 0;
  int64_t inner = 1;
  ScalarKind dtype = ScalarKind::kFloat32;
  SoftmaxCudaKnobs knobs;
};

// out = softmax(scale * a @ b^T + mask, -1) for a (B, Ha, M, K), b (B, Hb, N, K), out (B, Ha, M,
// N). Row (b, h, i) of out is a probability vector over the N keys; a-head h reads b-head h / (Ha /
// Hb) (grouped-query attention). Column j is visible to row i iff
// (!causal || j <= i) && mask(b, h, i, j): the top-left causal diagonal of SDPA's is_causal.
// A row with no visible column is written as all zeros.
struct MatmulSoftmaxParams {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;         // contiguous (B, Ha, M, N)
  const void* mask = nullptr;  // viewed as (B, Ha, M, N) through strides; broadcast dims stride 0

  // Element strides of (batch, head, row); a's and b's last dimension has stride 1.
  int64_t a_batch_stride = 0, a_head_stride = 0, a_row_stride = 0;
  int64_t b_batch_stride = 0, b_head_stride = 0, b_row_stride = 0;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  int64_t batch = 0;
  int64_t heads_a = 0;
  int64_t heads_b = 0;  // heads_a % heads_b == 0
  int64_t rows = 0;     // M
  int64_t cols = 0;     // N
  int64_t depth = 0;    // K

  double scale = 1.0;
  bool causal = false;
  ScalarKind dtype = ScalarKind::kFloat32;
  MaskKind mask_kind = MaskKind::kNone;
  // FLASHMOD_MMSM_SINGLE_PASS_MAX_N=n (CUDA host glue): the longest rows (N) of fp32's single-pass
  // kernel, 0 for always two passes; -1 (unset): what the device's shared memory allows.
  int64_t single_pass_max_cols = -1;
  // FLASHMOD_MMSM_WARP_ROWS=0 (CUDA host glue): the fallback's normalize takes a block per row even
  // where a row fits a warp (A/B, tests).
  bool normalize_warp_rows = true;
};

}  // namespace flashmod
