// The forward kernel for AVX-512 (Skylake-SP and later, Zen 4): 16 fp32 lanes, 32 registers.
#include <immintrin.h>

#include "kernel.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace flashmod::cpu {
namespace {

#include "simd_avx512.h"

// Scores: 8 keys x 2 vectors = 16 accumulators + 2 Q vectors of the 32 registers.
// P V: 4 rows x 4 vectors (64 columns) = 16 accumulators + 4 broadcasts.
constexpr int kNV = 2, kKB = 8, kRB = 4, kDV = 4;

// Bc = 64: S_ij (Bc x Br fp32) and a D=128 fp32 K_j/V_j tile (32 KiB) stay near L1.
constexpr int64_t kBc = 64;

#include "engine_common.h"
#include "engine_decode.h"
#include "engine_prefill.h"

}  // namespace

const KernelInfo kAvx512Kernel = {
    "avx512", kBr, nullptr, nullptr, &run_tasks_with<VecEngine>, kW, &decode_run, &decode_merge};

}  // namespace flashmod::cpu
