// src/cuda/sm90/tma_layout.cpp
// \brief See tma_layout.h.
#include "cuda/sm90/tma_layout.h"

namespace flashkit::sm90 {
namespace {

// A dim of extent 1 has no stride to check.
std::string stride_problem(const char* tensor, const char* dim, int64_t extent, int64_t stride) {
  if (extent == 1) return "";
  if (stride <= 0 || stride % 8 != 0 || stride * 2 >= (int64_t{1} << 40)) {
    return std::string(tensor) + " " + dim + " stride " + std::to_string(stride) +
           " is not a positive multiple of 8 elements (16 bytes) below 2^39";
  }
  return "";
}

}  // namespace

std::string tma_layout_problem(const TmaTensorLayout& t, bool varlen) {
  if (t.rows <= 0) return "";
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return std::string(t.name) + " is not 16-byte aligned";
  std::string why = stride_problem(t.name, "row", t.rows, t.row_stride);
  if (why.empty()) why = stride_problem(t.name, "head", t.heads, t.head_stride);
  if (why.empty() && !varlen) why = stride_problem(t.name, "batch", t.batch, t.batch_stride);
  return why;
}

}  // namespace flashkit::sm90
