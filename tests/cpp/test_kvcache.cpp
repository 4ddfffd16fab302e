// tests/cpp/test_kvcache.cpp
// \brief mha_fwd_kvcache on the CPU: the reference against a naive fp64 oracle written straight
// from the semantics of kvcache_params.h (append, rotary both ways, paging, left pads, batch
// indices, masks), the cache after the append element by element, every class of bad input, and
// the split heuristic; and mha_fwd's short queries as a decode (api/fwd_decode_route.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "api/fwd_decode_route.h"
#include "api/kvcache_fwd_route.h"
#include "api/split_heuristic.h"
#include "api/validate_fwd.h"
#include "api/validate_kvcache.h"
#include "common/half_float.h"
#include "cpu/reference_kvcache.h"
#include "cuda/sm80/decode_sm80.h"
#include "expect_error.h"
#include "flashkit/flashkit.h"
#include "kvcache_case.h"

namespace flashkit::test {
namespace {

constexpr Device kCpu{};
constexpr Device kCuda0{DeviceKind::kCuda, 0};

// ------------------------------------------------------------------------------------------------
// The naive oracle
// ------------------------------------------------------------------------------------------------

struct NaiveResult {
  std::vector<uint16_t> k_cache, v_cache;  // after the append
  std::vector<double> out;                 // [batch, seqlen_q, heads_q, head_dim]
  std::vector<double> lse;                 // [batch, heads_q, seqlen_q]
};

// Element index of (sequence b, cache index j, kv head h, column 0) in the case's cache.
int64_t naive_cache_index(const KvcacheCase& c, const KvcacheInputs& in, int b, int j, int h) {
  const int64_t hkv = c.heads_kv, d = c.head_dim;
  if (c.page_block_size > 0) {
    const int64_t page = in.block_table[b * c.max_blocks() + j / c.page_block_size];
    return ((page * c.page_block_size + j % c.page_block_size) * hkv + h) * d;
  }
  const int64_t row = c.batch_idx ? in.batch_idx[b] : b;
  return ((row * c.capacity + j) * hkv + h) * d;
}

// x (head_dim dtype values) rotated to `pos` per the case's tables.
std::vector<uint16_t> naive_rotate(const KvcacheCase& c, const KvcacheInputs& in,
                                   const uint16_t* x, int pos) {
  std::vector<uint16_t> y(x, x + c.head_dim);
  const int half = c.rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const int a = c.rotary_interleaved ? 2 * i : i;
    const int b = c.rotary_interleaved ? 2 * i + 1 : i + half;
    const cpu::RotatedPair r = cpu::rotate_pair(
        bits_to_float(c.dtype, x[a]), bits_to_float(c.dtype, x[b]),
        bits_to_float(c.dtype, in.rotary_cos[pos * half + i]),
        bits_to_float(c.dtype, in.rotary_sin[pos * half + i]));
    y[a] = float_to_bits(c.dtype, r.first);
    y[b] = float_to_bits(c.dtype, r.second);
  }
  return y;
}

NaiveResult naive_kvcache(const KvcacheCase& c, const KvcacheInputs& in) {
  NaiveResult r;
  r.k_cache = in.k_cache;
  r.v_cache = in.v_cache;
  const int hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim, group = hq / hkv;
  for (int b = 0; b < c.batch; ++b) {
    const int length = in.seqlens[b], pad = in.leftpad[b];
    for (int i = 0; i < c.seqlen_new; ++i) {
      for (int h = 0; h < hkv; ++h) {
        const int64_t src = ((int64_t{b} * c.seqlen_new + i) * hkv + h) * d;
        const std::vector<uint16_t> k = naive_rotate(c, in, &in.k_new[src], length - pad + i);
        const int64_t dst = naive_cache_index(c, in, b, length + i, h);
        for (int x = 0; x < d; ++x) {
          r.k_cache[dst + x] = k[x];
          r.v_cache[dst + x] = in.v_new[src + x];
        }
      }
    }
  }
  r.out.assign(int64_t{c.batch} * c.seqlen_q * hq * d, 0.0);
  r.lse.assign(int64_t{c.batch} * hq * c.seqlen_q, -std::numeric_limits<double>::infinity());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const bool local = c.causal || c.window_left >= 0 || c.window_right >= 0;
  for (int b = 0; b < c.batch; ++b) {
    const int length = in.seqlens[b], pad = in.leftpad[b];
    const int len_k = length + c.seqlen_new - pad;
    for (int i = 0; i < c.seqlen_q; ++i) {
      const int diag = i + len_k - c.seqlen_q;
      int lo = 0, hi = len_k;  // keys [lo, hi)
      if (c.window_left >= 0) lo = std::max(lo, diag - c.window_left);
      const int right = c.causal ? 0 : c.window_right;
      if (right >= 0) hi = std::min(hi, diag + right + 1);
      for (int h = 0; h < hq; ++h) {
        const int64_t q_at = ((int64_t{b} * c.seqlen_q + i) * hq + h) * d;
        const std::vector<uint16_t> q =
            naive_rotate(c, in, &in.q[q_at], length - pad + (local ? i : 0));
        std::vector<double> s;
        for (int j = lo; j < hi; ++j) {
          const int64_t k_at = naive_cache_index(c, in, b, pad + j, h / group);
          double dot = 0;
          for (int x = 0; x < d; ++x) {
            dot += double{bits_to_float(c.dtype, q[x])} * bits_to_float(c.dtype, r.k_cache[k_at + x]);
          }
          dot *= scale;
          if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
          if (c.alibi) dot -= double{in.alibi[h]} * std::abs(diag - j);
          s.push_back(dot);
        }
        if (s.empty()) continue;
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - m));
        r.lse[(int64_t{b} * hq + h) * c.seqlen_q + i] = m + std::log(sum);
        for (int j = lo; j < hi; ++j) {
          const int64_t v_at = naive_cache_index(c, in, b, pad + j, h / group);
          for (int x = 0; x < d; ++x) {
            r.out[q_at + x] += s[j - lo] / sum * bits_to_float(c.dtype, r.v_cache[v_at + x]);
          }
        }
      }
    }
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// Reference vs naive
// ------------------------------------------------------------------------------------------------

KvcacheCase base_case(const std::string& name) {
  KvcacheCase c;
  c.name = name;
  c.dtype = DType::kBFloat16;
  c.batch = 3;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 32;
  c.seqlen_q = 2;
  c.seqlen_new = 3;
  c.capacity = 48;
  return c;
}

std::vector<KvcacheCase> reference_cases() {
  std::vector<KvcacheCase> cases;
  auto add = [&](KvcacheCase c) {
    c.seed = cases.size() + 1;
    cases.push_back(c);
  };
  add(base_case("contiguous"));
  KvcacheCase c = base_case("paged16");
  c.page_block_size = 16;
  add(c);
  c = base_case("paged3_fill_to_end");
  c.page_block_size = 3;
  c.fill_to_end = true;
  c.seqlen_new = 5;
  add(c);
  c = base_case("paged1_rotary_half");
  c.page_block_size = 1;
  c.rotary_dim = 16;
  add(c);
  c = base_case("paged512_fill_to_end");  // flash_attn's page sizes are multiples of 256
  c.page_block_size = 512;
  c.capacity = 1024;
  c.fill_to_end = true;
  add(c);
  c = base_case("rotary_interleaved_full_causal");
  c.rotary_dim = 32;
  c.rotary_interleaved = true;
  c.causal = true;
  add(c);
  c = base_case("rotary_leftpad_batch_idx_window");
  c.rotary_dim = 16;
  c.leftpad = true;
  c.batch_idx = true;
  c.extra_cache_rows = 2;
  c.window_left = 5;
  c.window_right = 1;
  add(c);
  c = base_case("paged_leftpad_alibi_softcap_fp16");
  c.dtype = DType::kFloat16;
  c.page_block_size = 8;
  c.leftpad = true;
  c.alibi = true;
  c.softcap = 5.0f;
  c.causal = true;
  add(c);
  c = base_case("no_append_scalar_length_mqa");
  c.seqlen_new = 0;
  c.scalar_length = true;
  c.heads_kv = 1;
  add(c);
  return cases;
}

class KvcacheReferenceTest : public ::testing::TestWithParam<KvcacheCase> {};

TEST_P(KvcacheReferenceTest, MatchesNaiveOracleAndAppendsExactly) {
  const KvcacheCase& c = GetParam();
  SCOPED_TRACE(c.describe());
  KvcacheInputs in = make_kvcache_inputs(c);
  const NaiveResult naive = naive_kvcache(c, in);
  std::vector<uint16_t> out(in.q.size(), kKvcachePoison16);
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q, std::nanf(""));
  mha_fwd_kvcache(kvcache_params(c, in, host_buffers(in, out, lse), kCpu));

