// Where a decode step's time goes, CTA by CTA (issue 14: the 4k step's ~12 us of fixed cost). Runs
// the decode kernel itself (fwd_sm80_launch.h, built here with FLASHMOD_CTA_TIMELINE:
// cta_timeline.h) on the benchmark's shape (B 8, 32 / 8 heads, D 128, bf16, flash-attn's (B,
// tokens, heads, D) cache, one query token, no append) from a cold L2 (cold_l2.h), and reports per
// split count:
//   step      the median event time of the launch (as bench_serve.py times it) and the copy rate's
//             fraction (a device-to-device copy of as many bytes read + written, same process)
//   span      last CTA end - first CTA start (global timer); the rest of the step is launch
//   starts    when the last CTA started, after the first
//   ends      when 10 / 50 / 90 / 100 % of the CTAs had ended
//   busy      the CTAs' summed time over (CTAs x span): the share of the span the grid was full
//   alone / shared  mean CTA time on an SM that held one CTA / two or more
// and below each row: the time after the key loop (partial, count, combine), a CTA's mean and the
// last CTA's, and when the last key loop ended; the spread of the CTA times: their sd over every
// call, and the sd of their means by block index (the same work each call), by SM and by call; with
// the heuristic's splits also the means by split, kv head and batch row; and a CTA's mean time from
// its start to its prologue's copies and to its first key block's landing, then per block to its
// last one's, and that last block's math (tools/read_ceiling.cu's pipeline modes: the same without
// the math). Every number is the median
// over the timed calls. The output of two rows is checked against a double-precision reference
// first.
//
// Build and run on the GPU machine (no torch needed):
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -DFLASHMOD_BUILT_SM90A \
//     -DFLASHMOD_CTA_TIMELINE -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
//     -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
//     -gencode=arch=compute_90a,code=sm_90a -o /tmp/decode_timeline tools/decode_timeline.cu \
//     && /tmp/decode_timeline [cache tokens, default 4096,16384] [splits, default 0,2,8; 0: the
//     heuristic] [warm]
// FLAT_GRID=1 in the environment runs the decode kernel on its 1-D grid (cta_tile.h: cta_grid).
// With "warm", every timed call follows (after the L2 flush) a call of the same kernel on a small
// cache of its own (B 1, 256 tokens, 2 splits): the kernel's machine code is then in L2 and the
// SMs' instruction caches, its data is not. The difference to the cold rows is what fetching the
// code costs a step.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../csrc/attention/cuda/fwd_sm80_launch.h"
#include "cold_l2.h"
#include "cuda_check.h"

namespace fk = flashmod::cuda_kernels;

namespace {

constexpr int kBatch = 8, kHeadsQ = 32, kHeadsKv = 8, kDim = 128;

// A bump allocator over one buffer, reset before every launch: the workspace the torch glue gets
// from the caching allocator.
struct Arena {
  char* base = nullptr;
  size_t size = 0, used = 0;
  int* counters = nullptr;  // zero; the kernel leaves its counters zero again
};
void* arena_alloc(void* ctx, size_t bytes) {
  auto* a = static_cast<Arena*>(ctx);
  const size_t at = (a->used + 255) & ~size_t(255);
  if (at + bytes > a->size) return nullptr;
  a->used = at + bytes;
  return a->base + at;
}
int* arena_counters(void* ctx, size_t count) {
  return count <= 65536 ? static_cast<Arena*>(ctx)->counters : nullptr;
}

std::vector<std::vector<int>> parse_lists(int argc, char** argv) {
  std::vector<std::vector<int>> lists = {{4096, 16384}, {0, 2, 8}};
  for (int a = 1; a < argc && a <= 2; ++a) {
    lists[a - 1].clear();
    for (char* tok = std::strtok(argv[a], ","); tok; tok = std::strtok(nullptr, ","))
      lists[a - 1].push_back(std::atoi(tok));
  }
  return lists;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool warm_code = argc > 3 && std::strcmp(argv[3], "warm") == 0;
  const auto lists = parse_lists(argc, argv);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "%s, %d SMs; decode B %d, %d/%d heads, D %d, bf16, cold L2, %s code, median of 30 "
      "calls\n",
      prop.name, prop.multiProcessorCount, kBatch, kHeadsQ, kHeadsKv, kDim,
      warm_code ? "warm" : "cold");
  const ColdL2 cold_l2(prop);
  Arena arena;
  arena.size = 256 << 20;
  CHECK(cudaMalloc(&arena.base, arena.size));
  CHECK(cudaMalloc(&arena.counters, 65536 * sizeof(int)));
  CHECK(cudaMemset(arena.counters, 0, 65536 * sizeof(int)));
  fk::DeviceWorkspace ws;
  ws.ctx = &arena;
  ws.alloc = arena_alloc;
  ws.zeroed_counters = arena_counters;
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  void* timeline = nullptr;
  CHECK(cudaGetSymbolAddress(&timeline, fk::g_cta_timeline));
  std::mt19937 rng(14);
  std::normal_distribution<float> normal;

