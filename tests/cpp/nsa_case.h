// tests/cpp/nsa_case.h
// \brief The host side of an nsa_fwd / nsa_bwd test case, shared by the CPU and the GPU tests and
// free of CUDA: the case description (NsaCase: sizes, layout, how the selections are drawn), seeded
// inputs rounded into the dtype (make_nsa_inputs), the params over any set of buffers
// (nsa_fwd_params / nsa_bwd_params, host or device), NsaHostCase (the CPU tests' host buffers) and
// nsa_rule_cases(), one small case per rule of nsa_params.h. Builds on attention_case.h (Rng,
// input_value, nan_bits, short_dtype_name).
//
// Every tensor is addressed through the case (q_offset, kv_offset, index_offset, count_offset), so
// a test never assumes a layout: contiguous [batch, seqlen, heads, head_dim] by default, or
// heads-major [batch, heads, seqlen, head_dim + dim_pad] (heads_major), and padded, kv-head-major
// selection arrays (strided_indices). Values are drawn per logical element, so two cases that
// differ only in layout hold the same values. Input padding is NaN: a read of it shows.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "api/validate_nsa.h"
#include "attention_case.h"
#include "common/half_float.h"
#include "common/nsa_problem.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {

// How the slots of each selection are drawn: per slot, with these probabilities, a repeat of a
// block chosen earlier in the row, -1 padding, or an out-of-range index (>= num_key_blocks, or a
// large negative); otherwise a block not chosen yet (any block once every block is chosen).
struct SelectionMix {
  double duplicate = 0.0;
  double padding = 0.0;
  double out_of_range = 0.0;
};

enum class CountsKind {
  kNone,     // no block_counts: every slot is in use
  kInRange,  // block_counts in [0, selected]
  kMixed,    // also below 0 (-1 ... INT_MIN) and above selected (... INT_MAX), which clamp
};

struct NsaCase {
  std::string name = "nsa";  // GoogleTest-safe ([A-Za-z0-9_])
  DType dtype = DType::kBFloat16;
  int batch = 1;
  int heads_q = 4;
  int heads_kv = 1;
  int head_dim = 64;
  int seqlen_q = 64;
  int seqlen_k = 64;
  int block_size = 64;
  int selected = 16;  // slots per (token, kv head): block_indices.size(3)
  bool causal = false;
  float softmax_scale = 0.0f;  // 0: the default 1/sqrt(head_dim)

  SelectionMix mix;
  // Slot 0 names the block of the token's last visible key, as NSA always selects the local block
  // (so causal rows see the diagonal cut through a block); the other slots as `mix` draws them.
  bool own_block_first = true;
  CountsKind counts = CountsKind::kNone;
  int empty_token = -1;  // >= 0: this query token selects nothing (all slots -1, count 0)

  // Layouts. heads_major: q/k/v/out/dout/dq/dk/dv stored [batch, heads, seqlen, head_dim + dim_pad]
  // instead of [batch, seqlen, heads, head_dim + dim_pad] (dim_pad: a multiple of 8 keeps CUDA rows
  // 16-byte aligned). strided_indices: block_indices stored [heads_kv, batch, seqlen_q,
  // selected + 3] and block_counts [seqlen_q, batch, heads_kv + 2].
  bool heads_major = false;
  int dim_pad = 0;
  bool strided_indices = false;

  float q_scale = 1.0f;  // multiplies the random queries (peakier rows)
  uint64_t seed = 1;