  // The cache after the append: every element, appended or not.
  int64_t cache_diffs = 0;
  for (size_t i = 0; i < in.k_cache.size(); ++i) {
    cache_diffs += in.k_cache[i] != naive.k_cache[i];
    cache_diffs += in.v_cache[i] != naive.v_cache[i];
  }
  EXPECT_EQ(cache_diffs, 0);

  // The output, rounded once to the dtype: within one rounding of the fp64 oracle (plus the
  // difference between two fp64 summation orders, far below it).
  const double ulp = c.dtype == DType::kBFloat16 ? 0x1.0p-8 : 0x1.0p-11;
  int64_t bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double x = bits_to_float(c.dtype, out[i]);
    const double want = naive.out[i];
    if (!(std::fabs(x - want) <= ulp * std::fabs(want) + 1e-6)) ++bad;
  }
  EXPECT_EQ(bad, 0);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(naive.lse[i])) {
      EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity()) << "lse " << i;
    } else {
      EXPECT_NEAR(lse[i], naive.lse[i], 1e-5 * (1 + std::fabs(naive.lse[i]))) << "lse " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, KvcacheReferenceTest, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<KvcacheCase>& info) {
                           return info.param.name;
                         });

// A sequence with no key at all (length 0, no append) gets out 0 and lse -inf.
TEST(KvcacheReference, EmptySequenceGivesZeroRowAndMinusInf) {
  KvcacheCase c = base_case("empty");
  c.seqlen_new = 0;
  c.scalar_length = true;
  KvcacheInputs in = make_kvcache_inputs(c);
  in.seqlens.assign(c.batch, 0);
  std::vector<uint16_t> out(in.q.size(), kKvcachePoison16);
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q, std::nanf(""));
  mha_fwd_kvcache(kvcache_params(c, in, host_buffers(in, out, lse), kCpu));
  for (uint16_t x : out) EXPECT_EQ(bits_to_float(c.dtype, x), 0.0f);
  for (float l : lse) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
}

