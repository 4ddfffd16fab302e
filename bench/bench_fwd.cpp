// bench/bench_fwd.cpp
// \brief flashkit_bench: times the forward pass (flashkit::mha_fwd, public API only) on the
// standard grid and writes the results format of docs/DESIGN.md.
//
// The grid: dtypes bf16, fp16; head dims 64, 128, 256; seqlen 512 ... 16k with batch = 16384 /
// seqlen (16k tokens) and heads = 2048 / head_dim (model dim 2048); causal and not. --quick: bf16,
// d64 and d128, seqlen 2k and 8k.
//
// The method (docs/GPU.md, "Time properly"): inputs uniform in [-1, 1) filled on the host; warm-up
// of at least 25 ms in two or more batches of >= 3 launches (the last batch sizes the timed loop);
// then CUDA events around every launch, median of at least 20 launches and at least 100 ms,
// rotating among enough input sets that they exceed twice the L2 when one set is smaller. The
// output and LSE are poisoned with 0xFF bytes (NaN) before the timed launches and checked after; a
// few rows are compared with the CPU reference (flashkit's own CPU backend). A case that throws,
// leaves NaN or disagrees with the reference gets tflops null and a note; the exit status is 1 if
// any case failed (a head dim left out of the build is reported, not counted as a failure).
//
// Without a CUDA device (or in a build without CUDA) it times the CPU backend on one small problem
// and says so: those numbers are not GPU numbers.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/half_float.h"
#include "flashkit/flashkit.h"

#ifdef FLASHKIT_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using flashkit::DType;

constexpr int64_t kTotalTokens = 16384;  // batch * seqlen of every grid shape
constexpr int kModelDim = 2048;          // heads * head_dim of every grid shape
constexpr double kWarmupMs = 25.0;
constexpr int kMinWarmupLaunches = 3;
constexpr double kMinTimedMs = 100.0;
constexpr int kMinReps = 20;
constexpr int kMaxReps = 2000;
constexpr int kSpotRows = 4;  // query rows per block compared with the CPU reference

const double kNaN = std::numeric_limits<double>::quiet_NaN();

const char* const kMethodNote =
    "tflops = 4*b*h*sq*sk*d / time, halved for causal (the FlashAttention convention, not the "
    "exact count of unmasked pairs); time = median of CUDA-event-timed launches after warm-up "
    "(>= 20 launches and >= 100 ms), inputs uniform in [-1, 1) rotated past 2x L2; outputs "
    "poisoned with NaN and checked, a few rows compared with the CPU reference";

const char* const kCpuMethodNote =
    "CPU reference backend on a small problem, not GPU numbers: tflops = 4*b*h*sq*sk*d / time, "
    "halved for causal; time = median host wall-clock time of >= 5 calls and >= 100 ms after one "
    "warm-up call";

const char* const kUsage =
    "usage: flashkit_bench [--dtype bf16,fp16] [--hdim 64,128,256] [--seqlen 512,1k,2k,4k,8k,16k]\n"
    "                      [--causal both|yes|no] [--quick] [--json PATH]\n"
    "  Times flashkit::mha_fwd with batch = 16384 / seqlen and heads = 2048 / hdim.\n"
    "  --quick     bf16, hdim 64 and 128, seqlen 2k and 8k (explicit flags still override)\n"
    "  --json      write the results (docs/DESIGN.md format) to PATH\n"
    "  Lists are comma-separated; seqlens take a k suffix (2k = 2048).\n"
    "  Environment: FLASHKIT_GIT_COMMIT, FLASHKIT_DRIVER (nvidia-smi's driver version) for the\n"
    "  JSON.\n";

// ------------------------------------------------------------------------------------------------
// Options and the grid

struct Options {
  std::vector<DType> dtypes;
  std::vector<int> head_dims;
  std::vector<int> seqlens;
  std::vector<bool> causal;
  std::string json_path;
};

