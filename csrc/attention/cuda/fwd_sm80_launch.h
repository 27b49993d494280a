// Tile choices per head dim and the (torch-free) launch of the tensor-core kernel. Each
// generated/fwd_sm80_<dtype>_hd<D>.cu (tools/gen_kernels.py) instantiates the entry points of one
// variant, so ninja compiles them in parallel.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "../../common/cuda/kernel_launch.h"
#include "../../common/cuda/tma_ops.h"
#include "decode_heuristics.h"
#include "entry_points.h"
#include "fwd_sm80_kernel.h"
#include "split_combine.h"

namespace flashmod::cuda_kernels {

// (Br, Bc, warps, stages, Q in registers) per padded head dim. Each warp owns 32 query rows (two
// m16 tiles) where registers allow: every K_j/V_j fragment a warp reads from shared memory then
// feeds twice the mma work, and ldmatrix traffic stays under shared-memory bandwidth. Past
// D = 128 the O accumulator alone (D fp32 registers per thread at 32 rows per warp) would not
// fit, so warps own 16 rows. Measured on an H100 (bf16, N = 1k..16k, vs SDPA FLASH in the same
// process; benchmarks/results/design/cuda-sm80.md):
//   D = 64:  128x64 with Q in registers 1.02-1.08x FLASH; 128x64 re-reading Q 0.97-1.02x;
//            128x128 1.00-1.08x; 128x64 3 stages + Q in regs 1.01-1.08x (no better, more smem).
//   D = 128: 128x64 0.96-1.08x over three runs (FLASH itself moves ~3% run to run); 128x32
//            0.94-1.02x; 8 warps x 16 rows 0.79-0.89x (smem-bound); 3 stages 0.83-0.96x (one
//            CTA per SM instead of two).
//   D = 160..256: 64x64, 4 warps of 16 rows: fits sm80's 163 KB; 0.77-0.86x FLASH at D = 256.
template <typename Elem, int kHeadDim>
struct FwdConfig;
// Tile per head dim (Br, Bc, warps, CTAs per SM, Q kept in registers), as measured above.
#define FLASHMOD_CONFIG(D, ...)                     \
  template <typename Elem>                          \
  struct FwdConfig<Elem, D> {                       \
    using Traits = FwdTraits<Elem, D, __VA_ARGS__>; \
  };
FLASHMOD_CONFIG(32, 128, 64, 4, 2, true)
FLASHMOD_CONFIG(64, 128, 64, 4, 2, true)
FLASHMOD_CONFIG(96, 128, 64, 4, 2, false)
FLASHMOD_CONFIG(128, 128, 64, 4, 2, false)
FLASHMOD_CONFIG(160, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(192, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(224, 64, 64, 4, 2, false)
FLASHMOD_CONFIG(256, 64, 64, 4, 2, false)
#undef FLASHMOD_CONFIG

// The kernel variant for (general scores, K/V addressing); kDecode picks the decode variants.
// The key-split decode kernel (kernel_traits.h: KeySplitTraits) is built for plain scores and
// per-sequence K/V only (run_attention_fwd_decode): nullptr otherwise.
template <class Tr, bool kDecode>
auto pick_fwd_kernel(bool general, KvAddressing addr) {
  if constexpr (Tr::kKeySplit) {
    using Kernel = decltype(&attention_fwd_kernel<Tr, false, kDecode, kSequences>);
    switch (addr) {
      case kSequences:
        return general ? Kernel{} : attention_fwd_kernel<Tr, false, kDecode, kSequences>;
      case kBlockPages:
        return general ? Kernel{} : attention_fwd_kernel<Tr, false, kDecode, kBlockPages>;
      case kRowPages:
        return general ? Kernel{} : attention_fwd_kernel<Tr, false, kDecode, kRowPages>;
      default: return Kernel{};
    }
  } else {
    switch (addr) {
      case kSequences:
        return general ? attention_fwd_kernel<Tr, true, kDecode, kSequences>
                       : attention_fwd_kernel<Tr, false, kDecode, kSequences>;
      case kBlockPages:
        return general ? attention_fwd_kernel<Tr, true, kDecode, kBlockPages>
                       : attention_fwd_kernel<Tr, false, kDecode, kBlockPages>;
      case kRowPages:
        return general ? attention_fwd_kernel<Tr, true, kDecode, kRowPages>
                       : attention_fwd_kernel<Tr, false, kDecode, kRowPages>;
      default:
        return general ? attention_fwd_kernel<Tr, true, kDecode, kDense>
                       : attention_fwd_kernel<Tr, false, kDecode, kDense>;
    }
  }
}

template <class Tr>
cudaError_t launch_fwd(const AttentionParams& params, const FwdLaunchFlags& flags,
                       const DeviceWorkspace& ws, cudaStream_t stream) {
  AttentionParams p = params;
  const cudaError_t err = classify_mask_tiles<typename Tr::Elem>(p, Tr::Br, Tr::Bc, ws, stream);
  if (err != cudaSuccess) return err;
  const bool general = general_scores(p);
  const KvAddressing addr = kv_addressing(p, Tr::Bc);
  auto kernel = pick_fwd_kernel<Tr, false>(general, addr);
  // Dropout: dense calls (attention_dropout) and packed rows (attention_varlen); the serving ops'
  // caches and pages take none.
  if (p.dropout_rng != nullptr) {
    switch (addr) {
      case kDense:
        kernel = general ? attention_fwd_kernel<Tr, true, false, kDense, true>
                         : attention_fwd_kernel<Tr, false, false, kDense, true>;
        break;
      case kSequences:
        kernel = general ? attention_fwd_kernel<Tr, true, false, kSequences, true>
                         : attention_fwd_kernel<Tr, false, false, kSequences, true>;
        break;
      default: return cudaErrorInvalidValue;
    }
  }
  return cuda::launch_kernel(kernel, cta_count(p, Tr::Br), Tr::kNThreads, Tr::kSmemBytes, stream, p,
                             flags, SplitKvArgs{}, KvTensorMaps{});
}

template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd(const AttentionParams& p, const FwdLaunchFlags& flags,
                              const DeviceWorkspace& ws, cudaStream_t stream) {
  return launch_fwd<typename FwdConfig<Elem, kHeadDim>::Traits>(p, flags, ws, stream);
}

// ---------------------------------------------------------------------------------------------
// Decode: seqlen_q <= kDecodeMaxNq (after GQA packing up to kDecodeMaxNq * g rows per kv head).
// 64-row tiles of 4 warps x 16 rows (one m16 tile each): a prefill tile of 128 rows would be
// mostly padding, and its mma work (Br x Bc x D per 2 Bc D bytes of K/V) would approach the
// memory roofline's budget. With MT = 1 registers are plentiful, so Q stays in registers up to
// D = 128. Shared memory: 64 D (Q) + 2 stages x 2 x 64 D (K, V) elements = 80 KB at D = 128,
// two CTAs per SM on sm80 and sm90. (3 stages, 112 KB, still two CTAs per SM on sm90, measured
// 2-5 % slower at every cache length; for 16-token pages through the copy engine, 2-3 % slower
// from 4k tokens: benchmarks/results/design/cuda-serving.md, sessions 12 and 24.)
template <typename Elem, int kHeadDim>
struct DecodeConfig {
  using Traits = FwdTraits<Elem, kHeadDim, 64, 64, 4, 2, (kHeadDim <= 128)>;
};
// A decode kernel's shared memory: the tiles, then one mbarrier per stage for the copy engine and
// the split combine's flag (fwd_sm80_kernel.h).
template <class Tr>
constexpr int decode_smem_bytes() {
  return Tr::kSmemBytes + 8 * Tr::kStages + 16;
}

// The tensor maps of a decode call's page pools where the copy engine takes its K/V tiles
// (KvTensorMaps, fwd_sm80_kernel.h: kKvTma): pages shorter than a key block that tile it (16 or 32
// rows at Bc = 64: one box per page, starting on a whole 8-row swizzle atom), head dims of whole
// 64-column blocks, pools TMA can address (16-byte aligned base and strides), and splits of at
// least kTmaMinBlocksPerSplit key blocks. H100, B 8, 32/8 heads, D 128, 16-token pages, time of
// the copy engine's path over cp.async's in the same run (two runs): 1k tokens (4 blocks a split)
// 0.996 / 1.034, 4k (16) 0.989 / 0.995, 16k 0.985 / 0.984, 64k 0.980 / 0.984: its barrier set-up
// and the table reads ahead of the first boxes do not pay over a few blocks. Otherwise box_rows
// stays 0 and the kernel copies with cp.async (bitwise the same result).
constexpr int64_t kTmaMinBlocksPerSplit = 16;
template <class Tr>
KvTensorMaps decode_kv_maps(const AttentionParams& p, const DecodeOptions& opt, KvAddressing addr,
                            int64_t blocks_per_split) {
  KvTensorMaps maps{};
  constexpr int Bc = Tr::Bc;
  if (!opt.kv_tma || Tr::kHeadDim % 64 != 0 || addr != kRowPages || p.page_size % 8 != 0 ||
      Bc % p.page_size != 0 || opt.kv_outer <= 0 || blocks_per_split < kTmaMinBlocksPerSplit)
    return maps;
  const int box = static_cast<int>(p.page_size);
  constexpr bool kBf16 = std::is_same_v<typename Tr::Elem, __nv_bfloat16>;
  if (!encode_rows_tensor_map(&maps.k, kBf16, p.k, opt.kv_outer, p.heads_kv, box, p.head_dim,
                              p.k_page_stride, p.k_head_stride, p.k_row_stride, box) ||
      !encode_rows_tensor_map(&maps.v, kBf16, p.v, opt.kv_outer, p.heads_kv, box, p.head_dim,
                              p.v_page_stride, p.v_head_stride, p.v_row_stride, box))
    return maps;
  maps.box_rows = box;
  return maps;
}

constexpr int kMaxCachedDevices = 64;
// Resident CTAs per SM of a decode kernel, from the occupancy calculator, cached per device.
template <class Kernel>
int decode_ctas_per_sm(Kernel kernel, int threads, int smem, std::atomic<int>* cache) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxCachedDevices) return 1;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n > 0) return n;
  // The occupancy of a kernel past 48 KB of shared memory needs its opt-in first; a refused
  // opt-in is not cached (the launch reports it).
  if (cuda::allow_dynamic_smem(kernel, smem) != cudaSuccess) return 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess ||
      n < 1)
    n = 1;
  cache[dev].store(n, std::memory_order_relaxed);  // racing callers store the same value
  return n;
}

