// src/cuda/sm90/tensor_map.h
// \brief Host side of the bulk tensor copy engine: the CUtensorMap of a strided tensor of 16-bit
// elements, tiled in boxes of 64 elements (128 bytes: the 128-byte swizzle atom) by `box_rows` rows,
// and of an fp32 one, tiled in boxes of 32; and the maps of the API's q / k / v / out / dout layouts
// that the sm90 kernels load and store through.
//
// cuTensorMapEncodeTiled is a driver API function; it is fetched through the runtime's driver
// entry point, so flashkit does not link libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/fwd_problem.h"

namespace flashkit::sm90 {

// The 16-bit elements of the 128-byte swizzle atom's row, and so of one box's inner extent.
constexpr int kSwizzleAtomElements = 64;

// A tensor of `rank` (2..5) dims, innermost first: extents in elements, the byte strides of dims
// 1..rank-1 (dim 0 is contiguous).
struct StridedTensor {
  const void* base = nullptr;
  int rank = 0;
  uint64_t extents[5] = {};
  uint64_t byte_strides[4] = {};  // byte_strides[i] is the stride of dim i + 1
};

// Encodes the map of a 16-bit tensor, in boxes of kSwizzleAtomElements x box_rows x 1 x ..., with
// 128-byte swizzle and zero fill out of bounds. `bf16` picks the element type. Throws
// flashkit::Error naming `what` when the driver refuses it (alignment, strides).
CUtensorMap encode_tensor_map(const StridedTensor& tensor, bool bf16, int box_rows,
                              const char* what);

// The map of an fp32 tensor with 128-byte swizzle and boxes of box[i] elements per dim (box[0] at
// most 32: one swizzle row). The sm90 backward adds its dQ parts to the fp32 dQ accumulator through
// it. Throws as above.
CUtensorMap encode_fp32_tensor_map(const StridedTensor& tensor, const uint32_t* box, const char* what);

// The tensor map of q, k, v or out: [D, seqlen, heads, batch] (fixed) or [D, total, heads] (varlen),
// tiled in 64 x box_rows boxes. The driver wants every extent >= 1 and every stride a positive
// multiple of 16 bytes: a tensor with no rows (no keys at all: nothing is ever loaded, and its
// strides may be 0) gets a map of one row, and a dim of extent 1, whose stride is never used and may
// be anything, gets the span of the dims inside it when its own stride does not qualify.
CUtensorMap input_tensor_map(const FwdProblem& p, const void* base, int64_t rows, int heads, int64_t row_stride,
                             int64_t head_stride, int64_t batch_stride, int box_rows, const char* what);

// The map of q or out with each kv head's `group` query heads side by side in a box (the sm90
// forward's packed query heads): [D, group, seqlen, heads / group, batch] (fixed) or [D, group,
// total, heads / group] (varlen), in boxes of 64 x group x box_tokens, whose group x box_tokens
// rows land in shared memory in the order (token, head in group): row r of a box is token r / group
// of head r % group. `group` divides heads; group 1 is the plain layout of input_tensor_map with a
// dim of extent 1 more. The same rules for empty tensors and dims of extent 1.
CUtensorMap grouped_rows_tensor_map(const FwdProblem& p, const void* base, int64_t rows, int heads, int group,
                                    int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_tokens,
                                    const char* what);

}  // namespace flashkit::sm90