struct Case {
  DType dtype;
  int batch;
  int heads;
  int seqlen;
  int head_dim;
  bool causal;

  int64_t tensor_elems() const { return int64_t(batch) * seqlen * heads * head_dim; }
  double flops() const {
    return 4.0 * batch * heads * double(seqlen) * seqlen * head_dim * (causal ? 0.5 : 1.0);
  }
};

struct Result {
  explicit Result(const Case& shape) : c(shape) {}
  Case c;
  double ms = kNaN;
  double tflops = kNaN;
  double rel_err = kNaN;  // of the rows compared with the CPU reference
  std::string note;       // why tflops is null (empty when it is not)
  bool failed = false;    // a note that counts as a failure (not a head dim left out of the build)
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> items;
  std::stringstream stream(s);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  if (items.empty()) throw std::invalid_argument("empty list '" + s + "'");
  return items;
}

int parse_positive(const std::string& s, bool allow_k_suffix) {
  std::string digits = s;
  int64_t scale = 1;
  if (allow_k_suffix && !digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
    digits.pop_back();
    scale = 1024;
  }
  size_t used = 0;
  long value = 0;
  try {
    value = std::stol(digits, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != digits.size() || value <= 0 || value * scale > (1 << 30)) {
    throw std::invalid_argument("'" + s + "' is not a positive integer");
  }
  return static_cast<int>(value * scale);
}

DType parse_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  if (s == "fp16" || s == "float16") return DType::kFloat16;
  throw std::invalid_argument("dtype '" + s + "' is not bf16 or fp16");
}

const char* short_name(DType t) { return t == DType::kBFloat16 ? "bf16" : "fp16"; }

std::vector<bool> parse_causal(const std::string& s) {
  if (s == "both") return {false, true};
  if (s == "yes" || s == "1" || s == "true") return {true};
  if (s == "no" || s == "0" || s == "false") return {false};
  throw std::invalid_argument("--causal takes both, yes or no, not '" + s + "'");
}

// Parses argv into Options; throws std::invalid_argument with a message on bad input.
Options parse_options(int argc, char** argv) {
  bool quick = false;
  std::string dtypes, hdims, seqlens, causal = "both", json;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--quick" || arg == "--help" || arg == "-h") {
      if (arg != "--quick") {
        std::fputs(kUsage, stdout);
        std::exit(0);
      }
      quick = true;
      continue;
    }
    std::string* target = arg == "--dtype"    ? &dtypes
                          : arg == "--hdim"   ? &hdims
                          : arg == "--seqlen" ? &seqlens
                          : arg == "--causal" ? &causal
                          : arg == "--json"   ? &json
                                              : nullptr;
    if (target == nullptr) throw std::invalid_argument("unknown option " + arg);
    if (eq == std::string::npos) {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      value = argv[++i];
    }
    *target = value;
  }
  if (dtypes.empty()) dtypes = quick ? "bf16" : "bf16,fp16";
  if (hdims.empty()) hdims = quick ? "64,128" : "64,128,256";
  if (seqlens.empty()) seqlens = quick ? "2k,8k" : "512,1k,2k,4k,8k,16k";

  Options opt;
  for (const auto& s : split_list(dtypes)) opt.dtypes.push_back(parse_dtype(s));
  for (const auto& s : split_list(hdims)) opt.head_dims.push_back(parse_positive(s, false));
  for (const auto& s : split_list(seqlens)) opt.seqlens.push_back(parse_positive(s, true));
  opt.causal = parse_causal(causal);
  opt.json_path = json;
  return opt;
}

