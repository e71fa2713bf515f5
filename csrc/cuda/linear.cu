// Launchers of linear and embedding. Three kernels, chosen by named predicates:
//   use_gemv_tc:    decode (T <= 4), 4/8-bit affine with BF16 scales, groups of whole 32-byte
//                   steps -> kernels/linear_gemv_tc.cuh (tensor cores)
//   use_gemv:       other decode shapes (T <= 8), same variants -> kernels/linear_gemv.cuh
//   use_tensor_gemm: larger T, same variants, 16-byte aligned operands -> kernels/linear_gemm.cuh
//   otherwise the generic kernel (every variant, any shape)          -> kernels/linear_generic.cuh
#include <algorithm>
#include <cstdint>

#include "cuda_ops.h"
#include "kernels/linear_gemm.cuh"
#include "kernels/linear_gemv.cuh"
#include "kernels/linear_gemv_tc.cuh"
#include "kernels/linear_generic.cuh"
#include "linear.cuh"
#include "runtime.cuh"

namespace lily::cuda {

static_assert(LINEAR_TILE_ROWS == GEMM_BM && LINEAR_TILE_ROWS == GENERIC_TILE_ROWS,
              "MoE tile maps assume one tile height for every linear kernel");

constexpr int GEMV_MAX_TOKENS = 8;

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

WeightView weight_view(const QMatrix& w) {
  WeightView v;
  v.w = w.weight.data();
  v.scales = w.scales.data();
  v.biases = w.biases.data();
  v.rows = w.rows;
  v.cols = w.cols;
  v.bits = w.bits;
  v.group_size = w.group_size;
  v.dtype = w.dtype;
  v.scale_dtype = w.scale_dtype;
  return v;
}

bool is_fast_affine(const WeightView& w) {
  return (w.bits == 4 || w.bits == 8) && w.scale_dtype == DType::BF16 && w.cols % 32 == 0 && is_aligned16(w.w);
}

static size_t gemv_smem_bytes(int num_tokens, int64_t cols, int bits) {
  return size_t(num_tokens) * (cols * 4 + cols / (128 / bits) * 4);
}

static int gemv_tokens(int64_t T) { return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8; }

static bool use_gemv(const WeightView& w, const Tensor& x) {
  const int64_t T = x.dim(0);
  return T <= GEMV_MAX_TOKENS && is_fast_affine(w) && is_aligned16(x.data) &&
         gemv_smem_bytes(gemv_tokens(T), w.cols, w.bits) <= GEMV_MAX_SMEM;
}

static bool use_tensor_gemm(const LinearArgs& a) {
  return is_fast_affine(a.w) && a.ldx % 4 == 0 && is_aligned16(a.x);
}

// The power of two covering a row's 16-byte chunks in one step, at most a CTA.
int gemv_tpr(int64_t chunks) {
  int tpr = 1;
  while (tpr < chunks && tpr < GEMV_THREADS) tpr *= 2;
  return tpr;
}

// CTAs for `passes` units of work: as many as fit on the device at once, spread evenly so that no
// CTA runs one pass more than the others when a second round is needed.
int gemv_grid(const void* kernel, size_t smem, int64_t passes) {
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, GEMV_THREADS, smem));
  const int64_t resident = int64_t(num_sms()) * std::max(per_sm, 1);
  const int64_t rounds = std::max<int64_t>(1, ceil_div<int64_t>(passes, resident));
  return int(ceil_div<int64_t>(passes, rounds));
}

