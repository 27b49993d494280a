// The sm_90 tensor memory accelerator (TMA) and the warp-specialization primitives around it: tiled
// tensor-map loads global -> shared completing on an mbarrier (the barrier helpers are in
// bulk_copy_ops.h), register reallocation between warpgroups (setmaxnreg, sm_90a), and the
// arrive-only half of a named barrier. Plus the host side: encoding a tensor map through the
// driver entry point the CUDA runtime hands out, so nothing links libcuda.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only; no driver symbol is linked)
#include <cuda_runtime.h>

#include <cstdint>

namespace flashmod::cuda_kernels {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// Fetches the tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache ahead of
// the first load that uses it.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// One box of a 4-D tensor map at coordinates (c0 innermost .. c3) into shared memory at dst
// (aligned as the map's swizzle needs: 1024 bytes for 128-byte swizzle); completion counts the
// box's bytes (out-of-bounds elements included, zero-filled) on bar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The reverse of tma_load_4d: one box from shared memory at src (laid out as tma_load_4d leaves
// it) to the tensor at coordinates (c0 .. c3); elements outside the tensor are not written. The
// copy runs on after the call: tma_store_commit closes this thread's group of stores, and
// tma_store_wait_read<0> waits until they have read shared memory (before src is written again).
// The writing threads order their shared stores before it with fence_proxy_async_smem.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Adds `bytes` of fp32 (a multiple of 16; both addresses 16-byte aligned) from shared memory into
// global memory, element by element (atomic adds, in no fixed order). Runs on after the call in
// this thread's bulk group, as tma_store_4d: the same commit and waits.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until the stores are done (written to global memory), not only read.
__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// A barrier's arrive without the wait: counts this warp's threads toward `threads` on barrier id
// and goes on (the signalling half of a producer/consumer hand-off between warpgroups).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#endif  // __CUDA_ARCH__ >= 900

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Register reallocation: every warp of a warpgroup runs the same one (aligned). The kernel needs a
// register cap at entry (__launch_bounds__(threads, 1)) for these to take effect.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#endif

// Host: a 4-D tiled tensor map over a strided (batch, heads, rows, cols) tensor of 16-bit
// elements, boxes of box_rows x 64 columns (128 bytes: the 128-byte swizzle's span), swizzled as
// the wgmma descriptors of wgmma_ops.h read them. Elements past cols, or past rows of one
// (batch, head), read as zeros, so a box never brings in the next head's rows. Strides are in
// elements; those of a dimension of size 1 are never used and are replaced by valid ones.
// Returns false (the map unusable) when TMA cannot take the tensor: base not 16-byte aligned, a
// used stride not a positive multiple of 16 bytes, or the driver refusing it. The driver's
// function is looked up once per process.
inline bool encode_rows_tensor_map(CUtensorMap* map, bool bf16, const void* base, int64_t batch,
                                   int64_t heads, int64_t rows, int64_t cols, int64_t batch_stride,
                                   int64_t head_stride, int64_t row_stride, int box_rows) {
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = []() -> Encode {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  constexpr int64_t kElem = 2;
  int64_t row_b = row_stride * kElem, head_b = head_stride * kElem, batch_b = batch_stride * kElem;
  if (rows == 1) row_b = (cols * kElem + 15) / 16 * 16;
  if (heads == 1) head_b = rows * row_b;
  if (batch == 1) batch_b = heads * head_b;
  for (int64_t s : {row_b, head_b, batch_b})
    if (s <= 0 || s % 16 != 0 || s >= (int64_t{1} << 40)) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_b), static_cast<cuuint64_t>(head_b),
                                 static_cast<cuuint64_t>(batch_b)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flashmod::cuda_kernels