// The grid in the order the table reads: dtype, head dim, causal, seqlen. (Unused in a build
// without CUDA, whose CPU mode runs one fixed problem.)
[[maybe_unused]] std::vector<Case> make_grid(const Options& opt) {
  std::vector<Case> cases;
  for (DType dtype : opt.dtypes) {
    for (int d : opt.head_dims) {
      for (bool causal : opt.causal) {
        for (int s : opt.seqlens) {
          const int batch = static_cast<int>(std::max<int64_t>(1, kTotalTokens / s));
          const int heads = std::max(1, kModelDim / d);
          cases.push_back({dtype, batch, heads, s, d, causal});
        }
      }
    }
  }
  return cases;
}

// ------------------------------------------------------------------------------------------------
// Host data: random fill, NaN checks

// Fills n values of dtype with uniform random numbers in [-1, 1) (splitmix64 stream from seed).
void fill_uniform(uint16_t* dst, int64_t n, DType dtype, uint64_t seed) {
  uint64_t state = seed;
  for (int64_t i = 0; i < n; ++i) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // 24 random bits
    dst[i] = flashkit::float_to_bits(dtype, u);
  }
}

int64_t count_nonfinite(const uint16_t* values, int64_t n, DType dtype) {
  const uint16_t exponent_mask = dtype == DType::kBFloat16 ? 0x7f80 : 0x7c00;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += (values[i] & exponent_mask) == exponent_mask;
  return bad;
}

int64_t count_nonfinite(const float* values, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += !std::isfinite(values[i]);
  return bad;
}

// The check after the runs: every output and LSE value written (no poison left) and finite.
std::string nonfinite_note(const Case& c, const uint16_t* out, const float* lse) {
  const int64_t out_n = c.tensor_elems();
  const int64_t lse_n = int64_t(c.batch) * c.heads * c.seqlen;
  const int64_t bad_out = count_nonfinite(out, out_n, c.dtype);
  const int64_t bad_lse = count_nonfinite(lse, lse_n);
  if (bad_out == 0 && bad_lse == 0) return "";
  return std::to_string(bad_out) + " of " + std::to_string(out_n) + " output and " +
         std::to_string(bad_lse) + " of " + std::to_string(lse_n) +
         " LSE values are NaN/inf (unwritten or overflowed)";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// ------------------------------------------------------------------------------------------------
// Output: the human table and the JSON file

struct RunInfo {
  std::string gpu;
  std::string driver;  // empty: null
  std::string cuda;    // empty: null
  std::string date;
  std::string git_commit;
  std::string impl;  // "flashkit", or "flashkit_cpu" for the CPU backend
  const char* method_note = kMethodNote;
};

std::string utc_now_iso() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string(value) : fallback;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", u);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string json_string_or_null(const std::string& s) {
  return s.empty() ? "null" : json_string(s);
}

// `v` printed with `format`, or `missing` when it is NaN (not measured).
std::string format_number(double v, const char* format, const char* missing = "null") {
  if (std::isnan(v)) return missing;
  char buf[32];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// Writes the whole file again (after every case, so that a run cut short keeps what it measured).
void write_json(const std::string& path, const RunInfo& info, const std::vector<Result>& results) {
  std::ostringstream js;
  js << "{\n  \"gpu\": " << json_string(info.gpu)
     << ",\n  \"driver\": " << json_string_or_null(info.driver)
     << ",\n  \"cuda\": " << json_string_or_null(info.cuda)
     << ",\n  \"torch\": null,\n  \"date\": " << json_string(info.date)
     << ",\n  \"git_commit\": " << json_string(info.git_commit)
     << ",\n  \"note\": " << json_string(info.method_note) << ",\n  \"records\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const Case& c = r.c;
    js << (i ? ",\n" : "\n") << "    {\"op\": \"fwd\", \"impl\": " << json_string(info.impl)
       << ", \"dtype\": \"" << short_name(c.dtype) << "\", \"batch\": " << c.batch
       << ", \"heads_q\": " << c.heads << ", \"heads_kv\": " << c.heads
       << ", \"seqlen_q\": " << c.seqlen << ", \"seqlen_k\": " << c.seqlen
       << ", \"head_dim\": " << c.head_dim << ", \"causal\": " << (c.causal ? "true" : "false")
       << ", \"window\": [-1, -1], \"ms\": " << format_number(r.ms, "%.6g")
       << ", \"tflops\": " << format_number(r.tflops, "%.4g") << ", \"tbps\": null";
    if (!r.note.empty()) js << ", \"note\": " << json_string(r.note);
    js << "}";
  }
  js << "\n  ]\n}\n";

  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp);
    file << js.str();
    if (!file) throw std::runtime_error("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
  }
}

