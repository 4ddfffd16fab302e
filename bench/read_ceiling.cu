// bench/read_ceiling.cu
// \brief flashkit_bench_read_ceiling: the GPU's own limits for a decode call, measured the way
// flashkit_bench_decode measures mha_fwd_kvcache, so that its TB/s can be read against them:
//   - the streaming-read ceiling: a kernel that does nothing but read N bytes from HBM once (16-byte
//     loads, eight in flight per thread, one, two and four CTAs per SM tried, the best kept), at the
//     byte counts of the decode grid's batch-1 cells and of batch 8 at 128k;
//   - the launch floor: one empty kernel between two events, the least an event-timed call costs.
// A decode call reads the same bytes plus Q, block tables and partials, and does its softmax, so
// its time is at least ceiling time + (what it cannot overlap of) the launch floor.
//
// Method (docs/GPU.md; bench_support.h's time_launches, as bench_decode.cpp): warm-up >= 25 ms,
// CUDA events around every call, median of >= 20 calls and >= 100 ms, buffers rotated so that the
// bytes touched between two reads of one buffer exceed twice the L2.
//
//   flashkit_bench_read_ceiling [--json PATH]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "bench_support.h"

namespace {

using flashkit::bench::cuda_ok;  // CUDA_OK

constexpr int kThreads = 512;
constexpr int kLoadsInFlight = 8;  // 16-byte loads per thread per step: 64 KiB per CTA in flight

// Reads `chunks` 16-byte chunks once; XORs them so the loads are live, and stores the XOR only
// where it equals a value the data never produces (all bytes zeroed by the caller), which keeps
// the store from being issued.
__global__ void __launch_bounds__(kThreads) stream_read(const uint4* __restrict__ data, int64_t chunks,
                                                         uint32_t* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t acc = 0;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kLoadsInFlight - 1) * stride < chunks; i += kLoadsInFlight * stride) {
    uint4 v[kLoadsInFlight];
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j) v[j] = __ldcs(data + i + j * stride);
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < chunks; i += stride) {
    const uint4 v = __ldcs(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0xdeadbeefu) sink[0] = acc;
}

__global__ void empty_kernel() {}

// Median milliseconds per launch of `launch(set)`, set = 0, 1, ... modulo `sets` (bench_support.h's
// time_launches: the method of flashkit_bench and flashkit_bench_decode).
template <typename Launch>
double median_ms(Launch launch, int sets) {
  int last_set = 0;
  return flashkit::bench::time_launches(launch, sets, nullptr, [] {}, &last_set);
}

struct Row {
  double mbytes;  // bytes read per call / 1e6
  const char* cell;
  double ms;
  double tbps;
  int ctas_per_sm;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: flashkit_bench_read_ceiling [--json PATH]\n");
      return 2;
    }
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "flashkit_bench_read_ceiling: no CUDA device\n");
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  const double l2_bytes = prop.l2CacheSize;

  // The decode grid's batch-1 byte counts (bf16 K + V, 8 KV heads, head dim 128) and the 128k
  // batch-8 one: 2 * cache * 8 * 128 * 2 bytes.
  const struct {
    const char* cell;
    int64_t bytes;
  } sizes[] = {{"b1 8k", 2LL * 8192 * 8 * 128 * 2},
               {"b1 32k", 2LL * 32768 * 8 * 128 * 2},
               {"b1 128k", 2LL * 131072 * 8 * 128 * 2},
               {"b8 128k", 8 * 2LL * 131072 * 8 * 128 * 2}};

  uint32_t* sink = nullptr;
  CUDA_OK(cudaMalloc(&sink, sizeof(uint32_t)));
  std::vector<Row> rows;
  for (const auto& size : sizes) {
    // Enough buffers that 2 x L2 bytes pass between two reads of one of them.
    const int sets = static_cast<int>(std::max<int64_t>(1, static_cast<int64_t>(2 * l2_bytes / size.bytes) + 1));
    std::vector<uint4*> buffers(sets);
    for (uint4*& b : buffers) {
      CUDA_OK(cudaMalloc(&b, size.bytes));
      CUDA_OK(cudaMemset(b, 0, size.bytes));
    }
    const int64_t chunks = size.bytes / 16;
    Row best{size.bytes / 1e6, size.cell, 0, 0, 0};
    for (int per_sm = 1; per_sm <= 4; per_sm *= 2) {
      const double ms = median_ms([&](int set) {
        stream_read<<<sms * per_sm, kThreads>>>(buffers[set], chunks, sink);
      }, sets);
      if (best.ms == 0 || ms < best.ms) best = Row{size.bytes / 1e6, size.cell, ms, size.bytes / (ms * 1e-3) / 1e12, per_sm};
    }
    rows.push_back(best);
    for (uint4* b : buffers) cudaFree(b);
  }
  const double launch_floor_ms = median_ms([](int) { empty_kernel<<<1, 32>>>(); }, 1);
  cudaFree(sink);

  std::printf("%s, %d SMs, L2 %.0f MiB\n", prop.name, sms, l2_bytes / (1 << 20));
  std::printf("launch floor (one empty kernel between events): %.2f us\n", launch_floor_ms * 1e3);
  std::printf("streaming read, best CTAs per SM of 1/2/4:\n");
  for (const Row& r : rows) {
    std::printf("  %-8s %8.1f MB  %9.2f us  %6.3f TB/s  (%d CTAs/SM)\n", r.cell, r.mbytes, r.ms * 1e3, r.tbps,
                r.ctas_per_sm);
  }
  if (!json_path.empty()) {
    std::ofstream json(json_path);
    json << "{\n  \"gpu\": \"" << prop.name << "\",\n  \"launch_floor_us\": " << launch_floor_ms * 1e3
         << ",\n  \"note\": \"streaming read of each size once per call, events around each call, median; "
            "best of 1, 2, 4 CTAs per SM\",\n  \"reads\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      json << "    {\"cell\": \"" << r.cell << "\", \"mbytes\": " << r.mbytes << ", \"us\": " << r.ms * 1e3
           << ", \"tbps\": " << r.tbps << ", \"ctas_per_sm\": " << r.ctas_per_sm << "}"
           << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    json << "  ]\n}\n";
  }
  return 0;
}
