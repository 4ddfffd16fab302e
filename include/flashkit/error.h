// flashkit/error.h
// \brief The one exception flashkit throws for bad input, unsupported features and CUDA failures.
//
// Every message names the argument, the value it got and what is supported, e.g.
//   "mha_fwd: k.dtype is float16 but q.dtype is bfloat16; q, k and v must share one dtype".
// A thrown Error leaves the library ready for the next call: nothing is launched before validation.
#pragma once

#include <stdexcept>
#include <string>

namespace flashkit {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace flashkit
