// tests/cpp/test_gpu_kvcache.cpp
// \brief The CUDA decode path of mha_fwd_kvcache against the CPU reference: paged (randperm block
// tables, page sizes 1 to 1024) and contiguous caches, appends that cross pages and fill a cache to
// its end, rotary both ways and rotary_dim < head_dim, cache_batch_idx, left pads, masks, ALiBi,
// softcap, splits 1 to 128 and the heuristic, seqlen_q 1 to 16 with GQA ratios 1 to 16 and MQA,
// bf16 and fp16, head dims 64 / 128 / 256 (and one that pads).
//
// Every run poisons out, softmax_lse and the workspace with NaN first, checks the whole cache
// after the append element by element (bit-exact: the kernels round rotary like the reference),
// and checks out / lse with the rule of TESTING.md: err(kernel, fp64 oracle) <= 2 x err(input-dtype
// oracle, fp64 oracle) + slack (3x with softcap), lse within 1e-3 + 2e-5 |lse|, rows that see no
// key exactly 0 with lse -inf. Without a GPU every test skips itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "api/validate_kvcache.h"
#include "cpu/reference_kvcache.h"
#include "expect_error.h"
#include "gpu_test_util.h"
#include "kvcache_case.h"

namespace flashkit::test {
namespace {

constexpr Device kCpu{};

// A vector's bytes on the device (nothing for an empty vector).
template <typename T>
DeviceBuffer upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer buffer(std::max<size_t>(host.size() * sizeof(T), 1));
  if (!host.empty()) {
    FK_CUDA_CHECK(cudaMemcpyAsync(buffer.get(), host.data(), host.size() * sizeof(T),
                                  cudaMemcpyHostToDevice, stream));
  }
  return buffer;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buffer, size_t count, cudaStream_t stream) {
  std::vector<T> host(count);
  FK_CUDA_CHECK(cudaMemcpyAsync(host.data(), buffer.get(), count * sizeof(T),
                                cudaMemcpyDeviceToHost, stream));
  return host;
}

struct KvcacheOracle {
  std::vector<uint16_t> k_cache, v_cache;  // after the append
  std::vector<float> ref_out, ref_lse, low_out, low_lse;  // [b, h, t, d] / [b, h, t]
};

KvcacheOracle run_kvcache_oracle(const KvcacheCase& c, const KvcacheInputs& inputs) {
  KvcacheInputs in = inputs;  // the append writes into the copy's cache
  std::vector<uint16_t> out(in.q.size());
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);
  const KvcacheProblem problem =
      api::validate_mha_fwd_kvcache(kvcache_params(c, in, host_buffers(in, out, lse), kCpu));
  cpu::reference_kvcache_append(problem);
  KvcacheOracle o;
  o.ref_out.resize(out.size());
  o.low_out.resize(out.size());
  o.ref_lse.resize(lse.size());
  o.low_lse.resize(lse.size());
  cpu::reference_kvcache_attention_fp32(problem, cpu::RefPrecision::kExact, o.ref_out.data(),
                                        o.ref_lse.data());
  cpu::reference_kvcache_attention_fp32(problem, cpu::RefPrecision::kInputDtype, o.low_out.data(),
                                        o.low_lse.data());
  o.k_cache = std::move(in.k_cache);
  o.v_cache = std::move(in.v_cache);
  return o;
}

struct KvcacheRun {
  std::vector<uint16_t> out, k_cache, v_cache;
  std::vector<float> lse;
  int num_splits = 0;
};

// A case's device copies of its inputs and outputs, and the params over them (no workspace yet).
struct DeviceKvcache {
  DeviceBuffer q, k_cache, v_cache, k_new, v_new, cos, sin, alibi, seqlens, leftpad, batch_idx,
      table, out, lse;
  MhaFwdKvcacheParams params;