void print_table_header() {
  std::printf("%-5s %5s %6s %5s %5s %6s %10s %9s %9s\n", "dtype", "hdim", "seqlen", "batch",
              "heads", "causal", "ms", "TFLOP/s", "check");
}

void print_row(const Result& r) {
  const Case& c = r.c;
  std::printf("%-5s %5d %6d %5d %5d %6s %10s %9s %9s\n", short_name(c.dtype), c.head_dim, c.seqlen,
              c.batch, c.heads, c.causal ? "yes" : "no", format_number(r.ms, "%.4f", "-").c_str(),
              format_number(r.tflops, "%.4g", "-").c_str(),
              format_number(r.rel_err, "%.1e", "-").c_str());
  if (!r.note.empty()) std::printf("      note: %s\n", r.note.c_str());
  std::fflush(stdout);
}

// Runs every case, printing each row as it completes and rewriting the JSON file after each.
// Returns the process exit status: 1 if any case failed.
int run_cases(const std::vector<Case>& cases, const RunInfo& info, const std::string& json_path,
              const std::function<Result(const Case&)>& run_case) {
  std::vector<Result> results;
  print_table_header();
  int failed = 0;
  for (const Case& c : cases) {
    results.push_back(run_case(c));
    failed += results.back().failed;
    print_row(results.back());
    if (!json_path.empty()) write_json(json_path, info, results);
  }
  std::printf("%d of %zu cases failed%s%s\n", failed, cases.size(),
              json_path.empty() ? "" : "; results in ", json_path.c_str());
  return failed ? 1 : 0;
}

// The views of one forward problem over q, k, v, out, lse (contiguous [b, s, h, d], lse [b, h, s]).
flashkit::MhaFwdParams make_params(const Case& c, int rows_q, int rows_k, void* q, void* k, void* v,
                                   void* out, float* lse, flashkit::Device device) {
  flashkit::MhaFwdParams p;
  const int64_t b = c.batch, h = c.heads, d = c.head_dim;
  p.q = flashkit::make_view(q, c.dtype, {b, rows_q, h, d}, device);
  p.k = flashkit::make_view(k, c.dtype, {b, rows_k, h, d}, device);
  p.v = flashkit::make_view(v, c.dtype, {b, rows_k, h, d}, device);
  p.out = flashkit::make_view(out, c.dtype, {b, rows_q, h, d}, device);
  p.softmax_lse = flashkit::make_view(lse, DType::kFloat32, {b, h, rows_q}, device);
  p.mask.causal = c.causal;
  return p;
}

// ------------------------------------------------------------------------------------------------
// CPU mode: no GPU, so time the reference backend on one small problem.

