// tests/cpp/gpu_test_util.h
// \brief The machinery of the GPU forward tests (test_gpu_fwd.cpp) on top of the host-side case of
// attention_case.h (FwdCase, make_inputs): CUDA plumbing, the CPU oracle run in parallel over
// (batch, head) pieces (all of them or a sample), device buffers in any layout, and the comparison
// rule of DESIGN.md / TESTING.md.
//
// One run of a case:
//   FwdCase c = ...;                        // what to compute
//   HostInputs in = make_inputs(c);         // rounded q/k/v bits, slopes, cu_seqlens
//   Oracle o = run_oracle(c, in, all_items(c));       // fp64 reference + input-dtype reference
//   DeviceProblem dev(c, in, contiguous_layout(c));   // allocates and poisons (0xFF bytes)
//   dev.upload(stream); dev.poison_outputs(stream); dev.launch(stream);
//   KernelOut k = dev.download(stream);
//   CheckReport r = check_against_oracle(c, o, k);
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api/validate_fwd.h"
#include "attention_case.h"
#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "cpu/reference_fwd.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {

// ------------------------------------------------------------------------------------------------
// CUDA plumbing
// ------------------------------------------------------------------------------------------------

// A CUDA runtime call failed. Thrown (not asserted) so that helpers returning values can use it;
// GoogleTest reports an exception escaping a test body as a failure with this message.
class CudaFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// cudaMalloc / cudaMallocHost ran out of memory: the big-tensor tests turn this into a skip.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void cuda_check(cudaError_t code, const char* call, const char* file, int line) {
  if (code == cudaSuccess) return;
  std::ostringstream msg;
  msg << file << ":" << line << ": " << call << " failed: " << cudaGetErrorName(code) << " ("
      << cudaGetErrorString(code) << ")";
  if (code == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so later calls are unaffected
    throw OutOfMemory(msg.str());
  }
  throw CudaFailure(msg.str());
}

#define FK_CUDA_CHECK(call) ::flashkit::test::cuda_check((call), #call, __FILE__, __LINE__)

