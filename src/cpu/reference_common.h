// src/cpu/reference_common.h
// \brief What the reference forward and backward passes share: the sequences of a (fixed or varlen)
// batch, the keys a query row may see, 16-bit loads and stores, and the thread pool that runs a
// list of independent tasks on every core.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "common/philox.h"
#include "flashkit/error.h"

namespace flashkit::cpu {

// One sequence of the batch: its lengths and the token index of its first query / key row.
// `len_k` is the number of keys used (seqused_k when given); `stored_len_k` the keys the sequence
// holds in the packed k / v (cu_seqlens_k), which the backward writes gradients for.
struct Sequence {
  int len_q = 0;
  int len_k = 0;
  int stored_len_k = 0;
  int64_t q_token = 0;
  int64_t k_token = 0;
};

// The sequences of `p`, checked against the problem's seqlen bounds (the fp32 oracles size their
// outputs by them). `who` names the caller in the error message.
inline std::vector<Sequence> sequences_of(const FwdProblem& p, const char* who) {
  std::vector<Sequence> sequences(p.batch);
  for (int b = 0; b < p.batch; ++b) {
    Sequence& s = sequences[b];
    if (!p.is_varlen()) {
      s.len_q = p.seqlen_q;
      s.len_k = s.stored_len_k = p.seqlen_k;
      continue;
    }
    s.q_token = p.cu_seqlens_q[b];
    s.k_token = p.cu_seqlens_k[b];
    s.len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    s.stored_len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    s.len_k = p.seqused_k != nullptr ? p.seqused_k[b] : s.stored_len_k;
    if (s.len_q < 0 || s.len_q > p.seqlen_q || s.len_k < 0 || s.len_k > p.seqlen_k ||
        s.len_k > s.stored_len_k) {
      throw Error(std::string(who) + ": sequence " + std::to_string(b) + " has " +
                  std::to_string(s.len_q) + " queries and " + std::to_string(s.len_k) + " of " +
                  std::to_string(s.stored_len_k) + " keys; the problem bounds them by seqlen_q = " +
                  std::to_string(p.seqlen_q) + " and seqlen_k = " + std::to_string(p.seqlen_k));
    }
  }
  return sequences;
}

// The keys row i may see: [first, end), empty when first >= end.
struct KeyRange {
  int64_t first;
  int64_t end;
  bool empty() const { return first >= end; }
};

inline KeyRange allowed_keys(const FwdProblem& p, const Sequence& s, int64_t i) {
  const int64_t diagonal = i + s.len_k - s.len_q;
  const int64_t first = p.window_left >= 0 ? std::max<int64_t>(0, diagonal - p.window_left) : 0;
  const int64_t end =
      p.window_right >= 0 ? std::min<int64_t>(s.len_k, diagonal + p.window_right + 1) : s.len_k;
  return {first, end};
}

// The dropout decisions of keys [first, end) of query row i of (batch * heads_q + head) `bh`:
// keep[j - first] is 1 for a kept key. Four Philox calls per 32 keys (one per fragment slot of
// the row, each giving the row's 8 bytes of its 16), instead of one per key.
inline void dropout_keep_row(const DropoutMask& mask, uint32_t bh, int64_t i, int64_t first,
                             int64_t end, std::vector<uint8_t>& keep) {
  keep.assign(static_cast<size_t>(std::max<int64_t>(0, end - first)), 0);
  const auto row = static_cast<uint32_t>(i);
  const int half = static_cast<int>((row % 16) / 8);
  for (int64_t group = first / 32; group * 32 < end; ++group) {
    for (uint32_t pair = 0; pair < 4; ++pair) {
      const PhiloxBlock bits =
          mask.block(bh, row / 16, (row % 8) * 4 + pair, static_cast<uint32_t>(group));
      for (int tile = 0; tile < 4; ++tile) {
        for (int e = 0; e < 2; ++e) {
          const int64_t j = group * 32 + tile * 8 + pair * 2 + e;
          if (j >= first && j < end) keep[j - first] = mask.keeps(bits, half * 8 + tile * 2 + e);
        }
      }
    }
  }
}

// The 16-bit element at `index` of `base`, as a float (exact).
inline float load_half(DType dtype, const void* base, int64_t index) {
  return bits_to_float(dtype, static_cast<const uint16_t*>(base)[index]);
}

// `x` rounded once to `dtype` (fp16 / bf16), as bits. Rounding through float would round twice; a
// round-to-odd step to float first keeps the result correctly rounded, since float has more than
// two extra significand bits over either 16-bit type.
inline uint16_t double_to_half_bits(DType dtype, double x) {
  float f = static_cast<float>(x);
  if (std::isfinite(x) && static_cast<double>(f) != x) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= 1u;
    std::memcpy(&f, &bits, sizeof f);
  }
  return float_to_bits(dtype, f);
}

// How one precision mode computes: the accumulator type, and whether intermediates are rounded to
// the input dtype (RefPrecision::kInputDtype) or kept
// (kExact).
template <typename Acc>
struct Arithmetic {
  DType dtype;
  bool round_to_input;
  Acc round(Acc x) const {
    return round_to_input ? static_cast<Acc>(round_to(dtype, static_cast<float>(x))) : x;
  }
};

// Below this many multiply-adds a problem runs on the calling thread: starting threads would cost
// more than it saves.
constexpr double kMinWorkPerThread = 1 << 20;

// Runs body(state, n) for every task n in [0, tasks) on up to one thread per core (fewer when
// `work`, in multiply-adds, is small), each thread with its own default-constructed State (reusable
// buffers). The first exception thrown by a task (e.g. std::bad_alloc) stops the others and is
// rethrown on the calling thread.
template <typename State, typename Body>
void run_tasks(int tasks, double work, const Body& body) {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = std::max(
      1, static_cast<int>(std::min({cores, static_cast<double>(tasks), work / kMinWorkPerThread})));
  std::atomic<int> next_task{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&] {
    State state;
    try {
      for (int n = next_task++; n < tasks; n = next_task++) body(state, n);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next_task = tasks;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashkit::cpu