  int num_key_blocks() const { return (seqlen_k + block_size - 1) / block_size; }
  float resolved_scale() const {
    if (softmax_scale != 0.0f) return softmax_scale;
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
  int group() const { return heads_q / heads_kv; }

  // ---- where each element lives ----
  struct Strides {  // of a [batch, seqlen, heads, ...] tensor, in elements
    int64_t batch;
    int64_t row;
    int64_t head;
  };
  int64_t row_elements() const { return head_dim + dim_pad; }
  Strides tensor_strides(int seqlen, int heads) const {
    const int64_t p = row_elements();
    return heads_major ? Strides{int64_t{heads} * seqlen * p, p, int64_t{seqlen} * p}
                       : Strides{int64_t{seqlen} * heads * p, int64_t{heads} * p, p};
  }
  Strides q_strides() const { return tensor_strides(seqlen_q, heads_q); }   // q, out, dout, dq
  Strides kv_strides() const { return tensor_strides(seqlen_k, heads_kv); }  // k, v, dk, dv
  int64_t q_elements() const { return int64_t{batch} * seqlen_q * heads_q * row_elements(); }
  int64_t kv_elements() const { return int64_t{batch} * seqlen_k * heads_kv * row_elements(); }
  // Element offset of the first element of row (b, token, head).
  int64_t q_offset(int b, int i, int h) const {
    const Strides s = q_strides();
    return b * s.batch + i * s.row + h * s.head;
  }
  int64_t kv_offset(int b, int j, int g) const {
    const Strides s = kv_strides();
    return b * s.batch + j * s.row + g * s.head;
  }

  int index_slots() const { return selected + (strided_indices ? 3 : 0); }  // stored per row
  Strides index_strides() const {
    const int64_t slots = index_slots();
    return strided_indices
               ? Strides{int64_t{seqlen_q} * slots, slots, int64_t{batch} * seqlen_q * slots}
               : Strides{int64_t{seqlen_q} * heads_kv * slots, int64_t{heads_kv} * slots, slots};
  }
  int64_t index_elements() const { return int64_t{batch} * seqlen_q * heads_kv * index_slots(); }
  int64_t index_offset(int b, int i, int g) const {  // of slot 0
    const Strides s = index_strides();
    return b * s.batch + i * s.row + g * s.head;
  }
  int count_row() const { return heads_kv + (strided_indices ? 2 : 0); }
  Strides count_strides() const {
    return strided_indices ? Strides{count_row(), int64_t{batch} * count_row(), 1}
                           : Strides{int64_t{seqlen_q} * heads_kv, heads_kv, 1};
  }
  int64_t count_elements() const {
    return counts == CountsKind::kNone ? 0 : int64_t{batch} * seqlen_q * count_row();
  }
  int64_t count_offset(int b, int i, int g) const {
    const Strides s = count_strides();
    return b * s.batch + i * s.row + g * s.head;
  }
  int64_t lse_elements() const { return int64_t{batch} * heads_q * seqlen_q; }
  int64_t lse_offset(int b, int h, int i) const {  // contiguous [batch, heads_q, seqlen_q]
    return (int64_t{b} * heads_q + h) * seqlen_q + i;
  }

  std::string describe() const {
    std::ostringstream os;
    os << name << ": " << short_dtype_name(dtype) << " batch=" << batch << " heads=" << heads_q
       << "/" << heads_kv << " head_dim=" << head_dim << " seqlen_q=" << seqlen_q
       << " seqlen_k=" << seqlen_k << " block_size=" << block_size << " selected=" << selected
       << (causal ? " causal" : "") << " mix=(dup " << mix.duplicate << ", pad " << mix.padding
       << ", oor " << mix.out_of_range << ")" << (own_block_first ? " own_block" : "")
       << " counts="
       << (counts == CountsKind::kNone      ? "none"
           : counts == CountsKind::kInRange ? "in_range"
                                            : "mixed");
    if (empty_token >= 0) os << " empty_token=" << empty_token;
    if (heads_major) os << " heads_major";
    if (dim_pad > 0) os << " dim_pad=" << dim_pad;
    if (strided_indices) os << " strided_indices";
    if (softmax_scale != 0.0f) os << " softmax_scale=" << softmax_scale;
    if (q_scale != 1.0f) os << " q_scale=" << q_scale;
    os << " seed=" << seed;
    return os.str();
  }
};

// GoogleTest prints a parameterised case with this instead of its bytes.
inline void PrintTo(const NsaCase& c, std::ostream* os) { *os << c.describe(); }

// ------------------------------------------------------------------------------------------------
// Inputs
// ------------------------------------------------------------------------------------------------

struct NsaInputs {
  std::vector<uint16_t> q, k, v, dout;  // in the case's layout (q_offset / kv_offset)
  std::vector<int32_t> block_indices;   // index_offset
  std::vector<int32_t> block_counts;    // count_offset; empty for CountsKind::kNone
};

// Fills the [batch, seqlen, heads, head_dim] tensor `bits` (stored as `c` lays it out) with
// round(dtype, scale * input_value(seed, logical index)), padding with NaN.
inline void fill_nsa_tensor(const NsaCase& c, std::vector<uint16_t>& bits, int seqlen, int heads,
                            uint64_t seed, float scale, float outlier_factor) {
  const NsaCase::Strides s = c.tensor_strides(seqlen, heads);
  bits.assign(static_cast<size_t>(c.batch) * seqlen * heads * c.row_elements(), nan_bits(c.dtype));
  for (int b = 0; b < c.batch; ++b) {
    for (int t = 0; t < seqlen; ++t) {
      for (int h = 0; h < heads; ++h) {
        const uint64_t logical = ((uint64_t(b) * seqlen + t) * heads + h) * c.head_dim;
        uint16_t* row = &bits[b * s.batch + t * s.row + h * s.head];
        for (int e = 0; e < c.head_dim; ++e) {
          row[e] = float_to_bits(c.dtype, scale * input_value(seed, logical + e, outlier_factor));
        }
      }
    }
  }
}

// The block that holds query token i's last visible key, or -1 when it sees none.
inline int own_block(const NsaCase& c, int i) {
  const int64_t last_key = c.causal ? int64_t{i} + c.seqlen_k - c.seqlen_q : c.seqlen_k - 1;
  return last_key < 0 || c.seqlen_k == 0
             ? -1
             : static_cast<int>(std::min<int64_t>(last_key, c.seqlen_k - 1) / c.block_size);
}

// The slots of one (b, i, g), drawn as c.mix says (see SelectionMix).
inline void draw_selection(const NsaCase& c, int i, Rng& rng, int32_t* slots) {
  const int blocks = c.num_key_blocks();
  std::vector<int> chosen;
  std::vector<bool> is_chosen(blocks, false);
  for (int s = 0; s < c.selected; ++s) {
    int block = -1;
    const double u = rng.uniform01();
    if (s == 0 && c.own_block_first) {
      block = own_block(c, i);
    } else if (u < c.mix.duplicate) {
      block = chosen.empty() ? -1 : chosen[rng.next() % chosen.size()];
    } else if (u < c.mix.duplicate + c.mix.padding) {
      block = -1;
    } else if (u < c.mix.duplicate + c.mix.padding + c.mix.out_of_range) {
      static const int kNegatives[] = {INT_MIN, -1000000, -2};
      block = rng.chance(0.5) ? blocks + rng.uniform_int(0, blocks + 3)
                              : kNegatives[rng.next() % 3];
    } else if (blocks > 0) {
      // A block not chosen yet: uniform among the free ones, or any once none is free.
      const int free = blocks - static_cast<int>(chosen.size());
      if (free <= 0) {
        block = rng.uniform_int(0, blocks - 1);
      } else {
        int nth = rng.uniform_int(0, free - 1);
        for (block = 0;; ++block) {
          if (!is_chosen[block] && nth-- == 0) break;
        }
      }
    }
    slots[s] = block;
    if (block >= 0 && block < blocks && !is_chosen[block]) {
      is_chosen[block] = true;
      chosen.push_back(block);
    }
  }
}

inline int32_t draw_count(const NsaCase& c, Rng& rng) {
  if (c.counts == CountsKind::kMixed) {
    const double u = rng.uniform01();
    if (u < 0.15) return rng.chance(0.5) ? INT_MIN : -rng.uniform_int(1, 5);
    if (u < 0.3) return rng.chance(0.5) ? INT_MAX : c.selected + rng.uniform_int(1, 5);
  }
  return rng.uniform_int(0, c.selected);
}

inline NsaInputs make_nsa_inputs(const NsaCase& c) {
  NsaInputs in;
  // Outliers (x4) in q and k give peaky rows; v and dout stay standard normal (attention_case.h
  // says why).
  fill_nsa_tensor(c, in.q, c.seqlen_q, c.heads_q, splitmix64(c.seed * 8 + 0), c.q_scale, 4.0f);
  fill_nsa_tensor(c, in.k, c.seqlen_k, c.heads_kv, splitmix64(c.seed * 8 + 1), 1.0f, 4.0f);
  fill_nsa_tensor(c, in.v, c.seqlen_k, c.heads_kv, splitmix64(c.seed * 8 + 2), 1.0f, 1.0f);
  fill_nsa_tensor(c, in.dout, c.seqlen_q, c.heads_q, splitmix64(c.seed * 8 + 3), 1.0f, 1.0f);

  // Unused storage (the padding of strided_indices) holds a valid block, 0: a read of it would
  // change the result.
  in.block_indices.assign(c.index_elements(), 0);
  in.block_counts.assign(c.count_elements(), 0);
  Rng rng(splitmix64(c.seed * 8 + 4));
  for (int b = 0; b < c.batch; ++b) {
    for (int i = 0; i < c.seqlen_q; ++i) {
      for (int g = 0; g < c.heads_kv; ++g) {
        int32_t* slots = &in.block_indices[c.index_offset(b, i, g)];
        draw_selection(c, i, rng, slots);
        int32_t count = c.counts != CountsKind::kNone ? draw_count(c, rng) : 0;
        if (i == c.empty_token) {
          std::fill(slots, slots + c.selected, -1);
          count = 0;
        }
        if (c.counts != CountsKind::kNone) in.block_counts[c.count_offset(b, i, g)] = count;
      }
    }
  }
  return in;
}

// Which keys query token i of sequence b and kv head g sees, [seqlen_q, seqlen_k], read off
// nsa_params.h word for word: every slot s < count(b, i, g) that names a block n in
// [0, num_key_blocks) marks the keys [n * block_size, min((n + 1) * block_size, seqlen_k)); a
// boolean mask is a set, so duplicates need no care; causal then clears j > i + seqlen_k -
// seqlen_q.
inline std::vector<char> nsa_dense_mask(const NsaCase& s, const NsaInputs& in, int b, int g) {
  std::vector<char> mask(static_cast<size_t>(s.seqlen_q) * s.seqlen_k, 0);
  for (int i = 0; i < s.seqlen_q; ++i) {
    int64_t count = s.selected;
    if (s.counts != CountsKind::kNone) {
      count = std::clamp<int64_t>(in.block_counts[s.count_offset(b, i, g)], 0, s.selected);
    }
    for (int64_t slot = 0; slot < count; ++slot) {
      const int64_t n = in.block_indices[s.index_offset(b, i, g) + slot];
      if (n < 0 || n >= s.num_key_blocks()) continue;
      for (int64_t j = n * s.block_size; j < std::min<int64_t>((n + 1) * s.block_size, s.seqlen_k);
           ++j) {
        mask[i * s.seqlen_k + j] = 1;
      }
    }
    if (s.causal) {
      for (int64_t j = std::max<int64_t>(0, int64_t{i} + s.seqlen_k - s.seqlen_q + 1);
           j < s.seqlen_k; ++j) {
        mask[i * s.seqlen_k + j] = 0;
      }
    }
  }
  return mask;
}

// ------------------------------------------------------------------------------------------------
// Params over any buffers
// ------------------------------------------------------------------------------------------------

// Where each tensor of a case lives (host vectors' data, or device copies of them). Sizes: q, out,
// dout, dq: c.q_elements() 16-bit; k, v, dk, dv: c.kv_elements(); block_indices:
// c.index_elements() int32; block_counts: c.count_elements(); lse: c.lse_elements() float.
struct NsaBuffers {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* block_indices = nullptr;
  void* block_counts = nullptr;  // null without counts
  void* out = nullptr;
  void* lse = nullptr;
  void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};

// A [batch, seqlen, heads, head_dim] view of `data` in the case's layout.
inline TensorView nsa_tensor_view(const NsaCase& c, void* data, int seqlen, int heads,
                                  Device device) {
  const NsaCase::Strides s = c.tensor_strides(seqlen, heads);
  return make_strided_view(data, c.dtype, {c.batch, seqlen, heads, c.head_dim},
                           {s.batch, s.row, s.head, 1}, device);
}

// The forward's params of case `c` over `buf` on `device`.
inline NsaFwdParams nsa_fwd_params(const NsaCase& c, const NsaBuffers& buf, Device device) {
  NsaFwdParams p;
  p.q = nsa_tensor_view(c, buf.q, c.seqlen_q, c.heads_q, device);
  p.k = nsa_tensor_view(c, buf.k, c.seqlen_k, c.heads_kv, device);
  p.v = nsa_tensor_view(c, buf.v, c.seqlen_k, c.heads_kv, device);
  const NsaCase::Strides bi = c.index_strides();
  p.block_indices = make_strided_view(buf.block_indices, DType::kInt32,
                                      {c.batch, c.seqlen_q, c.heads_kv, c.selected},
                                      {bi.batch, bi.row, bi.head, 1}, device);
  if (c.counts != CountsKind::kNone) {
    const NsaCase::Strides bc = c.count_strides();
    p.block_counts = make_strided_view(buf.block_counts, DType::kInt32,
                                       {c.batch, c.seqlen_q, c.heads_kv}, {bc.batch, bc.row, 1},
                                       device);
  }
  p.block_size = c.block_size;
  p.out = nsa_tensor_view(c, buf.out, c.seqlen_q, c.heads_q, device);
  p.softmax_lse = make_view(buf.lse, DType::kFloat32, {c.batch, c.heads_q, c.seqlen_q}, device);
  p.softmax_scale = c.softmax_scale;
  p.causal = c.causal;
  return p;
}

// The backward's params of case `c` over `buf` on `device`; the workspace is left empty (the
// caller sizes it with nsa_bwd_workspace_size).
inline NsaBwdParams nsa_bwd_params(const NsaCase& c, const NsaBuffers& buf, Device device) {
  const NsaFwdParams f = nsa_fwd_params(c, buf, device);
  NsaBwdParams p;
  p.dout = nsa_tensor_view(c, buf.dout, c.seqlen_q, c.heads_q, device);
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.block_indices = f.block_indices;
  p.block_counts = f.block_counts;
  p.block_size = f.block_size;
  p.out = f.out;
  p.softmax_lse = f.softmax_lse;
  p.dq = nsa_tensor_view(c, buf.dq, c.seqlen_q, c.heads_q, device);
  p.dk = nsa_tensor_view(c, buf.dk, c.seqlen_k, c.heads_kv, device);
  p.dv = nsa_tensor_view(c, buf.dv, c.seqlen_k, c.heads_kv, device);
  p.softmax_scale = f.softmax_scale;
  p.causal = f.causal;
  return p;
}

// ------------------------------------------------------------------------------------------------
// The case on the host
// ------------------------------------------------------------------------------------------------

// The inputs of make_nsa_inputs, the outputs poisoned (out / dq / dk / dv with nan_bits, lse with
// NaN, padding included), and the CPU params and (validated) problems over them. Tests may change
// any buffer in place before they ask for params.
class NsaHostCase {
 public:
  explicit NsaHostCase(NsaCase c) : case_(std::move(c)) {
    in = make_nsa_inputs(case_);
    const uint16_t poison = nan_bits(case_.dtype);
    out.assign(case_.q_elements(), poison);
    dq.assign(case_.q_elements(), poison);
    dk.assign(case_.kv_elements(), poison);
    dv.assign(case_.kv_elements(), poison);
    lse.assign(case_.lse_elements(), std::nanf(""));
  }

