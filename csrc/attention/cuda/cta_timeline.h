// A per-CTA timeline for tools/decode_timeline.cu, which defines FLASHMOD_CTA_TIMELINE before it
// includes the decode kernel (the extension never does; then this header declares nothing). Thread
// 0 of every CTA records the global timer when the CTA starts, when it knows its key range
// (ranged()), when its prologue's copies were issued (issued()), when its first and its last key
// block had landed (landed()), when its key loop is done (mark()) and when it leaves (the probe's
// destructor runs at whichever return it takes), and the SM it ran on.
#pragma once

#ifdef FLASHMOD_CTA_TIMELINE
namespace flashmod::cuda_kernels {

constexpr int kTimelineMaxCtas = 1 << 16;
struct CtaTimelineEntry {
  unsigned long long start_ns, loop_done_ns, end_ns, first_landed_ns, last_landed_ns, issued_ns,
      ranged_ns;
  unsigned int sm, pad;
};
__device__ CtaTimelineEntry g_cta_timeline[kTimelineMaxCtas];

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct CtaTimelineProbe {
  unsigned long long start_ns = global_timer_ns(), loop_done_ns = 0, first_landed_ns = 0,
                     last_landed_ns = 0, issued_ns = 0, ranged_ns = 0;
  __device__ void ranged() { ranged_ns = global_timer_ns(); }
  __device__ void issued() { issued_ns = global_timer_ns(); }
  __device__ void landed(bool first, bool last) {
    if (!first && !last) return;
    const unsigned long long t = global_timer_ns();
    if (first) first_landed_ns = t;
    if (last) last_landed_ns = t;
  }
  __device__ void mark() { loop_done_ns = global_timer_ns(); }
  __device__ ~CtaTimelineProbe() {
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x != 0 || cta >= kTimelineMaxCtas) return;
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_cta_timeline[cta] = {start_ns,
                           loop_done_ns,
                           global_timer_ns(),
                           first_landed_ns,
                           last_landed_ns,
                           issued_ns,
                           ranged_ns,
                           sm,
                           0u};
  }
};

}  // namespace flashmod::cuda_kernels
#endif
