// tests/cpp/test_gpu_sm90_blocks.cu
// \brief GPU unit tests of the sm90 building blocks (src/cuda/sm90/), each against a CPU
// computation: wgmma with A and B from shared memory (K-major, several column blocks), wgmma with A
// from registers and B MN-major, the bulk tensor copy (TMA) of a 4-D tensor with zero fill past its
// end, streamed through an mbarrier ring (full/empty phases) by a producer warp to a consumer
// warpgroup after setmaxnreg, an accumulator staged with stmatrix and TMA-stored with clipping,
// named barriers and the non-blocking mbarrier test. Compiled for sm_90a only (its own object
// library); every test skips itself unless a compute capability 9.0 device is present, except the
// host-side coverage rules (Sm90Coverage), which need no GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/bwd_problem.h"
#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "cuda/sm90/bwd_sm90.h"
#include "cuda/sm90/fwd_sm90.h"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tensor_map.h"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/warpgroup.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace flashkit::sm90 {
namespace {

#define SM90_CHECK(call)                                                                  \
  do {                                                                                    \
    const cudaError_t code_ = (call);                                                     \
    ASSERT_EQ(code_, cudaSuccess) << #call << ": " << cudaGetErrorString(code_);          \
  } while (0)

bool has_hopper() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9 && prop.minor == 0;
}

class GpuSm90BlocksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_hopper()) GTEST_SKIP() << "no compute capability 9.0 device";
  }
};

// Random 16-bit values (small integers / 8, exact in both types, so products sum exactly in fp32).
std::vector<uint16_t> random_bits(DType dtype, size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-8, 8);
  std::vector<uint16_t> bits(n);
  for (auto& b : bits) b = float_to_bits(dtype, static_cast<float>(dist(gen)) / 8.0f);
  return bits;
}

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(size_t n) { cudaMalloc(&ptr, n * sizeof(T)); }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<T> download(size_t n) const {
    std::vector<T> host(n);
    cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
};

// Copies a row-major [kRows x kCols] matrix from global memory into a Swizzle128Tile, as the copy
// engine would lay it out, with ordinary stores (then the proxy fence for the tensor cores).
template <int kRows, int kCols>
__device__ void fill_tile(uint32_t tile, const uint16_t* src) {
  using Tile = Swizzle128Tile<kRows, kCols>;
  for (int i = threadIdx.x; i < kRows * kCols / 8; i += blockDim.x) {
    const int row = i / (kCols / 8);
    const int chunk = i % (kCols / 8);
    const uint4 value = *reinterpret_cast<const uint4*>(src + row * kCols + chunk * 8);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + Tile::chunk_offset(row, chunk)),
                 "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w));
  }
  fence_proxy_async_shared();
  __syncthreads();
}

// Writes the m64nN fp32 accumulator of one warpgroup to a row-major [64 x N] matrix.
template <int N>
__device__ void store_accumulator(const float* d, float* c) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int j = 0; j < N / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = warp * 16 + lane / 4 + (i / 2) * 8;
      const int col = j * 8 + (lane % 4) * 2 + i % 2;
      c[row * N + col] = d[4 * j + i];
    }
  }
}

// C [64 x N] = A [64 x K] * B^T, B [N x K]: both K-major in shared memory.
template <typename Element, int N, int K>
__global__ void wgmma_ss_kernel(const uint16_t* a, const uint16_t* b, float* c) {
  using ATile = Swizzle128Tile<64, K>;
  using BTile = Swizzle128Tile<N, K>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t sa = smem_u32(smem);
  const uint32_t sb = sa + ATile::kBytes;
  fill_tile<64, K>(sa, a);
  fill_tile<N, K>(sb, b);
  float d[N / 2];
  wgmma_fence();
  // The kernels' own issue loop (descriptors per k-step; committed).
  issue_k_major_product<Element, N, K, ATile::kColumnBlockBytes, BTile::kColumnBlockBytes>(d, sa, sb);
  wgmma_wait<0>();
  wgmma_fence_registers<N / 2>(d);
  store_accumulator<N>(d, c);
}

