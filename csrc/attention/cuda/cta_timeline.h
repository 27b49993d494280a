// A per-CTA timeline for tools/decode_timeline.cu, which defines FLASHMOD_CTA_TIMELINE before it
// includes the decode kernel (the extension never does; then this header declares nothing). Thread
// 0 of every CTA records the global timer when the CTA starts, when its key loop is done (mark())
// and when it leaves (the probe's destructor runs at whichever return it takes), and the SM it ran
// on.
#pragma once

#ifdef FLASHMOD_CTA_TIMELINE
namespace flashmod::cuda_kernels {

constexpr int kTimelineMaxCtas = 1 << 16;
struct CtaTimelineEntry {
  unsigned long long start_ns, loop_done_ns, end_ns;
  unsigned int sm, pad;
};
__device__ CtaTimelineEntry g_cta_timeline[kTimelineMaxCtas];

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct CtaTimelineProbe {
  unsigned long long start_ns = global_timer_ns(), loop_done_ns = 0;
  __device__ void mark() { loop_done_ns = global_timer_ns(); }
  __device__ ~CtaTimelineProbe() {
    if (threadIdx.x != 0 || blockIdx.x >= kTimelineMaxCtas) return;
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_cta_timeline[blockIdx.x] = {start_ns, loop_done_ns, global_timer_ns(), sm, 0u};
  }
};

}  // namespace flashmod::cuda_kernels
#endif