inline bool has_cuda_device() {
  static const bool present = [] {
    int count = 0;
    const cudaError_t code = cudaGetDeviceCount(&count);
    if (code != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return present;
}

inline int current_device() {
  int device = 0;
  FK_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// Device memory owned by the test. Every allocation gets kSlackBytes past its end, so that a test
// which deliberately shifts a pointer (bad-input tests) cannot fault if validation misses it, and
// an empty tensor still gets a valid, 256-byte aligned, non-null pointer.
class DeviceBuffer {
 public:
  static constexpr size_t kSlackBytes = 256;

  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    FK_CUDA_CHECK(cudaMalloc(&ptr_, bytes + kSlackBytes));
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(ptr_, o.ptr_);
      bytes_ = o.bytes_;
    }
    return *this;
  }

  void* get() const { return ptr_; }
  char* bytes_ptr() const { return static_cast<char*>(ptr_); }
  size_t bytes() const { return bytes_; }
  // Fills the whole allocation (slack included) with 0xFF bytes: NaN in fp16, bf16 and fp32.
  void poison(cudaStream_t stream) const {
    FK_CUDA_CHECK(cudaMemsetAsync(ptr_, 0xFF, bytes_ + kSlackBytes, stream));
  }

 private:
  void reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory, so that copies on a stream are truly asynchronous (the stream test
// relies on it).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    FK_CUDA_CHECK(cudaMallocHost(&ptr_, std::max<size_t>(bytes, 1)));
  }
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_ != nullptr) cudaFreeHost(ptr_);
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A stream created (non-blocking) and destroyed by the test.
class Stream {
 public:
  Stream() { FK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// The oracle
// ------------------------------------------------------------------------------------------------

// One (batch, query head) piece of the oracle. The oracle is computed piecewise so that it runs on
// every core and so that huge problems can be checked on a sample of pieces.
struct OracleItem {
  int b = 0;
  int h = 0;
};

inline std::vector<OracleItem> all_items(const FwdCase& c) {
  std::vector<OracleItem> items;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_q; ++h) items.push_back({b, h});
  }
  return items;
}

// `count` pieces drawn at random, plus the four corners (first/last batch x first/last head).
inline std::vector<OracleItem> sampled_items(const FwdCase& c, int count, uint64_t seed) {
  std::vector<OracleItem> items = {
      {0, 0}, {0, c.heads_q - 1}, {c.batch - 1, 0}, {c.batch - 1, c.heads_q - 1}};
  Rng rng(seed);
  for (int i = 0; i < count; ++i) {
    items.push_back({rng.uniform_int(0, c.batch - 1), rng.uniform_int(0, c.heads_q - 1)});
  }
  std::sort(items.begin(), items.end(), [](const OracleItem& x, const OracleItem& y) {
    return x.b != y.b ? x.b < y.b : x.h < y.h;
  });
  items.erase(std::unique(items.begin(), items.end(),
                          [](const OracleItem& x, const OracleItem& y) {
                            return x.b == y.b && x.h == y.h;
                          }),
              items.end());
  return items;
}

// The whole problem over host memory in the contiguous logical layout, resolved by the same
// validation that mha_fwd / mha_varlen_fwd run (src/api/validate_fwd.h): the oracle sees exactly
// the defaults and windows the kernel gets (window sides >= seqlen_k unbounded, causal folded into
// window_right, the default scale). Its out / lse pointers are cleared: the oracle writes the
// caller's fp32 buffers instead.
inline FwdProblem host_problem(const FwdCase& c, const HostInputs& in) {
  const flashkit::Device cpu{};
  const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  // Validation reads only metadata (and the varlen index arrays): the views never write.
  auto* q = const_cast<uint16_t*>(in.q.data());
  auto* k = const_cast<uint16_t*>(in.k.data());
  auto* v = const_cast<uint16_t*>(in.v.data());
  std::vector<float> lse(static_cast<size_t>(c.batch) * c.heads_q * c.lse_rows() + 1);
  flashkit::FwdCommon f;
  if (c.varlen) {
    f.q = flashkit::make_view(q, c.dtype, {c.total_q(), hq, d}, cpu);
    f.k = flashkit::make_view(k, c.dtype, {c.total_k(), hkv, d}, cpu);
    f.v = flashkit::make_view(v, c.dtype, {c.total_k(), hkv, d}, cpu);
  } else {
    f.q = flashkit::make_view(q, c.dtype, {c.batch, c.seqlen_q, hq, d}, cpu);
    f.k = flashkit::make_view(k, c.dtype, {c.batch, c.seqlen_k, hkv, d}, cpu);
    f.v = flashkit::make_view(v, c.dtype, {c.batch, c.seqlen_k, hkv, d}, cpu);
  }
  f.out = f.q;  // never written: validation only checks its shape, and the pointer is cleared
  f.softmax_lse =
      flashkit::make_view(lse.data(), DType::kFloat32, {c.batch, hq, c.lse_rows()}, cpu);
  auto* slopes = const_cast<float*>(in.alibi.data());
  if (c.alibi == AlibiKind::kPerHead) {
    f.alibi_slopes = flashkit::make_view(slopes, DType::kFloat32, {hq}, cpu);
  } else if (c.alibi == AlibiKind::kPerBatchHead) {
    f.alibi_slopes = flashkit::make_view(slopes, DType::kFloat32, {c.batch, hq}, cpu);
  }
  f.softmax_scale = c.softmax_scale;
  f.softcap = c.softcap;
  f.mask.causal = c.causal;
  f.mask.window_left = c.window_left;
  f.mask.window_right = c.window_right;

  FwdProblem p;
  if (c.varlen) {
    flashkit::MhaVarlenFwdParams params;
    static_cast<flashkit::FwdCommon&>(params) = f;
    auto* cu_q = const_cast<int*>(in.cu_q.data());
    auto* cu_k = const_cast<int*>(in.cu_k.data());
    params.cu_seqlens_q = flashkit::make_view(cu_q, DType::kInt32, {c.batch + 1}, cpu);
    params.cu_seqlens_k = flashkit::make_view(cu_k, DType::kInt32, {c.batch + 1}, cpu);
    if (!in.used_k.empty()) {
      params.seqused_k =
          flashkit::make_view(const_cast<int*>(in.used_k.data()), DType::kInt32, {c.batch}, cpu);
    }
    params.max_seqlen_q = c.max_len_q();
    params.max_seqlen_k = c.max_len_k();
    p = flashkit::api::validate_mha_varlen_fwd(params);
  } else {
    flashkit::MhaFwdParams params;
    static_cast<flashkit::FwdCommon&>(params) = f;
    p = flashkit::api::validate_mha_fwd(params);
  }
  p.out = nullptr;
  p.lse = nullptr;
  return p;
}

// The piece (b, h) of `full` as a problem of its own: batch 1, one query head, one kv head.
inline FwdProblem item_problem(const FwdProblem& full, const FwdCase& c, OracleItem it) {
  FwdProblem p = full;
  const int group = c.heads_q / c.heads_kv;
  const auto* q = static_cast<const uint16_t*>(full.q);
  const auto* k = static_cast<const uint16_t*>(full.k);
  const auto* v = static_cast<const uint16_t*>(full.v);
  p.batch = 1;
  p.heads_q = 1;
  p.heads_kv = 1;
  // Varlen batch strides are 0: the sequence offset comes from cu_seqlens, shifted below.
  p.q = q + it.b * full.q_batch_stride + it.h * full.q_head_stride;
  p.k = k + it.b * full.k_batch_stride + (it.h / group) * full.k_head_stride;
  p.v = v + it.b * full.v_batch_stride + (it.h / group) * full.v_head_stride;
  if (full.is_varlen()) {
    p.cu_seqlens_q = full.cu_seqlens_q + it.b;
    p.cu_seqlens_k = full.cu_seqlens_k + it.b;
    if (full.seqused_k != nullptr) p.seqused_k = full.seqused_k + it.b;
  }
  if (full.alibi_slopes != nullptr) {
    p.alibi_slopes = full.alibi_slopes + it.b * full.alibi_batch_stride + it.h;
    p.alibi_batch_stride = 0;
  }
  return p;
}

// Oracle results for a list of pieces: block n holds piece items[n], rows [0, lse_rows).
struct Oracle {
  std::vector<OracleItem> items;
  int rows = 0;
  std::vector<float> ref_out;  // kExact: [item][row][head_dim]
  std::vector<float> ref_lse;  // kExact: [item][row]
  std::vector<float> low_out;  // kInputDtype, rounded to the dtype like a framework's result
  std::vector<float> low_lse;
};

inline Oracle run_oracle(const FwdCase& c, const HostInputs& in, std::vector<OracleItem> items) {
  using flashkit::cpu::RefPrecision;
  Oracle o;
  o.items = std::move(items);
  o.rows = c.lse_rows();
  const size_t block = static_cast<size_t>(o.rows) * c.head_dim;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  o.ref_out.assign(o.items.size() * block, nan);
  o.low_out.assign(o.items.size() * block, nan);
  o.ref_lse.assign(o.items.size() * o.rows, nan);
  o.low_lse.assign(o.items.size() * o.rows, nan);
  const FwdProblem full = host_problem(c, in);
  parallel_for(o.items.size(), [&](size_t n) {
    const FwdProblem p = item_problem(full, c, o.items[n]);
    flashkit::cpu::reference_fwd_fp32(p, RefPrecision::kExact, &o.ref_out[n * block],
                                      &o.ref_lse[n * o.rows]);
    flashkit::cpu::reference_fwd_fp32(p, RefPrecision::kInputDtype, &o.low_out[n * block],
                                      &o.low_lse[n * o.rows]);
    // What plain framework code returns is a tensor in the input dtype: round the low-precision
    // result (a no-op if the oracle already did). Every representable value is at least as far
    // from the exact result as the nearest one, so rounding never makes err_low smaller than the
    // rounding error the kernel must make when it stores out.
    for (size_t i = n * block; i < (n + 1) * block; ++i) {
      if (std::isfinite(o.low_out[i])) o.low_out[i] = flashkit::round_to(c.dtype, o.low_out[i]);
    }
  });
  return o;
}

// ------------------------------------------------------------------------------------------------
// Device layouts
// ------------------------------------------------------------------------------------------------

// Where a [tokens, heads, head_dim] tensor sits in a device buffer (strides in elements; the last
// dim is always contiguous). Fixed length: token t of batch b = t / seqlen is at
// offset + b * batch_stride + (t % seqlen) * row_stride. Varlen: batch_stride is unused.
struct Placement {
  int buffer = 0;  // index into Layout::input_buffers (q, k, v); unused for out
  int64_t offset = 0;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

struct Layout {
  std::string name = "contiguous";
  std::vector<int64_t> input_buffers;  // element counts of the buffers q, k and v live in
  Placement q, k, v;
  int64_t out_elems = 0;  // the output buffer
  Placement out;
};

inline Placement dense_placement(const FwdCase& c, int buffer, int heads, int seqlen) {
  Placement p;
  p.buffer = buffer;
  p.head_stride = c.head_dim;
  p.row_stride = int64_t{heads} * c.head_dim;
  p.batch_stride = c.varlen ? 0 : seqlen * p.row_stride;
  return p;
}

inline Layout contiguous_layout(const FwdCase& c) {
  Layout l;
  const int64_t d = c.head_dim;
  l.q = dense_placement(c, 0, c.heads_q, c.seqlen_q);
  l.k = dense_placement(c, 1, c.heads_kv, c.seqlen_k);
  l.v = dense_placement(c, 2, c.heads_kv, c.seqlen_k);
  l.out = dense_placement(c, 0, c.heads_q, c.seqlen_q);
  l.input_buffers = {c.total_q() * c.heads_q * d, c.total_k() * c.heads_kv * d,
                     c.total_k() * c.heads_kv * d};
  l.out_elems = c.total_q() * c.heads_q * d;
  return l;
}

// Rows of one head that are evenly spaced on both sides: `rows` rows starting at host element
// `host_offset` (row pitch heads * head_dim) and at device element `device_offset` (row pitch
// row_stride). A tensor is a list of such blocks: one per (batch, head), or per head for varlen.
struct RowBlock {
  int64_t host_offset;
  int64_t device_offset;
  int64_t rows;
};

inline std::vector<RowBlock> row_blocks(const FwdCase& c, const Placement& p, int heads, int seqlen,
                                        int64_t total_tokens) {
  std::vector<RowBlock> blocks;
  const int64_t d = c.head_dim;
  if (c.varlen) {
    for (int h = 0; h < heads; ++h)
      blocks.push_back({h * d, p.offset + h * p.head_stride, total_tokens});
  } else {
    for (int b = 0; b < c.batch; ++b) {
      for (int h = 0; h < heads; ++h) {
        blocks.push_back({(int64_t{b} * seqlen * heads + h) * d,
                          p.offset + b * p.batch_stride + h * p.head_stride, seqlen});
      }
    }
  }
  return blocks;
}

// True when the placement is the dense [tokens, heads, head_dim] layout (one plain copy moves it).
inline bool is_dense(const FwdCase& c, const Placement& p, int heads, int seqlen) {
  const int64_t row = int64_t{heads} * c.head_dim;
  return p.head_stride == c.head_dim && p.row_stride == row &&
         (c.varlen || c.batch == 1 || p.batch_stride == seqlen * row);
}

// Copies a logical [tokens, heads, d] tensor between host memory and its placement on the device.
inline void copy_tensor(const FwdCase& c, const Placement& p, int heads, int seqlen,
                        int64_t total_tokens, uint16_t* host, char* device_base, bool to_device,
                        cudaStream_t stream) {
  const int64_t d = c.head_dim;
  const size_t elem = 2;
  if (total_tokens == 0) return;
  if (is_dense(c, p, heads, seqlen)) {
    char* dev = device_base + p.offset * elem;
    const size_t bytes = static_cast<size_t>(total_tokens * heads * d) * elem;
    FK_CUDA_CHECK(to_device ? cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream)
                            : cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    return;
  }
  for (const RowBlock& blk : row_blocks(c, p, heads, seqlen, total_tokens)) {
    if (blk.rows == 0) continue;
    char* dev = device_base + blk.device_offset * elem;
    uint16_t* h = host + blk.host_offset;
    const size_t host_pitch = static_cast<size_t>(heads * d) * elem;
    const size_t dev_pitch = static_cast<size_t>(p.row_stride) * elem;
    const size_t width = static_cast<size_t>(d) * elem;
    FK_CUDA_CHECK(to_device ? cudaMemcpy2DAsync(dev, dev_pitch, h, host_pitch, width, blk.rows,
                                                cudaMemcpyHostToDevice, stream)
                            : cudaMemcpy2DAsync(h, host_pitch, dev, dev_pitch, width, blk.rows,
                                                cudaMemcpyDeviceToHost, stream));
  }
}

// ------------------------------------------------------------------------------------------------
// The problem on the device
// ------------------------------------------------------------------------------------------------

struct KernelOut {
  std::vector<uint16_t> out;  // logical [total_q, heads_q, head_dim] gathered from the layout
  std::vector<float> lse;     // [batch, heads_q, lse_rows]
};

// Output buffers are poisoned with 0xFF bytes: 0xFFFF is a NaN in fp16 and bf16, 0xFFFFFFFF in
// fp32.
constexpr uint16_t kPoison16 = 0xFFFF;

class DeviceProblem {
 public:
  // Allocates every buffer of the layout and fills all of it (gaps between strided rows too) with
  // 0xFF bytes, so that a kernel reading a gap sees NaN. Throws OutOfMemory when cudaMalloc fails.
  DeviceProblem(const FwdCase& c, const HostInputs& in, Layout layout)
      : c_(c), in_(in), layout_(std::move(layout)), device_(current_device()) {
    for (int64_t elems : layout_.input_buffers)
      inputs_.emplace_back(static_cast<size_t>(elems) * 2);
    out_ = DeviceBuffer(static_cast<size_t>(layout_.out_elems) * 2);
    lse_ = DeviceBuffer(static_cast<size_t>(c_.batch) * c_.heads_q * c_.lse_rows() * sizeof(float));
    if (c_.varlen) {
      cu_q_ = DeviceBuffer(in_.cu_q.size() * sizeof(int));
      cu_k_ = DeviceBuffer(in_.cu_k.size() * sizeof(int));
      if (!in_.used_k.empty()) used_k_ = DeviceBuffer(in_.used_k.size() * sizeof(int));
    }
    if (!in_.alibi.empty()) alibi_ = DeviceBuffer(in_.alibi.size() * sizeof(float));
    for (const auto& buffer : inputs_) buffer.poison(nullptr);
    out_.poison(nullptr);
    lse_.poison(nullptr);
    // Every host buffer the copies use is page-locked and allocated here, so that upload, launch
    // and download make no call that synchronizes the device (cudaMallocHost may): the copies are
    // truly asynchronous, and the stream test can tell a launch on the wrong stream.
    stage_q_ = stage(in_.q);
    stage_k_ = stage(in_.k);
    stage_v_ = stage(in_.v);
    stage_cu_q_ = stage(in_.cu_q);
    stage_cu_k_ = stage(in_.cu_k);
    stage_used_k_ = stage(in_.used_k);
    stage_alibi_ = stage(in_.alibi);
    out_host_ = PinnedBuffer(in_.q.size() * 2);
    lse_host_ = PinnedBuffer(lse_elems() * sizeof(float));
    // The workspace the call asks for (short queries on the decode kernel split the keys through
    // it), poisoned, allocated here for the same reason. A case the API rejects gets none: its
    // launch reports the error.
    size_t workspace_bytes = 0;
    try {
      workspace_bytes = workspace_size_query();
    } catch (const flashkit::Error&) {
    }
    if (workspace_bytes > 0) {
      workspace_ = DeviceBuffer(workspace_bytes);
      workspace_.poison(nullptr);
    }
    FK_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Enqueues the copies of the inputs on `stream`.
  void upload(cudaStream_t stream) {
    copy_tensor(c_, layout_.q, c_.heads_q, c_.seqlen_q, c_.total_q(), stage_q_.as<uint16_t>(),
                inputs_[layout_.q.buffer].bytes_ptr(), true, stream);
    copy_tensor(c_, layout_.k, c_.heads_kv, c_.seqlen_k, c_.total_k(), stage_k_.as<uint16_t>(),
                inputs_[layout_.k.buffer].bytes_ptr(), true, stream);
    copy_tensor(c_, layout_.v, c_.heads_kv, c_.seqlen_k, c_.total_k(), stage_v_.as<uint16_t>(),
                inputs_[layout_.v.buffer].bytes_ptr(), true, stream);
    upload_small(stage_cu_q_, cu_q_, stream);
    upload_small(stage_cu_k_, cu_k_, stream);
    upload_small(stage_used_k_, used_k_, stream);
    upload_small(stage_alibi_, alibi_, stream);
  }

  void poison_outputs(cudaStream_t stream) const {
    out_.poison(stream);
    lse_.poison(stream);
  }

  flashkit::Device device() const { return {flashkit::DeviceKind::kCuda, device_}; }

  TensorView tensor_view(const Placement& p, char* base, int heads, int seqlen,
                         int64_t total_tokens) const {
    void* data = base + p.offset * 2;
    if (c_.varlen) {
      return flashkit::make_strided_view(data, c_.dtype, {total_tokens, heads, c_.head_dim},
                                         {p.row_stride, p.head_stride, 1}, device());
    }
    return flashkit::make_strided_view(data, c_.dtype, {c_.batch, seqlen, heads, c_.head_dim},
                                       {p.batch_stride, p.row_stride, p.head_stride, 1}, device());
  }

  void fill_common(flashkit::FwdCommon& f) const {
    f.q = tensor_view(layout_.q, inputs_[layout_.q.buffer].bytes_ptr(), c_.heads_q, c_.seqlen_q,
                      c_.total_q());
    f.k = tensor_view(layout_.k, inputs_[layout_.k.buffer].bytes_ptr(), c_.heads_kv, c_.seqlen_k,
                      c_.total_k());
    f.v = tensor_view(layout_.v, inputs_[layout_.v.buffer].bytes_ptr(), c_.heads_kv, c_.seqlen_k,
                      c_.total_k());
    f.out = tensor_view(layout_.out, out_.bytes_ptr(), c_.heads_q, c_.seqlen_q, c_.total_q());
    f.softmax_lse = flashkit::make_view(lse_.get(), DType::kFloat32,
                                        {c_.batch, c_.heads_q, c_.lse_rows()}, device());
    if (c_.alibi == AlibiKind::kPerHead) {
      f.alibi_slopes = flashkit::make_view(alibi_.get(), DType::kFloat32, {c_.heads_q}, device());
    } else if (c_.alibi == AlibiKind::kPerBatchHead) {
      f.alibi_slopes =
          flashkit::make_view(alibi_.get(), DType::kFloat32, {c_.batch, c_.heads_q}, device());
    }
    f.softmax_scale = c_.softmax_scale;
    f.softcap = c_.softcap;
    f.mask.causal = c_.causal;
    f.mask.window_left = c_.window_left;
    f.mask.window_right = c_.window_right;
  }

  flashkit::MhaFwdParams fixed_params() const {
    flashkit::MhaFwdParams p;
    fill_common(p);
    p.workspace = workspace_.get();
    p.workspace_bytes = workspace_.bytes();
    return p;
  }

  flashkit::MhaVarlenFwdParams varlen_params() const {
    flashkit::MhaVarlenFwdParams p;
    fill_common(p);
    p.cu_seqlens_q = flashkit::make_view(cu_q_.get(), DType::kInt32, {c_.batch + 1}, device());
    p.cu_seqlens_k = flashkit::make_view(cu_k_.get(), DType::kInt32, {c_.batch + 1}, device());
    if (!in_.used_k.empty()) {
      p.seqused_k = flashkit::make_view(used_k_.get(), DType::kInt32, {c_.batch}, device());
    }
    p.max_seqlen_q = c_.max_len_q();
    p.max_seqlen_k = c_.max_len_k();
    p.workspace = workspace_.get();
    p.workspace_bytes = workspace_.bytes();
    return p;
  }

  // What the size query of this call asks for now (FLASHKIT_FWD_PATH may force another path).
  size_t workspace_size_query() const {
    return c_.varlen ? flashkit::mha_varlen_fwd_workspace_size(varlen_params())
                     : flashkit::mha_fwd_workspace_size(fixed_params());
  }

  // Calls the API (it throws flashkit::Error on bad input) and checks the launch. A call whose
  // workspace size (FLASHKIT_FWD_PATH may have changed since the constructor) exceeds the one
  // allocated runs without one, as the API allows.
  void launch(cudaStream_t stream) const {
    const bool drop_workspace = workspace_size_query() > workspace_.bytes();
    auto without_workspace_if_short = [&](flashkit::FwdCommon& p) {
      if (drop_workspace) {
        p.workspace = nullptr;
        p.workspace_bytes = 0;
      }
    };
    if (c_.varlen) {
      flashkit::MhaVarlenFwdParams p = varlen_params();
      without_workspace_if_short(p);
      flashkit::mha_varlen_fwd(p, stream);
    } else {
      flashkit::MhaFwdParams p = fixed_params();
      without_workspace_if_short(p);
      flashkit::mha_fwd(p, stream);
    }
    FK_CUDA_CHECK(cudaGetLastError());
  }

  // Enqueues the copies back on `stream`, waits for that stream only, and returns the results.
  KernelOut download(cudaStream_t stream) {
    const size_t out_elems = in_.q.size();
    copy_tensor(c_, layout_.out, c_.heads_q, c_.seqlen_q, c_.total_q(), out_host_.as<uint16_t>(),
                out_.bytes_ptr(), false, stream);
    if (lse_elems() > 0) {
      FK_CUDA_CHECK(cudaMemcpyAsync(lse_host_.as<float>(), lse_.get(), lse_elems() * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
    }
    FK_CUDA_CHECK(cudaStreamSynchronize(stream));
    KernelOut k;
    k.out.assign(out_host_.as<uint16_t>(), out_host_.as<uint16_t>() + out_elems);
    k.lse.assign(lse_host_.as<float>(), lse_host_.as<float>() + lse_elems());
    return k;
  }

  // Counts the elements of the output buffer outside the logical tensor (gaps of a strided layout
  // and the slack past the end) that lost their poison: the kernel wrote where it must not.
  // Returns -1 when the buffer is too large to scan (the huge-offset layouts).
  int64_t out_gaps_written() const {
    constexpr int64_t kMaxScan = int64_t{1} << 28;
    const int64_t elems = layout_.out_elems + static_cast<int64_t>(DeviceBuffer::kSlackBytes / 2);
    if (elems > kMaxScan) return -1;
    std::vector<uint16_t> all(static_cast<size_t>(elems));
    FK_CUDA_CHECK(cudaMemcpy(all.data(), out_.get(), all.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<uint8_t> logical(all.size(), 0);
    for (const RowBlock& blk : row_blocks(c_, layout_.out, c_.heads_q, c_.seqlen_q, c_.total_q())) {
      for (int64_t r = 0; r < blk.rows; ++r) {
        const int64_t start = blk.device_offset + r * layout_.out.row_stride;
        std::fill_n(logical.begin() + start, c_.head_dim, uint8_t{1});
      }
    }
    int64_t written = 0;
    for (size_t i = 0; i < all.size(); ++i) written += (!logical[i] && all[i] != kPoison16);
    return written;
  }

  const Layout& layout() const { return layout_; }

 private:
  size_t lse_elems() const { return static_cast<size_t>(c_.batch) * c_.heads_q * c_.lse_rows(); }

  template <class T>
  static PinnedBuffer stage(const std::vector<T>& host) {
    PinnedBuffer buffer(host.size() * sizeof(T));
    if (!host.empty()) std::memcpy(buffer.as<T>(), host.data(), host.size() * sizeof(T));
    return buffer;
  }

  static void upload_small(const PinnedBuffer& host, const DeviceBuffer& dev, cudaStream_t stream) {
    if (host.bytes() == 0) return;
    FK_CUDA_CHECK(
        cudaMemcpyAsync(dev.get(), host.as<char>(), host.bytes(), cudaMemcpyHostToDevice, stream));
  }

  const FwdCase& c_;
  const HostInputs& in_;
  Layout layout_;
  DeviceBuffer workspace_;  // empty unless mha_fwd_workspace_size asked for one
  int device_;
  std::vector<DeviceBuffer> inputs_;
  DeviceBuffer out_, lse_, cu_q_, cu_k_, used_k_, alibi_;
  PinnedBuffer stage_q_, stage_k_, stage_v_, stage_cu_q_, stage_cu_k_, stage_used_k_, stage_alibi_;
  PinnedBuffer out_host_, lse_host_;  // download targets
};

// Uploads, poisons, launches and downloads on `stream` (nullptr: the legacy default stream).
inline KernelOut run_on_device(DeviceProblem& dev, cudaStream_t stream) {
  dev.upload(stream);
  dev.poison_outputs(stream);
  dev.launch(stream);
  return dev.download(stream);
}

// ------------------------------------------------------------------------------------------------
// The comparison rule
// ------------------------------------------------------------------------------------------------

// Tolerances (DESIGN.md, "Measuring"; TESTING.md, "The oracle").
//
// Output. ref = oracle kExact (fp64 accumulation, exact result in fp32), low = oracle kInputDtype
// (scores and probabilities rounded to the input dtype, fp32 accumulation, result rounded to the
// dtype). With err_kernel = max |out - ref| and err_low = max |low - ref| over every checked
// element, the kernel passes when
//     err_kernel <= factor * err_low + slack,     factor = 2 (3 with softcap).
// Softcap gets 3x because the kernel may evaluate tanh with a hardware approximation
// (tanh.approx.f32, relative error up to 2^-11) where the oracle uses the exact function.
//
// Slack: both dtypes compute in fp32, so the slack models fp32 arithmetic, not the dtype; the
// dtype's own rounding is already inside err_low. Storing out in the dtype never needs slack:
// the kernel's stored value is the representable value nearest to its fp32 result, and no
// representable value is closer to ref than the nearest one, which low's error already includes.
// What remains is the kernel's fp32 error (exp2 approximations, the rescaling of the running sum,
// 1/l), a few fp32 ulps of the output's magnitude: 1e-5 * max(1, max |ref|) covers that with a
// margin of about 10x for fp16 and bf16 alike (fp32 ulp at 1.0 is 1.2e-7). It only matters when
// err_low is itself tiny (one visible key, where both results are exact up to fp32 rounding).
inline float out_error_factor(const FwdCase& c) { return c.softcap > 0.0f ? 3.0f : 2.0f; }

inline double out_slack(DType dtype, double max_abs_ref) {
  const double per_unit = dtype == DType::kFloat16 ? 1e-5 : 1e-5;  // same for both: see above
  return per_unit * std::max(1.0, max_abs_ref);
}

// Log-sum-exp. The kernel computes it in fp32 from fp32 scores (q.k from the exact dtype inputs
// accumulated in fp32: relative error ~ sqrt(d) * 2^-24 of sum |q_i k_i|, about 1e-5 absolute
// for our score magnitudes) through exp2/log2 (ex2.approx / lg2.approx: ~2^-22 relative /
// absolute) and one final conversion to base e. Absolute 1e-3 is two orders of magnitude above
// that; 2e-5 relative covers rows whose ALiBi bias puts the lse at -1000 or so (fp32 ulp there
// is 6e-5). With softcap a tanh approximation may move each capped score by up to
// softcap * 2^-11, and the lse by as much: allow softcap * 2^-10.
inline double lse_tolerance(const FwdCase& c, double ref_lse) {
  double tol = 1e-3 + 2e-5 * std::fabs(ref_lse);
  if (c.softcap > 0.0f) tol += c.softcap * 0x1.0p-10;
  return tol;
}

struct CheckReport {
  bool ok = true;
  std::string text;  // always filled: the case and the errors measured
};

inline bool verbose() {
  const char* env = std::getenv("FLASHKIT_TEST_VERBOSE");
  return env != nullptr && env[0] != '\0' && env[0] != '0';
}

// Compares the kernel's outputs with the oracle on the oracle's pieces, and checks on every row
// that written rows are finite (or exactly zero with lse -inf), that varlen tail rows kept their
// poison, and that the lse of every valid row is a number.
inline CheckReport check_against_oracle(const FwdCase& c, const Oracle& o, const KernelOut& k,
                                        int64_t out_gaps_written = 0) {
  const int d = c.head_dim;
  const int hq = c.heads_q;
  const int rows = c.lse_rows();
  const double inf = std::numeric_limits<double>::infinity();

  double err_kernel = 0, err_low = 0, max_abs_ref = 0;
  std::string err_kernel_at = "-";
  double lse_err = 0, lse_worst_ratio = 0;
  std::string lse_worst_at = "-";
  int64_t lse_bad = 0, class_mismatch = 0, empty_rows = 0, empty_row_bad = 0, low_nonfinite = 0;
  int64_t not_finite = 0, lse_not_number = 0, tail_written = 0;
  std::vector<std::string> examples;
  auto note = [&](const std::string& s) {
    if (examples.size() < 8) examples.push_back(s);
  };
  auto where = [](int b, int h, int i, int col) {
    std::ostringstream os;
    os << "(b=" << b << ", h=" << h << ", row=" << i;
    if (col >= 0) os << ", col=" << col;
    os << ")";
    return os.str();
  };

  // 1. Against the oracle, piece by piece.
  for (size_t n = 0; n < o.items.size(); ++n) {
    const int b = o.items[n].b, h = o.items[n].h;
    for (int i = 0; i < c.len_q(b); ++i) {
      const size_t lse_index = (static_cast<size_t>(b) * hq + h) * rows + i;
      const double ref_l = o.ref_lse[n * rows + i];
      const double ker_l = k.lse[lse_index];
      const uint16_t* ker_row = &k.out[((c.start_q(b) + i) * hq + h) * d];
      const float* ref_row = &o.ref_out[(n * rows + i) * d];
      const float* low_row = &o.low_out[(n * rows + i) * d];
      if (ref_l == -inf) {
        // The row sees no key: lse exactly -inf, out exactly zero.
        ++empty_rows;
        bool zero = true;
        for (int col = 0; col < d; ++col)
          zero &= flashkit::bits_to_float(c.dtype, ker_row[col]) == 0.0f;
        if (ker_l != -inf || !zero) {
          ++empty_row_bad;
          std::ostringstream os;
          os << "empty row " << where(b, h, i, -1) << ": lse " << ker_l << " (want -inf), out "
             << (zero ? "zero" : "not zero");
          note(os.str());
        }
        continue;
      }
      if (std::isfinite(ref_l)) {
        const double diff = std::fabs(ker_l - ref_l);  // NaN if ker_l is NaN
        const double tol = lse_tolerance(c, ref_l);
        if (!(diff <= tol)) {
          ++lse_bad;
          std::ostringstream os;
          os << "lse " << where(b, h, i, -1) << ": kernel " << ker_l << " ref " << ref_l << " tol "
             << tol;
          note(os.str());
        }
        if (std::isfinite(diff)) {
          lse_err = std::max(lse_err, diff);
          if (diff / tol > lse_worst_ratio) {
            lse_worst_ratio = diff / tol;
            lse_worst_at = where(b, h, i, -1);
          }
        }
      } else if (!(std::isnan(ref_l) ? std::isnan(ker_l) : ker_l == ref_l)) {
        ++lse_bad;
        note("lse " + where(b, h, i, -1) + ": kernel " + std::to_string(ker_l) + " ref " +
             std::to_string(ref_l));
      }
      for (int col = 0; col < d; ++col) {
        const double r = ref_row[col];
        const double x = flashkit::bits_to_float(c.dtype, ker_row[col]);
        const double l = low_row[col];
        if (!std::isfinite(r)) {
          // Non-finite reference: the kernel must agree in kind (NaN with NaN, inf with same inf).
          if (!(std::isnan(r) ? std::isnan(x) : x == r)) {
            ++class_mismatch;
            note("out " + where(b, h, i, col) + ": kernel " + std::to_string(x) + " ref " +
                 std::to_string(r));
          }
          continue;
        }
        if (!std::isfinite(x)) {
          ++class_mismatch;
          note("out " + where(b, h, i, col) + ": kernel " + std::to_string(x) + " ref " +
               std::to_string(r) + (ker_row[col] == kPoison16 ? " (poison: never written)" : ""));
          continue;
        }
        max_abs_ref = std::max(max_abs_ref, std::fabs(r));
        const double e = std::fabs(x - r);
        if (e > err_kernel) {
          err_kernel = e;
          std::ostringstream os;
          os << where(b, h, i, col) << " kernel " << x << " ref " << r << " low " << l;
          err_kernel_at = os.str();
        }
        if (std::isfinite(l)) {
          err_low = std::max(err_low, std::fabs(l - r));
        } else {
          ++low_nonfinite;  // the dtype overflowed in the low oracle: leave it out (stricter)
        }
      }
    }
  }

  // 2. Every row that must be written: finite out, lse a number (finite or -inf).
  for (int b = 0; b < c.batch; ++b) {
    for (int i = 0; i < c.len_q(b); ++i) {
      for (int h = 0; h < hq; ++h) {
        const uint16_t* row = &k.out[((c.start_q(b) + i) * hq + h) * d];
        for (int col = 0; col < d; ++col) {
          if (!std::isfinite(flashkit::bits_to_float(c.dtype, row[col]))) {
            if (++not_finite <= 2) note("out " + where(b, h, i, col) + " is not finite");
          }
        }
        const float l = k.lse[(static_cast<size_t>(b) * hq + h) * rows + i];
        if (std::isnan(l) || l == std::numeric_limits<float>::infinity()) {
          if (++lse_not_number <= 2) note("lse " + where(b, h, i, -1) + " = " + std::to_string(l));
        }
      }
    }
  }

  // 3. Varlen: the tokens after cu_seqlens_q[batch] belong to no sequence and must stay poisoned.
  for (int64_t t = c.used_tokens_q(); t < c.total_q(); ++t) {
    for (int64_t e = 0; e < int64_t{hq} * d; ++e)
      tail_written += k.out[t * hq * d + e] != kPoison16;
  }
  if (tail_written > 0) note("the kernel wrote " + std::to_string(tail_written) + " tail elements");
  if (out_gaps_written > 0) {
    note("the kernel wrote " + std::to_string(out_gaps_written) + " elements outside the out view");
  }

  const double factor = out_error_factor(c);
  const double slack = out_slack(c.dtype, max_abs_ref);
  const double bound = factor * err_low + slack;
  CheckReport r;
  r.ok = err_kernel <= bound && lse_bad == 0 && class_mismatch == 0 && empty_row_bad == 0 &&
         not_finite == 0 && lse_not_number == 0 && tail_written == 0 && out_gaps_written <= 0;
  std::ostringstream os;
  os << "case " << c.describe() << "\n"
     << "  out: err_kernel = " << err_kernel << " at " << err_kernel_at << "\n"
     << "       err_low = " << err_low << ", bound = " << factor << " * err_low + " << slack
     << " = " << bound << (err_kernel <= bound ? " (ok)" : " (EXCEEDED)") << "\n"
     << "  lse: max |kernel - ref| = " << lse_err << ", worst err/tol = " << lse_worst_ratio
     << " at " << lse_worst_at << ", rows over tolerance: " << lse_bad << "\n"
     << "  pieces checked: " << o.items.size() << " of " << int64_t{c.batch} * hq
     << "; empty rows (lse -inf, out 0): " << empty_rows << ", wrong: " << empty_row_bad << "\n"
     << "  non-finite mismatches: " << class_mismatch
     << "; non-finite written outputs: " << not_finite << "; lse NaN/+inf: " << lse_not_number
     << "; tail elements written: " << tail_written << "; gap elements written: "
     << (out_gaps_written < 0 ? std::string("not scanned") : std::to_string(out_gaps_written));
  if (low_nonfinite > 0) os << "; low oracle overflowed on " << low_nonfinite << " elements";
  for (const auto& e : examples) os << "\n    " << e;
  r.text = os.str();
  return r;
}

// ------------------------------------------------------------------------------------------------
// Build contents
// ------------------------------------------------------------------------------------------------

// Whether `arg` appears in `msg` as a whole token (not inside a longer identifier), so that "k"
// matches "k.stride(1)" but not "seqlen_k".
inline bool names_argument(const std::string& msg, const std::string& arg) {
  auto ident = [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) != 0 || ch == '_';
  };
  for (size_t pos = msg.find(arg); pos != std::string::npos; pos = msg.find(arg, pos + 1)) {
    const bool left_ok = pos == 0 || !ident(msg[pos - 1]);
    const bool right_ok = pos + arg.size() == msg.size() || !ident(msg[pos + arg.size()]);
    if (left_ok && right_ok) return true;
  }
  return false;
}

// Why a case cannot run in this build ("" when it can): a build may leave out head-dim families
// (FLASHKIT_HEAD_DIMS) and dtypes (FLASHKIT_DTYPES); those cases are skipped, never failed.
inline std::string case_unavailable(const FwdCase& c) {
  if (!flashkit::cuda_fwd_built(c.dtype, c.head_dim)) {
    return std::string("this build has no CUDA forward kernel for ") + short_dtype_name(c.dtype) +
           " head dim " + std::to_string(c.head_dim) + " (FLASHKIT_DTYPES / FLASHKIT_HEAD_DIMS)";
  }
  return "";
}

// Sets an environment variable for one scope and restores the caller's value (the whole binary may
// run under FLASHKIT_FWD_PATH=sm80).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

}  // namespace flashkit::test