// C [64 x N] = A [64 x K] * B, A from registers (loaded as mma.sync A fragments), B [K x N]
// MN-major in shared memory.
template <typename Element, int N, int K>
__global__ void wgmma_rs_kernel(const uint16_t* a, const uint16_t* b, float* c) {
  using BTile = Swizzle128Tile<K, N>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t sb = smem_u32(smem);
  fill_tile<K, N>(sb, b);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int row = warp * 16 + lane / 4;
  const int col = (lane % 4) * 2;
  auto pair = [&](int r, int k) {
    return static_cast<uint32_t>(a[r * K + k]) | (static_cast<uint32_t>(a[r * K + k + 1]) << 16);
  };
  // All A fragments are loaded before the first wgmma: registers written between the products of
  // one batch would make ptxas serialize them (warning C7519).
  uint32_t frag[K / 16][4];
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    frag[kk][0] = pair(row, kk * 16 + col);
    frag[kk][1] = pair(row + 8, kk * 16 + col);
    frag[kk][2] = pair(row, kk * 16 + col + 8);
    frag[kk][3] = pair(row + 8, kk * 16 + col + 8);
  }
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  wgmma_fence();
  issue_register_product<Element, N, K, BTile::kColumnBlockBytes>(d, frag, sb);  // the kernels' own loop
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_registers<N / 2>(d);
  store_accumulator<N>(d, c);
}

void expect_matrix_eq(const std::vector<float>& got, const std::vector<double>& want, int cols,
                      const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != static_cast<float>(want[i]) && ++bad <= 5) {
      ADD_FAILURE() << what << ": C[" << i / cols << "][" << i % cols << "] = " << got[i]
                    << ", expected " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " wrong elements";
}

template <typename Element, int N, int K>
void run_ss(DType dtype) {
  const auto a = random_bits(dtype, 64 * K, 1);
  const auto b = random_bits(dtype, N * K, 2);
  DeviceArray<uint16_t> da(a), db(b);
  DeviceArray<float> dc(64 * N);
  const int smem = (64 + N) * K * 2;
  auto kernel = wgmma_ss_kernel<Element, N, K>;
  SM90_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<1, 128, smem>>>(da.ptr, db.ptr, dc.ptr);
  SM90_CHECK(cudaDeviceSynchronize());
  std::vector<double> want(64 * N, 0.0);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        want[m * N + n] += static_cast<double>(bits_to_float(dtype, a[m * K + k])) *
                           bits_to_float(dtype, b[n * K + k]);
  expect_matrix_eq(dc.download(64 * N), want, N,
                   "SS m64n" + std::to_string(N) + " K=" + std::to_string(K));
}

template <typename Element, int N, int K>
void run_rs(DType dtype) {
  const auto a = random_bits(dtype, 64 * K, 3);
  const auto b = random_bits(dtype, K * N, 4);
  DeviceArray<uint16_t> da(a), db(b);
  DeviceArray<float> dc(64 * N);
  const int smem = K * N * 2;
  auto kernel = wgmma_rs_kernel<Element, N, K>;
  SM90_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<1, 128, smem>>>(da.ptr, db.ptr, dc.ptr);
  SM90_CHECK(cudaDeviceSynchronize());
  std::vector<double> want(64 * N, 0.0);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        want[m * N + n] += static_cast<double>(bits_to_float(dtype, a[m * K + k])) *
                           bits_to_float(dtype, b[k * N + n]);
  expect_matrix_eq(dc.download(64 * N), want, N,
                   "RS m64n" + std::to_string(N) + " K=" + std::to_string(K));
}