// The same values through padded strides (q, out and the caches with a gap after each head, the
// block table with a gap after each row) give the same bits: the reference reads and writes
// through the strides, never assuming contiguity.
TEST(KvcacheReference, LayoutInvariance) {
  KvcacheCase c = base_case("layout");
  c.page_block_size = 8;
  c.rotary_dim = 16;
  c.leftpad = true;
  KvcacheInputs in = make_kvcache_inputs(c);
  KvcacheInputs padded_in = in;
  std::vector<uint16_t> out(in.q.size(), kKvcachePoison16);
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);
  mha_fwd_kvcache(kvcache_params(c, in, host_buffers(in, out, lse), kCpu));

  const int64_t d = c.head_dim, pad = 8, head_stride = d + pad;
  // Spread a [..., heads, d] tensor into [..., heads, d + pad] memory.
  auto spread = [&](const std::vector<uint16_t>& dense) {
    std::vector<uint16_t> wide(dense.size() / d * head_stride, kKvcachePoison16);
    for (size_t row = 0; row < dense.size() / d; ++row)
      std::copy_n(&dense[row * d], d, &wide[row * head_stride]);
    return wide;
  };
  padded_in.q = spread(in.q);
  padded_in.k_cache = spread(padded_in.k_cache);
  padded_in.v_cache = spread(padded_in.v_cache);
  const int64_t table_stride = c.max_blocks() + 3;
  std::vector<int> table(c.batch * table_stride, -1);
  for (int b = 0; b < c.batch; ++b)
    std::copy_n(&in.block_table[b * c.max_blocks()], c.max_blocks(), &table[b * table_stride]);
  padded_in.block_table = table;
  std::vector<uint16_t> padded_out(in.q.size() / d * head_stride, kKvcachePoison16);
  std::vector<float> padded_lse(lse.size());
  MhaFwdKvcacheParams p =
      kvcache_params(c, padded_in, host_buffers(padded_in, padded_out, padded_lse), kCpu);
  auto widen = [&](TensorView& v) {
    const int64_t heads = v.sizes[2];
    v = make_strided_view(v.data, v.dtype, {v.sizes[0], v.sizes[1], heads, d},
                          {v.sizes[1] * heads * head_stride, heads * head_stride, head_stride, 1},
                          kCpu);
  };
  widen(p.q);
  widen(p.out);
  widen(p.k_cache);
  widen(p.v_cache);
  p.block_table = make_strided_view(table.data(), DType::kInt32, {c.batch, c.max_blocks()},
                                    {table_stride, 1}, kCpu);
  mha_fwd_kvcache(p);
  for (size_t row = 0; row < out.size() / d; ++row) {
    for (int64_t x = 0; x < d; ++x) {
      ASSERT_EQ(padded_out[row * head_stride + x], out[row * d + x]) << "row " << row;
    }
    for (int64_t x = d; x < head_stride; ++x) {
      ASSERT_EQ(padded_out[row * head_stride + x], kKvcachePoison16) << "gap written, row " << row;
    }
  }
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_EQ(padded_lse[i], lse[i]);
  for (size_t row = 0; row < in.k_cache.size() / d; ++row) {
    for (int64_t x = 0; x < d; ++x) {
      ASSERT_EQ(padded_in.k_cache[row * head_stride + x], in.k_cache[row * d + x]);
      ASSERT_EQ(padded_in.v_cache[row * head_stride + x], in.v_cache[row * d + x]);
    }
  }
}

// On the CPU nothing is split and no workspace is needed.
TEST(KvcacheReference, CpuNeedsNoWorkspace) {
  KvcacheCase c = base_case("cpu");
  c.num_splits = 0;
  KvcacheInputs in = make_kvcache_inputs(c);
  std::vector<uint16_t> out(in.q.size());
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);
  const MhaFwdKvcacheParams p = kvcache_params(c, in, host_buffers(in, out, lse), kCpu);
  EXPECT_EQ(mha_fwd_kvcache_workspace_size(p), 0u);
  EXPECT_EQ(mha_fwd_kvcache_num_splits(p), 1);
}

// ------------------------------------------------------------------------------------------------
// Bad input
// ------------------------------------------------------------------------------------------------

// Each bad call must fail with an error that names mha_fwd_kvcache and every fragment.
#define EXPECT_KVCACHE_ERROR(mutation, ...)                                         \
  do {                                                                              \
    SCOPED_TRACE(#mutation);                                                        \
    KvcacheInputs in = make_kvcache_inputs(c);                                      \
    std::vector<uint16_t> out(in.q.size());                                         \
    std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);              \
    MhaFwdKvcacheParams p = kvcache_params(c, in, host_buffers(in, out, lse), kCpu); \
    mutation;                                                                       \
    expect_error([&] { mha_fwd_kvcache(p); }, {"mha_fwd_kvcache", __VA_ARGS__});    \
  } while (0)

KvcacheCase paged_case() {
  KvcacheCase c = base_case("paged");
  c.page_block_size = 16;
  c.rotary_dim = 16;
  return c;
}

TEST(KvcacheValidation, BlockTable) {
  const KvcacheCase c = paged_case();
  EXPECT_KVCACHE_ERROR(p.block_table.dtype = DType::kFloat32, "block_table.dtype", "float32",
                       "int32");
  EXPECT_KVCACHE_ERROR(p.block_table.rank = 1, "block_table", "rank 1");
  EXPECT_KVCACHE_ERROR(p.block_table.sizes[0] = c.batch + 1, "block_table", "has shape");
  EXPECT_KVCACHE_ERROR(p.block_table.strides[1] = 2, "block_table", "stride");
  EXPECT_KVCACHE_ERROR(p.block_table.device = kCuda0, "block_table", "cuda:0");
  EXPECT_KVCACHE_ERROR(in.block_table[0] = c.num_blocks(), "block_table[0][0]", "num_blocks");
  EXPECT_KVCACHE_ERROR(in.block_table[1] = -1, "block_table[0][1]");
  EXPECT_KVCACHE_ERROR(p.cache_batch_idx = make_view(in.block_table.data(), DType::kInt32,
                                                     {c.batch}, kCpu),
                       "cache_batch_idx", "paged");
  EXPECT_KVCACHE_ERROR(p.k_cache.sizes[1] = p.v_cache.sizes[1] = 0, "page_block_size", "is 0");
}

// Two sequences appending into one page (or one sequence naming a page twice where it appends)
// would leave the page's rows to the order of the writes: the CUDA append writes every token of
// every sequence in parallel, the CPU one sequence after the other. kvcache_params.h lists it among
// the caller's promises; the CPU backend (and FLASHKIT_CHECK_KVCACHE=1) now checks it like the
// others. Sharing pages that are only read (a common prefix) stays allowed.
TEST(KvcacheValidation, AppendedPagesAreNotShared) {
  const KvcacheCase c = paged_case();
  const int blocks = c.max_blocks();
  // Sequence 1 appends into its page 0 (cache_seqlens 0) and names sequence 0's page 0.
  EXPECT_KVCACHE_ERROR((in.seqlens[0] = in.seqlens[1] = 0, in.leftpad[0] = in.leftpad[1] = 0,
                        in.block_table[blocks] = in.block_table[0]),
                       "block_table[1][0] and block_table[0][0] are both page",
                       "the pages an append writes must be distinct");
  // One sequence naming one page for two stretches of its append (page_block_size 16, 3 new
  // tokens from position 15 span its pages 0 and 1).
  EXPECT_KVCACHE_ERROR((in.seqlens[2] = 15, in.leftpad[2] = 0,
                        in.block_table[2 * blocks + 1] = in.block_table[2 * blocks]),
                       "block_table[2][1] and block_table[2][0] are both page");

  // A page every sequence reads but none appends to (a shared prefix) is fine.
  KvcacheInputs in = make_kvcache_inputs(c);
  std::vector<uint16_t> out(in.q.size());
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);
  for (int b = 0; b < c.batch; ++b) {
    in.seqlens[b] = 20;  // the append goes to page 1; page 0 is read only
    in.leftpad[b] = 0;
    in.block_table[b * blocks] = in.block_table[0];
  }
  const MhaFwdKvcacheParams p = kvcache_params(c, in, host_buffers(in, out, lse), kCpu);
  EXPECT_NO_THROW(mha_fwd_kvcache(p));
}

