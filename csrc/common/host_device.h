// FLASHMOD_HD marks the small torch-free helpers that host glue and CUDA kernels both call.
#pragma once

#if defined(__CUDACC__)
#define FLASHMOD_HD __host__ __device__ __forceinline__
#else
#define FLASHMOD_HD inline
#endif