TEST_F(GpuSm90BlocksTest, WgmmaSharedKMajorBf16) {
  run_ss<__nv_bfloat16, 128, 128>(DType::kBFloat16);
  run_ss<__nv_bfloat16, 80, 256>(DType::kBFloat16);
  run_ss<__nv_bfloat16, 64, 64>(DType::kBFloat16);
}

TEST_F(GpuSm90BlocksTest, WgmmaSharedKMajorFp16) { run_ss<__half, 128, 128>(DType::kFloat16); }

TEST_F(GpuSm90BlocksTest, WgmmaRegistersAMnMajorB) {
  run_rs<__nv_bfloat16, 128, 128>(DType::kBFloat16);
  run_rs<__nv_bfloat16, 256, 80>(DType::kBFloat16);
  run_rs<__half, 64, 128>(DType::kFloat16);
}

// The TMA ring: a producer warp (24 registers after setmaxnreg) streams the row blocks of one
// (head, batch) slice of a [batch, seqlen, heads, 128] tensor through kStages stages; a consumer
// warpgroup (240 registers) copies each stage back out, un-swizzled, then frees it. The last block
// reaches past seqlen and must arrive zero-filled.
constexpr int kRingStages = 2;
constexpr int kRingRows = 64;
constexpr int kRingCols = 128;
using RingTile = Swizzle128Tile<kRingRows, kRingCols>;

struct RingBarriers {
  uint64_t full[kRingStages];
  uint64_t empty[kRingStages];
};

__global__ void __launch_bounds__(256, 1)
    tma_ring_kernel(const __grid_constant__ CUtensorMap map, int blocks, int head, int batch,
                    uint16_t* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t tiles = smem_u32(smem);
  auto& bars = *reinterpret_cast<RingBarriers*>(smem + kRingStages * RingTile::kBytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      mbarrier_init(smem_u32(&bars.full[s]), 1);
      mbarrier_init(smem_u32(&bars.empty[s]), 4);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < kWarpgroupThreads) {
    warpgroup_release_registers<24>();
    if (threadIdx.x < 32) {
      RingCursor<kRingStages> cursor;
      for (int block = 0; block < blocks; ++block) {
        mbarrier_wait(smem_u32(&bars.empty[cursor.stage]), cursor.phase ^ 1u);
        if (threadIdx.x == 0) {
          const uint32_t full = smem_u32(&bars.full[cursor.stage]);
          mbarrier_arrive_expect_tx(full, RingTile::kBytes);
          for (int cb = 0; cb < RingTile::kColumnBlocks; ++cb) {
            tma_load_4d(tiles + cursor.stage * RingTile::kBytes + cb * RingTile::kColumnBlockBytes,
                        map, full, cb * kSwizzleAtomElements, block * kRingRows, head, batch);
          }
        }
        cursor.advance();
      }
    }
  } else {
    warpgroup_claim_registers<240>();
    const int thread = threadIdx.x - kWarpgroupThreads;
    RingCursor<kRingStages> cursor;
    for (int block = 0; block < blocks; ++block) {
      mbarrier_wait(smem_u32(&bars.full[cursor.stage]), cursor.phase);
      const uint32_t tile = tiles + cursor.stage * RingTile::kBytes;
      for (int i = thread; i < kRingRows * kRingCols / 8; i += kWarpgroupThreads) {
        const int row = i / (kRingCols / 8);
        const int chunk = i % (kRingCols / 8);
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(tile + RingTile::chunk_offset(row, chunk)));
        *reinterpret_cast<uint4*>(out + (static_cast<size_t>(block) * kRingRows + row) * kRingCols + chunk * 8) = v;
      }
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbarrier_arrive(smem_u32(&bars.empty[cursor.stage]));
      cursor.advance();
    }
  }
}