// out and softmax_lse are written while the caches are read: a view passed twice is refused, as
// mha_fwd refuses it (out over q, an in-place call, stays allowed).
TEST(KvcacheValidation, OutputsDoNotAliasTheCache) {
  const KvcacheCase c = base_case("alias");
  EXPECT_KVCACHE_ERROR(p.out.data = p.k_cache.data, "out.data", "is also k_cache.data");
  EXPECT_KVCACHE_ERROR(p.out.data = p.v_cache.data, "out.data", "is also v_cache.data");
  EXPECT_KVCACHE_ERROR(p.softmax_lse.data = p.k_cache.data, "softmax_lse.data",
                       "is also k_cache.data");
  EXPECT_KVCACHE_ERROR(p.softmax_lse.data = p.out.data, "is also softmax_lse.data");
}

TEST(KvcacheValidation, TooFewBlocksForTheLength) {
  KvcacheCase c = paged_case();
  // 3 pages of 16 hold 48 tokens; the append would end at 48 + 3.
  EXPECT_KVCACHE_ERROR(in.seqlens[1] = 46, "cache_seqlens[1]", "46", "capacity is 48");
  EXPECT_KVCACHE_ERROR((p.cache_seqlens = TensorView{}, p.cache_seqlen = 47), "cache_seqlen (47)",
                       "seqlen_new (3)", "48");
  EXPECT_KVCACHE_ERROR((p.cache_seqlens = TensorView{}, p.cache_seqlen = 49), "cache_seqlen", "49");
}

TEST(KvcacheValidation, SplitsRotaryAppendAndIndexArrays) {
  const KvcacheCase c = paged_case();
  EXPECT_KVCACHE_ERROR(p.num_splits = -1, "num_splits is -1", "128");
  EXPECT_KVCACHE_ERROR(p.num_splits = 129, "num_splits is 129", "128");
  EXPECT_KVCACHE_ERROR((p.k_new = TensorView{}, p.v_new = TensorView{}), "rotary", "k_new");
  EXPECT_KVCACHE_ERROR(p.v_new = TensorView{}, "k_new is given without v_new");
  EXPECT_KVCACHE_ERROR(p.rotary_sin = TensorView{}, "rotary_cos is given without rotary_sin");
  EXPECT_KVCACHE_ERROR((p.rotary_cos.sizes[1] = p.rotary_sin.sizes[1] = 4), "rotary_dim", "8",
                       "multiple of 16");
  EXPECT_KVCACHE_ERROR((p.rotary_cos.sizes[0] = p.rotary_sin.sizes[0] = 40), "seqlen_ro", "40",
                       "48");
  EXPECT_KVCACHE_ERROR(p.rotary_cos.dtype = DType::kFloat16, "rotary_cos.dtype", "float16");
  EXPECT_KVCACHE_ERROR(p.k_new.sizes[2] = 3, "k_new", "has shape");
  EXPECT_KVCACHE_ERROR(p.v_new.dtype = DType::kFloat16, "v_new.dtype");
  EXPECT_KVCACHE_ERROR(p.cache_seqlens.dtype = DType::kFloat32, "cache_seqlens.dtype");
  EXPECT_KVCACHE_ERROR(p.cache_seqlens.sizes[0] = 2, "cache_seqlens", "has shape");
  EXPECT_KVCACHE_ERROR((p.cache_seqlens = TensorView{}, p.cache_seqlen = -1), "k_new is given",
                       "cache_seqlens");
  EXPECT_KVCACHE_ERROR(in.seqlens[2] = -3, "cache_seqlens[2]", "-3");
}

// Under a causal mask query token i sits at L - P + i, so more query tokens than appended ones
// reach past L + N, and past the tables when the cache is nearly full: a broken promise on CUDA
// (FLASHKIT_CHECK_KVCACHE=1 reports it), an error for CPU views.
TEST(KvcacheValidation, RotaryQueryPositionsInsideTheTables) {
  KvcacheCase c = paged_case();  // capacity 48 = seqlen_ro, 3 new tokens
  c.causal = true;
  c.seqlen_q = 5;
  EXPECT_KVCACHE_ERROR((in.seqlens[0] = 10, in.seqlens[1] = 45, in.seqlens[2] = 20), "query token 4",
                       "sequence 1", "position 49", "48 rows (seqlen_ro)");
}

TEST(KvcacheValidation, ContiguousCacheShapesAndOptions) {
  KvcacheCase c = base_case("contiguous");
  c.leftpad = true;
  c.batch_idx = true;
  c.extra_cache_rows = 1;
  EXPECT_KVCACHE_ERROR(p.k_cache.dtype = DType::kFloat16, "k_cache.dtype", "float16");
  EXPECT_KVCACHE_ERROR(p.v_cache.sizes[1] = 47, "v_cache", "has shape");
  EXPECT_KVCACHE_ERROR(p.k_cache.strides[3] = 2, "k_cache.stride(-1)");
  EXPECT_KVCACHE_ERROR((p.q.sizes[2] = 3, p.out.sizes[2] = 3), "3 heads", "multiple of heads_kv");
  EXPECT_KVCACHE_ERROR((p.q.sizes[3] = 20), "head_dim", "20");
  EXPECT_KVCACHE_ERROR(p.out.sizes[1] = 1, "out", "has shape");
  EXPECT_KVCACHE_ERROR(p.softmax_lse.dtype = DType::kBFloat16, "softmax_lse.dtype");
  EXPECT_KVCACHE_ERROR(in.batch_idx[0] = c.batch + 1, "cache_batch_idx[0]", "4");
  EXPECT_KVCACHE_ERROR(in.batch_idx[1] = in.batch_idx[0], "cache_batch_idx[1]", "distinct");
  EXPECT_KVCACHE_ERROR(in.leftpad[0] = in.seqlens[0] + 1, "cache_leftpad[0]");
  EXPECT_KVCACHE_ERROR((p.cache_batch_idx = TensorView{}, p.k_cache.sizes[0] = 2,
                        p.v_cache.sizes[0] = 2),
                       "batch_cache", "cache_batch_idx");
  EXPECT_KVCACHE_ERROR(p.softcap = -1.0f, "softcap is -1");
  EXPECT_KVCACHE_ERROR(p.mask.window_left = -2, "window_left is -2");
  EXPECT_KVCACHE_ERROR(p.alibi_slopes = make_view(in.alibi.data(), DType::kFloat32, {5}, kCpu),
                       "alibi_slopes", "[5]");
  EXPECT_KVCACHE_ERROR(p.q.dtype = DType::kFloat32, "q.dtype", "float32");
  EXPECT_KVCACHE_ERROR(p.k_cache = TensorView{}, "k_cache is undefined");
  EXPECT_KVCACHE_ERROR(p.cache_leftpad.device = kCuda0, "cache_leftpad is on cuda:0", "q is on cpu");
  EXPECT_KVCACHE_ERROR(p.v_cache.device = kCuda0, "v_cache is on cuda:0");
  EXPECT_KVCACHE_ERROR(p.k_cache.sizes[1] = 1000, "k_cache", "has shape");
}