  DeviceKvcache(const KvcacheCase& c, const KvcacheInputs& in, cudaStream_t stream)
      : q(upload(in.q, stream)), k_cache(upload(in.k_cache, stream)), v_cache(upload(in.v_cache, stream)),
        k_new(upload(in.k_new, stream)), v_new(upload(in.v_new, stream)),
        cos(upload(in.rotary_cos, stream)), sin(upload(in.rotary_sin, stream)),
        alibi(upload(in.alibi, stream)), seqlens(upload(in.seqlens, stream)),
        leftpad(upload(in.leftpad, stream)), batch_idx(upload(in.batch_idx, stream)),
        table(upload(in.block_table, stream)), out(in.q.size() * 2),
        lse(int64_t{c.batch} * c.heads_q * c.seqlen_q * sizeof(float)) {
    KvcacheBuffers buf;
    buf.q = q.get();
    buf.k_cache = k_cache.get();
    buf.v_cache = v_cache.get();
    buf.k_new = k_new.get();
    buf.v_new = v_new.get();
    buf.rotary_cos = cos.get();
    buf.rotary_sin = sin.get();
    buf.alibi = alibi.get();
    buf.seqlens = seqlens.get();
    buf.leftpad = leftpad.get();
    buf.batch_idx = batch_idx.get();
    buf.block_table = table.get();
    buf.out = out.get();
    buf.lse = lse.get();
    params = kvcache_params(c, in, buf, Device{DeviceKind::kCuda, current_device()});
  }

  void poison_outputs(cudaStream_t stream) const {
    out.poison(stream);
    lse.poison(stream);
  }

  // Waits for `stream`.
  KvcacheRun download_all(const KvcacheCase& c, const KvcacheInputs& in, cudaStream_t stream) const {
    KvcacheRun run;
    run.out = download<uint16_t>(out, in.q.size(), stream);
    run.lse = download<float>(lse, int64_t{c.batch} * c.heads_q * c.seqlen_q, stream);
    run.k_cache = download<uint16_t>(k_cache, in.k_cache.size(), stream);
    run.v_cache = download<uint16_t>(v_cache, in.v_cache.size(), stream);
    FK_CUDA_CHECK(cudaStreamSynchronize(stream));
    return run;
  }
};

KvcacheRun run_on_gpu(const KvcacheCase& c, const KvcacheInputs& in, cudaStream_t stream) {
  DeviceKvcache dev(c, in, stream);
  dev.poison_outputs(stream);
  const size_t workspace_bytes = mha_fwd_kvcache_workspace_size(dev.params);
  DeviceBuffer workspace(std::max<size_t>(workspace_bytes, 1));
  workspace.poison(stream);
  dev.params.workspace = workspace_bytes > 0 ? workspace.get() : nullptr;
  dev.params.workspace_bytes = workspace_bytes;
  const int num_splits = mha_fwd_kvcache_num_splits(dev.params);
  mha_fwd_kvcache(dev.params, stream);
  FK_CUDA_CHECK(cudaGetLastError());
  KvcacheRun run = dev.download_all(c, in, stream);
  run.num_splits = num_splits;
  return run;
}