static_assert(kMaxSplits <= kMaxCombinedSplits, "the combine's warp holds every split's weight");

template <class Tr>
cudaError_t launch_decode(const AttentionParams& p, const FwdLaunchFlags& flags,
                          const DecodeOptions& opt, const DeviceWorkspace& ws,
                          cudaStream_t stream) {
  using Elem = typename Tr::Elem;
  constexpr int kHeadDim = Tr::kHeadDim;
  const bool general = general_scores(p);
  const KvAddressing addr = kv_addressing(p, Tr::Bc);
  auto kernel = pick_fwd_kernel<Tr, true>(general, addr);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int64_t ctas = cta_count(p, Tr::Br), key_blocks = decode_key_blocks(p, Tr::Bc);
  int splits = opt.forced_splits;
  if (splits <= 0) {
    // Both copy paths take the same shared memory, so the split count, and with it the result,
    // does not depend on the path.
    static std::atomic<int> per_sm_cache[2][4][kMaxCachedDevices];
    const int per_sm = decode_ctas_per_sm(kernel, Tr::kNThreads, decode_smem_bytes<Tr>(),
                                          per_sm_cache[general][addr]);
    splits =
        choose_splits(ctas, key_blocks, opt.num_sms, static_cast<int64_t>(opt.num_sms) * per_sm);
  }
  if (ctas * splits > cuda::kMaxGridBlocks) return cudaErrorInvalidConfiguration;

  SplitKvArgs sk;
  sk.splits = splits;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  if (splits > 1) {
    const cudaError_t err =
        alloc_split_workspace<kHeadDim>(sk, rows, ctas, opt.fused_combine, ws, stream);
    if (err != cudaSuccess) return err;
  }
  const KvTensorMaps maps = decode_kv_maps<Tr>(p, opt, addr, (key_blocks + splits - 1) / splits);
  const cudaError_t err =
      cuda::launch_kernel(kernel, cta_grid(p, Tr::Br, splits, opt.flat_grid), Tr::kNThreads,
                          decode_smem_bytes<Tr>(), stream, p, flags, sk, maps);
  if (err != cudaSuccess || splits == 1 || sk.tile_counters != nullptr) return err;
  return launch_split_combine<Elem, kHeadDim>(p, sk, stream);
}