int run_cpu_mode(const std::string& why, const Options& opt, RunInfo info) {
  std::printf(
      "no GPU found (%s): timing the CPU reference backend on a small problem; these "
      "numbers are not GPU numbers (grid options ignored)\n",
      why.c_str());
  info.gpu = "none (CPU reference backend)";
  info.impl = "flashkit_cpu";
  info.method_note = kCpuMethodNote;
  const flashkit::Device cpu{flashkit::DeviceKind::kCpu, 0};

  std::vector<Case> cases;
  for (bool causal : {false, true}) cases.push_back({DType::kBFloat16, 1, 2, 256, 64, causal});

  return run_cases(cases, info, opt.json_path, [&](const Case& c) {
    Result r(c);
    const int64_t n = c.tensor_elems();
    std::vector<uint16_t> q(n), k(n), v(n), out(n);
    std::vector<float> lse(int64_t(c.batch) * c.heads * c.seqlen);
    fill_uniform(q.data(), n, c.dtype, 1);
    fill_uniform(k.data(), n, c.dtype, 2);
    fill_uniform(v.data(), n, c.dtype, 3);
    std::memset(out.data(), 0xff, n * sizeof(uint16_t));
    std::memset(lse.data(), 0xff, lse.size() * sizeof(float));
    const auto params = make_params(c, c.seqlen, c.seqlen, q.data(), k.data(), v.data(), out.data(),
                                    lse.data(), cpu);
    try {
      flashkit::mha_fwd(params);  // warm-up, and the run whose output is checked
      r.note = nonfinite_note(c, out.data(), lse.data());
      std::vector<double> times;
      double total = 0;
      while (r.note.empty() && (times.size() < 5 || total < kMinTimedMs) && times.size() < 100) {
        const auto t0 = std::chrono::steady_clock::now();
        flashkit::mha_fwd(params);
        const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
        times.push_back(dt.count());
        total += dt.count();
      }
      if (r.note.empty()) {
        r.ms = median(times);
        r.tflops = c.flops() / (r.ms * 1e9);
      }
    } catch (const std::exception& e) {
      r.note = first_line(e.what());
    }
    r.failed = !r.note.empty();
    return r;
  });
}

// ------------------------------------------------------------------------------------------------
// GPU mode

#ifdef FLASHKIT_BENCH_CUDA

void cuda_ok(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(code));
  }
}
#define CUDA_OK(call) cuda_ok((call), #call)