// On CUDA views with host pointers, validation must reject before any CUDA call: a misaligned
// cache stride is caught from metadata alone.
TEST(KvcacheValidation, CudaAlignmentIsCheckedFromMetadata) {
  const KvcacheCase c = paged_case();
  KvcacheInputs in = make_kvcache_inputs(c);
  std::vector<uint16_t> out(in.q.size());
  std::vector<float> lse(int64_t{c.batch} * c.heads_q * c.seqlen_q);
  MhaFwdKvcacheParams p = kvcache_params(c, in, host_buffers(in, out, lse), kCuda0);
  p.k_cache.strides[1] += 4;
  expect_error([&] { mha_fwd_kvcache(p); }, {"k_cache.stride(1)", "16 bytes"});
}

// ------------------------------------------------------------------------------------------------
// mha_fwd's short queries as a decode (api/fwd_decode_route.h)
// ------------------------------------------------------------------------------------------------

constexpr int kH100Sms = 132;  // an H100's (and H200's) SM count, for the route's few-tiles rule

// One mha_fwd problem on CPU views, q and out with a padded head stride (so that the view's
// strides, not the shape, address them), k and v packed in one [batch, seqlen_k, 2, heads_kv, d]
// buffer.
struct ShortQueryCase {
  int batch, heads_q, heads_kv, head_dim, seqlen_q, seqlen_k;
  bool causal = false;
  int window_left = -1, window_right = -1;
  int alibi = 0;  // 0: none, 1: [heads_q] slopes, 2: [batch, heads_q]
  float softcap = 0.0f;
};

struct ShortQueryBuffers {
  std::vector<uint16_t> q, kv, out;
  std::vector<float> lse, alibi;
  MhaFwdParams params;
};

void fill_short_query(const ShortQueryCase& c, uint32_t seed, ShortQueryBuffers& b) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  const int64_t d = c.head_dim, pad = 8;
  const int64_t q_elems = int64_t{c.batch} * c.seqlen_q * c.heads_q * (d + pad);
  const int64_t kv_elems = int64_t{c.batch} * c.seqlen_k * 2 * c.heads_kv * d;
  b.q.resize(q_elems);
  b.kv.resize(kv_elems);
  for (auto& x : b.q) x = float_to_bf16_bits(uniform(rng));
  for (auto& x : b.kv) x = float_to_bf16_bits(uniform(rng));
  b.out.assign(q_elems, 0xFFFF);
  b.lse.assign(int64_t{c.batch} * c.heads_q * c.seqlen_q, std::nanf(""));
  b.alibi.resize(int64_t{c.batch} * c.heads_q);
  for (auto& x : b.alibi) x = 0.5f * (uniform(rng) + 2.0f);
  const int64_t q_row = int64_t{c.heads_q} * (d + pad), kv_row = 2 * int64_t{c.heads_kv} * d;
  MhaFwdParams& p = b.params;
  p.q = make_strided_view(b.q.data(), DType::kBFloat16, {c.batch, c.seqlen_q, c.heads_q, d},
                          {c.seqlen_q * q_row, q_row, d + pad, 1}, kCpu);
  p.k = make_strided_view(b.kv.data(), DType::kBFloat16, {c.batch, c.seqlen_k, c.heads_kv, d},
                          {c.seqlen_k * kv_row, kv_row, d, 1}, kCpu);
  p.v = make_strided_view(b.kv.data() + c.heads_kv * d, DType::kBFloat16,
                          {c.batch, c.seqlen_k, c.heads_kv, d}, {c.seqlen_k * kv_row, kv_row, d, 1},
                          kCpu);
  p.out = make_strided_view(b.out.data(), DType::kBFloat16, {c.batch, c.seqlen_q, c.heads_q, d},
                            {c.seqlen_q * q_row, q_row, d + pad, 1}, kCpu);
  p.softmax_lse = make_view(b.lse.data(), DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q}, kCpu);
  if (c.alibi == 1) p.alibi_slopes = make_view(b.alibi.data(), DType::kFloat32, {c.heads_q}, kCpu);
  if (c.alibi == 2) {
    p.alibi_slopes = make_view(b.alibi.data(), DType::kFloat32, {c.batch, c.heads_q}, kCpu);
  }
  p.mask.causal = c.causal;
  p.mask.window_left = c.window_left;
  p.mask.window_right = c.window_right;
  p.softcap = c.softcap;
}

