#include <cstdint>

#include "kvcache_append.h"

namespace flashmod::cuda_kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerBlock = 64;  // (token, kv head) rows per CTA; grid.y covers the rest

// grid (B, ceil(s_new * Hkv / kRowsPerBlock)); each warp copies whole (token, head) rows, lanes
// over head_dim. Slots are disjoint per (row, token, head), so no two threads write one element.
__global__ void __launch_bounds__(32 * kWarps) kvcache_append_kernel(const KvAppendArgs a) {
  const int64_t b = blockIdx.x;
  const int64_t start = a.cache_seqlens[b];
  if (blockIdx.y == 0 && threadIdx.x == 0) a.seqused_k[b] = static_cast<int32_t>(start + a.s_new);
  const int64_t rows = a.s_new * a.heads_kv;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
  const int64_t last = first + kRowsPerBlock < rows ? first + kRowsPerBlock : rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto* kn = static_cast<const uint16_t*>(a.k_new);
  const auto* vn = static_cast<const uint16_t*>(a.v_new);
  auto* kc = static_cast<uint16_t*>(a.k_cache);
  auto* vc = static_cast<uint16_t*>(a.v_cache);
  for (int64_t r = first + warp; r < last; r += kWarps) {
    const int64_t t = r / a.heads_kv, h = r % a.heads_kv, pos = start + t;
    int64_t slot, row;  // the cache's batch (or page) index and row within it
    if (a.block_table != nullptr) {
      slot = a.block_table[b * a.block_table_batch_stride + pos / a.page_size];
      row = pos % a.page_size;
    } else {
      slot = a.kv_batch_idx != nullptr ? a.kv_batch_idx[b] : b;
      row = pos;
    }
    const uint16_t* ks = kn + b * a.kn_batch_stride + t * a.kn_row_stride + h * a.kn_head_stride;
    const uint16_t* vs = vn + b * a.vn_batch_stride + t * a.vn_row_stride + h * a.vn_head_stride;
    uint16_t* kd = kc + slot * a.kc_batch_stride + row * a.kc_row_stride + h * a.kc_head_stride;
    uint16_t* vd = vc + slot * a.vc_batch_stride + row * a.vc_row_stride + h * a.vc_head_stride;
    for (int64_t d = lane; d < a.head_dim; d += 32) {
      kd[d] = ks[d];
      vd[d] = vs[d];
    }
  }
}

}  // namespace

cudaError_t run_kvcache_append(const KvAppendArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  const int64_t rows = a.s_new * a.heads_kv;
  const int64_t chunks = rows > 0 ? (rows + kRowsPerBlock - 1) / kRowsPerBlock : 1;
  if (a.batch > 0x7fffffff || chunks > 65535) return cudaErrorInvalidConfiguration;
  kvcache_append_kernel<<<dim3(static_cast<unsigned>(a.batch), static_cast<unsigned>(chunks)),
                          32 * kWarps, 0, stream>>>(a);
  return cudaPeekAtLastError();
}

}  // namespace flashmod::cuda_kernels
