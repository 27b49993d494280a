// CUDA registration of the serving ops (attention_varlen, attention_kvcache): the shared host
// preparation (serve_host.cpp), the CUDA-only checks, and the launch of the kernels'
// per-sequence variants (KvAddressing: the wgmma kernel on sm_90 for head dims 64/128/256, the
// mma.sync kernel elsewhere). No host sync: the extents stay on the device and the grid comes
// from the caller's upper bounds. Decode-shaped KV-cache calls (seqlen_q <= 64) take the decode
// kernel (GQA packing, split-KV, the append of the new keys/values inside it).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>

#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../serve_host.h"
#include "decode_dispatch.h"
#include "decode_heuristics.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "host_alignment.h"
#include "kvcache_append.h"
#include "serve_cuda_checks.h"

namespace flashmod {
namespace {

// Whether a call runs the decode kernel (GQA packing, split-KV, the fused append) rather than
// the prefill kernel; FLASHMOD_DECODE=0 forces the prefill kernel (tests, tuning).
bool decode_shaped(const AttentionParams& p) {
  return p.cu_seqlens_q == nullptr && p.seqlen_q <= cuda_kernels::kDecodeMaxNq &&
         env_flag("FLASHMOD_DECODE", true);
}

// k: the K tensor params read (a paged cache's pool (pages, page size, Hkv, D): the decode
// kernel's tensor maps take its page count).
cudaError_t launch(AttentionParams p, const cuda_kernels::FwdLaunchFlags& flags,
                   const at::Tensor& k, const at::TensorOptions& options, cudaStream_t stream) {
  const int padded = cuda_kernels::padded_head_dim(cuda_kernels::kFwdSm80HeadDims, p.head_dim);
  const int key = cuda_kernels::variant_key(p.dtype, padded);
  // The Hopper kernels' size (decode keeps the portable size: its kernels are mma.sync ones).
  const int wide = sm90_widened_head_dim(cuda_kernels::kFwdSm90HeadDims, p.head_dim, padded);
  const int wide_key = cuda_kernels::variant_key(p.dtype, wide);
  if (decode_shaped(p)) {
    if (env_flag("FLASHMOD_DECODE_PACK", true)) cuda_kernels::pack_gqa_rows(p);
    cuda_kernels::DecodeOptions opt = decode_options();
    if (p.block_table != nullptr) opt.kv_outer = k.size(0);  // the pool's pages
    // The split-KV workspace depends on shapes only (batch, heads, seqlen_q, the cache's
    // capacity), never on values, so a captured graph replays with the same allocation.
    TorchWorkspace workspace(options, stream);
    const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
    cudaError_t err = cudaSuccess;
    if (cuda_kernels::run_decode_kernel(p, flags, opt, ws, stream, padded, err)) return err;
  }
  // Dropout (varlen only) where the warp-specialized kernel does not take it (it answers
  // cudaErrorNotSupported, e.g. soft caps) runs the mma.sync kernels, which carry it for every
  // option; the other Hopper kernel has none.
  const bool dropout = p.dropout_rng != nullptr;
  if (use_sm90_ws_kernel(wide)) {               // packed rows; it hands over what it cannot take
    TorchWorkspace workspace(options, stream);  // the tile scheduler's counter
    const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
    cudaError_t err = cudaErrorNotSupported;  // no variant of this key: the kernels below
    switch (wide_key) {
#define FLASHMOD_SERVE_PREFILL_SM90_WS(E, kind, D)                             \
  case cuda_kernels::variant_key(ScalarKind::kind, D):                         \
    err = cuda_kernels::run_attention_fwd_sm90_ws<E, D>(p, flags, ws, stream); \
    break;
      FLASHMOD_FWD_SM90_WS_VARIANTS(FLASHMOD_SERVE_PREFILL_SM90_WS)
#undef FLASHMOD_SERVE_PREFILL_SM90_WS
    }
    if (err != cudaErrorNotSupported) return err;
  }
  if (!dropout && sm90_kernels_usable()) {
    switch (wide_key) {
#define FLASHMOD_SERVE_PREFILL_SM90(E, kind, D)        \
  case cuda_kernels::variant_key(ScalarKind::kind, D): \
    return cuda_kernels::run_attention_fwd_sm90<E, D>(p, flags, {}, stream);
      FLASHMOD_FWD_SM90_VARIANTS(FLASHMOD_SERVE_PREFILL_SM90)
#undef FLASHMOD_SERVE_PREFILL_SM90
    }
  }
  switch (key) {
#define FLASHMOD_SERVE_PREFILL(E, kind, D)             \
  case cuda_kernels::variant_key(ScalarKind::kind, D): \
    return cuda_kernels::run_attention_fwd<E, D>(p, flags, {}, stream);
    FLASHMOD_FWD_SM80_VARIANTS(FLASHMOD_SERVE_PREFILL)
#undef FLASHMOD_SERVE_PREFILL
  }
  return cudaErrorInvalidValue;
}

void run(const char* op, PreparedServe& r, const at::Tensor& q) {
  AttentionParams& p = r.params;
  if (r.out.numel() == 0 || p.batch == 0 || p.seqlen_q == 0) return;
  cuda_kernels::FwdLaunchFlags flags{};
  flags.out_vec16 = rows_aligned16(r.out) && p.head_dim % 8 == 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = launch(p, flags, r.k, q.options(), stream);
  TORCH_CHECK(err != cudaErrorInvalidConfiguration,
              error_message(op,
                            ": too many query blocks for one launch (batch * heads * "
                            "ceil(max_seqlen_q / Br) must be < 2^31)"));
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_cuda_inputs("flashmod.attention_varlen", q);
  PreparedServe r =
      prepare_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               scale, is_causal, window_left, window_right, softcap);
  set_varlen_dropout(r.params, "flashmod.attention_varlen", q, dropout_p, rng_state);
  AttentionParams& p = r.params;
  // Read-only inputs without aligned rows are copied once (head dims like 59, odd offsets).
  auto fix = [](at::Tensor& t, const void*& ptr, int64_t& hs, int64_t& rs) {
    if (rows_aligned16(t)) return;
    t = aligned_copy(t);
    ptr = t.data_ptr();
    hs = t.stride(1), rs = t.stride(0);
  };
  fix(r.q, p.q, p.q_head_stride, p.q_row_stride);
  fix(r.k, p.k, p.k_head_stride, p.k_row_stride);
  fix(r.v, p.v, p.v_head_stride, p.v_row_stride);
  run("flashmod.attention_varlen", r, q);
  return {r.out, r.lse};
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& block_table,
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right,
    double softcap) {
  const c10::cuda::CUDAGuard guard(q.device());
  constexpr const char* op = "flashmod.attention_kvcache";
  // Every check runs before the append kernel below: a refused call writes nothing.
  check_cuda_inputs(op, q);
  PreparedServe r =
      prepare_attention_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                block_table, scale, is_causal, window_left, window_right, softcap,
                                /*append_here=*/false);
  // The caches are read in place (a copy would cost the whole cache per step); their layout was
  // checked by the shared preparation.
  for (auto [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}}) {
    TORCH_CHECK(rows_aligned16(*t),
                error_message(op, ": ", name,
                              " must have 16-byte aligned rows on CUDA (data pointer and "
                              "strides multiples of 8 elements; head_dim % 8 == 0), got strides ",
                              t->strides()));
  }
  AttentionParams& p = r.params;
  // The append. Decode-shaped calls fuse it into the attention kernel (fwd_sm80_kernel.h: the new
  // rows are read from k/v and written into the cache by the kernel), so a decode step is one
  // attention launch (two with split-KV's combine); other calls (or
  // FLASHMOD_KVCACHE_FUSED_APPEND=0) run the append kernel first, which also writes each row's
  // valid length.
  const bool attends = r.out.numel() > 0 && p.batch > 0 && p.seqlen_q > 0;
  // New rows as the kernels read them, and the old lengths: alive until the launches are queued.
  at::Tensor kn, vn, old_lengths = r.seqused_k;
  if (k.has_value()) {
    kn = k->stride(-1) == 1 ? *k : k->contiguous();
    vn = v->stride(-1) == 1 ? *v : v->contiguous();
  }
  const bool fused_append = k.has_value() && attends && p.head_dim % 8 == 0 && decode_shaped(p) &&
                            env_flag("FLASHMOD_KVCACHE_FUSED_APPEND", true);
  if (fused_append) {
    // cp.async and the kernel's 16-byte writes need 16-byte aligned new rows.
    kn = with_aligned_rows16(kn);
    vn = with_aligned_rows16(vn);
    p.k_new = kn.data_ptr(), p.v_new = vn.data_ptr();
    p.kn_batch_stride = kn.stride(0), p.kn_row_stride = kn.stride(1),
    p.kn_head_stride = kn.stride(2);
    p.vn_batch_stride = vn.stride(0), p.vn_row_stride = vn.stride(1),
    p.vn_head_stride = vn.stride(2);
    p.seqlen_new = kn.size(1);  // p.seqused_k: the old lengths, from the shared preparation
  } else if (k.has_value()) {
    // The append and the valid lengths in one kernel, queued before the attention.
    r.seqused_k = at::empty({p.batch}, r.seqused_k.options());
    cuda_kernels::KvAppendArgs a;
    a.cache_seqlens = p.seqused_k;  // the old lengths
    a.kv_batch_idx = p.kv_batch_idx;
    a.block_table = p.block_table;
    a.block_table_batch_stride = p.block_table_batch_stride;
    a.page_size = p.page_size;
    a.seqused_k = r.seqused_k.data_ptr<int32_t>();
    p.seqused_k = a.seqused_k;
    a.batch = p.batch, a.heads_kv = p.heads_kv, a.head_dim = p.head_dim;
    a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr();
    a.kc_batch_stride = k_cache.stride(0), a.kc_row_stride = k_cache.stride(1);
    a.kc_head_stride = k_cache.stride(2);
    a.vc_batch_stride = v_cache.stride(0), a.vc_row_stride = v_cache.stride(1);
    a.vc_head_stride = v_cache.stride(2);
    a.s_new = kn.size(1);
    a.k_new = kn.data_ptr(), a.v_new = vn.data_ptr();
    a.kn_batch_stride = kn.stride(0), a.kn_row_stride = kn.stride(1);
    a.kn_head_stride = kn.stride(2);
    a.vn_batch_stride = vn.stride(0), a.vn_row_stride = vn.stride(1);
    a.vn_head_stride = vn.stride(2);
    const cudaError_t err = cuda_kernels::run_kvcache_append(a, at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err != cudaErrorInvalidConfiguration,
                error_message(op,
                              ": too many new tokens for one append launch (seqlen_new * "
                              "heads_k must be <= ",
                              int64_t{65535} * 64, ")"));
    C10_CUDA_CHECK(err);
  }
  if (!rows_aligned16(r.q)) {
    r.q = aligned_copy(r.q);
    p.q = r.q.data_ptr();
    p.q_batch_stride = r.q.stride(0), p.q_head_stride = r.q.stride(2);
    p.q_row_stride = r.q.stride(1);
  }
  run(op, r, q);
  return {r.out, r.lse};
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("attention_varlen", &flashmod::attention_varlen_cuda);
  m.impl("attention_kvcache", &flashmod::attention_kvcache_cuda);
}
