// The entry points the torch host launcher (attention_cuda.cpp) calls. Torch-free on purpose:
// the .cu files that define them include nothing from torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../attention_params.h"

namespace flashmod::cuda_kernels {

struct FwdLaunchFlags {
  int out_vec16;  // out's row starts are 16-byte aligned and head_dim % 8 == 0: 16-byte stores
};

// fp16/bf16 (Elem = __half or __nv_bfloat16) on tensor cores, head_dim <= kHeadDim. Requires
// q/k/v row starts to be 16-byte aligned (cp.async). Returns the first CUDA error of the set-up;
// the caller checks the launch with cudaGetLastError.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              cudaStream_t stream);

// The Hopper variant (wgmma, sm_90a machine code only) for kHeadDim = 64, 128 and 256; same
// contract.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_sm90(const AttentionParams& p, const FwdLaunchFlags& flags,
                                   cudaStream_t stream);

// Split-KV workspace of the decode kernel. rows = batch * heads_q * seqlen_q of the params the
// kernel gets (GQA-packed or not: same count), row id = the lse index.
struct SplitKvArgs {
  int splits = 1;        // > 1: CTAs write partials here; the combine kernel writes out and lse
  float* o = nullptr;    // (splits, rows, kHeadDim): each split's normalized O (padding cols 0)
  float* lse = nullptr;  // (splits, rows): each split's lse, -inf where it saw no visible key
};

// Host memory hooks for the decode launch, so the kernel files stay torch-free: alloc returns
// `bytes` of device memory usable in stream order on the launch's stream (the torch caching
// allocator in attention_cuda.cpp), or nullptr.
struct DecodeWorkspace {
  void* ctx = nullptr;
  void* (*alloc)(void* ctx, size_t bytes) = nullptr;
};

struct DecodeOptions {
  int num_sms = 1;
  int forced_splits = 0;  // > 0: use exactly this many splits (tests, tuning); 0: heuristic
};

// The decode path: query rows per head <= kDecodeMaxNq (one 64-row tile when GQA-packed rows fit).
constexpr int64_t kDecodeMaxNq = 64;
constexpr int kDecodeBc = 64;  // key block of the decode config (fwd_sm80_launch.h: DecodeConfig)

// Decode kernel (fp16/bf16 tensor cores, 64-row tiles) for p.seqlen_q <= kDecodeMaxNq, with
// split-KV when the grid is small; p may be GQA-packed (pack_gqa_rows). Same alignment rules as
// run_attention_fwd.
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_decode(const AttentionParams& p, const FwdLaunchFlags& flags,
                                     const DecodeOptions& opt, const DecodeWorkspace& ws,
                                     cudaStream_t stream);

// GQA packing: folds the g = heads_q / heads_kv query heads of each kv head into one head of
// g * seqlen_q rows (head-major: row r is q head hk * g + r / seqlen_q at position r % seqlen_q),
// so each kv head's K/V is streamed once per tile instead of once per q head. Only through
// strides (no copy): needs one row stride that steps through the packed rows of q and of out,
// i.e. seqlen_q == 1 or head stride == seqlen_q * row stride, and no mask tensor (its rows are
// per q head). lse is (B, Hq, Nq), which is already the packed layout (g heads of Nq rows make
// one head of g * Nq rows). Returns false
// and leaves p alone when it does not apply.
inline bool pack_gqa_rows(AttentionParams& p) {
  const int64_t g = p.heads_q / p.heads_kv, nq = p.seqlen_q;
  if (g <= 1 || p.mask_kind != MaskKind::kNone || nq > kDecodeMaxNq) return false;
  auto packed_row_stride = [nq](int64_t head_stride, int64_t row_stride) -> int64_t {
    if (nq == 1) return head_stride;
    return head_stride == nq * row_stride ? row_stride : -1;
  };
  const int64_t q_rs = packed_row_stride(p.q_head_stride, p.q_row_stride);
  const int64_t o_rs = packed_row_stride(p.out_head_stride, p.out_row_stride);
  if (q_rs < 0 || o_rs < 0) return false;
  p.q_row_stride = q_rs, p.q_head_stride *= g;
  p.out_row_stride = o_rs, p.out_head_stride *= g;
  p.pos_period = nq;
  p.lse_head_stride *= g;
  p.seqlen_q = g * nq;
  p.heads_q = p.heads_kv;
  return true;
}

