// Which fused kernels run the fp16/bf16 backward (after its row statistics), shared by the dense
// op (attention_backward_cuda.cpp) and the variable-length one (serve_backward_cuda.cpp): the
// Hopper (wgmma) kernels where the build has them for the head dim, in the tile that
// FLASHMOD_BWD_SM90_TILE names or the default one, else the portable mma.sync kernels. Both
// families take per-sequence extents (sequence_view_bwd) themselves.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <string>

#include "../../common/error_message.h"
#include "../../common/knobs.h"
#include "../sequence_view.h"
#include "entry_points.h"
#include "generated/kernel_variants.h"
#include "host_alignment.h"

namespace flashmod {

// The row of kBwdSm90Tiles to run for padded head dim d: the one FLASHMOD_BWD_SM90_TILE names, or
// the default tile when it is unset. A name with no build for d is an error listing those built.
inline int bwd_sm90_tile(const char* op, int d, const AttentionBwdParams& p,
                         const cuda_kernels::BwdRowStats& st) {
  const std::string name = env_text("FLASHMOD_BWD_SM90_TILE");
  const int additive = cuda_kernels::bwd_sm90_additive_tile(d);
  if (name.empty() && additive >= 0 && cuda_kernels::bwd_additive_fast(p, st)) return additive;
  const int tile = cuda_kernels::find_tile(cuda_kernels::kBwdSm90Tiles, name.c_str(), d);
  if (tile < 0) {
    std::string built;
    for (const cuda_kernels::KernelTile& t : cuda_kernels::kBwdSm90Tiles)
      if (t.head_dim == d) built += (built.empty() ? "" : ", ") + std::string(t.name);
    TORCH_CHECK(false, error_message(op, ": FLASHMOD_BWD_SM90_TILE=", name,
                                     " names no Hopper backward tile for head dim ", d,
                                     "; expected one of: ", built));
  }
  return tile;
}

// dK/dV and dQ of fp16/bf16 p (st filled by run_attention_bwd_rowstats), after classifying a mask
// tensor's tiles (cuda_kernels::classify_bwd_mask_tiles; FLASHMOD_BWD_MASK_TILES=0 leaves every
// tile mixed) in workspace memory of `options`' device. An unsupported head dim is an error naming
// op.
inline cudaError_t run_fused_backward(const char* op, AttentionBwdParams p,
                                      const cuda_kernels::BwdRowStats& st,
                                      const at::TensorOptions& options, cudaStream_t stream) {
  TorchWorkspace workspace(options, stream);  // the mask's tile classes, freed in stream order
  if (p.mask_kind != MaskKind::kNone && env_flag("FLASHMOD_BWD_MASK_TILES", true)) {
    const cudaError_t err = cuda_kernels::classify_bwd_mask_tiles(p, workspace.hooks(), stream);
    if (err != cudaSuccess) return err;
  }
  const int padded = cuda_kernels::padded_head_dim(cuda_kernels::kBwdSm80HeadDims, p.head_dim);
  const int key = cuda_kernels::variant_key(p.dtype, padded);
  if (sm90_kernels_usable() && cuda_kernels::has_head_dim(cuda_kernels::kBwdSm90HeadDims, padded)) {
    // Tile indices are below 64 (tools/gen_kernels.py checks). Variable-length calls run the
    // default tile, the only one built with their variants (bwd_sm90_launch.h).
    const int tile = has_sequence_extents(p)
                         ? cuda_kernels::find_tile(cuda_kernels::kBwdSm90Tiles, "", padded)
                         : bwd_sm90_tile(op, padded, p, st);
    switch (key * 64 + tile) {
#define FLASHMOD_BWD_SM90_CASE(Elem, kind, D, T)                \
  case cuda_kernels::variant_key(ScalarKind::kind, D) * 64 + T: \
    return cuda_kernels::run_attention_bwd_sm90<Elem, D, T>(p, st, stream);
      FLASHMOD_BWD_SM90_VARIANTS(FLASHMOD_BWD_SM90_CASE)
#undef FLASHMOD_BWD_SM90_CASE
    }
  }
  switch (key) {
#define FLASHMOD_BWD_CASE(Elem, kind, D)               \
  case cuda_kernels::variant_key(ScalarKind::kind, D): \
    return cuda_kernels::run_attention_bwd<Elem, D>(p, st, stream);
    FLASHMOD_BWD_SM80_VARIANTS(FLASHMOD_BWD_CASE)
#undef FLASHMOD_BWD_CASE
  }
  TORCH_CHECK(false, error_message(op, ": unsupported head_dim ", p.head_dim));
}

}  // namespace flashmod