// A contiguous [batch, seqlen, heads, stored] tensor of 16-bit elements at `base`, described to the
// copy engine with `cols` <= stored columns per row.
StridedTensor bshd_tensor(void* base, int batch, int seqlen, int heads, int stored, int cols) {
  StridedTensor t;
  t.base = base;
  t.rank = 4;
  t.extents[0] = cols;
  t.extents[1] = seqlen;
  t.extents[2] = heads;
  t.extents[3] = batch;
  t.byte_strides[0] = static_cast<uint64_t>(heads) * stored * 2;
  t.byte_strides[1] = static_cast<uint64_t>(stored) * 2;
  t.byte_strides[2] = static_cast<uint64_t>(seqlen) * heads * stored * 2;
  return t;
}

// `cols` valid columns of the 128 stored per row: boxes reaching past them (partly, or wholly for
// cols <= 64) must arrive zero-filled, as the forward's padded head dims rely on.
void run_tma_ring(int cols) {
  const int batch = 2, seqlen = 300, heads = 3, head = 2, b = 1;
  const int blocks = (seqlen + kRingRows - 1) / kRingRows;  // 5: the last one is 44 rows
  const auto x = random_bits(DType::kBFloat16, static_cast<size_t>(batch) * seqlen * heads * kRingCols, 5);
  DeviceArray<uint16_t> dx(x);
  DeviceArray<uint16_t> dout(static_cast<size_t>(blocks) * kRingRows * kRingCols);
  const CUtensorMap map =
      encode_tensor_map(bshd_tensor(dx.ptr, batch, seqlen, heads, kRingCols, cols), true, kRingRows, "test tensor");
  const int smem = kRingStages * RingTile::kBytes + static_cast<int>(sizeof(RingBarriers));
  SM90_CHECK(cudaFuncSetAttribute(tma_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tma_ring_kernel<<<1, 256, smem>>>(map, blocks, head, b, dout.ptr);
  SM90_CHECK(cudaDeviceSynchronize());
  const auto got = dout.download(static_cast<size_t>(blocks) * kRingRows * kRingCols);
  int bad = 0;
  for (int row = 0; row < blocks * kRingRows; ++row) {
    for (int col = 0; col < kRingCols; ++col) {
      const uint16_t want =
          row < seqlen && col < cols
              ? x[((static_cast<size_t>(b) * seqlen + row) * heads + head) * kRingCols + col]
              : 0;
      if (got[static_cast<size_t>(row) * kRingCols + col] != want && ++bad <= 5) {
        ADD_FAILURE() << cols << " columns: row " << row << " col " << col << ": got bits "
                      << got[static_cast<size_t>(row) * kRingCols + col] << ", expected " << want;
      }
    }
  }
  EXPECT_EQ(bad, 0) << cols << " columns";
}

TEST_F(GpuSm90BlocksTest, TmaTilesThroughMbarrierRing) { run_tma_ring(kRingCols); }

TEST_F(GpuSm90BlocksTest, TmaZeroFillsColumnsPastTheTensor) {
  run_tma_ring(96);
  run_tma_ring(40);
}

// The staged epilogue's path: a warpgroup writes an m64 x kCols accumulator (value v(row, col)) as
// 16-bit elements into a Swizzle128Tile with stmatrix (store_accumulator_tile), then one thread TMA-
// stores it at row `row0` of one (head, batch) slice of a [batch, seqlen, heads, kCols] tensor whose
// map has `cols` columns: rows past seqlen and columns past `cols` must be clipped, the rest of the
// tensor untouched.
__host__ __device__ float staged_value(int row, int col) {
  return static_cast<float>((row * 131 + col * 7) % 251 - 125) / 4.0f;  // exact in bf16 and fp16
}

template <typename Element, int kCols>
__global__ void __launch_bounds__(128, 1)
    tma_store_kernel(const __grid_constant__ CUtensorMap map, int row0, int head, int batch) {
  using Tile = Swizzle128Tile<64, kCols>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t tile = smem_u32(smem);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float acc[kCols / 2];
  for (int j = 0; j < kCols / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      acc[4 * j + i] = staged_value(warp * 16 + lane / 4 + (i / 2) * 8, j * 8 + (lane % 4) * 2 + i % 2);
    }
  }
  store_accumulator_tile<Element, kCols>(acc, tile, warp);
  fence_proxy_async_shared();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int cb = 0; cb < Tile::kColumnBlocks; ++cb) {
      tma_store_4d(map, tile + cb * Tile::kColumnBlockBytes, cb * kSwizzleAtomElements, row0, head, batch);
    }
    tma_store_commit();
    tma_store_wait_read<0>();
  }
}

