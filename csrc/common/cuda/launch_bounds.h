// The second argument of a kernel's __launch_bounds__ (its minimum CTAs per SM), from its shared
// memory.
//
// Under __launch_bounds__(threads) alone ptxas picks registers for an occupancy of its own
// choosing: in our units at most 168 registers a thread, and no more than two CTAs' worth (128
// registers at 256 threads): three CTAs of 128 threads, two of 256. Where shared memory holds a
// kernel to fewer CTAs per SM than that, the registers ptxas withheld buy nothing and cost spills
// or a tighter schedule. Naming the CTAs shared memory allows lets ptxas take the registers that
// will be there (design log cuda-registers.md, sessions 56-57). Where shared memory allows as many
// CTAs as ptxas aims at, or more, the bound names none (0: ptxas's own choice): naming them all
// would ask for fewer registers than ptxas takes (the fp32 backward's D = 32 tiles fit five CTAs by
// shared memory; bounds of five squeezed them into 80 registers with 250-440 bytes of spills).
#pragma once

namespace flashmod::cuda {

// Shared memory one SM holds for its CTAs in the architecture this pass compiles for: 228 KB on
// sm_90, 164 KB on sm_80 / sm_87, 100 KB on sm_86 / sm_89. The host pass (which ignores launch
// bounds) takes the smallest.
constexpr int sm_shared_memory_bytes() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return 228 * 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870)
  return 164 * 1024;
#else
  return 100 * 1024;
#endif
}

// CTAs per SM that smem_bytes of dynamic shared memory allow (the system reserves 1 KB per CTA).
constexpr int ctas_for_smem(int smem_bytes) {
  return sm_shared_memory_bytes() / (smem_bytes + 1024);
}

// The CTAs per SM ptxas aims its registers at by itself (above): 168 registers a thread, at least
// two CTAs.
constexpr int ptxas_default_ctas(int threads) {
  const int at_168 = 65536 / (168 * threads);
  return at_168 > 2 ? at_168 : 2;
}

// __launch_bounds__(threads, min_ctas_for_smem(smem_bytes, threads)).
constexpr int min_ctas_for_smem(int smem_bytes, int threads) {
  const int fit = ctas_for_smem(smem_bytes);
  return fit >= ptxas_default_ctas(threads) ? 0 : fit < 1 ? 1 : fit;
}

}  // namespace flashmod::cuda
