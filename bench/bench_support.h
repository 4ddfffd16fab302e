// bench/bench_support.h
// \brief What flashkit_bench's forward and backward runners share: the grid constants, a case and
// its result, random fill and NaN counts, and (CUDA builds) device buffers, the input sets rotated
// past L2, CUDA events and the timing loop (the method of docs/GPU.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/half_float.h"
#include "flashkit/flashkit.h"

#ifdef FLASHKIT_BENCH_CUDA
#include <cuda_runtime.h>

#include "energy_meter.h"
#endif

namespace flashkit::bench {

using flashkit::DType;

constexpr int64_t kTotalTokens = 16384;  // batch * seqlen of every grid shape
constexpr int kModelDim = 2048;          // heads * head_dim of every grid shape
constexpr double kWarmupMs = 25.0;
constexpr int kMinWarmupLaunches = 3;
constexpr double kMinTimedMs = 100.0;
constexpr int kMinReps = 20;
constexpr int kMaxReps = 2000;
// flashkit_bench --energy: launches back to back for at least this long between two readings of the
// GPU's energy counter (which NVML updates every few milliseconds).
constexpr double kEnergyMs = 1000.0;

inline const double kNaN = std::numeric_limits<double>::quiet_NaN();

// What a case times.
enum class Op { kFwd, kBwd, kFwdBwd };

inline const char* op_name(Op op) {
  return op == Op::kFwd ? "fwd" : op == Op::kBwd ? "bwd" : "fwd_bwd";
}

// FLOPs in units of the forward's 4*b*h*sq*sk*d (the FlashAttention convention: the backward's five
// matrix products against the forward's two).
inline double op_flop_factor(Op op) { return op == Op::kFwd ? 1.0 : op == Op::kBwd ? 2.5 : 3.5; }

struct Case {
  Op op;
  DType dtype;
  int batch;
  int heads;
  int seqlen;
  int head_dim;
  bool causal;
  bool deterministic;  // the backward's deterministic mode (bwd, fwd_bwd)
  float dropout = 0.0f;  // dropout.p (see --dropout)
  int window = -1;       // >= 0: a causal sliding window, each query sees itself and `window` keys before it
  int group = 1;         // query heads per key / value head (--gqa): heads / group heads in k and v

  int kv_heads() const { return heads / group; }
  int64_t tensor_elems() const { return int64_t(batch) * seqlen * heads * head_dim; }  // q, out, dq
  int64_t kv_elems() const { return int64_t(batch) * seqlen * kv_heads() * head_dim; }  // k, v, dk, dv
  // The (query, key) pairs counted: all of them, half for causal (FlashAttention's convention), and
  // under a sliding window the exact count of visible pairs.
  double pairs() const {
    const double s = seqlen;
    if (window >= 0 && window < seqlen) return s * (window + 1) - 0.5 * window * (window + 1.0);
    return s * s * (causal ? 0.5 : 1.0);
  }
  double flops() const { return 4.0 * batch * heads * pairs() * head_dim * op_flop_factor(op); }
};

struct Result {
  explicit Result(const Case& shape) : c(shape) {}
  Case c;
  double ms = kNaN;
  double tflops = kNaN;
  double rel_err = kNaN;  // of the rows compared with the CPU reference
  double joules = kNaN;   // per call (--energy), and the mean power over its launches
  double watts = kNaN;
  std::string note;       // why tflops is null (empty when it is not)
  bool failed = false;    // a note that counts as a failure (not a head dim left out of the build)
};

inline const char* short_name(DType t) { return t == DType::kBFloat16 ? "bf16" : "fp16"; }

// Fills n values of dtype with uniform random numbers in [-1, 1) (splitmix64 stream from seed).
inline void fill_uniform(uint16_t* dst, int64_t n, DType dtype, uint64_t seed) {
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

inline int64_t count_nonfinite(const uint16_t* values, int64_t n, DType dtype) {
  const uint16_t exponent_mask = dtype == DType::kBFloat16 ? 0x7f80 : 0x7c00;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += (values[i] & exponent_mask) == exponent_mask;
  return bad;
}

inline int64_t count_nonfinite(const float* values, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += !std::isfinite(values[i]);
  return bad;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// The views of one forward problem over q, k, v, out, lse (contiguous [b, s, h, d], lse [b, h, s]).
inline flashkit::MhaFwdParams make_params(const Case& c, int rows_q, int rows_k, void* q, void* k,
                                          void* v, void* out, float* lse, flashkit::Device device) {
  flashkit::MhaFwdParams p;
  const int64_t b = c.batch, h = c.heads, h_kv = c.kv_heads(), d = c.head_dim;
  p.q = flashkit::make_view(q, c.dtype, {b, rows_q, h, d}, device);
  p.k = flashkit::make_view(k, c.dtype, {b, rows_k, h_kv, d}, device);
  p.v = flashkit::make_view(v, c.dtype, {b, rows_k, h_kv, d}, device);
  p.out = flashkit::make_view(out, c.dtype, {b, rows_q, h, d}, device);
  p.softmax_lse = flashkit::make_view(lse, DType::kFloat32, {b, h, rows_q}, device);
  p.mask.causal = c.causal;
  p.mask.window_left = c.window;
  p.dropout = {c.dropout, 0x5eed, 0};
  return p;
}

// The backward runners (bench_bwd.cpp). On the CPU: the reference backend on the case.
Result run_cpu_bwd_case(const Case& c);

#ifdef FLASHKIT_BENCH_CUDA

inline void cuda_ok(cudaError_t code, const char* what) {
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
  const EnergyMeter* energy = nullptr;  // --energy: the device's meter (available)
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
// the set of the last launch (the one whose output the checks read). With `energy` (--energy), the
// timed launches are followed by kEnergyMs more between two readings of the energy counter, and
// `result` gets the energy per launch and the mean power.
inline double time_launches(const std::function<void(int)>& launch, int sets, cudaStream_t stream,
                            const std::function<void()>& before_timed, int* last_set,
                            const EnergyMeter* energy = nullptr, Result* result = nullptr) {
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
  const double ms = median(times);
  if (energy != nullptr && result != nullptr) {
    const int energy_reps = static_cast<int>(std::ceil(kEnergyMs / std::max(ms, 1e-3)));
    Event begin, end;
    const double before = energy->millijoules();
    begin.record(stream);
    for (int i = 0; i < energy_reps; ++i) launch(i % sets);
    end.record(stream);
    end.synchronize();
    const double after = energy->millijoules();
    CUDA_OK(cudaGetLastError());
    *last_set = (energy_reps - 1) % sets;
    if (before >= 0 && after > before) {
      result->joules = (after - before) * 1e-3 / energy_reps;
      result->watts = (after - before) / end.since(begin);  // mJ / ms
    }
  }
  return ms;
}

// The backward runner on the GPU (bench_bwd.cpp): times the case's op (bwd alone, on the output
// and LSE of one forward per input set, or fwd_bwd) with time_launches.
Result run_gpu_bwd_case(const Case& c, Gpu& gpu);

#endif  // FLASHKIT_BENCH_CUDA

}  // namespace flashkit::bench