// The comparison; returns "" when everything holds, else what failed (with the measured errors).
std::string compare(const KvcacheCase& c, const KvcacheOracle& o, const KvcacheRun& r) {
  std::ostringstream fail;
  int64_t cache_diffs = 0, first_diff = -1;
  for (size_t i = 0; i < o.k_cache.size(); ++i) {
    const bool diff = o.k_cache[i] != r.k_cache[i] || o.v_cache[i] != r.v_cache[i];
    if (diff && first_diff < 0) first_diff = static_cast<int64_t>(i);
    cache_diffs += diff;
  }
  if (cache_diffs > 0) {
    fail << "cache: " << cache_diffs << " elements differ after the append (first at element "
         << first_diff << ")\n";
  }
  const int hq = c.heads_q, d = c.head_dim;
  double err_kernel = 0, err_low = 0, max_ref = 0;
  int64_t lse_bad = 0, not_finite = 0, empty_bad = 0;
  std::string worst;
  const double inf = std::numeric_limits<double>::infinity();
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      for (int t = 0; t < c.seqlen_q; ++t) {
        const int64_t row = (int64_t{b} * hq + h) * c.seqlen_q + t;
        const uint16_t* x = &r.out[((int64_t{b} * c.seqlen_q + t) * hq + h) * d];
        const double ref_l = o.ref_lse[row];
        if (ref_l == -inf) {
          bool zero = r.lse[row] == -inf;
          for (int col = 0; col < d; ++col) zero &= bits_to_float(c.dtype, x[col]) == 0.0f;
          empty_bad += !zero;
          continue;
        }
        const double tol = 1e-3 + 2e-5 * std::fabs(ref_l) + (c.softcap > 0 ? c.softcap * 0x1.0p-10 : 0);
        if (!(std::fabs(r.lse[row] - ref_l) <= tol)) {
          if (++lse_bad <= 3) {
            fail << "lse b" << b << " h" << h << " t" << t << ": kernel " << r.lse[row] << " ref "
                 << ref_l << "\n";
          }
        }
        for (int col = 0; col < d; ++col) {
          const double value = bits_to_float(c.dtype, x[col]);
          const double ref = o.ref_out[row * d + col];
          if (!std::isfinite(value)) {
            ++not_finite;
            continue;
          }
          max_ref = std::max(max_ref, std::fabs(ref));
          err_low = std::max(err_low, std::fabs(double{o.low_out[row * d + col]} - ref));
          if (std::fabs(value - ref) > err_kernel) {
            err_kernel = std::fabs(value - ref);
            std::ostringstream at;
            at << "b" << b << " h" << h << " t" << t << " col " << col << ": kernel " << value
               << " ref " << ref;
            worst = at.str();
          }
        }
      }
    }
  }
  const double factor = c.softcap > 0 ? 3.0 : 2.0;
  const double bound = factor * err_low + 1e-5 * std::max(1.0, max_ref);
  if (!(err_kernel <= bound)) {
    fail << "out: err_kernel " << err_kernel << " at " << worst << " > bound " << bound
         << " (err_low " << err_low << ")\n";
  }
  if (lse_bad > 0) fail << "lse: " << lse_bad << " rows over tolerance\n";
  if (not_finite > 0) fail << "out: " << not_finite << " non-finite elements (poison: never written?)\n";
  if (empty_bad > 0) fail << "rows without keys: " << empty_bad << " not (0, -inf)\n";
  if (verbose()) {
    std::cout << c.describe() << ": splits " << r.num_splits << ", err_kernel " << err_kernel
              << ", err_low " << err_low << "\n";
  }
  return fail.str();
}

// ------------------------------------------------------------------------------------------------
// The cases
// ------------------------------------------------------------------------------------------------

std::string unavailable(const KvcacheCase& c) {
  if (!cuda_kvcache_built(c.dtype, c.head_dim)) {
    return std::string("this build has no CUDA decode kernel for ") + short_dtype_name(c.dtype) +
           " head dim " + std::to_string(c.head_dim);
  }
  return "";
}

KvcacheCase decode_case(const std::string& name) {
  KvcacheCase c;
  c.name = name;
  c.dtype = DType::kBFloat16;
  c.batch = 3;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.seqlen_q = 1;
  c.seqlen_new = 1;
  c.page_block_size = 16;
  c.capacity = 512;
  c.rotary_dim = 64;
  c.num_splits = 0;
  return c;
}

std::vector<KvcacheCase> numbered(std::vector<KvcacheCase> cases) {
  for (size_t i = 0; i < cases.size(); ++i) cases[i].seed = 1000 + i;
  return cases;
}

std::vector<KvcacheCase> dtype_head_dim_cases() {
  std::vector<KvcacheCase> cases;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int d : {64, 128, 256, 96}) {
      for (bool paged : {true, false}) {
        KvcacheCase c = decode_case(std::string(short_dtype_name(dtype)) + "_d" + std::to_string(d) +
                                    (paged ? "_paged" : "_contiguous"));
        c.dtype = dtype;
        c.head_dim = d;
        c.rotary_dim = d == 96 ? 32 : d;
        c.rotary_interleaved = !paged;
        c.page_block_size = paged ? 16 : 0;
        c.seqlen_new = 3;
        c.seqlen_q = 3;
        c.causal = true;
        cases.push_back(c);
      }
    }
  }
  return numbered(cases);
}