template <typename Element, int kCols>
void run_tma_store(DType dtype, int cols, int row0) {
  const int batch = 2, seqlen = 100, heads = 3, head = 1, b = 1;
  const uint16_t kUntouched = 0x7FBF;  // a NaN pattern neither store can produce
  const size_t n = static_cast<size_t>(batch) * seqlen * heads * kCols;
  DeviceArray<uint16_t> dout(std::vector<uint16_t>(n, kUntouched));
  const CUtensorMap map = encode_tensor_map(bshd_tensor(dout.ptr, batch, seqlen, heads, kCols, cols),
                                            dtype == DType::kBFloat16, 64, "test tensor");
  const int smem = Swizzle128Tile<64, kCols>::kBytes;
  SM90_CHECK(cudaFuncSetAttribute(tma_store_kernel<Element, kCols>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tma_store_kernel<Element, kCols><<<1, 128, smem>>>(map, row0, head, b);
  SM90_CHECK(cudaDeviceSynchronize());
  const auto got = dout.download(n);
  int bad = 0;
  for (int bb = 0; bb < batch; ++bb) {
    for (int row = 0; row < seqlen; ++row) {
      for (int h = 0; h < heads; ++h) {
        for (int col = 0; col < kCols; ++col) {
          const bool written = bb == b && h == head && row >= row0 && row < row0 + 64 && col < cols;
          const uint16_t want = written ? float_to_bits(dtype, staged_value(row - row0, col)) : kUntouched;
          const uint16_t have = got[((static_cast<size_t>(bb) * seqlen + row) * heads + h) * kCols + col];
          if (have != want && ++bad <= 5) {
            ADD_FAILURE() << kCols << " x " << cols << " columns from row " << row0 << ": batch " << bb
                          << " row " << row << " head " << h << " col " << col << ": got bits " << have
                          << ", expected " << want;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << kCols << " x " << cols << " columns from row " << row0;
}

TEST_F(GpuSm90BlocksTest, StmatrixTileThroughTmaStoreClipsToTheTensor) {
  run_tma_store<__nv_bfloat16, 128>(DType::kBFloat16, 128, 0);
  run_tma_store<__nv_bfloat16, 128>(DType::kBFloat16, 72, 64);  // rows 100..127 and columns 72.. clipped
  run_tma_store<__half, 64>(DType::kFloat16, 64, 36);           // ends exactly at seqlen
  run_tma_store<__half, 256>(DType::kFloat16, 200, 50);
}

// Named barriers as the sm90 forward uses them (ConsumerTurn): two warps take turns, one passing the
// turn with bar.arrive, the other waiting for it with bar.sync, and back on a second barrier. At its
// turn each warp's first lane takes a ticket from a counter in global memory; the tickets show the
// order of the turns, which must alternate: warp 0's turn r takes 2r, warp 1's 2r + 1. (Tickets, not
// a value handed over in shared memory: the kernels pass turns with these barriers, never data, and
// compute-sanitizer's racecheck, which does not follow an arrive / sync pair, reported such a value
// as a race.)
enum class TestBarrier : uint32_t { kPublished = kFirstNamedBarrier, kConsumed };

__global__ void named_barrier_kernel(int rounds, int* tickets, int* counter) {
  const int warp = threadIdx.x / 32;
  for (int round = 0; round < rounds; ++round) {
    if (warp == 0) {
      if (round > 0) named_barrier_sync(TestBarrier::kConsumed, 64);
      if (threadIdx.x == 0) tickets[2 * round] = atomicAdd(counter, 1);
      named_barrier_arrive(TestBarrier::kPublished, 64);
    } else {
      named_barrier_sync(TestBarrier::kPublished, 64);
      if (threadIdx.x == 32) tickets[2 * round + 1] = atomicAdd(counter, 1);
      if (round + 1 < rounds) named_barrier_arrive(TestBarrier::kConsumed, 64);
    }
  }
}

TEST_F(GpuSm90BlocksTest, NamedBarriersPassTurns) {
  const int rounds = 16;
  DeviceArray<int> dtickets(2 * rounds);
  DeviceArray<int> dcounter(1);
  SM90_CHECK(cudaMemset(dcounter.ptr, 0, sizeof(int)));
  named_barrier_kernel<<<1, 64>>>(rounds, dtickets.ptr, dcounter.ptr);
  SM90_CHECK(cudaDeviceSynchronize());
  const auto got = dtickets.download(2 * rounds);
  for (int t = 0; t < 2 * rounds; ++t) {
    EXPECT_EQ(got[t], t) << "warp " << t % 2 << ", turn " << t / 2 << ": ticket " << got[t];
  }
}

// mbarrier_test: a non-blocking test of a phase. Thread 0 initialises a barrier of two arrivals and
// records the test of phase 0 before any arrival, after one, after both, then the test of phase 1
// (not yet completed) and of phase 1 after two more arrivals; warp 1 supplies the arrivals in
// between (named barriers order the steps).
__global__ void mbarrier_test_kernel(int* out) {
  __shared__ uint64_t bar;
  const uint32_t address = smem_u32(&bar);
  const bool recorder = threadIdx.x == 0;
  const bool arriver = threadIdx.x == 32;
  if (recorder) {
    mbarrier_init(address, 2);
    mbarrier_init_fence();
  }
  __syncthreads();
  for (int step = 0; step < 5; ++step) {
    if (recorder) out[step] = mbarrier_test(address, step < 3 ? 0u : 1u) ? 1 : 0;
    __syncthreads();
    // Arrivals after steps 0 and 1 complete phase 0; after steps 3 (two) they complete phase 1.
    if (arriver && (step == 0 || step == 1)) mbarrier_arrive(address);
    if (arriver && step == 3) {
      mbarrier_arrive(address);
      mbarrier_arrive(address);
    }
    __syncthreads();
  }
}

TEST_F(GpuSm90BlocksTest, MbarrierTestDoesNotBlock) {
  DeviceArray<int> dout(5);
  mbarrier_test_kernel<<<1, 64>>>(dout.ptr);
  SM90_CHECK(cudaDeviceSynchronize());
  const auto got = dout.download(5);
  // Phase 0: open, open (one of two arrivals), completed; phase 1: open, completed.
  const std::vector<int> want = {0, 0, 1, 0, 1};
  for (int step = 0; step < 5; ++step) EXPECT_EQ(got[step], want[step]) << "step " << step;
}

// A contiguous [batch, seqlen, heads, head_dim] bf16 problem with 16-byte aligned (fake) pointers;
// the coverage rules read only shapes, strides and addresses.
FwdProblem contiguous_problem(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim) {
  FwdProblem p;
  p.batch = batch;
  p.heads_q = heads;
  p.heads_kv = heads;
  p.head_dim = head_dim;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.q = p.k = p.v = p.out = reinterpret_cast<void*>(uintptr_t{1} << 20);
  const int64_t row = static_cast<int64_t>(heads) * head_dim;
  p.q_row_stride = p.out_row_stride = p.k_row_stride = p.v_row_stride = row;
  p.q_head_stride = p.out_head_stride = p.k_head_stride = p.v_head_stride = head_dim;
  p.q_batch_stride = p.out_batch_stride = row * seqlen_q;
  p.k_batch_stride = p.v_batch_stride = row * seqlen_k;
  return p;
}

TEST(Sm90Coverage, HeadDimsRoundUpToTheFamilies) {
  for (int d = 8; d <= 256; d += 8) {
    EXPECT_EQ(fwd_head_dim_family(d), d <= 64 ? 64 : d <= 128 ? 128 : 256) << "head dim " << d;
  }
  EXPECT_EQ(fwd_head_dim_family(264), -1);
}

TEST(Sm90Coverage, BroadcastKeysRunOnSm80AndNoKeysRunOnSm90) {
  EXPECT_EQ(fwd_unsupported_reason(contiguous_problem(2, 300, 500, 4, 128)), "");
  FwdProblem broadcast = contiguous_problem(2, 300, 500, 4, 128);
  broadcast.k_batch_stride = 0;  // one k for the whole batch
  EXPECT_NE(fwd_unsupported_reason(broadcast).find("k batch stride 0"), std::string::npos)
      << fwd_unsupported_reason(broadcast);
  // seqlen_k = 0: k and v are never read, and their contiguous batch stride is 0.
  EXPECT_EQ(fwd_unsupported_reason(contiguous_problem(2, 300, 0, 4, 128)), "");
  // A dim of extent 1 has no stride to check.
  FwdProblem one_head = contiguous_problem(2, 300, 500, 1, 64);
  one_head.k_head_stride = 0;
  EXPECT_EQ(fwd_unsupported_reason(one_head), "");
}

// Dropout runs on sm90; return_softmax (attn_probs) stays on the sm80 path, which writes it.
TEST(Sm90Coverage, DropoutRunsOnSm90AndAttnProbsOnSm80) {
  FwdProblem dropout = contiguous_problem(2, 300, 500, 4, 128);
  dropout.dropout_p = 0.1f;
  EXPECT_EQ(fwd_unsupported_reason(dropout), "");
  uint16_t probs = 0;
  dropout.attn_probs = &probs;
  EXPECT_NE(fwd_unsupported_reason(dropout).find("attn_probs"), std::string::npos)
      << fwd_unsupported_reason(dropout);
}

// The sm90 backward loads q and dout through tensor maps: a dout the copy engine cannot read (a row
// stride that is not a multiple of 16 bytes, an unaligned base) sends the problem to the sm80 path.
TEST(Sm90Coverage, BackwardNeedsQAndDoutTheCopyEngineReads) {
  BwdProblem bp;
  bp.fwd = contiguous_problem(2, 300, 500, 4, 128);
  bp.dout = bp.fwd.q;
  bp.dout_row_stride = bp.fwd.q_row_stride;
  bp.dout_head_stride = bp.fwd.q_head_stride;
  bp.dout_batch_stride = bp.fwd.q_batch_stride;
  EXPECT_EQ(bwd_unsupported_reason(bp), "");
  BwdProblem odd_rows = bp;
  odd_rows.dout_row_stride += 4;  // 8 bytes past a multiple of 16
  EXPECT_NE(bwd_unsupported_reason(odd_rows).find("dout row stride"), std::string::npos)
      << bwd_unsupported_reason(odd_rows);
  BwdProblem unaligned = bp;
  unaligned.dout = static_cast<const char*>(bp.dout) + 8;
  EXPECT_NE(bwd_unsupported_reason(unaligned).find("dout is not 16-byte aligned"), std::string::npos)
      << bwd_unsupported_reason(unaligned);
  BwdProblem q_heads = bp;
  q_heads.fwd.q_head_stride = 132;  // 264 bytes
  EXPECT_NE(bwd_unsupported_reason(q_heads).find("q head stride"), std::string::npos)
      << bwd_unsupported_reason(q_heads);
}

}  // namespace
}  // namespace flashkit::sm90
