// bench/fwd_trace_sm90.cu
// \brief flashkit_fwd_trace_sm90: where the sm90 forward's time goes around its tiles. Builds the
// bf16 d128 kernels (p = 0 and the dropout instance) and the bf16 d256 p = 0 kernel with
// FLASHKIT_SM90_FWD_TRACE (each consumer's first thread records clock64 at six points of every
// tile), runs one problem of the standard grid's shape (16k tokens, 2048 / head dim heads) and
// prints, per consumer, the mean cycles of each phase and the
// time between two tiles of one CTA (same SM, in start order), the main loop's per-block period, the
// per-tile cost in key blocks, the mean cycles of each phase of a main-loop iteration (slots 10-16 of
// the instrument: fwd_kernel_sm90.cuh), the key blocks per SM and the idle time at the end.
//
// Its default inputs (bf16 in [2^-7, 1.5 x 2^-7): few bits toggle) keep the GPU well under its
// power limit and at its top clock, so the cycle counts are the kernel's own but its span is shorter
// than the benchmark's; `random` takes the benchmark's inputs (uniform in [-1, 1)), which run at the
// power cap (bench/NOTES.md, "Session 10").
//
//   flashkit_fwd_trace_sm90 [seqlen (2048)] [causal (0)] [dropout p (0): > 0 traces the dropout instance]
//                           [inputs: small (default) | random] [head dim: 128 (default) | 256, p = 0 only]
#define FLASHKIT_SM90_FWD_TRACE 1
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "api/validate_fwd.h"
#include "common/half_float.h"
#include "cuda/sm90/fwd_launch_sm90.cuh"

namespace {

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

}  // namespace

