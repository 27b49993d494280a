#include "stream_counters.h"

#include <map>
#include <mutex>
#include <utility>

#include "../../common/knobs.h"

namespace flashmod {

int* stream_zeroed_counters(cudaStream_t stream, size_t count) {
  if (!env_flag("FLASHMOD_STREAM_COUNTERS", true)) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone)
    return nullptr;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
  struct Counters {
    int* memory = nullptr;
    size_t count = 0;
  };
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, Counters> pool;
  const std::lock_guard<std::mutex> lock(mutex);
  Counters& c = pool[{device, stream}];
  if (c.count < count) {
    // Grows by doubling; the smaller block stays allocated, since launches queued before this one
    // on the stream may still use it.
    size_t grown = c.count > 0 ? c.count : 1024;
    while (grown < count) grown *= 2;
    int* memory = nullptr;
    // Relaxed: an allocation is legal while another thread captures a graph in global mode.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t allocated = cudaMalloc(&memory, grown * sizeof(int));
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (allocated != cudaSuccess) {
      (void)cudaGetLastError();  // clear the allocation failure: the caller falls back
      return nullptr;
    }
    if (cudaMemsetAsync(memory, 0, grown * sizeof(int), stream) != cudaSuccess) return nullptr;
    c = Counters{memory, grown};
  }
  return c.memory;
}

}  // namespace flashmod
