// Thin wrappers over the sm_90 PTX that the streaming softmax is built from: mbarriers (with
// transaction counts), the 1-D bulk copy global -> shared (the TMA engine without a tensor map),
// and distributed shared memory across a thread-block cluster. Compiled only for sm_90+: callers
// guard their use with __CUDA_ARCH__ >= 900 and the host launches them only on such binaries.
#pragma once

#include <cstdint>

#include "ptx_ops.h"  // named_barrier

namespace flashmod::cuda_kernels {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the mbarrier inits visible to the other blocks of the cluster and to the async proxy.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also tells the barrier to expect `bytes` more of transactions this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Release (CTA scope): this thread's earlier shared-memory reads happen before the phase completes.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrival on another block's barrier (bar: a shared::cluster address from map_to_rank), releasing
// at cluster scope this thread's earlier stores into that block's shared memory.
__device__ __forceinline__ void mbarrier_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar)
               : "memory");
}

// Spins until the barrier's phase with parity `parity` has completed. CTA-scope acquire: enough
// for bulk copies into this block and arrivals from its own threads.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// As mbarrier_wait, acquiring at cluster scope: for phases completed by other blocks' arrivals.
__device__ __forceinline__ void mbarrier_wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this
// block's shared memory; completion counts `bytes` of transactions on `bar`. kReadOnce: nothing
// else reads the source, so it is marked first to leave L2 (not for sources other blocks read).
template <bool kReadOnce>
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes,
                                                    uint32_t bar) {
  if constexpr (kReadOnce) {
    asm volatile(
        "{\n"
        ".reg .b64 policy;\n"
        "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], policy;\n"
        "}\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        "\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
  }
}

// The shared::cluster address of the same variable in block `rank` of this cluster.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(addr), "r"(rank));
  return mapped;
}

__device__ __forceinline__ void store_remote_float2(uint32_t addr, float x, float y) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y)
               : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every block of the cluster: arrive (release), then wait (acquire).
__device__ __forceinline__ void cluster_barrier() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// The whole block at barrier 0, where its warps may arrive through different barrier
// instructions (warpgroups running different code): bar.sync / __syncthreads is .aligned, which
// requires every thread to execute the same one (compute-sanitizer's synccheck reports otherwise).
__device__ __forceinline__ void cta_barrier_unaligned() {
  asm volatile("barrier.sync 0;\n" ::: "memory");
}

#endif  // __CUDA_ARCH__ >= 900

// The "full" mbarriers of `stages` buffers that the copy engine fills, 8 bytes apart from bar0,
// each completing after `arrivals` arrivals and their bytes; by one thread, before its first copy.
// Declared for every target, so that code paths only sm_90 takes compile elsewhere.
__device__ __forceinline__ void init_stage_barriers(uint32_t bar0, int stages, int arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int s = 0; s < stages; ++s) mbarrier_init(bar0 + 8 * s, arrivals);
  fence_mbarrier_init();  // visible to the copy engine before the first copy completes on one
#endif
}

}  // namespace flashmod::cuda_kernels
