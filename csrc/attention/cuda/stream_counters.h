// Zeroed int counters kept per (device, stream) for the kernels that leave their counters zero
// again (the split-KV decode's fused combine, the warp-specialized forward's tile scheduler):
// launches on one stream run one after another, so they can share them, and an eager call then
// needs no memset node ahead of its kernel (~1.5 us of a 4k-token decode step's 57 on an H100).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashmod {

// `count` counters, zero in stream order on `stream` (of the current device), that the launch
// must leave zero; nullptr while the stream is being captured into a CUDA graph (a graph may be
// replayed on another stream beside eager work on this one: it takes its own zeroed memory) or
// when FLASHMOD_STREAM_COUNTERS=0. Memory of a stream that is gone stays for the next stream that
// reuses its handle (it too finds the counters zero); it is never freed (a few KB per stream).
int* stream_zeroed_counters(cudaStream_t stream, size_t count);

}  // namespace flashmod
