// bench/bench_decode.cpp
// \brief flashkit_bench_decode: times mha_fwd_kvcache decoding (public API only) and writes the
// results format of docs/DESIGN.md with op "decode".
//
// The grid: bf16, seqlen_q 1, GQA 32/8 (--heads-kv 1 for MQA), head dim 128; batch 1 ... 256 x
// cache length 1k ... 128k (cells above --max-tokens cached tokens in all are skipped: they need
// more memory than the GPU has); caches contiguous, paged with 16-token and with 256-token pages
// (randperm block tables; --page-shuffle N shuffles within runs of N pages instead, 1 keeps them in
// order, to tell address-translation or DRAM locality costs from the kernel's own); --splits times
// given split counts instead of the heuristic's (0).
// Every sequence holds the full cache length; no append (a decode step
// proper appends one token: --append adds it, with rotary off).
//
// tbps = bytes of K and V read / time = 2 * batch * cache_len * heads_kv * head_dim * 2 / s / 1e12
// (each key and value read once: the packed GQA kernel does exactly that).
//
// Method (docs/GPU.md; bench_support.h's time_launches, as flashkit_bench): warm-up of at least
// 25 ms in two or more batches; CUDA events around every call; median of at least 20 calls and
// 100 ms; cache sets rotated so that the bytes touched exceed twice the L2. The output is poisoned before the timed calls and checked for NaN after.
// bench/peers_decode.py times its peers the same way. An event pair around each call counts the
// gap between the begin event and the first kernel, and the end of the last kernel; the printed
// line adds, for reading where a small call's time goes (not in the JSON), the mean time per call
// of the same calls back to back between one event pair and the host's time to enqueue one.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/half_float.h"
#include "flashkit/flashkit.h"

namespace {

using flashkit::DType;
using flashkit::TensorView;
using flashkit::bench::cuda_ok;  // CUDA_OK

constexpr int kHeadsQ = 32;
constexpr int kHeadDim = 128;

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t scale = 1;
    if (!item.empty() && (item.back() == 'k' || item.back() == 'K')) {
      scale = 1024;
      item.pop_back();
    }
    values.push_back(std::stoll(item) * scale);
  }
  return values;
}

struct Options {
  std::vector<int64_t> batches = {1, 8, 64, 256};
  std::vector<int64_t> caches = {1024, 8192, 32768, 131072};
  std::vector<int64_t> pages = {0, 16, 256};  // 0: contiguous
  int heads_kv = 8;
  std::vector<int64_t> splits = {0};  // num_splits values to time (0: the heuristic)
  int64_t max_tokens = int64_t{2} << 20;
  int64_t page_shuffle = 0;  // shuffle the block table within runs of this many pages (0: all)
  bool append = false;
  std::string json;
};

struct Record {
  int64_t batch, cache, page;
  double ms;
  double tbps;
  int splits;
  double back_to_back_ms;  // mean per call, one event pair around all calls
  double host_ms;          // the host's enqueue time per call during those calls
  std::string note;
};

// Device buffers of one cache set.
struct CacheSet {
  void* k = nullptr;
  void* v = nullptr;
  int* block_table = nullptr;
};

