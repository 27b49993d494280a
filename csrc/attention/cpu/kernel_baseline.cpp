// The forward kernel for any x86-64 (SSE2): 4 fp32 lanes, 16 registers, no FMA.
#include "kernel.h"

namespace flashmod::cpu {
namespace {

constexpr int kW = 4;
using vf = float __attribute__((vector_size(16)));
using vi = int32_t __attribute__((vector_size(16)));

inline vf splat(float s) {
  return vf{s, s, s, s};
}
inline vf fmadd(vf a, vf b, vf c) {
  return a * b + c;
}
inline float hsum(vf v) {
  return (v[0] + v[2]) + (v[1] + v[3]);
}
inline vf load_f16(const uint16_t* p) {
  vf v;
  for (int i = 0; i < kW; ++i) {
    _Float16 h;
    std::memcpy(&h, p + i, 2);
    v[i] = float(h);
  }
  return v;
}
inline vf load_bf16(const uint16_t* p) {
  using vh = uint16_t __attribute__((vector_size(kW * 2)));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vi) << 16);
}
inline vi load_u8(const uint8_t* p) {
  return vi{p[0], p[1], p[2], p[3]};
}

constexpr int kNV = 2, kKB = 4, kRB = 4, kDV = 2;

// Bc = 64: S_ij (Bc x Br fp32) and a D=128 fp32 K_j/V_j tile (32 KiB) stay near L1.
constexpr int64_t kBc = 64;

#include "engine_common.h"
#include "engine_decode.h"
#include "engine_prefill.h"

}  // namespace

const KernelInfo kBaselineKernel = {
    "baseline", kBr, nullptr, nullptr, &run_tasks_with<VecEngine>, kW, &decode_run, &decode_merge};

}  // namespace flashmod::cpu
