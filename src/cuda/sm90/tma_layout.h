// src/cuda/sm90/tma_layout.h
// \brief Whether the copy engine (TMA) can read a strided 16-bit tensor of the API's layouts; plain
// C++ (the dispatcher asks before choosing the sm90 kernels, which load through tensor maps).
#pragma once

#include <cstdint>
#include <string>

namespace flashkit::sm90 {

// A [batch][rows][heads][head_dim] tensor (or [total][heads][head_dim] when varlen: the batch
// stride is not used) as the kernels' tensor maps see it.
struct TmaTensorLayout {
  const char* name;
  const void* data;
  int64_t rows, heads, batch;
  int64_t row_stride, head_stride, batch_stride;  // elements
};

// Why the copy engine cannot read `t` (its base not 16-byte aligned, or a stride that is not a
// positive multiple of 16 bytes below 2^40), or "". A tensor without rows is never read: "".
std::string tma_layout_problem(const TmaTensorLayout& t, bool varlen);

}  // namespace flashkit::sm90