std::vector<KvcacheCase> gqa_cases() {
  std::vector<KvcacheCase> cases;
  const int heads[][2] = {{8, 8}, {16, 4}, {16, 2}, {32, 2}, {16, 1}};
  for (const auto& hk : heads) {
    for (int sq : {1, 2, 5, 16}) {
      KvcacheCase c = decode_case("hq" + std::to_string(hk[0]) + "_hkv" + std::to_string(hk[1]) +
                                  "_sq" + std::to_string(sq));
      c.heads_q = hk[0];
      c.heads_kv = hk[1];
      c.seqlen_q = sq;
      c.seqlen_new = sq;
      c.causal = sq % 2 == 0;
      c.batch = 2;
      cases.push_back(c);
    }
  }
  return numbered(cases);
}

std::vector<KvcacheCase> page_and_append_cases() {
  std::vector<KvcacheCase> cases;
  for (int page : {1, 3, 16, 48, 256, 512, 1024}) {
    KvcacheCase c = decode_case("page" + std::to_string(page) + "_fill_to_end");
    c.page_block_size = page;
    c.capacity = page * ((768 + page - 1) / page);
    c.seqlen_new = 7;  // crosses page boundaries for pages < 7 and often for the others
    c.seqlen_q = 7;
    c.causal = true;
    c.fill_to_end = true;
    c.batch = 4;
    cases.push_back(c);
  }
  // Splits whose pages do not fit the kernel's shared-memory copy of the block table
  // (kDecodePageSlots): their lookups read the table in global memory (one split of 4200 keys: 4200
  // 1-token pages, or 1400 3-token pages with a division per lookup).
  for (int page : {1, 3}) {
    KvcacheCase c = decode_case("page" + std::to_string(page) + "_split_past_staged_pages");
    c.page_block_size = page;
    c.capacity = page * ((4200 + page - 1) / page);
    c.num_splits = 1;
    c.seqlen_new = 1;
    c.seqlen_q = 1;
    c.fill_to_end = true;  // sequence 0 past the slots; sequence 1's random length may fit them
    c.batch = 2;
    cases.push_back(c);
  }
  KvcacheCase c = decode_case("contiguous_batch_idx_leftpad");
  c.page_block_size = 0;
  c.batch_idx = true;
  c.extra_cache_rows = 3;
  c.leftpad = true;
  c.seqlen_new = 4;
  c.seqlen_q = 4;
  c.causal = true;
  cases.push_back(c);
  c = decode_case("paged_leftpad_window_alibi");
  c.leftpad = true;
  c.window_left = 37;
  c.window_right = 0;
  c.alibi = true;
  c.seqlen_q = 2;
  c.seqlen_new = 2;
  cases.push_back(c);
  c = decode_case("rotary_half_interleaved_softcap");
  c.rotary_dim = 32;
  c.rotary_interleaved = true;
  c.softcap = 10.0f;
  cases.push_back(c);
  c = decode_case("rotary_half_split_no_causal_sq4");
  c.rotary_dim = 48;
  c.seqlen_q = 4;
  c.seqlen_new = 2;
  cases.push_back(c);
  c = decode_case("no_append_scalar_length");
  c.seqlen_new = 0;
  c.rotary_dim = 0;
  c.scalar_length = true;
  cases.push_back(c);
  return numbered(cases);
}

std::vector<KvcacheCase> split_cases() {
  std::vector<KvcacheCase> cases;
  for (int splits : {1, 2, 3, 7, 16, 64, 128, 0}) {
    KvcacheCase c = decode_case("splits" + std::to_string(splits));
    c.num_splits = splits;
    c.capacity = 4096;
    c.page_block_size = splits % 2 == 0 ? 64 : 0;
    c.batch = 2;
    c.heads_q = 8;
    c.heads_kv = 1;
    c.seqlen_q = splits == 7 ? 3 : 1;
    c.seqlen_new = c.seqlen_q;
    cases.push_back(c);
  }
  return numbered(cases);
}