template <int BITS, int NT>
static void launch_gemv(GemvParams p) {
  const size_t smem = gemv_smem_bytes(NT, p.cols, BITS);
  static const bool configured = [] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(linear_gemv_kernel<BITS, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(GEMV_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  p.tpr = gemv_tpr(p.cols / (128 / BITS));
  p.num_passes = ceil_div(p.rows, (GEMV_THREADS / p.tpr) * GemvTiling<NT>::R);
  const int grid = gemv_grid(reinterpret_cast<const void*>(linear_gemv_kernel<BITS, NT>), smem, p.num_passes);
  linear_gemv_kernel<BITS, NT><<<grid, GEMV_THREADS, smem, stream()>>>(p);
  LILY_CUDA_LAUNCHED();
}

// Steps a warp of linear_gemv_tc_kernel holds per tile (a power of two), 0 when over 8.
static int gemv_tc_steps(int64_t cols, int bits, int group_size) {
  const int64_t vq = 256 / bits, groups = cols / group_size, spg = group_size / vq;
  const int64_t need = ceil_div<int64_t>(groups, TC_WARPS) * spg;
  for (int sw = 1; sw <= 8; sw *= 2)
    if (need <= sw) return sw;
  return 0;
}

template <int BITS, int NT>
static size_t gemv_tc_smem(int64_t cols, int group_size) {
  return gemv_tc_smem_bytes<BITS, NT>(int(cols), group_size);
}

static bool use_gemv_tc(const WeightView& w, const Tensor& x) {
  const int64_t T = x.dim(0);
  if (T > 4 || !is_aligned16(x.data) || w.group_size % (256 / w.bits) != 0 || gemv_tc_steps(w.cols, w.bits, w.group_size) == 0) return false;
  const size_t smem = w.bits == 4 ? gemv_tc_smem<4, 4>(w.cols, w.group_size) : gemv_tc_smem<8, 4>(w.cols, w.group_size);
  return smem <= GEMV_MAX_SMEM;
}

template <int BITS, int NT, int SW>
static void launch_gemv_tc(const GemvTcParams& p) {
  const auto kernel = linear_gemv_tc_kernel<BITS, NT, SW>;
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GEMV_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  const size_t smem = gemv_tc_smem<BITS, NT>(p.x.cols, p.x.group_size);
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TC_THREADS, smem));
  const int64_t tiles = ceil_div<int64_t>(p.w.rows, TC_TILE_ROWS);
  const int grid = int(std::min<int64_t>(tiles, int64_t(num_sms()) * std::max(per_sm, 1)));
  kernel<<<grid, TC_THREADS, smem, stream()>>>(p);
  LILY_CUDA_LAUNCHED();
}

template <int BITS, int NT>
static void dispatch_gemv_tc_steps(const GemvTcParams& p) {
  switch (gemv_tc_steps(p.x.cols, BITS, p.x.group_size)) {
    case 1: return launch_gemv_tc<BITS, NT, 1>(p);
    case 2: return launch_gemv_tc<BITS, NT, 2>(p);
    case 4: return launch_gemv_tc<BITS, NT, 4>(p);
    case 8: return launch_gemv_tc<BITS, NT, 8>(p);
    default: fail("linear: unsupported tensor-core GEMV width ", p.x.cols);
  }
}

template <int BITS>
static void dispatch_gemv_tc(const GemvTcParams& p) {
  switch (gemv_tokens(p.x.T)) {
    case 1: return dispatch_gemv_tc_steps<BITS, 1>(p);
    case 2: return dispatch_gemv_tc_steps<BITS, 2>(p);
    case 4: return dispatch_gemv_tc_steps<BITS, 4>(p);
    default: fail("linear: unsupported tensor-core GEMV token count ", p.x.T);
  }
}

TcMatrix tc_matrix(const QMatrix& w, int64_t e) {
  return TcMatrix{static_cast<const uint32_t*>(w.weight.data()) + e * w.rows * w.words_per_row(),
                  static_cast<const uint16_t*>(w.scales.data()) + e * w.rows * w.groups_per_row(),
                  static_cast<const uint16_t*>(w.biases.data()) + e * w.rows * w.groups_per_row(), int(w.rows),
                  int(w.cols), w.group_size};
}

static void run_gemv_tc(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y) {
  GemvTcParams p;
  p.w = tc_matrix(w, e);
  p.x = TcX{x.ptr<float>(), w.cols, w.cols, int(w.cols), int(w.cols), int(x.dim(0)), w.group_size};
  p.y = y.ptr<float>();
  if (w.bits == 4) return dispatch_gemv_tc<4>(p);
  return dispatch_gemv_tc<8>(p);
}

