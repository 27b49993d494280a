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

#include "../attention_params.h"

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
};

extern const KernelInfo kAmxBf16Kernel;  // bf16 on AMX tiles, the rest as kAvx512Kernel
extern const KernelInfo kAvx512Kernel;
extern const KernelInfo kAvx2Kernel;
extern const KernelInfo kBaselineKernel;

}  // namespace flashmod::cpu