class GpuKvcacheTest : public ::testing::TestWithParam<KvcacheCase> {
 protected:
  void SetUp() override {
    if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount reports none";
  }
};

TEST_P(GpuKvcacheTest, MatchesReference) {
  const KvcacheCase& c = GetParam();
  if (const std::string why = unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const KvcacheInputs in = make_kvcache_inputs(c);
  const KvcacheOracle oracle = run_kvcache_oracle(c, in);
  Stream stream;
  const KvcacheRun run = run_on_gpu(c, in, stream.get());
  const std::string failure = compare(c, oracle, run);
  EXPECT_TRUE(failure.empty()) << c.describe() << " (splits used: " << run.num_splits << ")\n"
                               << failure;
}

std::string case_name(const ::testing::TestParamInfo<KvcacheCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(DtypeHeadDim, GpuKvcacheTest, ::testing::ValuesIn(dtype_head_dim_cases()),
                         case_name);
INSTANTIATE_TEST_SUITE_P(GqaSeqlenQ, GpuKvcacheTest, ::testing::ValuesIn(gqa_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(PagesAppendOptions, GpuKvcacheTest,
                         ::testing::ValuesIn(page_and_append_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Splits, GpuKvcacheTest, ::testing::ValuesIn(split_cases()), case_name);

// Sequences with no key (length 0, no append): out 0 and lse -inf, split or not.
TEST(GpuKvcache, EmptySequencesGiveZeroAndMinusInf) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  for (int splits : {1, 4}) {
    KvcacheCase c = decode_case("empty");
    c.seqlen_new = 0;
    c.rotary_dim = 0;
    c.num_splits = splits;
    c.seed = 77;
    if (const std::string why = unavailable(c); !why.empty()) GTEST_SKIP() << why;
    KvcacheInputs in = make_kvcache_inputs(c);
    in.seqlens = {0, 5, 0};
    const KvcacheOracle oracle = run_kvcache_oracle(c, in);
    Stream stream;
    const KvcacheRun run = run_on_gpu(c, in, stream.get());
    const std::string failure = compare(c, oracle, run);
    EXPECT_TRUE(failure.empty()) << "splits " << splits << "\n" << failure;
  }
}

// One workspace, one call after another, output checked after each (kvcache_params.h: the
// workspace's contents on entry do not matter; sequential calls and graph replays may share one):
// 0xff bytes; the same call again; other split counts over each other's partials; zeros; random
// bytes; arbitrary words; and a CUDA graph (the decode and combine kernels, programmatic
// dependents) replayed four times with eager calls of other split counts between replays. Two
// blocks of rows per kv head (32 packed rows). (Written for an in-kernel combine whose last-split
// counters lived in the workspace, bench/NOTES.md decode4; kept for the contract it checks.)
TEST(GpuKvcache, ReusedWorkspaceAndGraphReplay) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  KvcacheCase c = decode_case("reused_workspace");
  c.seqlen_new = 0;  // no append: every call computes the same output
  c.rotary_dim = 0;
  c.page_block_size = 0;
  c.capacity = 2048;
  c.batch = 2;
  c.heads_q = 16;
  c.heads_kv = 1;
  c.seqlen_q = 2;
  c.causal = true;
  c.seed = 79;
  if (const std::string why = unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const KvcacheInputs in = make_kvcache_inputs(c);
  const KvcacheOracle oracle = run_kvcache_oracle(c, in);
  Stream stream;
  const cudaStream_t s = stream.get();
  DeviceKvcache dev(c, in, s);
  const int split_counts[] = {16, 5, 128, 3, 7, 2};
  size_t bytes = 0;
  for (int splits : split_counts) {
    dev.params.num_splits = splits;
    bytes = std::max(bytes, mha_fwd_kvcache_workspace_size(dev.params));
  }
  DeviceBuffer workspace(bytes);
  dev.params.workspace = workspace.get();
  dev.params.workspace_bytes = bytes;
  auto fill_words = [&](uint64_t word) {
    const std::vector<uint64_t> words(bytes / 8, word);
    FK_CUDA_CHECK(
        cudaMemcpyAsync(workspace.get(), words.data(), words.size() * 8, cudaMemcpyHostToDevice, s));
    FK_CUDA_CHECK(cudaStreamSynchronize(s));
  };
  auto check = [&](const std::string& what) {
    FK_CUDA_CHECK(cudaGetLastError());
    const std::string failure = compare(c, oracle, dev.download_all(c, in, s));
    EXPECT_TRUE(failure.empty()) << what << " (splits " << dev.params.num_splits << ")\n" << failure;
  };
  auto call = [&](int splits, const std::string& what) {
    dev.params.num_splits = splits;
    dev.poison_outputs(s);
    mha_fwd_kvcache(dev.params, s);
    check(what);
  };

  workspace.poison(s);
  call(16, "0xff bytes");
  call(16, "the same call again");
  call(5, "fewer splits over the last call's partials");
  call(128, "more splits");
  FK_CUDA_CHECK(cudaMemsetAsync(workspace.get(), 0, bytes, s));
  call(3, "zeros");
  std::vector<uint64_t> noise(bytes / 8);
  uint64_t state = 12345;
  for (uint64_t& word : noise) word = splitmix64(state++);
  FK_CUDA_CHECK(
      cudaMemcpyAsync(workspace.get(), noise.data(), noise.size() * 8, cudaMemcpyHostToDevice, s));
  call(16, "random bytes");
  fill_words(0x0123456789abcd07ull);
  call(16, "words 0x0123456789abcd07");
  fill_words(0x0123456789abcdffull);
  call(7, "words 0x0123456789abcdff");

  // A captured call, replayed.
  dev.params.num_splits = 7;
  cudaGraph_t graph = nullptr;
  FK_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  mha_fwd_kvcache(dev.params, s);
  FK_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  FK_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  auto replay = [&](const std::string& what) {
    dev.params.num_splits = 7;
    dev.poison_outputs(s);
    FK_CUDA_CHECK(cudaGraphLaunch(exec, s));
    check(what);
  };
  workspace.poison(s);
  replay("graph, first replay on 0xff bytes");
  replay("graph, second replay");
  replay("graph, third replay");
  call(7, "an eager call between replays, same split count");
  replay("graph replay after an eager call");
  call(2, "an eager call with 2 splits");
  replay("graph replay after 2 splits");
  fill_words(0x0123456789abcd03ull);
  replay("graph replay on words 0x0123456789abcd03");
  FK_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FK_CUDA_CHECK(cudaGraphDestroy(graph));
}

// The device-side promises are checked on request: FLASHKIT_CHECK_KVCACHE=1 copies the index
// arrays to the host and rejects a page out of range before any launch. And a workspace smaller
// than the size query's answer is rejected.
TEST(GpuKvcache, ContentsCheckAndWorkspaceSize) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  KvcacheCase c = decode_case("contents");
  c.num_splits = 4;
  c.seed = 78;
  if (const std::string why = unavailable(c); !why.empty()) GTEST_SKIP() << why;
  KvcacheInputs in = make_kvcache_inputs(c);
  in.block_table[0] = c.num_blocks() + 5;
  Stream stream;
  DeviceKvcache dev(c, in, stream.get());
  MhaFwdKvcacheParams& params = dev.params;
  const size_t bytes = mha_fwd_kvcache_workspace_size(params);
  ASSERT_GT(bytes, 0u);
  DeviceBuffer workspace(bytes);
  params.workspace = workspace.get();
  params.workspace_bytes = bytes - 1;
  EXPECT_ERROR_MENTIONS(mha_fwd_kvcache(params, stream.get()), "workspace");
  params.workspace_bytes = bytes;
  {
    const ScopedEnv check_contents("FLASHKIT_CHECK_KVCACHE", "1");
    EXPECT_ERROR_MENTIONS(mha_fwd_kvcache(params, stream.get()), "block_table[0][0]");
  }
  FK_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
}

}  // namespace
}  // namespace flashkit::test