template <int BITS>
static void dispatch_gemv_tokens(const GemvParams& p) {
  switch (gemv_tokens(p.T)) {
    case 1: return launch_gemv<BITS, 1>(p);
    case 2: return launch_gemv<BITS, 2>(p);
    case 4: return launch_gemv<BITS, 4>(p);
    case 8: return launch_gemv<BITS, 8>(p);
    default: fail("linear: unsupported GEMV token count ", p.T);
  }
}

static void run_gemv(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y) {
  GemvParams p;
  p.w = static_cast<const uint32_t*>(w.weight.data()) + e * w.rows * w.words_per_row();
  p.scales = static_cast<const uint16_t*>(w.scales.data()) + e * w.rows * w.groups_per_row();
  p.biases = static_cast<const uint16_t*>(w.biases.data()) + e * w.rows * w.groups_per_row();
  p.x = x.ptr<float>();
  p.y = y.ptr<float>();
  p.T = int(x.dim(0));
  p.rows = int(w.rows);
  p.cols = int(w.cols);
  p.group_size = w.group_size;
  switch (w.bits) {
    case 4: return dispatch_gemv_tokens<4>(p);
    case 8: return dispatch_gemv_tokens<8>(p);
    default: fail("linear: unsupported GEMV bits ", w.bits);
  }
}

template <int BITS>
static void launch_gemm(const LinearArgs& a, int64_t max_tiles) {
  static const bool configured = [] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(linear_gemm_kernel<BITS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         GEMM_SMEM_BYTES));
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(max_tiles), unsigned(ceil_div<int64_t>(a.w.rows, GEMM_BN)));
  linear_gemm_kernel<BITS><<<grid, GEMM_THREADS, GEMM_SMEM_BYTES, stream()>>>(a);
  LILY_CUDA_LAUNCHED();
}

void linear_tiles(const LinearArgs& a, int64_t max_tiles) {
  if (max_tiles <= 0 || a.w.rows == 0) return;
  LILY_CHECK(max_tiles <= INT32_MAX && ceil_div<int64_t>(a.w.rows, GENERIC_WARPS) <= 65535, "linear: ",
             a.w.rows, " outputs exceed the grid");
  if (use_tensor_gemm(a)) {
    switch (a.w.bits) {
      case 4: return launch_gemm<4>(a, max_tiles);
      case 8: return launch_gemm<8>(a, max_tiles);
      default: fail("linear: unsupported tensor-core bits ", a.w.bits);
    }
  }
  const dim3 grid(unsigned(max_tiles), unsigned(ceil_div<int64_t>(a.w.rows, GENERIC_WARPS)));
  linear_generic_kernel<<<grid, GENERIC_WARPS * 32, 0, stream()>>>(a);
  LILY_CUDA_LAUNCHED();
}

void linear(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y) {
  const int64_t T = x.dim(0);
  if (T == 0 || w.rows == 0) return;
  const WeightView v = weight_view(w);
  const bool aligned = is_aligned16(static_cast<const uint32_t*>(w.weight.data()) + e * w.rows * w.words_per_row());
  if (aligned && is_fast_affine(v) && use_gemv_tc(v, x)) return run_gemv_tc(w, e, x, y);
  if (aligned && use_gemv(v, x)) return run_gemv(w, e, x, y);
  LinearArgs a;
  a.w = v;
  a.x = x.ptr<float>();
  a.ldx = w.cols;
  a.y = y.ptr<float>();
  a.ldy = w.rows;
  a.tiles.M = T;
  a.tiles.expert = e;
  linear_tiles(a, ceil_div<int64_t>(T, LINEAR_TILE_ROWS));
}

void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y) {
  const int64_t T = ids.dim(0);
  if (T == 0 || table.cols == 0) return;
  EmbeddingParams p;
  p.table = weight_view(table);
  p.ids = ids.ptr<int32_t>();
  p.y = y.ptr<float>();
  p.H = table.cols;
  constexpr int threads = 256;
  const dim3 grid(unsigned(T), unsigned(ceil_div<int64_t>(table.cols, threads)));
  embedding_kernel<<<grid, threads, 0, stream()>>>(p);
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