// Key blocks the query positions can see at all (an estimate for the split heuristic: the union
// over positions of the window rule).
inline int64_t decode_key_blocks(const AttentionParams& p, int bc) {
  const int64_t positions = p.pos_period > 0 ? p.pos_period : p.seqlen_q;
  int64_t lo = 0, hi = p.seqlen_k;
  if (p.window_left >= 0 && p.diag_offset - p.window_left > lo) lo = p.diag_offset - p.window_left;
  if (p.window_right >= 0 && p.diag_offset + positions + p.window_right < hi)
    hi = p.diag_offset + positions + p.window_right;
  return hi > lo ? (hi - lo + bc - 1) / bc : 1;
}

// Split-KV heuristic. A decode grid has one CTA per (query block, head): often far fewer than
// the SMs can hold, so most of HBM's bandwidth idles while each CTA walks all of Nk. Splitting
// every CTA's key blocks into `splits` runs multiplies the grid; aim for one full wave of
// resident CTAs (slots = SMs x CTAs per SM): every SM streams, and each split stays as long as
// possible. Measured on an H100 (tools/decode_splits.py, bf16, B 8, Hq 32 / Hkv 8, D 128,
// Nq 1; 64 packed CTAs, 264 slots): one wave (4 splits) 8.05 / 10.92 / 12.15 TFLOP/s at Nk 4k /
// 16k / 64k, two waves (8 splits) 7.43 / 10.69 / 11.99, FLASH 8.05 / 10.93 / 12.09. floor()
// keeps the grid at or just under a full wave. Each split keeps >= kMinBlocksPerSplit key blocks
// (256 keys) so its fixed costs (Q load, pipeline fill, partial write, its share of the combine)
// stay small next to its K/V stream, and splits <= kMaxSplits bounds the workspace and the
// combine's loop. A grid that already fills a wave is not split. Last, the count is evened out:
// with per = ceil(blocks / splits) blocks each, ceil(blocks / per) splits cover them with no empty
// split.
constexpr int64_t kMinBlocksPerSplit = 4;
constexpr int64_t kMaxSplits = 128;
inline int choose_splits(int64_t ctas, int64_t key_blocks, int64_t slots) {
  if (ctas <= 0 || ctas >= slots) return 1;
  int64_t s = slots / ctas;
  if (s > key_blocks / kMinBlocksPerSplit) s = key_blocks / kMinBlocksPerSplit;
  if (s > kMaxSplits) s = kMaxSplits;
  if (s <= 1) return 1;
  const int64_t per = (key_blocks + s - 1) / s;
  return static_cast<int>((key_blocks + per - 1) / per);
}

// Launches `kernel` with one CTA of `threads` threads per (query block of br rows, head, batch) and
// smem_bytes of dynamic shared memory, opting in above 48 KB (per kernel, as CUDA requires).
template <typename Kernel, typename... Args>
cudaError_t launch_per_query_block(Kernel kernel, const AttentionParams& p, int br, int threads,
                                   int smem_bytes, cudaStream_t stream, Args... args) {
  const int64_t blocks = (p.seqlen_q + br - 1) / br * p.heads_q * p.batch;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (smem_bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};  // (not <<<>>>: this header is also read by the host compiler)
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// fp32: the 3xTF32 tensor-core kernel for head dims <= 128 and more than 32 query rows, else (or
// with force_ffma, the host's FLASHMOD_FP32_FFMA=1) the CUDA-core kernel. Both keep fp32
// accuracy; any alignment.
cudaError_t run_attention_fwd_fp32(const AttentionParams& p, bool force_ffma, cudaStream_t stream);
cudaError_t run_attention_fwd_fp32_tc(const AttentionParams& p, cudaStream_t stream);

// Padded head dims the kernels are compiled for.
inline int padded_head_dim(int64_t d) {
  for (int pd : {32, 64, 96, 128, 160, 192, 224, 256})
    if (d <= pd) return pd;
  return -1;
}

}  // namespace flashmod::cuda_kernels