Record run_cell(const Options& opt, int64_t batch, int64_t cache, int64_t page, int num_splits,
               int l2_bytes) {
  Record rec{batch, cache, page, NAN, NAN, 0, NAN, NAN, ""};
  const int64_t hkv = opt.heads_kv;
  const int64_t row_elems = hkv * kHeadDim;
  const int64_t capacity = cache + (opt.append ? 1 : 0);
  const int64_t pages_per_seq = page > 0 ? (capacity + page - 1) / page : 0;
  const int64_t cache_rows = page > 0 ? batch * pages_per_seq * page : batch * capacity;
  const size_t cache_bytes = static_cast<size_t>(cache_rows * row_elems * 2);
  const int sets = static_cast<int>(std::max<int64_t>(1, (2 * int64_t{l2_bytes}) / (2 * cache_bytes) + 1));
  std::vector<CacheSet> cache_sets(sets);
  std::mt19937 rng(1234);
  for (CacheSet& s : cache_sets) {
    if (cudaMalloc(&s.k, cache_bytes) != cudaSuccess || cudaMalloc(&s.v, cache_bytes) != cudaSuccess) {
      cudaGetLastError();
      rec.note = "out of device memory";
      for (CacheSet& t : cache_sets) {
        cudaFree(t.k);
        cudaFree(t.v);
      }
      return rec;
    }
    // 0x3C3C: bf16 0.0115 everywhere; the values do not change the bytes read.
    CUDA_OK(cudaMemset(s.k, 0x3C, cache_bytes));
    CUDA_OK(cudaMemset(s.v, 0x3C, cache_bytes));
    if (page > 0) {
      std::vector<int> table(batch * pages_per_seq);
      std::iota(table.begin(), table.end(), 0);
      const size_t run = opt.page_shuffle > 0 ? static_cast<size_t>(opt.page_shuffle) : table.size();
      for (size_t first = 0; first < table.size(); first += run) {
        std::shuffle(table.begin() + first, table.begin() + std::min(table.size(), first + run), rng);
      }
      CUDA_OK(cudaMalloc(&s.block_table, table.size() * sizeof(int)));
      CUDA_OK(cudaMemcpy(s.block_table, table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice));
    }
  }
  std::vector<uint16_t> q_host(batch * kHeadsQ * kHeadDim);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (uint16_t& x : q_host) x = flashkit::float_to_bits(DType::kBFloat16, uniform(rng));
  std::vector<int> seqlens(batch, static_cast<int>(cache));
  void *q, *out, *lse, *seqlens_dev, *k_new = nullptr, *v_new = nullptr;
  CUDA_OK(cudaMalloc(&q, q_host.size() * 2));
  CUDA_OK(cudaMalloc(&out, q_host.size() * 2));
  CUDA_OK(cudaMalloc(&lse, batch * kHeadsQ * 4));
  CUDA_OK(cudaMalloc(&seqlens_dev, batch * 4));
  CUDA_OK(cudaMemcpy(q, q_host.data(), q_host.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(seqlens_dev, seqlens.data(), batch * 4, cudaMemcpyHostToDevice));
  if (opt.append) {
    CUDA_OK(cudaMalloc(&k_new, batch * row_elems * 2));
    CUDA_OK(cudaMalloc(&v_new, batch * row_elems * 2));
    CUDA_OK(cudaMemset(k_new, 0x3C, batch * row_elems * 2));
    CUDA_OK(cudaMemset(v_new, 0x3C, batch * row_elems * 2));
  }

  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  const flashkit::Device dev{flashkit::DeviceKind::kCuda, device};
  std::vector<flashkit::MhaFwdKvcacheParams> params(sets);
  for (int i = 0; i < sets; ++i) {
    flashkit::MhaFwdKvcacheParams& p = params[i];
    p.q = flashkit::make_view(q, DType::kBFloat16, {batch, 1, kHeadsQ, kHeadDim}, dev);
    if (page > 0) {
      const int64_t blocks = batch * pages_per_seq;
      p.k_cache = flashkit::make_view(cache_sets[i].k, DType::kBFloat16, {blocks, page, hkv, kHeadDim}, dev);
      p.v_cache = flashkit::make_view(cache_sets[i].v, DType::kBFloat16, {blocks, page, hkv, kHeadDim}, dev);
      p.block_table = flashkit::make_view(cache_sets[i].block_table, DType::kInt32, {batch, pages_per_seq}, dev);
    } else {
      p.k_cache = flashkit::make_view(cache_sets[i].k, DType::kBFloat16, {batch, capacity, hkv, kHeadDim}, dev);
      p.v_cache = flashkit::make_view(cache_sets[i].v, DType::kBFloat16, {batch, capacity, hkv, kHeadDim}, dev);
    }
    p.cache_seqlens = flashkit::make_view(seqlens_dev, DType::kInt32, {batch}, dev);
    if (opt.append) {
      p.k_new = flashkit::make_view(k_new, DType::kBFloat16, {batch, 1, hkv, kHeadDim}, dev);
      p.v_new = flashkit::make_view(v_new, DType::kBFloat16, {batch, 1, hkv, kHeadDim}, dev);
    }
    p.out = flashkit::make_view(out, DType::kBFloat16, {batch, 1, kHeadsQ, kHeadDim}, dev);
    p.softmax_lse = flashkit::make_view(lse, DType::kFloat32, {batch, kHeadsQ, 1}, dev);
    p.num_splits = num_splits;
  }
  size_t workspace_bytes = flashkit::mha_fwd_kvcache_workspace_size(params[0]);
  rec.splits = flashkit::mha_fwd_kvcache_num_splits(params[0]);
  void* workspace = nullptr;
  if (workspace_bytes > 0) CUDA_OK(cudaMalloc(&workspace, workspace_bytes));
  for (auto& p : params) {
    p.workspace = workspace;
    p.workspace_bytes = workspace_bytes;
  }

  int last_set = 0;
  rec.ms = flashkit::bench::time_launches(
      [&](int set) { flashkit::mha_fwd_kvcache(params[set]); }, sets, nullptr,
      [&] { CUDA_OK(cudaMemset(out, 0xFF, q_host.size() * 2)); }, &last_set);
  {
    const int reps = std::clamp(static_cast<int>(std::ceil(flashkit::bench::kMinTimedMs / rec.ms)),
                                flashkit::bench::kMinReps, flashkit::bench::kMaxReps);
    flashkit::bench::Event begin, end;
    begin.record(nullptr);
    const auto host_begin = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) flashkit::mha_fwd_kvcache(params[i % sets]);
    const auto host_end = std::chrono::steady_clock::now();
    end.record(nullptr);
    end.synchronize();
    rec.back_to_back_ms = end.since(begin) / reps;
    rec.host_ms = std::chrono::duration<double, std::milli>(host_end - host_begin).count() / reps;
  }
  const double bytes = 2.0 * batch * cache * hkv * kHeadDim * 2;
  rec.tbps = bytes / (rec.ms * 1e-3) / 1e12;
  std::vector<uint16_t> out_host(q_host.size());
  CUDA_OK(cudaMemcpy(out_host.data(), out, out_host.size() * 2, cudaMemcpyDeviceToHost));
  for (uint16_t x : out_host) {
    if (!std::isfinite(flashkit::bits_to_float(DType::kBFloat16, x))) {
      rec.note = "non-finite output";
      rec.tbps = NAN;
      break;
    }
  }
  for (CacheSet& s : cache_sets) {
    cudaFree(s.k);
    cudaFree(s.v);
    cudaFree(s.block_table);
  }
  cudaFree(q);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(seqlens_dev);
  cudaFree(k_new);
  cudaFree(v_new);
  cudaFree(workspace);
  return rec;
}