  const NsaCase& spec() const { return case_; }

  NsaBuffers buffers() {
    auto ptr = [](auto& v) -> void* { return v.empty() ? nullptr : v.data(); };
    NsaBuffers b;
    b.q = ptr(in.q);
    b.k = ptr(in.k);
    b.v = ptr(in.v);
    b.block_indices = ptr(in.block_indices);
    b.block_counts = ptr(in.block_counts);
    b.out = ptr(out);
    b.lse = ptr(lse);
    b.dout = ptr(in.dout);
    b.dq = ptr(dq);
    b.dk = ptr(dk);
    b.dv = ptr(dv);
    return b;
  }
  NsaFwdParams fwd_params() { return nsa_fwd_params(case_, buffers(), Device{}); }
  NsaBwdParams bwd_params() { return nsa_bwd_params(case_, buffers(), Device{}); }
  // The problems validation makes of the host params: what the reference (the oracle) takes.
  NsaProblem problem() { return api::validate_nsa_fwd(fwd_params()); }
  NsaBwdProblem bwd_problem() { return api::validate_nsa_bwd(bwd_params()); }

  // The value of 16-bit element `offset` of `buffer` (an input or output of this case).
  float value(const std::vector<uint16_t>& buffer, int64_t offset) const {
    return bits_to_float(case_.dtype, buffer[offset]);
  }