template <int kHeadDim, bool kDropout>
int trace(int seqlen, bool causal, float dropout_p, bool random_inputs) {
  using namespace flashkit;
  const int batch = 16384 / seqlen, heads = 2048 / kHeadDim;
  constexpr sm90::FwdTileConfig kTile = sm90::fwd_tile_config(kHeadDim, kDropout);
  using Traits = sm90::FwdKernelTraits<__nv_bfloat16, kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, kDropout>;
  constexpr int kConsumers = Traits::kConsumerWarpgroups;

  const size_t elems = static_cast<size_t>(batch) * seqlen * heads * kHeadDim;
  std::vector<uint16_t> host(elems);
  uint64_t state = 0x5eed;
  for (size_t i = 0; i < elems; ++i) {
    if (random_inputs) {  // uniform in [-1, 1), a splitmix64 stream
      state += 0x9e3779b97f4a7c15ull;
      uint64_t z = (state ^ (state >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      host[i] = float_to_bf16_bits(static_cast<float>((z ^ (z >> 31)) >> 40) * 0x1p-23f - 1.0f);
    } else {
      host[i] = 0x3c00 + static_cast<uint16_t>((i * 2654435761u) >> 26);  // bf16 in [2^-7, 1.5 x 2^-7)
    }
  }
  void *q, *k, *v, *out, *lse;
  for (void** p : {&q, &k, &v, &out}) check(cudaMalloc(p, elems * 2), "cudaMalloc");
  check(cudaMalloc(&lse, static_cast<size_t>(batch) * heads * seqlen * 4), "cudaMalloc");
  for (void* p : {q, k, v}) check(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice), "copy");
  const Device gpu{DeviceKind::kCuda, 0};
  MhaFwdParams prm;
  prm.q = make_view(q, DType::kBFloat16, {batch, seqlen, heads, kHeadDim}, gpu);
  prm.k = make_view(k, DType::kBFloat16, {batch, seqlen, heads, kHeadDim}, gpu);
  prm.v = make_view(v, DType::kBFloat16, {batch, seqlen, heads, kHeadDim}, gpu);
  prm.out = make_view(out, DType::kBFloat16, {batch, seqlen, heads, kHeadDim}, gpu);
  prm.softmax_lse = make_view(lse, DType::kFloat32, {batch, heads, seqlen}, gpu);
  prm.mask.causal = causal;
  prm.dropout = {dropout_p, 0x5eed, 0};
  const FwdProblem problem = api::validate_mha_fwd(prm);

  const int tiles = batch * heads * ((seqlen + Traits::kBlockM - 1) / Traits::kBlockM);
  const size_t slots = static_cast<size_t>(tiles) * kConsumers * sm90::kTraceSlots;
  check(cudaMalloc(&sm90::fwd_trace_buffer, slots * 8), "cudaMalloc trace");
  for (int i = 0; i < 5; ++i) sm90::launch_fwd<Traits, true>(problem, sm90::FwdPlan{}, nullptr);
  check(cudaMemset(sm90::fwd_trace_buffer, 0, slots * 8), "memset");
  sm90::launch_fwd<Traits, true>(problem, sm90::FwdPlan{}, nullptr);
  check(cudaDeviceSynchronize(), "run");
  std::vector<long long> t(slots);
  check(cudaMemcpy(t.data(), sm90::fwd_trace_buffer, slots * 8, cudaMemcpyDeviceToHost), "copy trace");

  // The record of `tile` by consumer `c` (slots: fwd_kernel_sm90.cuh, FLASHKIT_FWD_TRACE).
  auto record = [&](int tile, int c) { return &t[(static_cast<size_t>(tile) * kConsumers + c) * sm90::kTraceSlots]; };
  // Tiles of one CTA, in walk order: grouped by SM and ordered by start (one CTA per SM at a time).
  const int blocks_full = seqlen / Traits::kBlockN;
  std::printf("bf16 d%d seqlen %d batch %d heads %d causal %d dropout %g, %s inputs: %d tiles, %d key blocks per full tile\n",
              kHeadDim, seqlen, batch, heads, causal, dropout_p, random_inputs ? "random" : "small", tiles,
              blocks_full);
  const char* names[] = {"q wait", "first S", "main loop", "last P V", "epilogue", "to next tile"};
  for (int c = 0; c < kConsumers; ++c) {
    std::map<long long, std::vector<std::pair<long long, int>>> by_sm;  // sm -> (start, tile)
    for (int tile = 0; tile < tiles; ++tile) {
      const long long* e = record(tile, c);
      if (e[0] != 0) by_sm[e[7]].push_back({e[0], tile});
    }
    double sum[6] = {}, count[6] = {}, loop_cycles = 0, blocks = 0;
    double loop_sum[sm90::kTraceLoopPhases] = {}, iterations = 0;
    for (auto& [sm, list] : by_sm) {
      std::sort(list.begin(), list.end());
      for (size_t i = 0; i < list.size(); ++i) {
        const long long* e = record(list[i].second, c);
        for (int ph = 0; ph < 5; ++ph) { sum[ph] += e[ph + 1] - e[ph]; count[ph] += 1; }
        for (int ph = 0; ph < sm90::kTraceLoopPhases; ++ph) loop_sum[ph] += e[10 + ph];
        // The main loop (slots 2 -> 3) runs every visited block (slot 9) but the first.
        blocks += static_cast<double>(e[9]);
        if (e[9] > 1) {
          loop_cycles += static_cast<double>(e[3] - e[2]);
          iterations += static_cast<double>(e[9] - 1);
        }
        if (i + 1 < list.size()) {
          const long long* f = record(list[i + 1].second, c);
          sum[5] += f[0] - e[5]; count[5] += 1;
        }
      }
    }
    std::printf("consumer %d:", c);
    for (int ph = 0; ph < 6; ++ph) std::printf("  %s %.0f", names[ph], count[ph] ? sum[ph] / count[ph] : 0.0);
    if (iterations > 0) {
      const double period = loop_cycles / iterations;
      const double tile_total = (sum[0] + sum[1] + sum[2] + sum[3] + sum[4]) / count[0] + (count[5] ? sum[5] / count[5] : 0);
      const double mean_blocks = blocks / count[0];
      std::printf("\n  main-loop period %.0f cycles per key block; tile start to next tile start %.0f = %.2f periods for %.2f blocks (%.2f blocks of overhead)",
                  period, tile_total, tile_total / period, mean_blocks, tile_total / period - mean_blocks);
      const char* loop_names[] = {"K/V wait", "turn wait", "issue", "S wait", "softmax", "P V wait", "rescale O"};  // slots 10-16
      double total = 0;
      std::printf("\n  main-loop iteration, mean cycles:");
      for (int ph = 0; ph < sm90::kTraceLoopPhases; ++ph) {
        std::printf("  %s %.0f", loop_names[ph], loop_sum[ph] / iterations);
        total += loop_sum[ph] / iterations;
      }
      std::printf("  (sum %.0f)", total);
    }
    // The main loop's first iterations of a tile against its later ones (tiles of >= 6 blocks),
    // and the time an iteration waits for its next K and V after the softmax (slots 17-21).
    {
      double first = 0, second = 0, third_fourth = 0, rest = 0, rest_iterations = 0, tiles_counted = 0, late_k = 0, late_v = 0;
      for (auto& [sm, list] : by_sm) {
        for (auto& [start, tile] : list) {
          const long long* e = record(tile, c);
          late_k += static_cast<double>(e[20]);
          late_v += static_cast<double>(e[21]);
          if (e[9] < 6) continue;
          first += static_cast<double>(e[17] - e[2]);
          second += static_cast<double>(e[18] - e[17]);
          third_fourth += static_cast<double>(e[19] - e[18]) / 2;
          rest += static_cast<double>(e[3] - e[19]);
          rest_iterations += static_cast<double>(e[9] - 5);
          tiles_counted += 1;
        }
      }
      if (tiles_counted > 0) {
        std::printf("\n  main-loop iterations (tiles of >= 6 blocks): 1st %.0f  2nd %.0f  3rd-4th %.0f  later %.0f cycles;"
                    " of the softmax phase, %.0f + %.0f cycles per iteration waiting for the next K + V",
                    first / tiles_counted, second / tiles_counted, third_fourth / tiles_counted,
                    rest / rest_iterations, iterations > 0 ? late_k / iterations : 0.0,
                    iterations > 0 ? late_v / iterations : 0.0);
      }
    }
    // Work per SM (key blocks of its tiles) against the mean: what the schedule left unbalanced.
    {
      std::vector<double> sm_blocks;
      for (auto& [sm, list] : by_sm) {
        double b = 0;
        for (auto& [start, tile] : list) b += static_cast<double>(record(tile, c)[9]);
        sm_blocks.push_back(b);
      }
      double mean = 0, most = 0;
      for (double b : sm_blocks) { mean += b; most = std::max(most, b); }
      mean /= static_cast<double>(sm_blocks.size());
      std::printf("\n  key blocks per SM: mean %.1f, most %.0f (mean / most %.3f)", mean, most, mean / most);
    }
    // Balance (globaltimer, comparable across SMs): each SM's last tile end against the kernel's.
    long long first = -1, last = 0;
    std::vector<long long> ends;
    for (auto& [sm, list] : by_sm) {
      long long end = 0;
      for (auto& [start, tile] : list) {
        const long long* e = record(tile, c);
        first = first < 0 ? e[6] : std::min(first, e[6]);
        end = std::max(end, e[8]);
      }
      ends.push_back(end);
      last = std::max(last, end);
    }
    double idle = 0;
    for (long long end : ends) idle += static_cast<double>(last - end);
    std::printf("\n  span %.1f us over %zu SMs; an SM's last tile ends on average %.1f us before the last one"
                " (%.1f%% of the span idle at the end)\n",
                (last - first) / 1e3, ends.size(), idle / ends.size() / 1e3,
                100.0 * idle / ends.size() / static_cast<double>(last - first));
  }
  return 0;
}

int main(int argc, char** argv) {
  const int seqlen = argc > 1 ? std::atoi(argv[1]) : 2048;
  const bool causal = argc > 2 && std::atoi(argv[2]) != 0;
  const float dropout_p = argc > 3 ? static_cast<float>(std::atof(argv[3])) : 0.0f;
  const bool random_inputs = argc > 4 && std::string(argv[4]) == "random";
  const int head_dim = argc > 5 ? std::atoi(argv[5]) : 128;
  if (head_dim == 256 && dropout_p == 0.0f) return trace<256, false>(seqlen, causal, 0.0f, random_inputs);
  if (head_dim != 128) {
    std::fprintf(stderr, "flashkit_fwd_trace_sm90: head dim %d%s is not traced (128, or 256 at p = 0)\n",
                 head_dim, dropout_p > 0.0f ? " with dropout" : "");
    return 2;
  }
  return dropout_p > 0.0f ? trace<128, true>(seqlen, causal, dropout_p, random_inputs)
                          : trace<128, false>(seqlen, causal, 0.0f, random_inputs);
}
