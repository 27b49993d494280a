// Torch-side helpers of the CUDA host code (forward and backward): the CUDA-only input checks,
// which kernel family runs, the 16-byte row alignment the cp.async tile loads need, the padded
// copy taken when an input lacks it, and the launches' scratch memory.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdint>
#include <vector>

#include "../../common/alignment.h"
#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../attention_host.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "stream_counters.h"

namespace flashmod {

constexpr int64_t kCudaMaxHeadDim = 256;

// What CUDA adds to the shared checks (same order and wording as flashmod/ops.py's fakes).
inline void check_cuda_attention_inputs(const char* op, const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() != at::kDouble,
              flashmod::error_message(
                  op, ": q's dtype float64 is supported on CPU only, got it on ", q.device()));
  TORCH_CHECK(q.size(3) <= kCudaMaxHeadDim,
              flashmod::error_message(op, ": q's head_dim must be <= ", kCudaMaxHeadDim,
                                      " on CUDA, got ", q.size(3)));
}

// A dropout call's arguments (attention_dropout and its backward); the CUDA host passes nullptr
// for calls without dropout.
struct DropoutArgs {
  double p;
  const at::Tensor& rng_state;
};

// Dropout's arguments into p: CUDA's dtype rule (fp16/bf16 only, the dtypes of the sm_80 kernels
// that carry it), then the shared set_dropout (attention_host.h). flashmod/ops.py's
// _check_dropout_args mirrors both.
inline void set_cuda_dropout(AttentionParams& p, const char* op, const at::Tensor& q,
                             const DropoutArgs& dropout) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              flashmod::error_message(op, ": fused dropout takes float16 or bfloat16 q, got ",
                                      q.scalar_type()));
  set_dropout(p, op, q, dropout.p, dropout.rng_state);
}

// The wgmma (Hopper) kernels run on sm_90 (H100/H200) when the build carries their sm_90a machine
// code. FLASHMOD_DISABLE_SM90=1 forces the portable mma.sync kernels (tests compare the two;
// benchmarks time both).
inline bool sm90_kernels_usable() {
#ifdef FLASHMOD_BUILT_SM90A
  if (env_flag("FLASHMOD_DISABLE_SM90", false)) return false;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
#else
  return false;
#endif
}

// The padded head dim of the fp16/bf16 kernels that serve head_dim d: `portable` (the mma.sync
// kernels' size for d, which the Hopper kernels share at 64 / 128 / 256, and 192 where they have
// it) or, on Hopper, the next of the Hopper kernels' sizes (`hopper`, ascending) up from it: their
// zero columns cost the tensor cores 1 / 8 to 1 / 2 of the work, and at D = 96 / 160 / 192 the
// portable kernels ran at half of cuDNN's speed (H200, forward + backward, session 57).
// FLASHMOD_SM90_WIDEN=0 keeps the portable size (tests and benchmarks compare the two).
template <int N>
int sm90_widened_head_dim(const int (&hopper)[N], int64_t d, int portable) {
  if (!sm90_kernels_usable() || cuda_kernels::has_head_dim(hopper, portable) ||
      !env_flag("FLASHMOD_SM90_WIDEN", true))
    return portable;
  const int wide = cuda_kernels::padded_head_dim(hopper, d);
  return wide > 0 ? wide : portable;
}

// The wgmma kernels where they exist for this (padded) head dim.
inline bool use_sm90_kernel(int padded_head_dim) {
  return sm90_kernels_usable() &&
         cuda_kernels::has_head_dim(cuda_kernels::kFwdSm90HeadDims, padded_head_dim);
}

// The warp-specialized TMA kernels (fwd_sm90_ws_kernel.h) where they exist for this head dim;
// they hand what they cannot take (masks, soft cap, paged or cache-length K/V, strides TMA cannot
// address) to the kernel above themselves. FLASHMOD_SM90_WS=0 sends everything to that one (tests
// and benchmarks compare the two).
inline bool use_sm90_ws_kernel(int padded_head_dim) {
  return sm90_kernels_usable() &&
         cuda_kernels::has_head_dim(cuda_kernels::kFwdSm90WsHeadDims, padded_head_dim) &&
         env_flag("FLASHMOD_SM90_WS", true);
}

// The decode path's knobs, read per call: FLASHMOD_DECODE_SPLITS=n (exactly n splits),
// FLASHMOD_DECODE_FUSED_COMBINE=0 (the combine kernel instead of each tile's last CTA),
// FLASHMOD_DECODE_TMA=0 (K/V by cp.async only; the copy engine needs the sm_90a build),
// FLASHMOD_FLAT_GRID=1 (a 1-D grid), FLASHMOD_DECODE_KEY_SPLIT=0 (no key-split kernel).
inline cuda_kernels::DecodeOptions decode_options() {
  cuda_kernels::DecodeOptions opt;
  // torch caches the properties per device (one cudaGetDeviceProperties each).
  opt.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  opt.forced_splits = static_cast<int>(env_int("FLASHMOD_DECODE_SPLITS", 0));
  opt.fused_combine = env_flag("FLASHMOD_DECODE_FUSED_COMBINE", true);
  opt.kv_tma = sm90_kernels_usable() && env_flag("FLASHMOD_DECODE_TMA", true);
  opt.flat_grid = env_flag("FLASHMOD_FLAT_GRID", false);
  opt.key_split = env_flag("FLASHMOD_DECODE_KEY_SPLIT", true);
  return opt;
}