// KV-cache, paged and varlen decode tiles of at most one warp's 16 rows (a GQA group's heads of
// one query, e.g. 32 / 8 heads) with plain scores at D = 128 take the key-split kernel: the
// row-split one computes 48 padding rows there. H100, bf16, B 8, 32 / 8 heads,
// flash_attn_with_kvcache from a cold L2, four runs, contiguous and paged (16 and 256): the step
// 0.6-2.4 % shorter at 4k tokens, 0.4-1.6 % at 16k, 0.1-0.6 % from 64k, -0.2 to +3.1 % at 1k. The
// rest stays on the row-split kernel: dense decode (flashmod.attention), whose key-split variant
// (168 registers, 28 bytes of spill) made the step 0.3-0.7 us longer (tools/decode_timeline.cu);
// soft caps and scales <= 0, whose key-split variants spill 16-52 bytes (the row-split ones none);
// other head dims, unmeasured, whose key-split variants spill 36-108 bytes at D = 64 and 256
// (benchmarks/results/design/cuda-serving.md, session 35).
template <typename Elem, int kHeadDim>
cudaError_t run_attention_fwd_decode(const AttentionParams& p, const FwdLaunchFlags& flags,
                                     const DecodeOptions& opt, const DeviceWorkspace& ws,
                                     cudaStream_t stream) {
  using Traits = typename DecodeConfig<Elem, kHeadDim>::Traits;
  if constexpr (kHeadDim == 128) {
    if (opt.key_split && p.seqlen_q <= Traits::kRowsPerWarp && has_sequence_extents(p) &&
        !general_scores(p))
      return launch_decode<KeySplitTraits<Traits>>(p, flags, opt, ws, stream);
  }
  return launch_decode<Traits>(p, flags, opt, ws, stream);
}

}  // namespace flashmod::cuda_kernels