  NsaInputs in;
  std::vector<uint16_t> out, dq, dk, dv;  // in the case's layout (q_offset / kv_offset)
  std::vector<float> lse;                 // [batch, heads_q, seqlen_q] (lse_offset)

 private:
  NsaCase case_;
};

// ------------------------------------------------------------------------------------------------
// One small case per rule
// ------------------------------------------------------------------------------------------------

// Small cases (at most a few million multiply-adds each) that together exercise every rule of
// nsa_params.h and every layout: distinct random blocks, duplicates, -1 padding, out-of-range
// indices, block_counts (in range, negative, past selected), future blocks under causal, seqlen_k
// not a multiple of block_size, seqlen_q above and below seqlen_k, GQA ratios 1, 4, 16 and 32,
// head dims 40 to 256, block sizes 16 to 256, up to kNsaMaxSelected slots, heads-major and padded
// q/k/v, strided selection arrays, a token with an empty selection, and empty problems.
inline std::vector<NsaCase> nsa_rule_cases() {
  std::vector<NsaCase> cases;
  auto add = [&](NsaCase c) {
    c.seed = cases.size() + 1;
    cases.push_back(std::move(c));
  };
  auto base = [](const char* name, DType dtype, int heads_q, int heads_kv, int head_dim,
                 int seqlen_q, int seqlen_k, int block_size, int selected) {
    NsaCase c;
    c.name = name;
    c.dtype = dtype;
    c.batch = 2;
    c.heads_q = heads_q;
    c.heads_kv = heads_kv;
    c.head_dim = head_dim;
    c.seqlen_q = seqlen_q;
    c.seqlen_k = seqlen_k;
    c.block_size = block_size;
    c.selected = selected;
    return c;
  };
  constexpr DType kBf16 = DType::kBFloat16;
  constexpr DType kFp16 = DType::kFloat16;
  {
    NsaCase c = base("distinct_blocks", kBf16, 4, 1, 64, 65, 200, 32, 4);  // GQA 4, 7 blocks
    c.own_block_first = false;
    add(c);
  }
  {
    NsaCase c = base("causal_future_blocks", kFp16, 4, 4, 40, 130, 130, 16, 8);  // MHA
    c.causal = true;
    add(c);
  }
  {
    NsaCase c = base("duplicates_and_padding", kBf16, 16, 1, 96, 33, 97, 32, 6);  // GQA 16
    c.mix = {0.3, 0.3, 0.0};
    c.causal = true;
    add(c);
  }
  {
    NsaCase c = base("out_of_range", kFp16, 32, 1, 128, 17, 80, 16, 8);  // GQA 32
    c.mix = {0.1, 0.1, 0.4};
    add(c);
  }
  {
    NsaCase c = base("counts_mixed", kBf16, 8, 2, 256, 40, 100, 48, 5);
    c.counts = CountsKind::kMixed;
    c.mix = {0.2, 0.1, 0.1};
    c.causal = true;
    add(c);
  }
  {
    NsaCase c = base("more_queries_than_keys", kFp16, 4, 2, 64, 90, 37, 16, 4);
    c.causal = true;  // the first 53 tokens see no key
    c.counts = CountsKind::kInRange;
    add(c);
  }
  {
    NsaCase c = base("heads_major_strided", kBf16, 8, 2, 64, 50, 77, 16, 7);
    c.heads_major = true;
    c.dim_pad = 8;
    c.strided_indices = true;
    c.counts = CountsKind::kMixed;
    c.mix = {0.2, 0.2, 0.1};
    c.causal = true;
    add(c);
  }
  {
    NsaCase c = base("empty_token", kFp16, 4, 1, 64, 20, 64, 16, 3);
    c.empty_token = 3;
    add(c);
  }
  {
    NsaCase c = base("max_selected", kBf16, 2, 1, 64, 9, 300, 16, kNsaMaxSelected);
    c.mix = {0.3, 0.2, 0.2};
    c.counts = CountsKind::kMixed;
    add(c);
  }
  {
    NsaCase c = base("block_size_256", kFp16, 4, 2, 128, 30, 600, 256, 2);
    c.causal = true;
    c.softmax_scale = 0.2f;
    add(c);
  }
  {
    NsaCase c = base("peaky_rows", kBf16, 4, 1, 64, 24, 160, 32, 3);
    c.q_scale = 4.0f;
    add(c);
  }
  {
    NsaCase c = base("one_key", kFp16, 2, 1, 64, 5, 1, 16, 2);
    c.causal = true;  // only the last token sees key 0
    add(c);
  }
  add(base("no_keys", kBf16, 4, 2, 64, 6, 0, 16, 2));
  add(base("no_queries", kFp16, 4, 2, 64, 0, 40, 16, 2));
  {
    NsaCase c = base("empty_batch", kBf16, 4, 2, 64, 8, 40, 16, 2);
    c.batch = 0;
    add(c);
  }
  return cases;
}

}  // namespace flashkit::test
