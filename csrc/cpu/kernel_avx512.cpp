// The forward kernel for AVX-512 (Skylake-SP and later, Zen 4): 16 fp32 lanes, 32 registers.
#include <immintrin.h>

#include "kernel.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace flashmod::cpu {
namespace {

#include "simd_avx512.h"
#include "kernel_impl.h"

}  // namespace

const KernelInfo kAvx512Kernel = {"avx512", kBr, &run_tasks_with<VecEngine>};

}  // namespace flashmod::cpu
