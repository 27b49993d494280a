// The KV-cache append of attention_kvcache on CUDA as one kernel (torch-free): new keys/values go
// into the caches at cache_seqlens (through the block table when paged), and each row's valid
// length cache_seqlens + s_new is written for the attention kernel that follows on the stream.
// For calls that run the prefill kernel; decode-shaped calls append inside the decode kernel
// (paged_kv.h: append_new_rows), one launch fewer per decode step.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashmod::cuda_kernels {

struct KvAppendArgs {
  const void* k_new = nullptr;  // (B, s_new, Hkv, D), element strides below
  const void* v_new = nullptr;
  void* k_cache = nullptr;  // (B_cache, S, Hkv, D), or pages (P, page_size, Hkv, D)
  void* v_cache = nullptr;
  int64_t kn_batch_stride = 0, kn_row_stride = 0, kn_head_stride = 0;
  int64_t vn_batch_stride = 0, vn_row_stride = 0, vn_head_stride = 0;
  // Batch (or page) / row / head strides of the caches.
  int64_t kc_batch_stride = 0, kc_row_stride = 0, kc_head_stride = 0;
  int64_t vc_batch_stride = 0, vc_row_stride = 0, vc_head_stride = 0;
  const int32_t* cache_seqlens = nullptr;  // (B): first slot to write per row
  const int32_t* kv_batch_idx = nullptr;   // (B) or nullptr: cache row of each batch row
  const int32_t* block_table = nullptr;    // (B, block_table_batch_stride) or nullptr
  int64_t block_table_batch_stride = 0;
  int64_t page_size = 0;
  int32_t* seqused_k = nullptr;  // (B) out: cache_seqlens + s_new
  int64_t batch = 0, s_new = 0, heads_kv = 0, head_dim = 0;
};

// 2-byte elements (fp16 / bf16: the CUDA serving ops' dtypes).
cudaError_t run_kvcache_append(const KvAppendArgs& a, cudaStream_t stream);

}  // namespace flashmod::cuda_kernels