// The decode view of each problem, run by the kvcache reference, writes what the forward reference
// writes, bit for bit: same rows of q and out, same keys, same window, ALiBi and softcap.
TEST(FwdDecodeRoute, DecodeViewMatchesTheForwardReference) {
  const ShortQueryCase cases[] = {
      {2, 8, 2, 64, 1, 37},                                   // GQA, one token
      {1, 4, 1, 128, 3, 29, true},                            // MQA, causal
      {2, 6, 6, 40, 16, 23, true, -1, -1, 1},                 // MHA, causal + ALiBi per head
      {1, 8, 2, 64, 5, 3, true},                              // causal with s_q > s_k: empty rows
      {2, 4, 2, 96, 4, 41, false, 7, 2, 2, 0.0f},             // local window, ALiBi [b, h]
      {1, 8, 4, 256, 2, 19, false, -1, -1, 0, 5.0f},          // softcap
      {3, 2, 1, 72, 16, 1},                                   // one key
  };
  uint32_t seed = 0x5E0;
  for (const ShortQueryCase& c : cases) {
    SCOPED_TRACE("batch " + std::to_string(c.batch) + " heads " + std::to_string(c.heads_q) + "/" +
                 std::to_string(c.heads_kv) + " d " + std::to_string(c.head_dim) + " s_q " +
                 std::to_string(c.seqlen_q) + " s_k " + std::to_string(c.seqlen_k));
    ShortQueryBuffers fwd, dec;
    fill_short_query(c, seed, fwd);
    fill_short_query(c, seed++, dec);
    const FwdProblem problem = api::validate_mha_fwd(fwd.params);
    EXPECT_TRUE(api::fwd_prefers_decode(problem, kH100Sms, 1, false));
    cpu::reference_fwd(problem);
    cpu::reference_kvcache(api::decode_view_of_fwd(api::validate_mha_fwd(dec.params)));
    ASSERT_EQ(fwd.out.size(), dec.out.size());
    EXPECT_EQ(std::memcmp(fwd.out.data(), dec.out.data(), fwd.out.size() * 2), 0);
    EXPECT_EQ(std::memcmp(fwd.lse.data(), dec.lse.data(), fwd.lse.size() * 4), 0);
  }
}

TEST(FwdDecodeRoute, WhichProblemsTakeTheDecodeKernel) {
  ShortQueryBuffers b;
  fill_short_query({2, 8, 2, 64, api::kFwdDecodeMaxSeqlenQ, 37}, 1, b);
  FwdProblem p = api::validate_mha_fwd(b.params);
  // Beside a forward kernel with one query head per tile: up to 16 tokens, past 16 only while the
  // forward kernels' tiles (batch x heads_q = 16 here) would fill at most a quarter of the SMs, and
  // never past 32.
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 1, false));
  p.seqlen_q = api::kFwdDecodeMaxSeqlenQ + 1;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 1, false));
  EXPECT_TRUE(api::fwd_prefers_decode(p, 64, 1, false));
  EXPECT_FALSE(api::fwd_prefers_decode(p, 63, 1, false));
  p.seqlen_q = api::kFwdDecodeMaxSeqlenQFewTiles;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 1, false));
  p.seqlen_q = api::kFwdDecodeMaxSeqlenQFewTiles + 1;
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 1, false));  // a longer query: the forward kernels
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 4, false));
  EXPECT_TRUE(api::fwd_decode_unsupported_reason(p).empty());  // (which a forced path overrides)
  // Beside the packed forward (4 heads per kv head here, batch 2 x 2 kv heads): up to 16 packed
  // rows, else while the decode kernel's 16-row tiles, batch x heads_kv x ceil(rows / 16), fill at
  // most 3/4 of the SMs.
  p.seqlen_q = 4;
  EXPECT_TRUE(api::fwd_prefers_decode(p, 4, 4, false)) << "16 rows: one decode tile per kv head, any SM count";
  p.seqlen_q = 5;
  EXPECT_FALSE(api::fwd_prefers_decode(p, 4, 4, false)) << "2 x 2 x 2 decode tiles on 4 SMs";
  EXPECT_TRUE(api::fwd_prefers_decode(p, 11, 4, false)) << "8 decode tiles on 11 SMs";
  EXPECT_FALSE(api::fwd_prefers_decode(p, 10, 4, false));
  p.seqlen_q = api::kFwdDecodeMaxSeqlenQFewTiles;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, false)) << "32 decode tiles";
  p.batch = 4;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.seqlen_q = 8;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, false)) << "64 decode tiles";
  p.seqlen_q = 16;
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 4, false)) << "128 decode tiles";
  // Beside a forward that splits the keys: one token, or up to 16 rows of the decode kernel's; with
  // at most 2048 keys also while the decode kernel's tiles fill at most a quarter of the SMs.
  p.seqlen_q = 4;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, true)) << "4 tokens x 4 heads";
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 1, true));
  p.seqlen_q = 5;
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 4, true)) << "64 decode tiles";
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 1, true));
  p.seqlen_k = api::kFwdDecodeMaxKeysBesideSplit;
  p.batch = 2;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, true)) << "32 decode tiles, 2048 keys";
  p.seqlen_q = 9;
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 4, true)) << "48 decode tiles";
  p.seqlen_q = 5;
  p.seqlen_k = api::kFwdDecodeMaxKeysBesideSplit + 1;
  EXPECT_FALSE(api::fwd_prefers_decode(p, kH100Sms, 4, true)) << "more keys";
  p.batch = 4;
  p.seqlen_k = 37;
  p.seqlen_q = 1;
  p.heads_q = 64;
  p.heads_kv = 1;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 64, true)) << "one token of 64 heads";
  p.batch = 2;
  p.heads_q = 8;
  p.heads_kv = 2;
  p.seqlen_q = 1;
  for (auto refuse : std::vector<void (*)(FwdProblem&)>{
           [](FwdProblem& x) { x.dropout_p = 0.1f; },
           [](FwdProblem& x) { x.attn_probs = &x; },
           [](FwdProblem& x) { x.seqlen_k = 0; },
           [](FwdProblem& x) { x.batch = 65536; },
           [](FwdProblem& x) { x.heads_q = x.heads_kv = 65536; }}) {
    FwdProblem refused = p;
    refuse(refused);
    EXPECT_FALSE(api::fwd_prefers_decode(refused, kH100Sms, 1, false));
    EXPECT_FALSE(api::fwd_prefers_decode(refused, kH100Sms, 4, false));
    EXPECT_FALSE(api::fwd_decode_unsupported_reason(refused).empty());
  }
}