// cp.async copies 16-byte chunks from 16-byte aligned addresses, so every row start must be
// 16-byte aligned: base pointer aligned and every stride but the last (the rows are contiguous) a
// multiple of 8 elements. Any rank, so that the dense (B, H, N, D) tensors, the packed varlen
// (total, H, D) ones and the (B, N, H, D) KV-cache inputs share one rule.
inline bool rows_aligned16(const at::Tensor& t) {
  if (!aligned16(t.data_ptr())) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % 8 != 0) return false;
  return true;
}

// Gradient rows start at even elements: the backward kernels store element pairs as one word
// (store_rows in bwd_common.h). Any rank, as rows_aligned16.
inline bool rows_aligned_pairs(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 * t.element_size()) != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % 2 != 0) return false;
  return true;
}

// BwdRowStats::vec_store for the gradients (rows as rows_aligned16 / rows_aligned_pairs read them;
// FLASHMOD_BWD_STAGED_STORES=0 stops at pairs).
inline int grad_store_kind(const at::Tensor& grad_q, const at::Tensor& grad_k,
                           const at::Tensor& grad_v, int64_t head_dim) {
  if (!rows_aligned_pairs(grad_q) || !rows_aligned_pairs(grad_k) || !rows_aligned_pairs(grad_v))
    return cuda_kernels::kGradStoreElements;
  return head_dim % 8 == 0 && env_flag("FLASHMOD_BWD_STAGED_STORES", true) &&
                 rows_aligned16(grad_q) && rows_aligned16(grad_k) && rows_aligned16(grad_v)
             ? cuda_kernels::kGradStoreRows16
             : cuda_kernels::kGradStorePairs;
}

// A copy of t whose rows are padded to a multiple of 8 elements (16 bytes), viewed back to t's
// shape. Only taken for inputs like head_dim = 59 or slices at odd offsets; documented cost:
// one extra read and write of that tensor. Any rank, as rows_aligned16.
inline at::Tensor aligned_copy(const at::Tensor& t) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  const int64_t d = shape.back();
  shape.back() = (d + 7) / 8 * 8;
  at::Tensor view = at::empty(shape, t.options()).narrow(-1, 0, d);
  view.copy_(t);
  return view;
}

// t when its rows are 16-byte aligned, else aligned_copy(t). For callers that set their params
// fields from the result themselves (the serving ops' layouts differ from align_rows16's).
inline at::Tensor with_aligned_rows16(const at::Tensor& t) {
  return rows_aligned16(t) ? t : aligned_copy(t);
}

// An input that the kernels will read with cp.async: left as it is when its rows are 16-byte
// aligned, else replaced by aligned_copy, with the params fields that point into it updated.
inline void align_rows16(at::Tensor& t, const void*& ptr, int64_t& batch_stride,
                         int64_t& head_stride, int64_t& row_stride) {
  if (rows_aligned16(t)) return;
  t = aligned_copy(t);
  ptr = t.data_ptr();
  batch_stride = t.stride(0), head_stride = t.stride(1), row_stride = t.stride(2);
}

// The backward's row-statistics workspace (lse in log2 units and delta per query row, each
// (batch, head) padded to whole blocks), held by `storage`; the caller sets vec_store and vec_rows.
// Shared by the dense and the variable-length backward.
inline cuda_kernels::BwdRowStats allocate_bwd_row_stats(const AttentionBwdParams& p,
                                                        const at::TensorOptions& options,
                                                        at::Tensor& storage) {
  cuda_kernels::BwdRowStats st;
  constexpr int64_t pad = cuda_kernels::kBwdRowPad;
  st.rows_padded = (p.seqlen_q + pad - 1) / pad * pad;
  storage = at::empty({2, p.batch * p.heads_q * st.rows_padded}, options.dtype(at::kFloat));
  st.lse2 = storage[0].data_ptr<float>();
  st.delta = storage[1].data_ptr<float>();
  st.additive_fast = env_flag("FLASHMOD_BWD_ADDITIVE_FAST", true);
  const int64_t tma_loads = env_int("FLASHMOD_BWD_TMA_LOADS", 1);
  TORCH_CHECK(tma_loads >= 0 && tma_loads <= 2,
              error_message("FLASHMOD_BWD_TMA_LOADS must be 0, 1 or 2, got ", tma_loads));
  st.tma_loads = static_cast<int>(tma_loads);
  return st;
}

// Scratch device memory for one launch (entry_points.h: DeviceWorkspace: the split-KV partials
// of the decode kernel, the tile counter of the warp-specialized forward) from torch's caching
// allocator on the current stream, and the stream's shared zeroed counters (stream_counters.h).
// Every allocation lives as long as the object; it is freed with it, in stream order, so the
// kernels still queued keep it.
class TorchWorkspace {
 public:
  TorchWorkspace(const at::TensorOptions& options, cudaStream_t stream)
      : options_(options), stream_(stream) {}
  TorchWorkspace(const TorchWorkspace&) = delete;
  TorchWorkspace& operator=(const TorchWorkspace&) = delete;

  cuda_kernels::DeviceWorkspace hooks() {
    cuda_kernels::DeviceWorkspace ws;
    ws.ctx = this;
    ws.alloc = [](void* self, size_t bytes) -> void* {
      auto* w = static_cast<TorchWorkspace*>(self);
      w->memory_.push_back(
          at::empty({static_cast<int64_t>((bytes + 3) / 4)}, w->options_.dtype(at::kFloat)));
      return w->memory_.back().data_ptr();
    };
    ws.zeroed_counters = [](void* self, size_t count) -> int* {
      return stream_zeroed_counters(static_cast<TorchWorkspace*>(self)->stream_, count);
    };
    return ws;
  }

 private:
  at::TensorOptions options_;
  cudaStream_t stream_;
  std::vector<at::Tensor> memory_;
};

}  // namespace flashmod
