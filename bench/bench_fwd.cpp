// bench/bench_fwd.cpp
// \brief flashkit_bench: times the forward pass (flashkit::mha_fwd, public API only) and, through
// bench_bwd.cpp, the backward pass (op bwd) and both (op fwd_bwd) on the standard grid, and writes
// the results format of docs/DESIGN.md. The backward runs in its default and in its deterministic
// mode (impl "flashkit_det").
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
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/half_float.h"
#include "flashkit/flashkit.h"

namespace flashkit::bench {
namespace {

constexpr int kSpotRows = 4;  // query rows per block compared with the CPU reference

const char* const kMethodNote =
    "tflops = 4*b*h*sq*sk*d / time (x2.5 for bwd, x3.5 for fwd_bwd), halved for causal (the "
    "FlashAttention convention, not the exact count of unmasked pairs; under --window the exact "
    "count); time = median of CUDA-event-timed launches after warm-up (>= 20 launches and >= 100 "
    "ms), inputs uniform in [-1, 1) rotated past 2x L2; outputs poisoned with NaN and checked, a "
    "few forward rows compared with the CPU reference; bwd times mha_bwd alone on the output and "
    "LSE of one forward (workspace from the size query)";

const char* const kCpuMethodNote =
    "CPU reference backend on a small problem, not GPU numbers: tflops = 4*b*h*sq*sk*d / time "
    "(x2.5 for bwd), halved for causal; time = median host wall-clock time of >= 5 calls and >= "
    "100 ms after one "
    "warm-up call";

const char* const kUsage =
    "usage: flashkit_bench [--dtype bf16,fp16] [--hdim 64,128,256] [--seqlen 512,1k,2k,4k,8k,16k]\n"
    "                      [--causal both|yes|no] [--op fwd,bwd,fwd_bwd] [--quick] [--json PATH]\n"
    "                      [--dropout P] [--window L] [--gqa G] [--energy]\n"
    "  Times flashkit::mha_fwd, mha_bwd (default and deterministic) and both with\n"
    "  batch = 16384 / seqlen and heads = 2048 / hdim.\n"
    "  --quick     bf16, hdim 64 and 128, seqlen 2k and 8k (explicit flags still override)\n"
    "  --json      write the results (docs/DESIGN.md format) to PATH\n"
    "  --dropout P every op with dropout.p = P (the backward regenerates the forward's mask;\n"
    "              results get \"dropout\": P and skip the forward's CPU spot check, whose\n"
    "              sub-problems would draw another mask)\n"
    "  --window L  a causal sliding window: each query sees itself and the L keys before it\n"
    "              (window_size (L, 0)); implies --causal yes; TFLOP/s count the visible pairs\n"
    "  --gqa G     grouped-query attention: heads / G key / value heads, G query heads each\n"
    "              (G divides every head count of the grid; results get \"heads_kv\")\n"
    "  --energy    also the energy per call and the mean power, from the GPU's energy counter\n"
    "              (NVML) over 1 s more of launches per case; results get \"joules\" and \"watts\"\n"
    "  Lists are comma-separated; seqlens take a k suffix (2k = 2048).\n"
    "  Environment: FLASHKIT_GIT_COMMIT, FLASHKIT_DRIVER (nvidia-smi's driver version) for the\n"
    "  JSON.\n";

// ------------------------------------------------------------------------------------------------
// Options and the grid

struct Options {
  std::vector<Op> ops;
  std::vector<DType> dtypes;
  std::vector<int> head_dims;
  std::vector<int> seqlens;
  std::vector<bool> causal;
  std::string json_path;
  float dropout = 0.0f;
  int window = -1;
  int gqa = 1;  // query heads per key / value head
  bool energy = false;
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

Op parse_op(const std::string& s) {
  if (s == "fwd") return Op::kFwd;
  if (s == "bwd") return Op::kBwd;
  if (s == "fwd_bwd") return Op::kFwdBwd;
  throw std::invalid_argument("op '" + s + "' is not fwd, bwd or fwd_bwd");
}

std::vector<bool> parse_causal(const std::string& s) {
  if (s == "both") return {false, true};
  if (s == "yes" || s == "1" || s == "true") return {true};
  if (s == "no" || s == "0" || s == "false") return {false};
  throw std::invalid_argument("--causal takes both, yes or no, not '" + s + "'");
}

// The query heads of the grid's shapes at one head dim (model dim 2048).
int grid_heads(int head_dim) { return std::max(1, kModelDim / head_dim); }

// Parses argv into Options; throws std::invalid_argument with a message on bad input.
Options parse_options(int argc, char** argv) {
  bool quick = false;
  bool energy = false;
  std::string ops = "fwd,bwd,fwd_bwd", dtypes, hdims, seqlens, causal = "both", json, dropout,
              window, gqa;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--energy") {
      energy = true;
      continue;
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
                          : arg == "--op"     ? &ops
                          : arg == "--dropout" ? &dropout
                          : arg == "--window" ? &window
                          : arg == "--gqa"    ? &gqa
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
  for (const auto& s : split_list(ops)) opt.ops.push_back(parse_op(s));
  for (const auto& s : split_list(dtypes)) opt.dtypes.push_back(parse_dtype(s));
  for (const auto& s : split_list(hdims)) opt.head_dims.push_back(parse_positive(s, false));
  for (const auto& s : split_list(seqlens)) opt.seqlens.push_back(parse_positive(s, true));
  opt.causal = parse_causal(causal);
  if (!window.empty()) {
    opt.window = window == "0" ? 0 : parse_positive(window, true);
    opt.causal = {true};
  }
  if (!gqa.empty()) {
    opt.gqa = parse_positive(gqa, false);
    for (int d : opt.head_dims) {
      if (grid_heads(d) % opt.gqa != 0) {
        throw std::invalid_argument("--gqa " + gqa + " does not divide head dim " + std::to_string(d) +
                                    "'s " + std::to_string(grid_heads(d)) + " heads");
      }
    }
  }
  opt.json_path = json;
  opt.energy = energy;
  if (!dropout.empty()) {
    size_t used = 0;
    try {
      opt.dropout = std::stof(dropout, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != dropout.size() || !(opt.dropout >= 0.0f && opt.dropout < 1.0f)) {
      throw std::invalid_argument("--dropout takes a probability in [0, 1), not '" + dropout + "'");
    }
  }
  return opt;
}

// The grid in the order the table reads: op, dtype, head dim, causal, seqlen, and for the
// backward ops the default mode, then the deterministic one. (Unused in a build without CUDA,
// whose CPU mode runs one fixed problem.)
[[maybe_unused]] std::vector<Case> make_grid(const Options& opt) {
  std::vector<Case> cases;
  for (Op op : opt.ops) {
    for (DType dtype : opt.dtypes) {
      for (int d : opt.head_dims) {
        for (bool causal : opt.causal) {
          for (int s : opt.seqlens) {
            const int batch = static_cast<int>(std::max<int64_t>(1, kTotalTokens / s));
            const int heads = grid_heads(d);
            for (bool deterministic : {false, true}) {
              if (deterministic && op == Op::kFwd) continue;
              cases.push_back(
                  {op, dtype, batch, heads, s, d, causal, deterministic, opt.dropout, opt.window, opt.gqa});
            }
          }
        }
      }
    }
  }
  return cases;
}

// ------------------------------------------------------------------------------------------------
// The forward's output checks

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
    const std::string impl = info.impl + (c.deterministic ? "_det" : "");
    js << (i ? ",\n" : "\n") << "    {\"op\": \"" << op_name(c.op)
       << "\", \"impl\": " << json_string(impl) << ", \"dtype\": \"" << short_name(c.dtype)
       << "\", \"batch\": " << c.batch << ", \"heads_q\": " << c.heads
       << ", \"heads_kv\": " << c.kv_heads() << ", \"seqlen_q\": " << c.seqlen
       << ", \"seqlen_k\": " << c.seqlen << ", \"head_dim\": " << c.head_dim
       << ", \"causal\": " << (c.causal ? "true" : "false")
       << ", \"window\": [" << c.window << ", " << (c.window >= 0 ? 0 : -1)
       << "], \"ms\": " << format_number(r.ms, "%.6g")
       << ", \"tflops\": " << format_number(r.tflops, "%.4g") << ", \"tbps\": null";
    if (c.dropout > 0.0f) js << ", \"dropout\": " << format_number(c.dropout, "%.6g");
    if (!std::isnan(r.joules)) {
      js << ", \"joules\": " << format_number(r.joules, "%.6g") << ", \"watts\": " << format_number(r.watts, "%.4g");
    }
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
  std::printf("%-7s %-5s %5s %6s %5s %5s %6s %5s %10s %9s %9s\n", "op", "dtype", "hdim", "seqlen",
              "batch", "heads", "causal", "det", "ms", "TFLOP/s", "check");
}

void print_row(const Result& r) {
  const Case& c = r.c;
  std::printf("%-7s %-5s %5d %6d %5d %5d %6s %5s %10s %9s %9s\n", op_name(c.op),
              short_name(c.dtype), c.head_dim, c.seqlen, c.batch, c.heads, c.causal ? "yes" : "no",
              c.deterministic ? "yes" : "no", format_number(r.ms, "%.4f", "-").c_str(),
              format_number(r.tflops, "%.4g", "-").c_str(),
              format_number(r.rel_err, "%.1e", "-").c_str());
  if (!std::isnan(r.joules)) {
    std::printf("      energy: %.4g J per call, %.0f W mean, %.3g TFLOP/J\n", r.joules, r.watts,
                r.c.flops() / r.joules * 1e-12);
  }
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
  for (Op op : opt.ops) {
    if (op == Op::kFwdBwd) continue;  // the CPU backend's fwd_bwd would only add the two
    for (bool causal : {false, true}) {
      cases.push_back({op, DType::kBFloat16, 1, 2, 256, 64, causal, false});
    }
  }

  return run_cases(cases, info, opt.json_path, [&](const Case& c) {
    if (c.op != Op::kFwd) return run_cpu_bwd_case(c);
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

// Copies `rows` rows of one head of sequence b, starting at row0, from a device [b, s, heads, d]
// tensor into a contiguous host [rows, d] block.
std::vector<uint16_t> copy_rows(const Case& c, const void* tensor, int heads, int b, int row0, int rows,
                                int head) {
  const size_t row_bytes = c.head_dim * sizeof(uint16_t);
  const int64_t offset = ((int64_t(b) * c.seqlen + row0) * heads + head) * c.head_dim;
  std::vector<uint16_t> host(int64_t(rows) * c.head_dim);
  CUDA_OK(cudaMemcpy2D(host.data(), row_bytes, static_cast<const uint16_t*>(tensor) + offset,
                       heads * row_bytes, row_bytes, rows, cudaMemcpyDeviceToHost));
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
  Case one_head{Op::kFwd, c.dtype, 1, 1, c.seqlen, c.head_dim, c.causal, false};
  one_head.window = c.window;
  double err2 = 0, ref2 = 0;
  struct Block {
    int row0, key0, keys, head;
  };
  // Under a window the last rows see only the window's keys before them: their sub-problem starts
  // there (its bottom-right alignment then puts every row's window where it is in the full one).
  const int last_key0 = c.window >= 0 ? std::max(0, c.seqlen - rows - c.window) : 0;
  const Block blocks[] = {{0, 0, c.causal ? rows : c.seqlen, 0},
                          {c.seqlen - rows, last_key0, c.seqlen - last_key0, c.heads - 1}};
  for (const Block& blk : blocks) {
    auto hq = copy_rows(c, q, c.heads, b, blk.row0, rows, blk.head);
    auto hk = copy_rows(c, k, c.kv_heads(), b, blk.key0, blk.keys, blk.head / c.group);
    auto hv = copy_rows(c, v, c.kv_heads(), b, blk.key0, blk.keys, blk.head / c.group);
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
  if (c.op != Op::kFwd) return run_gpu_bwd_case(c, gpu);
  Result r(c);
  try {
    const int64_t elems = c.tensor_elems();
    const int64_t set_bytes = (elems + 2 * c.kv_elems()) * static_cast<int64_t>(sizeof(uint16_t));
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
    r.ms = time_launches(launch, sets, gpu.stream, poison, &last_set, gpu.energy, &r);

    gpu.host_out.resize(elems);
    gpu.host_lse.resize(lse_elems);
    CUDA_OK(cudaMemcpy(gpu.host_out.data(), out, elems * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    CUDA_OK(
        cudaMemcpy(gpu.host_lse.data(), lse, lse_elems * sizeof(float), cudaMemcpyDeviceToHost));
    r.note = nonfinite_note(c, gpu.host_out.data(), gpu.host_lse.data());
    if (r.note.empty() && c.dropout == 0.0f) {
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
      // "... Kernel Module  580.95.05 ..." or "... Kernel Module for x86_64  580.159.04 ...": the
      // first word that starts with a digit.
      std::istringstream words(line.substr(at + 13));
      while (words >> driver) {
        if (std::isdigit(static_cast<unsigned char>(driver[0]))) return driver;
      }
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
  std::unique_ptr<EnergyMeter> energy;
  if (opt.energy) {
    energy = std::make_unique<EnergyMeter>(gpu.device);
    if (!energy->available()) throw std::runtime_error("--energy: " + energy->why_not());
    gpu.energy = energy.get();
  }
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
}  // namespace flashkit::bench

int main(int argc, char** argv) {
  using namespace flashkit::bench;
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