// A varlen problem reads sequence b's keys as one cache row from cu_seqlens_k[b] (the left pad)
// to cu_seqlens_k[b + 1] (the length), or seqused_k[b] keys from the left pad, and its queries
// from cu_seqlens_q[b].
TEST(FwdDecodeRoute, VarlenKeysAreOneCacheRowBetweenTheOffsets) {
  ShortQueryBuffers b;
  fill_short_query({1, 8, 2, 64, 1, 37}, 3, b);
  FwdProblem p = api::validate_mha_fwd(b.params);
  static const int cu_q[4] = {0, 1, 1, 2}, cu_k[4] = {0, 20, 30, 37};
  p.batch = 3;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 0;
  p.seqlen_k = 20;  // max_seqlen_k
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, false));
  const KvcacheProblem d = api::decode_view_of_fwd(p);
  EXPECT_EQ(d.cu_seqlens_q, cu_q);
  EXPECT_EQ(d.cache_leftpad, cu_k);
  EXPECT_EQ(d.cache_seqlens, cu_k + 1);
  EXPECT_EQ(d.k_cache_batch_stride, 0);
  EXPECT_EQ(d.cache_capacity, 20);
  EXPECT_EQ(d.seqlen_q, 1);
  EXPECT_EQ(d.seqused_k, nullptr);
  static const int used_k[3] = {5, 0, 7};  // seqused_k: that many keys from each left pad
  p.seqused_k = used_k;
  EXPECT_TRUE(api::fwd_prefers_decode(p, kH100Sms, 4, false));
  EXPECT_EQ(api::decode_view_of_fwd(p).seqused_k, used_k);
  EXPECT_THROW(cpu::reference_kvcache(d), Error);  // the CPU backend runs reference_fwd instead
}

TEST(FwdDecodeRoute, CpuNeedsNoWorkspace) {
  ShortQueryBuffers b;
  fill_short_query({2, 8, 2, 64, 1, 37}, 2, b);
  EXPECT_EQ(mha_fwd_workspace_size(b.params), 0u);
}

// ------------------------------------------------------------------------------------------------
// The split heuristic
// ------------------------------------------------------------------------------------------------

api::SplitShape h100_shape(int64_t ctas, int64_t key_blocks) {
  api::SplitShape s;
  s.ctas = ctas;
  s.key_blocks = key_blocks;
  s.sm_count = 132;
  return s;
}

TEST(SplitHeuristic, DegenerateInputsGiveOneSplit) {
  EXPECT_EQ(api::choose_num_splits(h100_shape(0, 100)), 1);
  EXPECT_EQ(api::choose_num_splits(h100_shape(8, 1)), 1);
  EXPECT_EQ(api::choose_num_splits(h100_shape(8, 0)), 1);
  api::SplitShape s = h100_shape(8, 100);
  s.sm_count = 0;
  EXPECT_EQ(api::choose_num_splits(s), 1);
  s = h100_shape(8, 100);
  s.max_splits = 1;
  EXPECT_EQ(api::choose_num_splits(s), 1);
}

TEST(SplitHeuristic, AFullGpuIsNotSplit) {
  EXPECT_EQ(api::choose_num_splits(h100_shape(132, 2048)), 1);
  EXPECT_EQ(api::choose_num_splits(h100_shape(512, 128)), 1);
}

// The split counts the H100 sweep of bench/NOTES.md found fastest for contiguous caches (GQA 32/8:
// 8 CTAs per sequence, 128 keys per block of 64 at 8k); the H200 sweep agrees at batch 1 and finds
// 2 and 4 splits within 1.5% at batch 8.
TEST(SplitHeuristic, MatchesTheMeasuredBestOnH100) {
  for (int64_t blocks : {128, 512, 2048}) {  // cache 8k, 32k, 128k
    EXPECT_EQ(api::choose_num_splits(h100_shape(8, blocks)), 16) << blocks;       // batch 1
    EXPECT_EQ(api::choose_num_splits(h100_shape(64, blocks)), 2) << blocks;       // batch 8
  }
  EXPECT_EQ(api::choose_num_splits(h100_shape(512, 128)), 1);  // batch 64
}

// A few CTAs over a long cache: one wave that occupies most SMs.
TEST(SplitHeuristic, SmallBatchFillsOneWave) {
  for (int64_t ctas : {1, 3, 8}) {
    const int s = api::choose_num_splits(h100_shape(ctas, 1000));
    EXPECT_LE(ctas * s, 132) << ctas;
    EXPECT_GE(ctas * s, 132 * 9 / 10) << ctas;
  }
}

TEST(SplitHeuristic, StaysInRangeAndNeverAddsEmptySplits) {
  for (int64_t ctas : {1, 3, 8, 40, 100, 200}) {
    for (int64_t blocks : {2, 3, 7, 64, 1000, 5000}) {
      const int s = api::choose_num_splits(h100_shape(ctas, blocks));
      EXPECT_GE(s, 1);
      EXPECT_LE(s, 128);
      EXPECT_LE(s, blocks);
      // No split is empty: the last one starts before the end.
      const int64_t per = (blocks + s - 1) / s;
      EXPECT_LT(per * (s - 1), blocks) << ctas << " " << blocks << " -> " << s;
    }
  }
}

// Batch 1 and 8 at GQA 32/8 after splitting (128 CTAs) run the whole-SM pipeline on 132 SMs;
// batch 64 (512 CTAs) and an explicit split count past the SMs do not.
TEST(SplitHeuristic, OneCtaPerSmWhenTheLaunchFitsTheSms) {
  EXPECT_TRUE(api::one_cta_per_sm(8, 16, 132));
  EXPECT_TRUE(api::one_cta_per_sm(64, 2, 132));
  EXPECT_TRUE(api::one_cta_per_sm(132, 1, 132));
  EXPECT_FALSE(api::one_cta_per_sm(133, 1, 132));
  EXPECT_FALSE(api::one_cta_per_sm(512, 1, 132));
  EXPECT_FALSE(api::one_cta_per_sm(2, 128, 132));
  EXPECT_FALSE(api::one_cta_per_sm(0, 1, 132));
  EXPECT_FALSE(api::one_cta_per_sm(8, 0, 132));
  EXPECT_FALSE(api::one_cta_per_sm(8, 1, 0));
  // What the heuristic picks for a small batch always fits.
  for (int64_t ctas : {1, 3, 8, 64}) {
    for (int64_t blocks : {2, 128, 2048}) {
      EXPECT_TRUE(api::one_cta_per_sm(ctas, api::choose_num_splits(h100_shape(ctas, blocks)), 132))
          << ctas << " " << blocks;
    }
  }
}

