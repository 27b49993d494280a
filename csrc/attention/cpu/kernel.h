// Interface between the torch-side glue (attention_cpu.cpp) and the per-ISA kernel translation
// units (kernel_amx.cpp, kernel_avx512.cpp, kernel_avx2.cpp, kernel_baseline.cpp).
//
// The kernel TUs are compiled for their instruction set with `#pragma GCC target`, so they must
// not include torch (or any header with out-of-line inline functions): an AVX-512 copy of such a
// function could win at link time and be called on a machine without AVX-512. They include only
// C-level standard headers, and keep all their code in an anonymous namespace.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>  // std::integral_constant (types only: no code to merge across ISAs)
#include <utility>      // std::make_integer_sequence

#include "../../common/additive_mask.h"
#include "../attention_params.h"
#include "../dropout_draws.h"
#include "dropout_lanes.h"

namespace flashmod::cpu {

// One implementation of the fp32/fp16/bf16 forward for one instruction set.
struct KernelInfo {
  const char* name;
  int64_t block_rows;  // Br: a task is one (batch, head, block of Br queries)
  // Optional data shared by every task (V transposed once per kv-head for AMX): its size in bytes
  // (0: none), and the fill of kv-heads [begin, end) of batch * heads_kv. May be null.
  int64_t (*shared_bytes)(const AttentionParams& p);
  void (*prepare)(const AttentionParams& p, void* shared, int64_t begin, int64_t end);
  // Runs tasks [begin, end) of batch * heads_q * ceil(seqlen_q / Br), in a stable order.
  void (*run)(const AttentionParams& p, const void* shared, int64_t begin, int64_t end);
  // Decode (few queries, head_dim % vector_width == 0): tasks [begin, end) of
  // batch * heads_kv * decode_chunks(p) * splits; with splits > 1 they fill `partial`
  // (decode_partial_floats(p, splits) floats) and decode_merge then combines chunks [begin, end)
  // of batch * heads_kv * decode_chunks(p).
  int64_t vector_width;
  void (*decode_run)(const AttentionParams& p, int64_t splits, float* partial, int64_t begin,
                     int64_t end);
  void (*decode_merge)(const AttentionParams& p, int64_t splits, const float* partial,
                       int64_t begin, int64_t end);
};

// Query rows per decode task (every query head of a kv group times every query position).
constexpr int64_t kDecodeRows = 8;

inline int64_t decode_chunks(const AttentionParams& p) {
  return ((p.heads_q / p.heads_kv) * p.seqlen_q + kDecodeRows - 1) / kDecodeRows;
}
inline int64_t decode_partial_floats(const AttentionParams& p, int64_t splits) {
  return p.batch * p.heads_kv * decode_chunks(p) * splits * kDecodeRows * (p.head_dim + 2);
}

// The name of the forward kernel in use (kAmxKernelName, "avx512", "avx2" or "baseline"): the
// backward (attention_backward_cpu.cpp) picks its elementwise code and its products by it.
// Defined in attention_cpu.cpp.
const char* kernel_name();
inline constexpr char kAmxKernelName[] = "amx-bf16";

extern const KernelInfo kAmxBf16Kernel;  // bf16 on AMX tiles, the rest as kAvx512Kernel
extern const KernelInfo kAvx512Kernel;
extern const KernelInfo kAvx2Kernel;
extern const KernelInfo kBaselineKernel;

}  // namespace flashmod::cpu