  for (const int tokens : lists[0]) {
    const size_t q_elems = size_t(kBatch) * kHeadsQ * kDim;
    const size_t kv_elems = size_t(kBatch) * tokens * kHeadsKv * kDim;
    std::vector<__nv_bfloat16> hq(q_elems), hk(kv_elems), hv(kv_elems);
    for (auto* h : {&hq, &hk, &hv})
      for (auto& x : *h) x = __float2bfloat16(normal(rng));
    __nv_bfloat16 *q, *k, *v, *out;
    float* lse;
    void* copy_dst;
    const size_t kv_bytes = 2 * kv_elems * sizeof(__nv_bfloat16);
    CHECK(cudaMalloc(&q, q_elems * 2));
    CHECK(cudaMalloc(&k, kv_elems * 2));
    CHECK(cudaMalloc(&v, kv_elems * 2));
    CHECK(cudaMalloc(&out, q_elems * 2));
    CHECK(cudaMalloc(&lse, kBatch * kHeadsQ * 4));
    CHECK(cudaMalloc(&copy_dst, kv_bytes / 2));
    CHECK(cudaMemcpy(q, hq.data(), q_elems * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(k, hk.data(), kv_elems * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(v, hv.data(), kv_elems * 2, cudaMemcpyHostToDevice));

    // flash-attn's layouts: q / out (B, 1, Hq, D), k / v (B, tokens, Hkv, D), lse (B, Hq, 1).
    flashmod::AttentionParams p;
    p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
    p.q_batch_stride = p.out_batch_stride = kHeadsQ * kDim;
    p.q_head_stride = p.out_head_stride = kDim;
    p.q_row_stride = p.out_row_stride = kHeadsQ * kDim;
    p.k_batch_stride = p.v_batch_stride = int64_t(tokens) * kHeadsKv * kDim;
    p.k_head_stride = p.v_head_stride = kDim;
    p.k_row_stride = p.v_row_stride = kHeadsKv * kDim;
    p.batch = kBatch, p.heads_q = kHeadsQ, p.heads_kv = kHeadsKv;
    p.seqlen_q = 1, p.seqlen_k = tokens, p.head_dim = kDim;
    p.diag_offset = tokens - 1;
    p.scale = 1.0 / std::sqrt(double(kDim));
    p.dtype = flashmod::ScalarKind::kBFloat16;
    p.lse_batch_stride = kHeadsQ, p.lse_head_stride = 1;
    if (!fk::pack_gqa_rows(p)) {
      std::fprintf(stderr, "GQA packing did not apply\n");
      return 1;
    }
    fk::FwdLaunchFlags flags{};
    flags.out_vec16 = 1;
    // The warm-up call's problem: the same packed layout on small buffers of its own.
    constexpr int kWarmTokens = 256;
    flashmod::AttentionParams p_warm = p;
    const size_t warm_kv_elems = size_t(kWarmTokens) * kHeadsKv * kDim;
    void *warm_q, *warm_k, *warm_v, *warm_out, *warm_lse;
    CHECK(cudaMalloc(&warm_q, kHeadsQ * kDim * 2));
    CHECK(cudaMalloc(&warm_k, warm_kv_elems * 2));
    CHECK(cudaMalloc(&warm_v, warm_kv_elems * 2));
    CHECK(cudaMalloc(&warm_out, kHeadsQ * kDim * 2));
    CHECK(cudaMalloc(&warm_lse, kHeadsQ * 4));
    CHECK(cudaMemset(warm_q, 0, kHeadsQ * kDim * 2));
    CHECK(cudaMemset(warm_k, 0, warm_kv_elems * 2));
    CHECK(cudaMemset(warm_v, 0, warm_kv_elems * 2));
    p_warm.q = warm_q, p_warm.k = warm_k, p_warm.v = warm_v, p_warm.out = warm_out;
    p_warm.lse = static_cast<float*>(warm_lse);
    p_warm.batch = 1, p_warm.seqlen_k = kWarmTokens, p_warm.diag_offset = kWarmTokens - 1;

    std::printf("\n%d tokens: %.1f MB of K/V\n", tokens, kv_bytes / 1e6);
    std::printf("%-7s %5s %8s %6s %8s %7s %26s %6s %14s\n", "splits", "CTAs", "step us", "of cp",
                "span us", "starts", "ends 10/50/90/100 % us", "busy", "alone/shared");
    std::vector<float> copy_ms;
    for (int rep = 0; rep < 30; ++rep) {
      cold_l2.flush();
      CHECK(cudaEventRecord(start));
      CHECK(cudaMemcpyAsync(copy_dst, k, kv_bytes / 2, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      copy_ms.push_back(t);
    }
    const float copy = median(copy_ms);

    for (const int forced : lists[1]) {
      fk::DecodeOptions opt;
      opt.num_sms = prop.multiProcessorCount;
      opt.forced_splits = forced;
      // FLAT_GRID=1 in the environment: the launch's 1-D grid (FLASHMOD_FLAT_GRID's A/B).
      opt.flat_grid = std::getenv("FLAT_GRID") != nullptr;
      auto launch = [&] {
        arena.used = 0;
        CHECK((fk::run_attention_fwd_decode<__nv_bfloat16, kDim>(p, flags, opt, ws, nullptr)));
      };
      // Validate before timing: two packed rows against a double-precision reference.
      launch();
      CHECK(cudaDeviceSynchronize());
      std::vector<__nv_bfloat16> hout(q_elems);
      CHECK(cudaMemcpy(hout.data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
      for (const int bh : {0, kBatch * kHeadsQ - 1}) {
        const int b = bh / kHeadsQ, h = bh % kHeadsQ, hk_ = h / (kHeadsQ / kHeadsKv);
        std::vector<double> s(tokens), o(kDim, 0.0);
        double m = -1e300, l = 0;
        for (int j = 0; j < tokens; ++j) {
          double dot = 0;
          for (int d = 0; d < kDim; ++d)
            dot += double(__bfloat162float(hq[(size_t(b) * kHeadsQ + h) * kDim + d])) *
                   __bfloat162float(hk[((size_t(b) * tokens + j) * kHeadsKv + hk_) * kDim + d]);
          s[j] = dot * p.scale;
          m = std::max(m, s[j]);
        }
        for (int j = 0; j < tokens; ++j) {
          const double w = std::exp(s[j] - m);
          l += w;
          for (int d = 0; d < kDim; ++d)
            o[d] +=
                w * __bfloat162float(hv[((size_t(b) * tokens + j) * kHeadsKv + hk_) * kDim + d]);
        }
        for (int d = 0; d < kDim; ++d) {
          const double got = __bfloat162float(hout[(size_t(b) * kHeadsQ + h) * kDim + d]);
          if (std::fabs(got - o[d] / l) > 1e-2) {
            std::fprintf(stderr, "splits %d: out[%d, %d, %d] = %f, reference %f\n", forced, b, h, d,
                         got, o[d] / l);
            return 1;
          }
        }
      }

      std::vector<float> step, span, starts, e10, e50, e90, e100, busy, alone, shared;
      // After the key loop: each CTA's epilogue (partial, count, combine), the last CTA's, and
      // when the last key loop ended.
      std::vector<float> epilogue_mean, epilogue_last, last_loop_done;
      // Within a CTA (means over its CTAs): from its start to its first key block's landing, the
      // blocks from then to its last one's landing (per block), and the last block's math.
      std::vector<float> to_range, to_issue, to_first_block, per_block, last_block_math;
      // Each timed call's CTA times, by block index and by SM: what the spread comes from.
      std::map<int, std::vector<double>> by_cta, by_sm;
      std::vector<double> all_durations, rep_means;
      int ctas = 0;
      for (int rep = 0; rep < 33; ++rep) {
        CHECK(cudaMemset(timeline, 0, sizeof(fk::CtaTimelineEntry) * fk::kTimelineMaxCtas));
        cold_l2.flush();
        if (warm_code) {
          fk::DecodeOptions warm_opt = opt;
          warm_opt.forced_splits = 2;
          arena.used = 0;
          CHECK((fk::run_attention_fwd_decode<__nv_bfloat16, kDim>(p_warm, flags, warm_opt, ws,
                                                                   nullptr)));
        }
        CHECK(cudaEventRecord(start));
        launch();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        if (rep < 3) continue;  // warm-up
        step.push_back(t * 1e3f);
        std::vector<fk::CtaTimelineEntry> tl(fk::kTimelineMaxCtas);
        CHECK(cudaMemcpyFromSymbol(tl.data(), fk::g_cta_timeline, tl.size() * sizeof(tl[0])));
        // This launch's CTAs (the buffer was cleared before it).
        std::vector<const fk::CtaTimelineEntry*> mine;
        for (const auto& e : tl)
          if (e.end_ns) mine.push_back(&e);
        unsigned long long first = ~0ull, last = 0, last_start = 0;
        for (auto* e : mine) first = std::min(first, e->start_ns);
        std::map<unsigned, int> per_sm;
        std::vector<float> ends;
        double summed = 0, epi = 0;  // the CTAs' times, and their times past the key loop
        double range_sum = 0, issue_sum = 0, first_sum = 0, between_sum = 0, math_sum = 0;
        const fk::CtaTimelineEntry* final_cta = mine.front();
        unsigned long long loops_done = 0;
        for (auto* e : mine) {
          last = std::max(last, e->end_ns);
          last_start = std::max(last_start, e->start_ns);
          ends.push_back((e->end_ns - first) * 1e-3f);
          summed += (e->end_ns - e->start_ns) * 1e-3;
          epi += (e->end_ns - e->loop_done_ns) * 1e-3;
          range_sum += (e->ranged_ns - e->start_ns) * 1e-3;
          issue_sum += (e->issued_ns - e->start_ns) * 1e-3;
          first_sum += (e->first_landed_ns - e->start_ns) * 1e-3;
          between_sum += (e->last_landed_ns - e->first_landed_ns) * 1e-3;
          math_sum += (e->loop_done_ns - e->last_landed_ns) * 1e-3;
          if (e->end_ns > final_cta->end_ns) final_cta = e;
          loops_done = std::max(loops_done, e->loop_done_ns);
          ++per_sm[e->sm];
        }
        ctas = static_cast<int>(mine.size());
        to_range.push_back(static_cast<float>(range_sum / ctas));
        to_issue.push_back(static_cast<float>(issue_sum / ctas));
        to_first_block.push_back(static_cast<float>(first_sum / ctas));
        per_block.push_back(static_cast<float>(between_sum / ctas));
        last_block_math.push_back(static_cast<float>(math_sum / ctas));
        std::sort(ends.begin(), ends.end());
        const float sp = (last - first) * 1e-3f;
        span.push_back(sp);
        starts.push_back((last_start - first) * 1e-3f);
        e10.push_back(ends[ends.size() / 10]);
        e50.push_back(ends[ends.size() / 2]);
        e90.push_back(ends[ends.size() * 9 / 10]);
        e100.push_back(ends.back());
        busy.push_back(static_cast<float>(summed / (ctas * sp)));
        rep_means.push_back(summed / ctas);
        epilogue_mean.push_back(static_cast<float>(epi / ctas));
        epilogue_last.push_back((final_cta->end_ns - final_cta->loop_done_ns) * 1e-3f);
        last_loop_done.push_back((loops_done - first) * 1e-3f);
        double a_sum = 0, s_sum = 0;
        int a_n = 0, s_n = 0;
        for (auto* e : mine) {  // per_sm is complete now
          const double d = (e->end_ns - e->start_ns) * 1e-3;
          if (per_sm[e->sm] == 1)
            a_sum += d, ++a_n;
          else
            s_sum += d, ++s_n;
          by_cta[static_cast<int>(e - tl.data())].push_back(d);
          by_sm[static_cast<int>(e->sm)].push_back(d);
          all_durations.push_back(d);
        }
        alone.push_back(a_n ? static_cast<float>(a_sum / a_n) : 0.f);
        shared.push_back(s_n ? static_cast<float>(s_sum / s_n) : 0.f);
      }
      char ends_text[64];
      std::snprintf(ends_text, sizeof(ends_text), "%.1f / %.1f / %.1f / %.1f", median(e10),
                    median(e50), median(e90), median(e100));
      std::printf("%-7s %5d %8.1f %6.3f %8.1f %7.1f %26s %6.3f %6.1f / %5.1f\n",
                  forced ? std::to_string(forced).c_str() : "heur", ctas, median(step),
                  copy * 1e3f / median(step), median(span), median(starts), ends_text, median(busy),
                  median(alone), median(shared));
      // The spread of CTA times (sd over every call's CTAs) against the spread of their means by
      // block index (the same work every call: batch row, kv head, split), by SM and by call.
      // Means over ~30 samples keep ~0.18 of a random spread; more is a systematic part.
      auto sd = [](const std::vector<double>& v) {
        double m = 0, q = 0;
        for (double x : v) m += x;
        m /= v.size();
        for (double x : v) q += (x - m) * (x - m);
        return std::sqrt(q / v.size());
      };
      auto sd_of_means = [&](const std::map<int, std::vector<double>>& groups) {
        std::vector<double> means;
        for (const auto& [key, v] : groups) {
          double m = 0;
          for (double x : v) m += x;
          means.push_back(m / v.size());
        }
        return sd(means);
      };
      std::printf(
          "        after the key loop: %.2f us a CTA, %.2f for the last one; the last loop ended "
          "at %.1f us\n",
          median(epilogue_mean), median(epilogue_last), median(last_loop_done));
      // Key blocks per CTA: the tile's blocks over its splits (CTAs per (batch row, kv head)).
      const int splits_run = ctas / (kBatch * kHeadsKv);
      const int blocks_per_cta = (tokens / 64 + splits_run - 1) / splits_run;
      std::printf(
          "        a CTA knew its key range %.2f us and issued its first copies %.2f us after its "
          "start; its first key block "
          "landed %.2f us after its start, then %.3f us a block to its last (%d blocks), whose "
          "math took %.2f us\n",
          median(to_range), median(to_issue), median(to_first_block),
          median(per_block) / std::max(1, blocks_per_cta - 1), blocks_per_cta,
          median(last_block_math));
      std::printf(
          "        CTA time sd %.2f us; sd of means by block index %.2f, by SM %.2f, by call "
          "%.2f\n",
          sd(all_durations), sd_of_means(by_cta), sd_of_means(by_sm), sd(rep_means));
      if (forced == 0) {
        // Means by split, kv head and batch row (tile-major grid: index = (b * Hkv + hk) * splits
        // + split, one query block).
        const int splits = ctas / (kBatch * kHeadsKv);
        std::vector<double> by_split(splits), by_head(kHeadsKv), by_batch(kBatch);
        for (const auto& [idx, v] : by_cta) {
          double m = 0;
          for (double x : v) m += x;
          m /= v.size();
          by_split[idx % splits] += m / (kBatch * kHeadsKv);
          by_head[(idx / splits) % kHeadsKv] += m / (kBatch * splits);
          by_batch[idx / (splits * kHeadsKv)] += m / (kHeadsKv * splits);
        }
        std::printf("        mean CTA time by split:");
        for (double m : by_split) std::printf(" %.1f", m);
        std::printf("; by kv head:");
        for (double m : by_head) std::printf(" %.1f", m);
        std::printf("; by batch row:");
        for (double m : by_batch) std::printf(" %.1f", m);
        std::printf("\n");
      }
    }
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                      static_cast<void*>(out), static_cast<void*>(lse), copy_dst})
      CHECK(cudaFree(ptr));
    for (void* ptr : {warm_q, warm_k, warm_v, warm_out, warm_lse}) CHECK(cudaFree(ptr));
  }
  return 0;
}