// One device allocation, grown on demand (contents are not kept when it grows).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }

  void* get(size_t bytes) {
    if (bytes > bytes_) {
      CUDA_OK(cudaFree(ptr_));
      ptr_ = nullptr;
      bytes_ = 0;
      CUDA_OK(cudaMalloc(&ptr_, bytes));
      bytes_ = bytes;
    }
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Sets of (q, k, v) filled with random values of one dtype. Every grid shape has the same number of
// elements, so the sets are filled once per dtype and reused by every case of that dtype.
class InputSets {
 public:
  // Returns tensor `which` (0 q, 1 k, 2 v) of set `set` (< sets) with at least `elems` random
  // values of `dtype`.
  void* tensor(DType dtype, int64_t elems, int sets, int set, int which) {
    if (dtype != dtype_ || elems > elems_ || sets * 3 > static_cast<int>(buffers_.size())) {
      refill(dtype, std::max(elems, elems_), std::max<int>(sets, buffers_.size() / 3));
    }
    return buffers_[set * 3 + which].get(elems * sizeof(uint16_t));
  }

 private:
  void refill(DType dtype, int64_t elems, int sets) {
    buffers_.clear();  // free first: the old sets and the new may not fit together
    buffers_ = std::vector<DeviceBuffer>(sets * 3);
    std::vector<uint16_t> host(elems);
    for (size_t i = 0; i < buffers_.size(); ++i) {
      fill_uniform(host.data(), elems, dtype, 1000 * static_cast<uint64_t>(dtype) + i + 1);
      CUDA_OK(cudaMemcpy(buffers_[i].get(elems * sizeof(uint16_t)), host.data(),
                         elems * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
    dtype_ = dtype;
    elems_ = elems;
  }

  DType dtype_ = DType::kFloat32;  // none yet
  int64_t elems_ = 0;
  std::vector<DeviceBuffer> buffers_;
};

struct Gpu {
  int device = 0;
  int64_t l2_bytes = 0;
  cudaStream_t stream = nullptr;
  InputSets inputs;
  DeviceBuffer out, lse;
  std::vector<uint16_t> host_out;  // the output copied back for the checks
  std::vector<float> host_lse;
};

// A CUDA event that is destroyed with its scope.
class Event {
 public:
  Event() { CUDA_OK(cudaEventCreate(&event_)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { cudaEventDestroy(event_); }

  void record(cudaStream_t stream) { CUDA_OK(cudaEventRecord(event_, stream)); }
  // Milliseconds from `start` to this event (both recorded and complete).
  double since(const Event& start) const {
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }
  void synchronize() const { CUDA_OK(cudaEventSynchronize(event_)); }

 private:
  cudaEvent_t event_ = nullptr;
};

// Times launch(set) for set = 0, 1, ... modulo `sets`: warm-up, then the median of event-timed
// launches. `before_timed` runs between the two (it poisons the outputs). Returns ms; `last_set` is
// the set of the last launch (the one whose output the checks read).
double time_launches(const std::function<void(int)>& launch, int sets, cudaStream_t stream,
                     const std::function<void()>& before_timed, int* last_set) {
  // Warm-up in batches until 25 ms have passed, at least two batches: the first may pay for module
  // loading, so the per-launch estimate that sizes the timed loop comes from the last batch.
  int launches = 0;
  double warm_ms = 0, estimate = 0;
  for (int batch = kMinWarmupLaunches, round = 0;; ++round) {
    Event begin, end;
    begin.record(stream);
    for (int i = 0; i < batch; ++i) launch(launches++ % sets);
    end.record(stream);
    end.synchronize();
    CUDA_OK(cudaGetLastError());
    const double ms = end.since(begin);
    warm_ms += ms;
    estimate = std::max(ms / batch, 1e-3);
    if (round >= 1 && warm_ms >= kWarmupMs) break;
    batch =
        std::max(kMinWarmupLaunches, static_cast<int>(std::ceil((kWarmupMs - warm_ms) / estimate)));
  }

  const int reps =
      std::clamp(static_cast<int>(std::ceil(kMinTimedMs / estimate)), kMinReps, kMaxReps);
  before_timed();
  std::vector<Event> events(2 * reps);
  for (int i = 0; i < reps; ++i) {
    events[2 * i].record(stream);
    launch(i % sets);
    events[2 * i + 1].record(stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  std::vector<double> times(reps);
  for (int i = 0; i < reps; ++i) times[i] = events[2 * i + 1].since(events[2 * i]);
  *last_set = (reps - 1) % sets;
  return median(times);
}

// Copies `rows` rows of one head of sequence b, starting at row0, from a device [b, s, h, d] tensor
// into a contiguous host [rows, d] block.
std::vector<uint16_t> copy_rows(const Case& c, const void* tensor, int b, int row0, int rows,
                                int head) {
  const size_t row_bytes = c.head_dim * sizeof(uint16_t);
  const int64_t offset = ((int64_t(b) * c.seqlen + row0) * c.heads + head) * c.head_dim;
  std::vector<uint16_t> host(int64_t(rows) * c.head_dim);
  CUDA_OK(cudaMemcpy2D(host.data(), row_bytes, static_cast<const uint16_t*>(tensor) + offset,
                       c.heads * row_bytes, row_bytes, rows, cudaMemcpyDeviceToHost));
  return host;
}

// Compares rows of the GPU output (already in gpu.host_out) with flashkit's CPU backend: the first
// kSpotRows query rows of head 0 and the last kSpotRows of the last head, both in the last
// sequence. Each block is its own small problem on the CPU: the first rows with keys [0, rows) when
// causal (and every key otherwise), the last rows with every key (the causal mask is aligned
// bottom-right, so both match the rows of the full problem). Returns ||gpu - ref|| / ||ref|| over
// the rows.
double spot_check(const Case& c, const Gpu& gpu, const void* q, const void* k, const void* v) {
  const int rows = std::min(kSpotRows, c.seqlen);
  const int b = c.batch - 1;
  const flashkit::Device cpu{flashkit::DeviceKind::kCpu, 0};
  const Case one_head{c.dtype, 1, 1, c.seqlen, c.head_dim, c.causal};
  double err2 = 0, ref2 = 0;
  struct Block {
    int row0, keys, head;
  };
  const Block blocks[] = {{0, c.causal ? rows : c.seqlen, 0},
                          {c.seqlen - rows, c.seqlen, c.heads - 1}};
  for (const Block& blk : blocks) {
    auto hq = copy_rows(c, q, b, blk.row0, rows, blk.head);
    auto hk = copy_rows(c, k, b, 0, blk.keys, blk.head);
    auto hv = copy_rows(c, v, b, 0, blk.keys, blk.head);
    std::vector<uint16_t> ref(int64_t(rows) * c.head_dim);
    std::vector<float> lse(rows);
    flashkit::mha_fwd(make_params(one_head, rows, blk.keys, hq.data(), hk.data(), hv.data(),
                                  ref.data(), lse.data(), cpu));
    for (int r = 0; r < rows; ++r) {
      const int64_t row = (int64_t(b) * c.seqlen + blk.row0 + r) * c.heads + blk.head;
      for (int j = 0; j < c.head_dim; ++j) {
        const double want = flashkit::bits_to_float(c.dtype, ref[int64_t(r) * c.head_dim + j]);
        const double got = flashkit::bits_to_float(c.dtype, gpu.host_out[row * c.head_dim + j]);
        err2 += (got - want) * (got - want);
        ref2 += want * want;
      }
    }
  }
  return std::sqrt(err2 / std::max(ref2, 1e-30));
}

Result run_gpu_case(const Case& c, Gpu& gpu) {
  Result r(c);
  try {
    const int64_t elems = c.tensor_elems();
    const int64_t set_bytes = 3 * elems * static_cast<int64_t>(sizeof(uint16_t));
    const int sets =
        static_cast<int>(std::max<int64_t>(1, (2 * gpu.l2_bytes + set_bytes - 1) / set_bytes));
    void* out = gpu.out.get(elems * sizeof(uint16_t));
    const int64_t lse_elems = int64_t(c.batch) * c.heads * c.seqlen;
    float* lse = static_cast<float*>(gpu.lse.get(lse_elems * sizeof(float)));
    const flashkit::Device device{flashkit::DeviceKind::kCuda, gpu.device};
    std::vector<flashkit::MhaFwdParams> params;
    std::vector<const void*> qkv;  // per set
    for (int s = 0; s < sets; ++s) {
      void* q = gpu.inputs.tensor(c.dtype, elems, sets, s, 0);
      void* k = gpu.inputs.tensor(c.dtype, elems, sets, s, 1);
      void* v = gpu.inputs.tensor(c.dtype, elems, sets, s, 2);
      params.push_back(make_params(c, c.seqlen, c.seqlen, q, k, v, out, lse, device));
      qkv.insert(qkv.end(), {q, k, v});
    }

    auto launch = [&](int s) { flashkit::mha_fwd(params[s], gpu.stream); };
    auto poison = [&] {
      CUDA_OK(cudaMemsetAsync(out, 0xff, elems * sizeof(uint16_t), gpu.stream));
      CUDA_OK(cudaMemsetAsync(lse, 0xff, lse_elems * sizeof(float), gpu.stream));
    };
    int last_set = 0;
    r.ms = time_launches(launch, sets, gpu.stream, poison, &last_set);

    gpu.host_out.resize(elems);
    gpu.host_lse.resize(lse_elems);
    CUDA_OK(cudaMemcpy(gpu.host_out.data(), out, elems * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    CUDA_OK(
        cudaMemcpy(gpu.host_lse.data(), lse, lse_elems * sizeof(float), cudaMemcpyDeviceToHost));
    r.note = nonfinite_note(c, gpu.host_out.data(), gpu.host_lse.data());
    if (r.note.empty()) {
      const void* const* set_qkv = &qkv[3 * last_set];
      r.rel_err = spot_check(c, gpu, set_qkv[0], set_qkv[1], set_qkv[2]);
      const double tolerance = c.dtype == DType::kBFloat16 ? 2e-2 : 5e-3;
      if (!(r.rel_err <= tolerance)) {
        char buf[160];
        std::snprintf(buf, sizeof(buf),
                      "wrong result: relative error %.3g against the CPU reference (tolerance %g)",
                      r.rel_err, tolerance);
        r.note = buf;
      }
    }
    if (r.note.empty()) r.tflops = c.flops() / (r.ms * 1e9);
  } catch (const std::exception& e) {
    r.note = first_line(e.what());
  }
  r.failed = !r.note.empty() && flashkit::cuda_head_dim_built(c.head_dim);
  return r;
}

// The driver version as nvidia-smi prints it: from FLASHKIT_DRIVER, else the kernel module's
// version file, else the CUDA driver API version.
std::string driver_version() {
  std::string driver = env_or("FLASHKIT_DRIVER", "");
  if (!driver.empty()) return driver;
  std::ifstream version_file("/proc/driver/nvidia/version");
  std::string line;
  if (std::getline(version_file, line)) {
    const size_t at = line.find("Kernel Module");
    if (at != std::string::npos) {
      std::istringstream words(line.substr(at + 13));
      words >> driver;
      if (!driver.empty()) return driver;
    }
  }
  int api = 0;
  cudaDriverGetVersion(&api);
  return "CUDA driver API " + std::to_string(api / 1000) + "." + std::to_string(api % 1000 / 10);
}

int run_gpu_grid(const Options& opt, RunInfo info) {
  Gpu gpu;
  CUDA_OK(cudaGetDevice(&gpu.device));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, gpu.device));
  int l2 = 0;
  CUDA_OK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, gpu.device));
  gpu.l2_bytes = l2;
  int runtime = 0;
  CUDA_OK(cudaRuntimeGetVersion(&runtime));
  CUDA_OK(cudaStreamCreateWithFlags(&gpu.stream, cudaStreamNonBlocking));
  info.gpu = prop.name;
  info.driver = driver_version();
  info.cuda = std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
  info.impl = "flashkit";
  std::printf(
      "flashkit_bench: %s (sm_%d%d, %d SMs, L2 %d MiB), driver %s, CUDA runtime %s, commit "
      "%s\n",
      info.gpu.c_str(), prop.major, prop.minor, prop.multiProcessorCount, l2 >> 20,
      info.driver.c_str(), info.cuda.c_str(), info.git_commit.c_str());
  const int status = run_cases(make_grid(opt), info, opt.json_path,
                               [&](const Case& c) { return run_gpu_case(c, gpu); });
  CUDA_OK(cudaStreamDestroy(gpu.stream));
  return status;
}

#endif  // FLASHKIT_BENCH_CUDA

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    opt = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flashkit_bench: %s\n%s", e.what(), kUsage);
    return 2;
  }
  RunInfo info;
  info.date = utc_now_iso();
  info.git_commit = env_or("FLASHKIT_GIT_COMMIT", "unknown");
  try {
#ifdef FLASHKIT_BENCH_CUDA
    int devices = 0;
    const cudaError_t found = cudaGetDeviceCount(&devices);
    if (found == cudaSuccess && devices > 0) return run_gpu_grid(opt, info);
    cudaGetLastError();  // clear the error of a machine without a driver or device
    const std::string why = found == cudaSuccess ? "no CUDA device" : cudaGetErrorString(found);
#else
    const std::string why = "this build has no CUDA: FLASHKIT_CUDA=OFF";
#endif
    return run_cpu_mode(why, opt, info);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashkit_bench: %s\n", e.what());
    return 1;
  }
}