// Two CTAs per SM count only where two per SM would still give each CTA at least 128 key blocks
// (8k keys), as the H200 sweep of session 12 (bench/NOTES.md) found faster for contiguous caches:
// batch 8 at 32k and 128k (4 splits), batch 4 and 16 at 128k (8 and 2), batch 2 at 128k (16).
// Batch 1 (16 splits: 8-128 blocks each), batch 8 at 8k, batch 16 at 8k (64 blocks each) and an
// unsplit launch keep one CTA per SM, and with it the whole-SM pipeline of a contiguous cache.
// Paged caches follow the same rule (session 19's sweep: 16 splits at batch 1 as fast as 32 or
// faster for 16- and 256-token pages).
TEST(SplitHeuristic, TwoCtasPerSmOnlyOverVeryLongSplits) {
  constexpr int64_t kSmemPerSm = 228 * 1024;
  constexpr int64_t kSharedSmCta = 101 * 1024;
  auto ctas_per_sm = [&](int64_t ctas, int64_t blocks) {
    return api::decode_ctas_per_sm(h100_shape(ctas, blocks), kSharedSmCta, kSmemPerSm);
  };
  for (int64_t blocks : {128, 512, 2048}) EXPECT_EQ(ctas_per_sm(8, blocks), 1) << blocks;  // batch 1
  EXPECT_EQ(ctas_per_sm(64, 128), 1);    // batch 8, 8k
  EXPECT_EQ(ctas_per_sm(64, 512), 2);    // batch 8, 32k
  EXPECT_EQ(ctas_per_sm(64, 2048), 2);   // batch 8, 128k
  EXPECT_EQ(ctas_per_sm(32, 512), 1);    // batch 4, 32k: 8 splits of 64 blocks
  EXPECT_EQ(ctas_per_sm(32, 2048), 2);   // batch 4, 128k
  EXPECT_EQ(ctas_per_sm(128, 128), 1);   // batch 16, 8k
  EXPECT_EQ(ctas_per_sm(128, 2048), 2);  // batch 16, 128k
  EXPECT_EQ(ctas_per_sm(512, 2048), 1);  // batch 64: not split
  EXPECT_EQ(api::decode_ctas_per_sm(h100_shape(64, 2048), 137 * 1024, kSmemPerSm), 1);
  EXPECT_EQ(api::decode_ctas_per_sm(h100_shape(64, 2048), 0, kSmemPerSm), 1);
  // A paged CTA's page slots (4 KiB) still leave room for two d128 shared-SM CTAs in an SM.
  const int64_t paged_cta = sm80::decode_smem_bytes(128, false, true) + 1024;
  EXPECT_EQ(api::decode_ctas_per_sm(h100_shape(64, 2048), paged_cta, kSmemPerSm), 2);
  api::SplitShape s = h100_shape(64, 2048);
  s.ctas_per_sm = ctas_per_sm(64, 2048);
  EXPECT_EQ(api::choose_num_splits(s), 4);
  s = h100_shape(128, 2048);
  s.ctas_per_sm = ctas_per_sm(128, 2048);
  EXPECT_EQ(api::choose_num_splits(s), 2);
}

TEST(SplitHeuristic, RespectsMaxSplits) {
  api::SplitShape s = h100_shape(1, 100000);
  s.max_splits = 16;
  EXPECT_EQ(api::choose_num_splits(s), 16);
}

// mha_fwd_kvcache's many-query route (kvcache_fwd_route.h): which calls are forward problems, the
// forward view's lengths, and the choice against the decode kernel (mha_fwd's for the same problem).
TEST(KvcacheFwdRoute, WhichCallsAreForwardProblems) {
  KvcacheProblem p;
  p.batch = 4;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.head_dim = 128;
  p.seqlen_q = 256;
  p.cache_capacity = 8192;
  p.cache_seqlen = 8192;
  p.causal = true;
  p.window_right = 0;
  int lengths[4] = {8192, 100, 0, 4000};
  p.cache_seqlens = lengths;
  EXPECT_EQ(api::kvcache_fwd_unsupported_reason(p), "");
  FwdProblem f = api::fwd_view_of_kvcache(p);
  EXPECT_EQ(f.seqlen_k, 8192);  // the capacity, each entry's length in seqused_k
  EXPECT_EQ(f.seqused_k, lengths);
  EXPECT_EQ(f.cu_seqlens_q, nullptr);
  EXPECT_TRUE(f.causal);
  EXPECT_EQ(f.window_right, 0);
  p.cache_seqlens = nullptr;
  p.cache_seqlen = 300;  // one length for every entry
  f = api::fwd_view_of_kvcache(p);
  EXPECT_EQ(f.seqlen_k, 300);
  EXPECT_EQ(f.seqused_k, nullptr);

  const char bytes[16] = {};
  KvcacheProblem append = p;
  append.k_new = bytes;
  append.v_new = bytes;
  EXPECT_NE(api::kvcache_fwd_unsupported_reason(append), "");
  KvcacheProblem paged = p;
  paged.block_table = lengths;
  EXPECT_NE(api::kvcache_fwd_unsupported_reason(paged), "");
  KvcacheProblem indexed = p;
  indexed.cache_batch_idx = lengths;
  EXPECT_NE(api::kvcache_fwd_unsupported_reason(indexed), "");
  KvcacheProblem padded = p;
  padded.cache_leftpad = lengths;
  EXPECT_NE(api::kvcache_fwd_unsupported_reason(padded), "");

  // Many tokens: the forward; one token: the decode kernel; 16 tokens of a packed GQA group: the
  // forward where its tiles fill the GPU (batch 4), the decode kernel where they do not (batch 1).
  EXPECT_TRUE(api::kvcache_prefers_fwd(p, kH100Sms, 4));
  p.seqlen_q = 1;
  EXPECT_FALSE(api::kvcache_prefers_fwd(p, kH100Sms, 4));
  p.seqlen_q = 16;
  EXPECT_TRUE(api::kvcache_prefers_fwd(p, kH100Sms, 4));
  p.batch = 1;
  EXPECT_FALSE(api::kvcache_prefers_fwd(p, kH100Sms, 4));
}

}  // namespace
}  // namespace flashkit::test