std::string number_or_null(double x) {
  if (!std::isfinite(x)) return "null";
  std::ostringstream os;
  os << x;
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (arg == "--batch") opt.batches = parse_list(value), ++i;
    else if (arg == "--cache") opt.caches = parse_list(value), ++i;
    else if (arg == "--pages") opt.pages = parse_list(value), ++i;
    else if (arg == "--splits") opt.splits = parse_list(value), ++i;
    else if (arg == "--heads-kv") opt.heads_kv = std::stoi(value), ++i;
    else if (arg == "--max-tokens") opt.max_tokens = parse_list(value)[0], ++i;
    else if (arg == "--page-shuffle") opt.page_shuffle = std::stoll(value), ++i;
    else if (arg == "--append") opt.append = true;
    else if (arg == "--json") opt.json = value, ++i;
    else {
      std::fprintf(stderr,
                   "usage: flashkit_bench_decode [--batch 1,8,64,256] [--cache 1k,8k,32k,128k] "
                   "[--pages 0,16,256] [--splits 0] [--heads-kv 8] [--max-tokens 2048k] "
                   "[--page-shuffle 0] [--append] [--json PATH]\n");
      return 2;
    }
  }
  int device = 0, l2_bytes = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "flashkit_bench_decode: no CUDA device\n");
    return 1;
  }
  l2_bytes = prop.l2CacheSize;
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  std::printf("flashkit_bench_decode: %s, %d SMs, L2 %d MiB; bf16 d%d heads %d/%d seqlen_q 1%s\n",
              prop.name, prop.multiProcessorCount, l2_bytes >> 20, kHeadDim, kHeadsQ, opt.heads_kv,
              opt.append ? ", appending 1 token" : "");
  std::vector<Record> records;
  for (int64_t page : opt.pages) {
    for (int64_t cache : opt.caches) {
      for (int64_t batch : opt.batches) {
        if (batch * cache > opt.max_tokens) continue;
        for (int64_t splits : opt.splits) {
          Record r = run_cell(opt, batch, cache, page, static_cast<int>(splits), l2_bytes);
          std::printf("  %-11s batch %4lld cache %7lld: %8.4f ms  %6.3f TB/s  splits %3d  "
                      "(back to back %8.4f ms, host %7.4f ms per call) %s\n",
                      page > 0 ? ("paged" + std::to_string(page) +
                                  (opt.page_shuffle > 0 ? "/" + std::to_string(opt.page_shuffle) : ""))
                                     .c_str()
                               : "contiguous",
                      static_cast<long long>(batch), static_cast<long long>(cache), r.ms, r.tbps,
                      r.splits, r.back_to_back_ms, r.host_ms, r.note.c_str());
          std::fflush(stdout);
          records.push_back(r);
        }
      }
    }
  }
  if (!opt.json.empty()) {
    std::ofstream js(opt.json);
    const char* commit = std::getenv("FLASHKIT_GIT_COMMIT");
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    js << "{\n  \"gpu\": \"" << prop.name << "\",\n  \"driver\": null,\n  \"cuda\": \"" << runtime / 1000
       << "." << (runtime % 1000) / 10 << "\",\n  \"torch\": null,\n  \"date\": \"" << date
       << "\",\n  \"git_commit\": \"" << (commit != nullptr ? commit : "unknown")
       << "\",\n  \"note\": \"tbps = bytes of K and V read (2*b*s*h_kv*d*2) / median time\",\n"
       << "  \"records\": [";
    for (size_t i = 0; i < records.size(); ++i) {
      const Record& r = records[i];
      js << (i ? ",\n" : "\n") << "    {\"op\": \"decode\", \"impl\": \"flashkit\", \"dtype\": \"bf16\", "
         << "\"batch\": " << r.batch << ", \"heads_q\": " << kHeadsQ << ", \"heads_kv\": " << opt.heads_kv
         << ", \"seqlen_q\": 1, \"seqlen_k\": " << r.cache << ", \"head_dim\": " << kHeadDim
         << ", \"causal\": false, \"window\": [-1, -1], \"layout\": \""
         << (r.page > 0 ? "paged" + std::to_string(r.page) : std::string("contiguous"))
         << "\", \"splits\": " << r.splits << ", \"ms\": " << number_or_null(r.ms)
         << ", \"tflops\": null, \"tbps\": " << number_or_null(r.tbps);
      if (r.page > 0 && opt.page_shuffle > 0) js << ", \"page_shuffle\": " << opt.page_shuffle;
      if (!r.note.empty()) js << ", \"note\": \"" << r.note << "\"";
      js << "}";
    }
    js << "\n  ]\n}\n";
  }
  return 0;
}
