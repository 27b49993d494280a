// Environment knobs: kernel-choice switches for tests and benchmarks, read per call by the host
// glue only (attention_cpu.cpp, attention_cuda.cpp, softmax_cuda.cpp) and handed to kernels in
// their params or options structs. One polarity: FLASHMOD_X=1 turns the named thing on (or
// forces it), FLASHMOD_X=0 turns it off; unset keeps the default. Any other value is an error
// naming the knob.
//
// Every knob (all for tests and benchmarks, comparing kernels on one machine; TRACE for debugging):
//   FLASHMOD_CPU_ISA=amx|avx512|avx2|baseline  forces that CPU kernel (read once per process); a
//                                     name that is unknown or that this CPU lacks is an error
//   FLASHMOD_CPU_DECODE=0             CPU decode shapes run the prefill kernel
//   FLASHMOD_DISABLE_SM90=1           the portable mma.sync kernel on an H100/H200
//   FLASHMOD_SM90_WIDEN=0             fp16/bf16 head dims other than 64/128/192/256 on the portable
//                                     kernels at their own size, not the Hopper kernels of the
//                                     next size up (H100/H200)
//   FLASHMOD_SM90_WS=0                the sm_90 forward without warp specialization/TMA (the
//                                     FlashAttention-2-style wgmma kernel)
//   FLASHMOD_SM90_WS_PERSISTENT=0     the warp-specialized kernel on one CTA per tile (default:
//                                     a persistent grid, dynamically scheduled under a right
//                                     window bound)
//   FLASHMOD_SM90_WS_TMA_STORE=0      the warp-specialized kernel's warps store the output
//                                     themselves (default: through the copy engine where the
//                                     output has a tensor map)
//   FLASHMOD_SM90_WS_END_ALIGNED=0    the warp-specialized kernel's query blocks start at a
//                                     head's first row under a right window bound too (default:
//                                     they end at its last row there)
//   FLASHMOD_SM90_WS_HALF_BLOCKS=0    that end-aligned kernel computes every key block whole
//                                     (default at D = 64: a consumer's last block as its left
//                                     half where its rows see nothing in the right half)
//   FLASHMOD_SM90_WS_BIAS=0           an additive mask in q's dtype runs the FlashAttention-2-style
//                                     kernel's staged tiles, not the warp-specialized kernel's
//                                     mask rows (default at head dims 64 and 128)
//   FLASHMOD_MASK_SHOWN_TILES=0       the warp-specialized kernel's mask rows test every value for
//                                     hiding its key (default: tiles classified as hiding none,
//                                     a dense bias's, are added untested)
//   FLASHMOD_SM90_MASK_STAGING=0      the FlashAttention-2-style wgmma kernel reads an additive
//                                     mask per score from global memory, not from tiles staged
//                                     in shared memory with K/V (staged_mask.h)
//   FLASHMOD_BWD_ADDITIVE_FAST=0      the Hopper backward takes additive masks in q's dtype through
//                                     the general path (no staged dK/dV tiles, no batched dQ
//                                     loads; bwd_common.h)
//   FLASHMOD_BWD_MASK_TILES=0         the fp16/bf16 backward reads a mask tensor per element in
//                                     every tile, without classifying its tiles first
//                                     (backward_dispatch.h)
//   FLASHMOD_BWD_FUSED_DQ=0|1|2       the Hopper backward's dQ added up in its dK/dV kernel
//                                     by atomics: 1 where it is the faster (a key's queries
//                                     >= 1024 on average, at D = 64 and 128;
//                                     backward_dispatch.h) with deterministic algorithms off
//                                     (default), 0 never, 2 wherever it applies; the same for
//                                     the fp32 backward (1: at every length and head dim)
//   FLASHMOD_BWD_TF32_WIDE=0|1|2      the fp32 backward's tiles past head dim 128: 1 (default) the
//                                     widest the device's shared memory takes (at D = 192 / 256
//                                     8 warps in pairs that split the head dim, else 4 warps of
//                                     whole rows), 0 the 2-warp tiles every sm_80+ GPU fits, 2 no
//                                     pairs (bwd_tf32_launch.h)
//   FLASHMOD_BWD_TMA_LOADS=0|1|2      the Hopper backward's plain kernels load their steps through
//                                     the copy engine: 1 in the dK/dV and dQ kernels (default),
//                                     2 in the dK/dV kernel only, 0 in neither (cp.async)
//   FLASHMOD_BWD_STAGED_STORES=0      the fp16/bf16 backward's warps store their gradient rows
//                                     straight from the accumulators (default: through shared
//                                     memory in 16-byte chunks where the rows are aligned)
//   FLASHMOD_BWD_DEFERRED_FENCES=0    the fused dQ variant's proxy fences right behind their
//                                     tiles' stores at D = 64 too (default: after the work that
//                                     follows them there; bwd_sm90_launch.h)
//   FLASHMOD_BWD_FUSED_OVERLAP=0      the fused dQ variant at D = 128 waits for each step's
//                                     gradient products at the step's end (default: with the
//                                     next step's dQ product; bwd_sm90_launch.h)
//   FLASHMOD_BWD_DQ_BESIDE=0          the backward's dQ kernel (fp16/bf16 and fp32) after the
//                                     dK/dV launch on the call's stream (default: beside it on a
//                                     pool stream; kernel_launch.h: launch_beside)
//   FLASHMOD_BWD_SM90_TILE=name       that tile of the Hopper backward (tools/gen_kernels.py's
//                                     BWD_SM90_TILES); a name not built for the head dim is an
//                                     error
//   FLASHMOD_CPU_BWD_BRGEMM=1|0       the CPU backward's fp32 products on oneDNN's micro-kernel
//                                     over transposed operands, or on the BLAS's sgemm (default:
//                                     the first on AMD CPUs running the AVX-512 kernel)
//   FLASHMOD_FP32_FFMA=1              fp32 on the CUDA-core (FFMA) kernel, not 3xTF32
//   FLASHMOD_FP32_WGMMA=0             fp32 on an H100/H200 on the mma.sync 3xTF32 kernel, not the
//                                     wgmma one (head dims <= 128, 16-byte aligned rows)
//   FLASHMOD_DECODE=0                 CUDA decode shapes run the prefill kernel
//   FLASHMOD_DECODE_PACK=0            no GQA row packing in the CUDA decode kernel
//   FLASHMOD_DECODE_SPLITS=n          exactly n split-KV splits (0: the heuristic)
//   FLASHMOD_DECODE_TMA=0             the CUDA decode kernel copies pages shorter than a key block
//                                     with cp.async, not the copy engine (sm_90a)
//   FLASHMOD_DECODE_FUSED_COMBINE=0   split-KV partials merged by the combine kernel, not by each
//                                     tile's last CTA
//   FLASHMOD_STREAM_COUNTERS=0        the decode combine's and the tile scheduler's counters
//                                     zeroed by a memset per call, not shared per stream
//                                     (stream_counters.h)
//   FLASHMOD_FLAT_GRID=1              the CUDA decode kernel on a 1-D grid, its CTAs' tiles
//                                     divided out of blockIdx.x (default: a (splits, heads,
//                                     batch) grid; cta_tile.h)
//   FLASHMOD_DECODE_KEY_SPLIT=0       CUDA decode tiles of <= 16 rows on the row-split kernel,
//                                     not the key-split one (kernel_traits.h: KeySplitTraits)
//   FLASHMOD_KVCACHE_FUSED_APPEND=0   decode-shaped KV-cache calls append with the append kernel
//                                     before the attention, not inside it
//   FLASHMOD_SOFTMAX_TRACE=1          prints the softmax launch path
//   FLASHMOD_SOFTMAX_STREAM=0         the sm_90 softmax stream path off
//   FLASHMOD_SOFTMAX_STREAM_CLUSTER=c forces the stream path's cluster size
//   FLASHMOD_MMSM_SINGLE_PASS_MAX_N=n caps fp32 matmul_softmax's single-pass rows (0: two-pass)
//   FLASHMOD_MMSM_WARP_ROWS=0         CUDA matmul_softmax's fallback normalize takes a block per
//                                     row even where a row fits one warp
//   FLASHMOD_MMSM_FUSED=0|1|2         CUDA matmul_softmax: 0 the cuBLAS + normalize fallback
//                                     always, 2 the fused kernels wherever they run, 1 the
//                                     measured rule (softmax_cuda.cpp: fused_preferred)
#pragma once

#include <cstdint>
#include <string>

namespace flashmod {

// FLASHMOD_X: unset -> fallback, "1" -> true, "0" -> false, anything else -> error.
bool env_flag(const char* name, bool fallback);

// A decimal integer; unset or empty -> fallback, anything that is not a whole integer -> error.
int64_t env_int(const char* name, int64_t fallback);

// The raw text; unset -> empty. For knobs whose values are names (FLASHMOD_CPU_ISA,
// FLASHMOD_BWD_SM90_TILE).
std::string env_text(const char* name);

}  // namespace flashmod
