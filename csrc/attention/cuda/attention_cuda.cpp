// CUDA registration of flashmod::attention: the shared checks (prepare_attention), the CUDA-only
// ones, alignment fix-ups, and the dispatch to a kernel by dtype and padded head dim.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../attention_host.h"
#include "decode_dispatch.h"
#include "decode_heuristics.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "host_alignment.h"

namespace flashmod {
namespace {

// Decode-shaped calls (seqlen_q <= kDecodeMaxNq): the decode kernel, with GQA packing and
// split-KV chosen from the shapes (decode_heuristics.h: pack_gqa_rows, choose_splits). Returns
// false when the shape is not decode-shaped; err is then untouched. Test/tuning knobs, read per
// call: FLASHMOD_DECODE=0 (prefill kernel instead), FLASHMOD_DECODE_PACK=0 (no GQA packing),
// decode_options() (host_alignment.h).
bool run_decode(AttentionParams p, const cuda_kernels::FwdLaunchFlags& flags, int padded,
                const at::TensorOptions& options, cudaStream_t stream, cudaError_t& err) {
  if (p.seqlen_q > cuda_kernels::kDecodeMaxNq || !env_flag("FLASHMOD_DECODE", true)) return false;
  if (env_flag("FLASHMOD_DECODE_PACK", true)) cuda_kernels::pack_gqa_rows(p);
  const cuda_kernels::DecodeOptions opt = decode_options();
  TorchWorkspace workspace(options, stream);  // the split-KV partials
  const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
  return cuda_kernels::run_decode_kernel(p, flags, opt, ws, stream, padded, err);
}

std::tuple<at::Tensor, at::Tensor> run_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v,
                                                      const std::optional<at::Tensor>& attn_mask,
                                                      std::optional<double> scale, bool is_causal,
                                                      bool bottom_right, int64_t window_left,
                                                      int64_t window_right, double softcap,
                                                      const DropoutArgs* dropout) {
  const c10::cuda::CUDAGuard guard(q.device());
  PreparedAttention prepared = prepare_attention(q, k, v, attn_mask, scale, is_causal, bottom_right,
                                                 window_left, window_right, softcap);
  check_cuda_attention_inputs("flashmod.attention", q);
  if (dropout != nullptr) set_cuda_dropout(prepared.params, "flashmod.attention", q, *dropout);
  if (nothing_to_compute(prepared)) return {prepared.out, prepared.lse};

  AttentionParams& p = prepared.params;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = cudaSuccess;
  if (p.dtype == ScalarKind::kFloat32) {
    err = cuda_kernels::run_attention_fwd_fp32(
        p, env_flag("FLASHMOD_FP32_FFMA", false),
        sm90_kernels_usable() && env_flag("FLASHMOD_FP32_WGMMA", true), stream);
  } else {
    // Alignment fix-ups (see aligned_copy); the copies are kept alive by prepared.
    align_rows16(prepared.q, p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
    align_rows16(prepared.k, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
    align_rows16(prepared.v, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride);

    cuda_kernels::FwdLaunchFlags flags{};
    flags.out_vec16 = rows_aligned16(prepared.out) && p.head_dim % 8 == 0;
    flags.one_tile_per_cta = !env_flag("FLASHMOD_SM90_WS_PERSISTENT", true);
    flags.out_tma = env_flag("FLASHMOD_SM90_WS_TMA_STORE", true);
    flags.staged_mask = env_flag("FLASHMOD_SM90_MASK_STAGING", true);
    flags.end_aligned = env_flag("FLASHMOD_SM90_WS_END_ALIGNED", true);
    flags.half_blocks = env_flag("FLASHMOD_SM90_WS_HALF_BLOCKS", true);
    flags.ws_bias = env_flag("FLASHMOD_SM90_WS_BIAS", true);
    flags.mask_shown_tiles = env_flag("FLASHMOD_MASK_SHOWN_TILES", true);
    const int padded = cuda_kernels::padded_head_dim(cuda_kernels::kFwdSm80HeadDims, p.head_dim);
    const int key = cuda_kernels::variant_key(p.dtype, padded);
    // The Hopper kernels' size (decode keeps the portable size: its kernels are mma.sync ones).
    const int wide = sm90_widened_head_dim(cuda_kernels::kFwdSm90HeadDims, p.head_dim, padded);
    const int wide_key = cuda_kernels::variant_key(p.dtype, wide);
    // Dropout: the warp-specialized Hopper kernel where it takes the call (plain dense scores; it
    // answers cudaErrorNotSupported otherwise), else the mma.sync kernels; never decode.
    const bool with_dropout = dropout != nullptr;
    bool launched = false;
    if (!with_dropout && run_decode(p, flags, padded, q.options(), stream, err)) {
      launched = true;  // by run_decode
    } else if (use_sm90_ws_kernel(wide)) {
      TorchWorkspace workspace(q.options(), stream);  // the tile scheduler's counter, mask tiles
      const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
      switch (wide_key) {
#define FLASHMOD_SM90_WS_CASE(Elem, kind, D)                                      \
  case cuda_kernels::variant_key(ScalarKind::kind, D):                            \
    err = cuda_kernels::run_attention_fwd_sm90_ws<Elem, D>(p, flags, ws, stream); \
    break;
        FLASHMOD_FWD_SM90_WS_VARIANTS(FLASHMOD_SM90_WS_CASE)
#undef FLASHMOD_SM90_WS_CASE
      }
      launched = !(with_dropout && err == cudaErrorNotSupported);
      if (!launched) err = cudaSuccess;
    } else if (!with_dropout && use_sm90_kernel(wide)) {
      TorchWorkspace workspace(q.options(), stream);  // a mask tensor's tile classes
      const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
      switch (wide_key) {
#define FLASHMOD_SM90_CASE(Elem, kind, D)                                      \
  case cuda_kernels::variant_key(ScalarKind::kind, D):                         \
    err = cuda_kernels::run_attention_fwd_sm90<Elem, D>(p, flags, ws, stream); \
    break;
        FLASHMOD_FWD_SM90_VARIANTS(FLASHMOD_SM90_CASE)
#undef FLASHMOD_SM90_CASE
      }
      launched = true;
    }
    if (!launched) {
      TorchWorkspace workspace(q.options(), stream);  // a mask tensor's tile classes
      const cuda_kernels::DeviceWorkspace ws = workspace.hooks();
      switch (key) {
#define FLASHMOD_SM80_CASE(Elem, kind, D)                                 \
  case cuda_kernels::variant_key(ScalarKind::kind, D):                    \
    err = cuda_kernels::run_attention_fwd<Elem, D>(p, flags, ws, stream); \
    break;
        FLASHMOD_FWD_SM80_VARIANTS(FLASHMOD_SM80_CASE)
#undef FLASHMOD_SM80_CASE
        default:
          TORCH_CHECK(false, flashmod::error_message("flashmod.attention: unsupported head_dim ",
                                                     p.head_dim));
      }
    }
  }
  TORCH_CHECK(err != cudaErrorInvalidConfiguration,
              flashmod::error_message(
                  "flashmod.attention: too many query blocks for one launch (batch * heads * "
                  "ceil(seqlen_q / Br) must be < 2^31)"));
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {prepared.out, prepared.lse};
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v,
                                                  const std::optional<at::Tensor>& attn_mask,
                                                  std::optional<double> scale, bool is_causal,
                                                  bool bottom_right, int64_t window_left,
                                                  int64_t window_right, double softcap) {
  return run_attention_cuda(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left,
                            window_right, softcap, nullptr);
}

std::tuple<at::Tensor, at::Tensor> attention_dropout_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool is_causal,
    bool bottom_right, int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const at::Tensor& rng_state) {
  const DropoutArgs dropout{dropout_p, rng_state};
  return run_attention_cuda(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left,
                            window_right, softcap, &dropout);
}

}  // namespace
}  // namespace flashmod

TORCH_LIBRARY_IMPL(flashmod, CUDA, m) {
  m.impl("attention", &flashmod::attention_cuda);
  m.impl("attention_dropout", &flashmod::attention_dropout_cuda);
}
