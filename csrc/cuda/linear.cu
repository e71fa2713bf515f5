// Launchers of linear and embedding. The kernels, chosen by named predicates:
//   use_gemv_mma:    one token, 4/8-bit affine with BF16 scales, whole 64-byte row segments
//                    -> kernels/gemv_mma.cuh (integer tensor cores); linear_add_rms_norm there in one
//                    kernel (the add in its epilogue, the norm by its last CTA), else linear + add_rms_norm;
//                    linear_add there in one kernel (the add in its epilogue), else linear + add;
//                    linear_rms_normed there in one kernel where linear_rms_normed_supported (every CTA
//                    normalises the input while staging it), else rms_norm + linear
//   use_dense_small: 2..32 tokens (DS_MAX_TOKENS), 4-bit affine layer matrices (not the vocabulary head)
//                    -> kernels/dense_small.cuh (bf16 mma.sync, tokens as N, K split over a cluster);
//                    linear_add there (the add in its epilogue), linear_add_rms_norm as that + rms_norm
//   use_gemv_mma_tokens: 2..16 tokens of the matrices use_dense_small does not take, the same matrices
//                    (8-bit ones from 1024 rows), up to 2^28 multiply-adds (gemv_plan.h's
//                    mma_tokens_shape: not the vocabulary head)
//                    -> kernels/gemv_mma_tokens.cuh in launches of at most 8 tokens, each token's row bit
//                    for bit the one-token kernel's; linear_add there (the add in its epilogue),
//                    linear_add_rms_norm as that + rms_norm
//   use_gemv:        decode (T <= 8), 4/8-bit affine with BF16 scales -> kernels/linear_gemv.cuh; also
//                    T <= 32 in blocks of 8 rows where the wgmma GEMM does not apply (8-bit products)
//   use_wgmma_gemm:  larger T, 4-bit affine (8-bit from GEMV_BLOCKED_MAX_TOKENS + 1 dense rows, any grouped
//                    product), BF16 scales, K % 64 == 0, group 32 or a power of two >= 64,
//                    16-byte aligned operands -> kernels/linear_wgmma_tma.cuh (Hopper wgmma + TMA;
//                    X converted to bf16 into the op's workspace first, unless its producer wrote it so:
//                    a.xb); a gated product (a.up set) as one GATED product where use_gated_wgmma holds (4-bit),
//                    else as its gate and up products; a GATED product may store its output as the next
//                    product's bf16 X (a.yb, linear_writes_xb), a plain unsplit one as bf16 rows (a.y16,
//                    linear_writes_bf16)
//   use_tensor_gemm: larger T, 4/8-bit affine, 16-byte aligned operands -> kernels/linear_gemm.cuh
//   use_dense_wgmma: T >= DENSE_WGMMA_MIN_ROWS, dense BF16 weights (the vision tower's), K % 8 == 0, 16-byte
//                    aligned operands -> kernels/linear_wgmma_dense.cuh (Hopper wgmma, both operands by TMA;
//                    X converted to bf16 in natural k order into the op's workspace first, unless its
//                    producer wrote it so: linear_bias_xb); linear_bias_gelu's GELU in its epilogue, stored
//                    as fp32 or as the next dense product's bf16 X (linear_bias_gelu_xb)
//   use_dense_gemm:  T > 8, the same weights below that -> kernels/linear_gemm.cuh with GEMM_DENSE_BF16 (the
//                    weights taken as stored)
//   otherwise the generic kernel (every variant, any shape)           -> kernels/linear_generic.cuh
#include <algorithm>
#include <cstdint>

#include "cuda_ops.h"
#include "kernels/dense_small.cuh"
#include "kernels/gelu.cuh"
#include "kernels/gemv_mma.cuh"
#include "kernels/gemv_mma_tokens.cuh"
#include "kernels/linear_gemm.cuh"
#include "kernels/linear_gemv.cuh"
#include "kernels/linear_generic.cuh"
#include "kernels/linear_wgmma_dense.cuh"
#include "kernels/linear_wgmma_tma.cuh"
#include "linear.h"
#include "../runtime/cuda_device.h"
#include "tensor_map.h"

namespace lily::cuda {

static_assert(LINEAR_TILE_ROWS == GEMM_BM && LINEAR_TILE_ROWS == GENERIC_TILE_ROWS,
              "MoE tile maps assume one tile height for every linear kernel");

constexpr int GEMV_MAX_TOKENS = 8;
// Short prompts of 8-bit products (the router and shared-expert gate) run the GEMV over blocks of
// GEMV_MAX_TOKENS rows up to this many rows: the mma.sync GEMM costs ~42 us a call at any T on those 0.5
// MB matrices, a GEMV block a few us (docs/perf-notes.md, "Short prompts"); the wgmma GEMM takes them
// above it (use_wgmma_gemm).
constexpr int GEMV_BLOCKED_MAX_TOKENS = 32;

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

WeightView weight_view(const QMatrix& w) {
  WeightView v;
  v.w = w.weight.data();
  v.scales = w.scales.data();
  v.biases = w.biases.data();
  v.num_stack = w.num_stack;
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

// Stack entry e of a 4/8-bit affine matrix with 2-byte (BF16) scales and biases as a one-entry view: its
// words, scales and biases from entry e's first row (group_size > 0: not for dense weights).
static WeightView affine_entry(const QMatrix& w, int64_t e) {
  WeightView v = weight_view(w);
  v.num_stack = 1;
  v.w = static_cast<const uint32_t*>(w.weight.data()) + e * w.rows * w.words_per_row();
  v.scales = static_cast<const uint16_t*>(w.scales.data()) + e * w.rows * w.groups_per_row();
  v.biases = static_cast<const uint16_t*>(w.biases.data()) + e * w.rows * w.groups_per_row();
  return v;
}

static bool use_gemv(const WeightView& w, const Tensor& x) {
  const int64_t T = x.dim(0);
  return T <= GEMV_MAX_TOKENS && is_fast_affine(w) && is_aligned16(x.data) &&
         gemv_smem_bytes(gemv_tokens(T), w.cols, w.bits) <= GEMV_MAX_SMEM;
}

// The wgmma GEMM's operands: 4- or 8-bit weights, k-tiles of 64 wholly inside K, one or two scale groups
// per k-tile (a power-of-two group: the kernel shifts, it does not divide), scale indices in 32 bits,
// 16-byte aligned X rows (wgx_bf16_kernel's float4 loads) and W (its TMA map: rows of K*bits/8 bytes, a
// multiple of 32); X given as Xb (a.xb): 16-byte aligned (its TMA map).
static bool wgmma_operands(const LinearArgs& a) {
  const int gs = a.w.group_size;
  return (a.w.bits == 4 || a.w.bits == 8) && a.w.scale_dtype == DType::BF16 && a.w.cols % WG_BK == 0 && gs > 0 &&
         (gs & (gs - 1)) == 0 && (gs == 32 || gs % WG_BK == 0) && a.w.cols % gs == 0 &&
         a.w.num_stack * a.w.rows * (a.w.cols / gs) <= int64_t(UINT32_MAX) && is_aligned16(a.w.w) &&
         (a.xb != nullptr ? is_aligned16(a.xb) : a.ldx % 4 == 0 && is_aligned16(a.x));
}

// The wgmma GEMM runs a product with wgmma_operands: 4-bit weights at any rows, 8-bit ones in grouped
// (MoE) products and in dense products above GEMV_BLOCKED_MAX_TOKENS rows (up to there the blocked GEMV,
// or where it does not fit the mma.sync GEMM, keeps them, as before the 8-bit instances).
static bool use_wgmma_gemm(const LinearArgs& a) {
  return wgmma_operands(a) &&
         (a.w.bits == 4 || a.tiles.tile_expert != nullptr || a.tiles.M > GEMV_BLOCKED_MAX_TOKENS);
}

static bool use_tensor_gemm(const LinearArgs& a) {
  return is_fast_affine(a.w) && a.ldx % 4 == 0 && is_aligned16(a.x);
}

// Dense BF16 weights of a prefill-sized product (decode-sized ones keep fp32 products, docs/numerics.md): rows of
// whole 16-byte chunks, X rows and W 16-byte aligned. Dense products only (no tile maps: linear(), not linear_tiles).
static bool use_dense_gemm(const LinearArgs& a) {
  return a.w.bits == 0 && a.w.dtype == DType::BF16 && a.tiles.M > GEMV_MAX_TOKENS && a.w.cols % 8 == 0 &&
         is_aligned16(a.w.w) && a.ldx % 4 == 0 && is_aligned16(a.x);
}

// Dense BF16 products from this many rows take the wgmma GEMM (one 128-row tile: below it the mma.sync
// GEMM's 64-row tiles waste less).
constexpr int64_t DENSE_WGMMA_MIN_ROWS = 128;

// Stack entry e of dense BF16 weights [num_stack, N, K].
static const uint16_t* dense_weights(const LinearArgs& a, int64_t e) {
  return static_cast<const uint16_t*>(a.w.w) + e * a.w.rows * a.w.cols;
}

// use_dense_gemm's conditions from DENSE_WGMMA_MIN_ROWS rows, with stack entry e's W (its TMA map: a
// 16-byte aligned start, rows of whole 16 bytes) and the workspace (Xb [M, K]: 16-byte aligned, room
// for it; linear's workspace always has it).
static bool use_dense_wgmma(const LinearArgs& a, int64_t e, const Tensor& workspace) {
  return use_dense_gemm(a) && a.tiles.M >= DENSE_WGMMA_MIN_ROWS && is_aligned16(dense_weights(a, e)) &&
         is_aligned16(workspace.data) && workspace.numel() >= a.tiles.M * a.w.cols;
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
  launch(linear_gemv_kernel<BITS, NT>, grid, GEMV_THREADS, smem, p);
  LILY_CUDA_LAUNCHED();
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
  const WeightView v = affine_entry(w, e);
  GemvParams p;
  p.w = static_cast<const uint32_t*>(v.w);
  p.scales = static_cast<const uint16_t*>(v.scales);
  p.biases = static_cast<const uint16_t*>(v.biases);
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

int mma_group_halves(int bits, int64_t group_size) {
  const int64_t vals = 512 / bits;  // values per 64-byte row segment
  if (group_size <= 0 || (group_size & (group_size - 1)) != 0) return 0;
  return group_size >= vals ? 1 : group_size * 2 == vals ? 2 : 0;
}

int log2_of(int64_t v) {
  int n = 0;
  while ((int64_t(1) << n) < v) ++n;
  return n;
}

MmaPlan mma_plan(const void* kernel, size_t smem, int64_t tiles, int64_t segments, int64_t grid_rows,
                 bool dependent) {
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MMA_THREADS, smem));
  const int64_t resident = int64_t(num_sms()) * std::max(per_sm, 1) / std::max<int64_t>(grid_rows, 1);
  return mma_plan_for(tiles, segments, std::max<int64_t>(resident, 1), dependent);
}

// The matrix as the integer GEMV takes it (any token count): 4/8-bit affine with BF16 scales, groups of a
// whole or half a row segment, whole segments, 16-byte aligned weights, 4-byte aligned scale pairs when a
// group is half a segment, one token's staged x within GEMV_MAX_SMEM. x then needs a 16-byte aligned
// start (its rows are whole segments: every row aligned).
static bool gemv_mma_matrix(const QMatrix& w, int64_t e) {
  if (!is_fast_affine(weight_view(w))) return false;
  const int halves = mma_group_halves(w.bits, w.group_size);
  const int64_t vals = 512 / w.bits;
  const WeightView v = affine_entry(w, e);
  return halves != 0 && w.cols % vals == 0 && is_aligned16(v.w) &&
         (halves == 1 ||
          (reinterpret_cast<uintptr_t>(v.scales) % 4 == 0 && reinterpret_cast<uintptr_t>(v.biases) % 4 == 0)) &&
         mma_x_bytes(w.cols, int(vals / halves)) <= GEMV_MAX_SMEM;
}

static bool use_gemv_mma(const QMatrix& w, int64_t e, const Tensor& x) {
  return x.dim(0) == 1 && w.rows >= GEMV_MMA_MIN_ROWS && is_aligned16(x.data) && gemv_mma_matrix(w, e);
}

// Short prompts on the multi-token integer GEMV: mma_tokens_shape's T and shapes (gemv_plan.h: not the
// vocabulary head) and the matrix as the integer GEMV takes it.
static bool gemv_mma_tokens_matrix(const QMatrix& w, int64_t e, int64_t T) {
  return mma_tokens_shape(w.bits, w.rows, w.cols, T) && gemv_mma_matrix(w, e);
}

static bool use_gemv_mma_tokens(const QMatrix& w, int64_t e, const Tensor& x) {
  return is_aligned16(x.data) && gemv_mma_tokens_matrix(w, e, x.dim(0));
}

// Short prompts' dense 4-bit products with the tokens as the MMA's N (kernels/dense_small.cuh): T = 2..
// DS_MAX_TOKENS tokens of a layer matrix (up to DS_MAX_ROWS rows: not the vocabulary head, whose blocks of
// rows keep the fp32 GEMV / wgmma GEMM), 4-bit MLX affine with BF16 scales, groups a power of two >= 32,
// whole segments, rows in whole 32-row warp tiles, 16-byte aligned weights, and a K split (ds_splits) whose
// staged X fits. Replaces the multi-token integer GEMV (T <= 16: its work grows with T) and the split-K wgmma
// GEMM (T = 17..32: ~25 us a call at any size) for those matrices; other matrices keep those paths.
static bool dense_small_matrix(const QMatrix& w, int64_t e, int64_t T) {
  const int64_t gs = w.group_size;
  return T >= 2 && T <= DS_MAX_TOKENS && w.bits == 4 && w.scale_dtype == DType::BF16 && gs >= 32 &&
         (gs & (gs - 1)) == 0 && w.rows % 32 == 0 && w.rows <= DS_MAX_ROWS && w.cols % MS_SEG_VALS == 0 &&
         is_aligned16(affine_entry(w, e).w) &&
         ds_splits(w.rows, w.cols, gs, T, int64_t(num_sms()) * DS_CTAS_PER_SM) > 0;
}

static bool use_dense_small(const QMatrix& w, int64_t e, const Tensor& x) {
  return is_aligned16(x.data) && dense_small_matrix(w, e, x.dim(0));
}

template <int NT>
static void launch_dense_small(const LinearArgs& a, int ks, bool accumulate) {
  const auto kernel = dense_small_kernel<NT>;
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(DS_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(ceil_div<int64_t>(a.w.rows, DS_SLICE_ROWS)), unsigned(ks));
  launch_clustered(kernel, grid, MS_THREADS, dim3(1, unsigned(ks), 1), ds_smem_bytes(a.w.cols / ks, NT), a,
                   accumulate);
  LILY_CUDA_LAUNCHED();
}

// y = x W_e^T (or y += it: accumulate) for x [T, cols], y [T, rows] on dense_small_kernel (use_dense_small).
static void run_dense_small(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, bool accumulate) {
  const int64_t T = x.dim(0);
  LinearArgs a;
  a.w = affine_entry(w, e);
  a.x = x.ptr<float>();
  a.ldx = w.cols;
  a.y = y.ptr<float>();
  a.ldy = w.rows;
  a.tiles.M = T;
  const int ks = ds_splits(w.rows, w.cols, w.group_size, T, int64_t(num_sms()) * DS_CTAS_PER_SM);
  LILY_CHECK(ks > 0, "linear: ", T, " tokens of a ", w.rows, "x", w.cols,
             " matrix do not fit the dense short-prompt kernel");
  switch (ds_tiles(T)) {
    case 1: return launch_dense_small<1>(a, ks, accumulate);
    case 2: return launch_dense_small<2>(a, ks, accumulate);
    case 3: return launch_dense_small<3>(a, ks, accumulate);
    case 4: return launch_dense_small<4>(a, ks, accumulate);
    default: fail("linear: ", T, " tokens exceed the dense short-prompt kernel's ", DS_MAX_TOKENS);
  }
}

// The plan is the plain kernel's for both instances, so a normed input splits K as linear of the
// normalised row does (the same sums); both are held to MMA_MIN_CTAS CTAs per SM by their registers.
template <int BITS, int NG>
static void launch_gemv_mma(const MmaLinearParams& p0) {
  const auto plain = linear_gemv_mma_kernel<BITS, NG, false>, normed = linear_gemv_mma_kernel<BITS, NG, true>;
  static const bool configured = [&] {
    for (const auto kernel : {plain, normed})
      LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GEMV_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  const size_t smem = mma_x_bytes(p0.cols, MmaSeg<BITS>::VALS / NG);
  MmaLinearParams p = p0;
  const MmaPlan plan = mma_plan(reinterpret_cast<const void*>(plain), smem, ceil_div(p.rows, 16),
                                p.cols / MmaSeg<BITS>::VALS, 1);
  p.ks = plan.ks;
  launch(p.norm_in.w != nullptr ? normed : plain, plan.grid, MMA_THREADS, smem, p);
  LILY_CUDA_LAUNCHED();
}

static void run_gemv_mma(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, bool accumulate = false,
                         const NormTail& tail = {}, const NormIn& norm_in = {}, bool wait_late = false) {
  MmaLinearParams p{};
  p.accumulate = accumulate;
  p.wait_late = wait_late;
  p.tail = tail;
  p.norm_in = norm_in;
  const WeightView v = affine_entry(w, e);
  p.w = static_cast<const uint32_t*>(v.w);
  p.scales = static_cast<const uint16_t*>(v.scales);
  p.biases = static_cast<const uint16_t*>(v.biases);
  p.x = x.ptr<float>();
  p.y = y.ptr<float>();
  p.rows = int(w.rows);
  p.cols = int(w.cols);
  p.group_shift = log2_of(w.group_size);
  const int halves = mma_group_halves(w.bits, w.group_size);
  if (w.bits == 4) return halves == 1 ? launch_gemv_mma<4, 1>(p) : launch_gemv_mma<4, 2>(p);
  if (w.bits == 8) return halves == 1 ? launch_gemv_mma<8, 1>(p) : launch_gemv_mma<8, 2>(p);
  fail("linear: unsupported tensor-core GEMV bits ", w.bits);
}

// Tokens per launch of the multi-token GEMV for rows of `cols`: MMA_MAX_TOKENS, fewer where their staged x
// would pass MMA_TOKENS_MAX_SMEM.
static int64_t mma_tokens_per_launch(int bits, int64_t cols, int64_t group_size) {
  const int64_t vals = 512 / bits, per = int64_t(mma_x_bytes(cols, int(vals / mma_group_halves(bits, group_size))));
  return std::max<int64_t>(1, std::min<int64_t>(MMA_MAX_TOKENS, int64_t(MMA_TOKENS_MAX_SMEM) / per));
}

// `tokens` rows of x on linear_gemv_mma_tokens_kernel: K-parts per tile from the one-token kernel's plan
// for this matrix (each token's row then has the one-token sums, bit for bit), CTAs over the passes as
// many as fit at once, spread evenly over the rounds.
template <int BITS, int NG>
static void launch_gemv_mma_tokens(const MmaLinearParams& p0, int tokens) {
  const auto one = linear_gemv_mma_kernel<BITS, NG, false>;
  const auto kernel = linear_gemv_mma_tokens_kernel<BITS, NG>;
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(one, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GEMV_MAX_SMEM)));
    LILY_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(MMA_TOKENS_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  constexpr int VB = MmaSeg<BITS>::VALS / NG;
  MmaLinearParams p = p0;
  const int64_t tiles = ceil_div(p.rows, 16), segments = p.cols / MmaSeg<BITS>::VALS;
  p.ks = mma_plan(reinterpret_cast<const void*>(one), mma_x_bytes(p.cols, VB), tiles, segments, 1).ks;
  const size_t smem = mma_x_bytes(int64_t(tokens) * p.cols, VB);
  LILY_CHECK(tokens >= 2 && tokens <= MMA_MAX_TOKENS && smem <= MMA_TOKENS_MAX_SMEM, "linear: ", tokens,
             " tokens of ", p.cols, " inputs do not fit one multi-token GEMV launch");
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MMA_THREADS, smem));
  const int64_t passes = ceil_div<int64_t>(tiles, MmaSplit(p.ks, int(segments)).rt);
  const int64_t resident = int64_t(num_sms()) * std::max(per_sm, 1);
  const int64_t rounds = ceil_div<int64_t>(passes, resident);
  launch(kernel, unsigned(ceil_div<int64_t>(passes, rounds)), MMA_THREADS, smem, p, tokens);
  LILY_CUDA_LAUNCHED();
}

// y = W x (or y += W x: accumulate) for x [T, cols], y [T, rows] on the multi-token GEMV: launches of at
// most mma_tokens_per_launch tokens, balanced (11 tokens of 2048 inputs: 5 + 6); a launch of one token
// takes the one-token kernel (the same sums).
static void run_gemv_mma_tokens(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, bool accumulate) {
  MmaLinearParams p{};
  p.accumulate = accumulate;
  const WeightView v = affine_entry(w, e);
  p.w = static_cast<const uint32_t*>(v.w);
  p.scales = static_cast<const uint16_t*>(v.scales);
  p.biases = static_cast<const uint16_t*>(v.biases);
  p.rows = int(w.rows);
  p.cols = int(w.cols);
  p.group_shift = log2_of(w.group_size);
  const int halves = mma_group_halves(w.bits, w.group_size);
  const int64_t T = x.dim(0), cap = mma_tokens_per_launch(w.bits, w.cols, w.group_size);
  const int64_t launches = ceil_div(T, cap);
  for (int64_t i = 0, t0 = 0; i < launches; ++i) {
    const int64_t n = (T - t0) / (launches - i);  // balanced: the later launches take the remainder
    p.x = x.ptr<float>() + t0 * w.cols;
    p.y = y.ptr<float>() + t0 * w.rows;
    t0 += n;
    if (n == 1) {
      if (w.bits == 4) halves == 1 ? launch_gemv_mma<4, 1>(p) : launch_gemv_mma<4, 2>(p);
      else halves == 1 ? launch_gemv_mma<8, 1>(p) : launch_gemv_mma<8, 2>(p);
    } else if (w.bits == 4) {
      halves == 1 ? launch_gemv_mma_tokens<4, 1>(p, int(n)) : launch_gemv_mma_tokens<4, 2>(p, int(n));
    } else if (w.bits == 8) {
      halves == 1 ? launch_gemv_mma_tokens<8, 1>(p, int(n)) : launch_gemv_mma_tokens<8, 2>(p, int(n));
    } else {
      fail("linear: unsupported tensor-core GEMV bits ", w.bits);
    }
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
  launch(linear_gemm_kernel<BITS>, grid, GEMM_THREADS, GEMM_SMEM_BYTES, a);
  LILY_CUDA_LAUNCHED();
}

template <int BM, int EPI>
static void launch_dense_wgmma(const LinearArgs& a, const float* bias, const void* w, const uint16_t* xb) {
  const auto kernel = linear_wgmma_dense_kernel<BM, EPI>;
  constexpr int smem = wgd_smem_bytes(BM);
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  CUtensorMap mx, mw;
  check_tensor_map(make_xb_tensor_map(mx, xb, a.tiles.M, a.w.cols, BM), "linear", "X");
  check_tensor_map(make_xb_tensor_map(mw, w, a.w.rows, a.w.cols, WG_BN), "linear", "dense W");
  const int64_t units = ceil_div<int64_t>(a.tiles.M, BM) * ceil_div<int64_t>(a.w.rows, WG_BN);
  launch(kernel, unsigned(std::min<int64_t>(units, num_sms())), WGD_THREADS, size_t(smem), a, bias, gelu_tanh_k(),
         mx, mw);
  LILY_CUDA_LAUNCHED();
}

template <int EPI>
static void launch_dense_wgmma_rows(const LinearArgs& a, const float* bias, const void* w, const uint16_t* xb) {
  if (wgd_bm(a.tiles.M, a.w.rows, num_sms()) == 64) return launch_dense_wgmma<64, EPI>(a, bias, w, xb);
  launch_dense_wgmma<128, EPI>(a, bias, w, xb);
}

// Y (+ bias) for stack entry e of dense BF16 weights on the dense wgmma GEMM, epilogue `epi` (WgdEpilogue;
// WGD_GELU_XB writes a.yb): X to bf16 (natural k order) in the workspace, then the GEMM; with `xb` given,
// X is read from there as it stands (its producer wrote it so; a.x unused).
static void run_dense_wgmma(const LinearArgs& a, int64_t e, const float* bias, const Tensor& workspace,
                            WgdEpilogue epi = WGD_PLAIN, const uint16_t* xb = nullptr) {
  const int64_t M = a.tiles.M, K = a.w.cols;
  LILY_CHECK(M <= INT32_MAX && a.w.rows <= INT32_MAX, "linear: ", M, " x ", a.w.rows, " exceeds the dense GEMM");
  const uint16_t* w = dense_weights(a, e);
  if (xb == nullptr) {
    uint16_t* ws = workspace.ptr<uint16_t>();
    launch(wgx_bf16_kernel<true>, unsigned(M), WGX_THREADS, 0, a.x, a.ldx, K, ws);
    LILY_CUDA_LAUNCHED();
    xb = ws;
  }
  switch (epi) {
    case WGD_PLAIN: return launch_dense_wgmma_rows<WGD_PLAIN>(a, bias, w, xb);
    case WGD_GELU: return launch_dense_wgmma_rows<WGD_GELU>(a, bias, w, xb);
    case WGD_GELU_XB: return launch_dense_wgmma_rows<WGD_GELU_XB>(a, bias, w, xb);
  }
}

// X rows [x_count, K] of a product as BF16 (wgx_bf16_kernel) in xb, unless it holds them already.
static const uint16_t* xb_rows(const LinearArgs& a, int64_t x_count, XbCopy& xb) {
  const int64_t K = a.w.cols;
  if (xb.x == a.x && xb.ldx == a.ldx && xb.rows == x_count && xb.K == K) return xb.data;
  LILY_CHECK(x_count <= INT32_MAX && x_count * K <= xb.capacity, "linear: a bf16 workspace of ", xb.capacity,
             " elements is too small for ", x_count, " x ", K);
  launch(wgx_bf16_kernel<false>, unsigned(x_count), WGX_THREADS, 0, a.x, a.ldx, K, xb.data);
  LILY_CUDA_LAUNCHED();
  xb.x = a.x, xb.ldx = a.ldx, xb.rows = x_count, xb.K = K;
  return xb.data;
}

// Split-K counters of linear_wgmma_tma_kernel (one per tile; zero between launches: the last unit of a
// tile resets its own). A process-wide scratch like the decode attention's partials: products run one
// at a time on the device's stream.
constexpr int64_t WG_SPLIT_MAX_UNITS = 256, WG_SPLIT_MAX_ROWS = 512;
constexpr int64_t WG_SPLIT_PARTIAL_BYTES = WG_SPLIT_MAX_UNITS * 256 * 64 * 4;  // units x 256 outputs x BM 64 (a tile's accumulators)
__device__ uint32_t g_wg_split_done[WG_SPLIT_MAX_UNITS];

// Split-K for dense products of short and medium prompts (T <= WG_SPLIT_MAX_ROWS, 64-row tiles) with fewer
// tiles than half the SMs: enough units to fill the SMs, at least 4 k-tiles each, at most 8 splits
// and WG_SPLIT_MAX_UNITS units; partials in the bf16 workspace after X (linear_workspace_elems makes
// room). Returns a with k_splits, partial and split_done set, or unchanged (k_splits 1; always for a bf16
// output, a.y16: linear_writes_bf16). Above 64 rows
// (several row tiles: a 146-token prompt's out_proj is 3 x 8 tiles, 24 CTAs walking K = 4096 unsplit:
// 54.4 -> 24.4 us split 5 ways; docs/perf-notes.md, ninth session).
static LinearArgs with_split_k(LinearArgs a, int64_t tiles, const XbCopy& xb) {
  const int64_t nk = a.w.cols / WG_BK, sms = num_sms();
  if (a.tiles.tile_expert != nullptr || a.x_rows != nullptr || a.y16 != nullptr || a.tiles.M > WG_SPLIT_MAX_ROWS ||
      tiles * 2 > sms || nk < 8)
    return a;
  const int64_t used = (xb.rows * xb.K + 127) / 128 * 128 * 2, avail = xb.capacity * 2 - used;
  for (int64_t sp = std::min<int64_t>({8, nk / 4, sms / tiles, WG_SPLIT_MAX_UNITS / tiles}); sp > 1; --sp) {
    if (tiles * sp * 256 * 64 * 4 > avail) continue;
    static uint32_t* done = [] {
      void* p = nullptr;
      LILY_CUDA_CHECK(cudaGetSymbolAddress(&p, g_wg_split_done));
      return static_cast<uint32_t*>(p);
    }();
    a.k_splits = int(sp);
    a.partial = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(xb.data) + used);
    a.split_done = done;
    return a;
  }
  return a;
}

// The gate product of a gated one, and its up product with SwiGLU (y holds the gate product by then).
static LinearArgs gate_of(const LinearArgs& a) {
  LinearArgs g = a;
  g.up = WeightView{};
  g.row_scale = nullptr;
  return g;
}
static LinearArgs up_of(const LinearArgs& a) {
  LinearArgs u = a;
  u.w = a.up;
  u.up = WeightView{};
  u.swiglu = true;
  return u;
}

// A gated product as one GATED product: both matrices 4-bit (no 8-bit GATED instance: its ring and exchange
// area do not fit) and on the wgmma GEMM with the same shape and group size (one tile covers the same
// rows of both, one scale index serves both), groups of 64 or more (no 32-wide GATED instance), and no
// split-K for dense products (short prompts keep the two split products: a gated tile would run all K
// on few CTAs).
constexpr int64_t WG_GATED_MIN_DENSE_ROWS = 65;  // below: the two split products
static bool use_gated_wgmma(const LinearArgs& a) {
  return a.w.bits == 4 && a.up.bits == 4 && use_wgmma_gemm(a) && use_wgmma_gemm(up_of(a)) &&
         a.up.num_stack == a.w.num_stack && a.up.rows == a.w.rows &&
         a.up.cols == a.w.cols && a.up.group_size == a.w.group_size && a.w.group_size != 32 &&
         (a.tiles.tile_expert != nullptr || a.tiles.M >= WG_GATED_MIN_DENSE_ROWS);
}

// Column tiles of linear_wgmma_tma_kernel at row tiles of BM: wg_rows(BM) outputs (256; 128 at BM = 256), or
// half that of a gated product.
static int64_t wgmma_col_tiles(const LinearArgs& a, int bm = 128) {
  return ceil_div<int64_t>(a.w.rows, a.up.w != nullptr ? wg_rows(bm) / 2 : wg_rows(bm));
}

// The persistent GEMM over row_tiles x column tiles: min(tiles, SMs) CTAs. Tensor maps are encoded per
// launch (host only, cheap) and passed as __grid_constant__ parameters (tmap_u: GATED's up matrix, else
// the W map again, unread).
template <int BITS, int BM, bool GS32, bool GATHER, bool SPLIT = false, bool GATED = false>
static void launch_wgmma(const LinearArgs& a, const uint16_t* xb, int64_t x_count, int64_t row_tiles) {
  const auto kernel = linear_wgmma_tma_kernel<BM, GS32, GATHER, SPLIT, GATED, BITS>;
  constexpr int smem = tma_smem_bytes(BM, BITS, GATED), box_rows = GATED ? wg_rows(BM) / 2 : wg_rows(BM);
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  CUtensorMap mx, mw, mu;
  check_tensor_map(make_xb_tensor_map(mx, xb, x_count, a.w.cols, BM), "linear", "X");
  check_tensor_map(make_w_tensor_map(mw, a.w.w, a.w.num_stack, a.w.rows, a.w.cols, BITS, box_rows), "linear",
                   "W");
  if (GATED)
    check_tensor_map(make_w_tensor_map(mu, a.up.w, a.up.num_stack, a.up.rows, a.up.cols, BITS, box_rows), "linear",
                     "up");
  else mu = mw;
  const int64_t units = row_tiles * wgmma_col_tiles(a, BM) * a.k_splits;
  launch(kernel, unsigned(std::min<int64_t>(units, num_sms())), TMA_THREADS, size_t(smem), a, xb, mx, mw, mu);
  LILY_CUDA_LAUNCHED();
}

// Grouped (MoE) tile maps have a.tiles.tile_rows (64, 128, or 160: plain products only) rows per tile: BM =
// tile_rows; gathered rows (x_rows) take the cp.async producer. Dense products take 128-row tiles when that still gives at least
// one tile per SM, 64-row tiles otherwise (and always with 32-wide groups, which have no 128-row variant).
// A gated product (use_gated_wgmma: 4-bit, no 32-wide groups, no split-K) takes the GATED instances, same
// rules. BITS: the weights' (4 or 8), the same choices for both.
// 128-row tiles for a dense product (unsplit, groups of 64 or more) when they fill the SMs, or when
// 64-row tiles would take more rounds of the SMs by more than a 128-row k-tile's extra cost: ~1.3x a
// 64-row one (~1.0 us at 4K prefill, ~0.8 us at T = 146; docs/perf-notes.md, eighth session). At T = 146
// in_proj's 147 64-row tiles take two rounds of 132 SMs (51 us), its 98 128-row tiles one.
static bool dense_wide(int64_t M, int64_t col_tiles, int64_t sms) {
  const int64_t t128 = ceil_div<int64_t>(M, 128) * col_tiles, t64 = ceil_div<int64_t>(M, 64) * col_tiles;
  return t128 >= sms || 10 * ceil_div(t64, sms) > 13 * ceil_div(t128, sms);
}
// 256-row tiles of 128 outputs (half the dequantization a MAC of the 128-row tiles: docs/perf-notes.md,
// seventeenth session) for a dense product whose tiles still fill the SMs in whole rounds as well as the
// 128-row tiles do: at least one tile an SM, and no more rounds than the 128-row tiles take.
static bool dense_tall(int64_t M, int64_t N, int64_t sms) {
  const int64_t t256 = ceil_div<int64_t>(M, 256) * ceil_div<int64_t>(N, wg_rows(256)),
                t128 = ceil_div<int64_t>(M, 128) * ceil_div<int64_t>(N, wg_rows(128));
  return t256 >= sms && ceil_div(t256, sms) <= ceil_div(t128, sms);
}

template <int BITS>
static void run_wgmma_bits(const LinearArgs& a, int64_t max_tiles, int64_t x_count, XbCopy& xb_copy) {
  const uint16_t* xb = a.xb != nullptr ? a.xb : xb_rows(a, x_count, xb_copy);
  const bool gs32 = a.w.group_size == 32, gather = a.x_rows != nullptr, grouped = a.tiles.tile_expert != nullptr;
  const int64_t col_tiles = wgmma_col_tiles(a);
  // the gather producer addresses a row's 16-byte chunks with 32-bit indices
  LILY_CHECK(!gather || x_count * (a.w.cols / 8) < int64_t(UINT32_MAX), "linear: ", x_count, " gathered rows of ",
             a.w.cols, " exceed the 32-bit chunk index");
  LILY_CHECK(!grouped || a.tiles.tile_rows == LINEAR_TILE_ROWS || a.tiles.tile_rows == LINEAR_WIDE_TILE_ROWS ||
                 a.tiles.tile_rows == LINEAR_MERGE_TILE_ROWS,
             "linear: unsupported tile map rows ", a.tiles.tile_rows);
  // the epilogues address a tile's rows by 32-bit offsets (row * ldy elements of F32 or, y16, bf16; or row * N
  // for a bf16 Xb output; row < 256)
  LILY_CHECK(a.ldy < (int64_t(1) << 22) && a.w.rows < (int64_t(1) << 22), "linear: an output row of ", a.ldy,
             " (", a.w.rows, " outputs) exceeds the wgmma epilogue's 32-bit row offsets");
  if constexpr (BITS == 4) {  // GATED instances: 4-bit only (run_wgmma checks)
    if (a.up.w != nullptr) {
      const bool wide = grouped ? a.tiles.tile_rows == LINEAR_WIDE_TILE_ROWS : dense_wide(a.tiles.M, col_tiles, num_sms());
      const int64_t row_tiles = grouped || !wide ? max_tiles : ceil_div<int64_t>(a.tiles.M, 128);
      if (wide) return gather ? launch_wgmma<4, 128, false, true, false, true>(a, xb, x_count, row_tiles)
                              : launch_wgmma<4, 128, false, false, false, true>(a, xb, x_count, row_tiles);
      return gather ? launch_wgmma<4, 64, false, true, false, true>(a, xb, x_count, row_tiles)
                    : launch_wgmma<4, 64, false, false, false, true>(a, xb, x_count, row_tiles);
    }
  }
  if (grouped && a.tiles.tile_rows == LINEAR_MERGE_TILE_ROWS) {
    LILY_CHECK(a.up.w == nullptr && !gather && linear_wide_tiles(a),
               "linear: a ", LINEAR_MERGE_TILE_ROWS, "-row tile map for a product without a ", LINEAR_MERGE_TILE_ROWS,
               "-row kernel");
    return launch_wgmma<BITS, LINEAR_MERGE_TILE_ROWS, false, false>(a, xb, x_count, max_tiles);
  }
  if (grouped && a.tiles.tile_rows == LINEAR_WIDE_TILE_ROWS) {
    LILY_CHECK(linear_wide_tiles(a), "linear: a 128-row tile map for a product without a 128-row kernel");
    return gather ? launch_wgmma<BITS, 128, false, true>(a, xb, x_count, max_tiles)
                  : launch_wgmma<BITS, 128, false, false>(a, xb, x_count, max_tiles);
  }
  if (!grouped && !gather && !gs32 && dense_tall(a.tiles.M, a.w.rows, num_sms()))
    return launch_wgmma<BITS, 256, false, false>(a, xb, x_count, ceil_div<int64_t>(a.tiles.M, 256));
  if (!grouped && !gather && !gs32 && dense_wide(a.tiles.M, col_tiles, num_sms()))
    return launch_wgmma<BITS, 128, false, false>(a, xb, x_count, ceil_div<int64_t>(a.tiles.M, 128));
  if (gather) return gs32 ? launch_wgmma<BITS, 64, true, true>(a, xb, x_count, max_tiles)
                          : launch_wgmma<BITS, 64, false, true>(a, xb, x_count, max_tiles);
  const LinearArgs as = with_split_k(a, max_tiles * col_tiles, xb_copy);
  if (as.k_splits > 1)  // split-K in its own instances: the unsplit kernel's loop stays as it was
    return gs32 ? launch_wgmma<BITS, 64, true, false, true>(as, xb, x_count, max_tiles)
                : launch_wgmma<BITS, 64, false, false, true>(as, xb, x_count, max_tiles);
  return gs32 ? launch_wgmma<BITS, 64, true, false>(a, xb, x_count, max_tiles)
              : launch_wgmma<BITS, 64, false, false>(a, xb, x_count, max_tiles);
}

static void run_wgmma(const LinearArgs& a, int64_t max_tiles, int64_t x_count, XbCopy& xb_copy) {
  LILY_CHECK(a.up.w == nullptr || a.w.bits == 4, "linear: no GATED wgmma instance for ", a.w.bits, "-bit weights");
  if (a.w.bits == 8) return run_wgmma_bits<8>(a, max_tiles, x_count, xb_copy);
  run_wgmma_bits<4>(a, max_tiles, x_count, xb_copy);
}

bool linear_reads_xb(const LinearArgs& a) { return a.xb != nullptr && use_wgmma_gemm(a); }

bool linear_writes_xb(const LinearArgs& a) { return a.up.w != nullptr && use_gated_wgmma(a) && a.w.rows % 8 == 0; }

bool linear_writes_bf16(const LinearArgs& a) {
  // the epilogue's pair stores: outputs o and o + 8 in a 4-byte word (W's rows in blocks of 16, ldy even, y16
  // 4-byte aligned)
  return a.up.w == nullptr && !a.swiglu && a.w.rows % 16 == 0 && a.ldy % 2 == 0 &&
         reinterpret_cast<uintptr_t>(a.y16) % 4 == 0 && use_wgmma_gemm(a);
}

// a as a grouped product (moe.cu asks before it builds the map): the wgmma GEMM takes it, 4- or 8-bit,
// with a 128-row instance (no 32-wide groups).
bool linear_wide_tiles(const LinearArgs& a) {
  if (a.up.w != nullptr) return linear_wide_tiles(gate_of(a)) && linear_wide_tiles(up_of(a));
  return wgmma_operands(a) && a.w.group_size != 32;
}

bool linear_tiles_on_wgmma(const LinearArgs& a) {
  if (a.up.w != nullptr) return use_gated_wgmma(a) || (use_wgmma_gemm(gate_of(a)) && use_wgmma_gemm(up_of(a)));
  return use_wgmma_gemm(a);
}

void linear_tiles(const LinearArgs& a, int64_t max_tiles, int64_t x_count, XbCopy& xb) {
  if (max_tiles <= 0 || a.w.rows == 0) return;
  LILY_CHECK(a.xb == nullptr || linear_reads_xb(a), "linear: X given only as bf16 (xb) needs the wgmma GEMM, which ",
             "does not take this ", a.w.bits, "-bit product of ", a.w.cols, " inputs");
  LILY_CHECK(a.yb == nullptr || linear_writes_xb(a), "linear: a bf16 output (yb) needs a gated product on the ",
             "GATED wgmma GEMM, which does not take this one");
  LILY_CHECK(a.y16 == nullptr || linear_writes_bf16(a), "linear: a bf16 output (y16) needs a plain product on the ",
             "wgmma GEMM, which does not take this one");
  LILY_CHECK(max_tiles <= INT32_MAX && ceil_div<int64_t>(a.w.rows, GENERIC_WARPS) <= 65535, "linear: ",
             a.w.rows, " outputs exceed the grid");
  if (a.up.w != nullptr) {
    LILY_CHECK(!a.swiglu, "linear: a gated product reads no gate product from y");
    if (use_gated_wgmma(a)) return run_wgmma(a, max_tiles, x_count, xb);
    linear_tiles(gate_of(a), max_tiles, x_count, xb);
    return linear_tiles(up_of(a), max_tiles, x_count, xb);
  }
  if (use_wgmma_gemm(a)) return run_wgmma(a, max_tiles, x_count, xb);
  LILY_CHECK(a.tiles.tile_expert == nullptr || a.tiles.tile_rows == LINEAR_TILE_ROWS,
             "linear: only the wgmma kernel takes a tile map of ", a.tiles.tile_rows, " rows");
  if (use_tensor_gemm(a)) {
    switch (a.w.bits) {
      case 4: return launch_gemm<4>(a, max_tiles);
      case 8: return launch_gemm<8>(a, max_tiles);
      default: fail("linear: unsupported tensor-core bits ", a.w.bits);
    }
  }
  const dim3 grid(unsigned(max_tiles), unsigned(ceil_div<int64_t>(a.w.rows, GENERIC_WARPS)));
  launch(linear_generic_kernel, grid, GENERIC_WARPS * 32, 0, a);
  LILY_CUDA_LAUNCHED();
}

int64_t linear_x_elems(int64_t T, int64_t in) { return T * in; }

// X as bf16, then (short prompts) room for the split-K partials after it (used when there).
int64_t linear_workspace_elems(int64_t T, int64_t in) {
  return (T * in + 127) / 128 * 128 + (T <= WG_SPLIT_MAX_ROWS ? WG_SPLIT_PARTIAL_BYTES / 2 : 0);
}

void linear_add_rms_norm(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                         const Tensor& y, const Tensor& tmp, const Tensor& workspace, const Tensor& sync) {
  if (use_gemv_mma(w, 0, x)) return run_gemv_mma(w, 0, x, res, true, norm_tail(res, weight, eps, y, sync));
  if (use_dense_small(w, 0, x)) {
    run_dense_small(w, 0, x, res, true);
    return rms_norm(res, weight, eps, y);
  }
  if (use_gemv_mma_tokens(w, 0, x)) {
    run_gemv_mma_tokens(w, 0, x, res, true);
    return rms_norm(res, weight, eps, y);
  }
  linear(w, 0, x, tmp, workspace);
  add_rms_norm(res, tmp, weight, eps, y);
}

// One token or a short prompt on the tensor-core GEMV, or a short prompt on the dense short-prompt kernel:
// its epilogue adds into res (y[o] += the row's sum, no tail). Otherwise linear into tmp, then add.
// y = x W^T for one token on the tensor-core GEMV, x two or more launches old: the whole product before the PDL
// wait, the stores into y after it (MmaLinearParams::wait_late; ops::linear_add_moe_rms_normed_add, beside
// router_early_kernel, the kernel just before).
bool linear_add_late_supported(const QMatrix& w, const Tensor& x) { return use_gemv_mma(w, 0, x); }
void linear_late(const QMatrix& w, const Tensor& x, const Tensor& y) {
  LILY_CHECK(linear_add_late_supported(w, x), "linear_late: not on the tensor-core GEMV");
  run_gemv_mma(w, 0, x, y, false, NormTail{}, NormIn{}, true);
}

void linear_add(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& tmp, const Tensor& workspace) {
  if (use_gemv_mma(w, 0, x)) return run_gemv_mma(w, 0, x, res, true);
  if (use_dense_small(w, 0, x)) return run_dense_small(w, 0, x, res, true);
  if (use_gemv_mma_tokens(w, 0, x)) return run_gemv_mma_tokens(w, 0, x, res, true);
  linear(w, 0, x, tmp, workspace);
  add(res, tmp);
}

// The GEMV stages rms_norm(x) * weight itself (mma_stage_normed_x) where it runs for x (use_gemv_mma: one
// token, whole segments, so cols % 4 == 0), rms_norm's threads for D = cols are the CTA's (norm_threads(cols)
// = MMA_THREADS), one octet a thread covers the row (cols <= MMA_NORM_MAX_COLS), and rms_norm would take
// float4s: x (checked by use_gemv_mma), weight and h 16-byte aligned.
bool linear_rms_normed_supported(const QMatrix& w, const Tensor& x, const Tensor& weight, const Tensor& h) {
  return use_gemv_mma(w, 0, x) && norm_threads(w.cols) == MMA_THREADS && w.cols <= MMA_NORM_MAX_COLS &&
         is_aligned16(weight.data) && is_aligned16(h.data);
}

void linear_rms_normed(const QMatrix& w, const Tensor& x, const Tensor& weight, float eps, const Tensor& h,
                       const Tensor& y, const Tensor& workspace) {
  if (linear_rms_normed_supported(w, x, weight, h))
    return run_gemv_mma(w, 0, x, y, false, NormTail{}, NormIn{weight.ptr<float>(), eps});
  rms_norm(x, weight, eps, h);
  linear(w, 0, h, y, workspace);
}

// Rows [r0, r0 + n) of a contiguous F32 matrix.
static Tensor row_block(const Tensor& t, int64_t r0, int64_t n) {
  return Tensor::of(t.ptr<float>() + r0 * t.dim(1), DType::F32, t.device, {n, t.dim(1)});
}

// The plain product y = x W_e^T over all of x's rows.
static LinearArgs linear_args(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y) {
  LinearArgs a;
  a.w = weight_view(w);
  a.x = x.ptr<float>();
  a.ldx = w.cols;
  a.y = y.ptr<float>();
  a.ldy = w.rows;
  a.tiles.M = x.dim(0);
  a.tiles.expert = e;
  return a;
}

void linear(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, const Tensor& workspace) {
  XbCopy xb{workspace.ptr<uint16_t>(), workspace.numel()};
  linear_with_xb(w, e, x, y, workspace, xb);
}

void linear_with_xb(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, const Tensor& workspace,
                    XbCopy& xb) {
  const int64_t T = x.dim(0);
  if (T == 0 || w.rows == 0) return;
  if (use_gemv_mma(w, e, x)) return run_gemv_mma(w, e, x, y);
  if (use_dense_small(w, e, x)) return run_dense_small(w, e, x, y, false);
  if (use_gemv_mma_tokens(w, e, x)) return run_gemv_mma_tokens(w, e, x, y, false);
  const WeightView v = weight_view(w);
  const bool w_aligned = is_aligned16(static_cast<const uint32_t*>(w.weight.data()) + e * w.rows * w.words_per_row());
  if (use_gemv(v, x) && w_aligned) return run_gemv(w, e, x, y);
  const LinearArgs a = linear_args(w, e, x, y);
  if (T <= GEMV_BLOCKED_MAX_TOKENS && !use_wgmma_gemm(a) && w_aligned && use_gemv(v, row_block(x, 0, GEMV_MAX_TOKENS))) {
    for (int64_t t0 = 0; t0 < T; t0 += GEMV_MAX_TOKENS) {  // x rows stay 16-byte aligned: t0 % 8 == 0
      const int64_t n = std::min<int64_t>(GEMV_MAX_TOKENS, T - t0);
      run_gemv(w, e, row_block(x, t0, n), row_block(y, t0, n));
    }
    return;
  }
  if (use_dense_wgmma(a, e, workspace))
    return run_dense_wgmma(a, e, nullptr, workspace);
  if (use_dense_gemm(a)) {
    LILY_CHECK(ceil_div<int64_t>(T, GEMM_BM) <= INT32_MAX && ceil_div<int64_t>(w.rows, GEMM_BN) <= 65535, "linear: ", T,
               " x ", w.rows, " exceeds the grid");
    return launch_gemm<GEMM_DENSE_BF16>(a, ceil_div<int64_t>(T, GEMM_BM));
  }
  linear_tiles(a, ceil_div<int64_t>(T, LINEAR_TILE_ROWS), T, xb);
}

// Dense BF16 weights on the dense wgmma GEMM: the bias in its epilogue (one fp32 add after the sum, as
// add_bias adds it). Otherwise linear into y, then add_bias.
void linear_bias(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace) {
  const LinearArgs a = linear_args(w, 0, x, y);
  if (x.dim(0) > 0 && w.rows > 0 && use_dense_wgmma(a, 0, workspace))
    return run_dense_wgmma(a, 0, bias.ptr<float>(), workspace);
  linear(w, 0, x, y, workspace);
  add_bias(y, bias);
}

// y = gelu_tanh(x W^T + bias): dense BF16 weights on the dense wgmma GEMM with the GELU in its epilogue (the
// bits of linear_bias then gelu there). Otherwise linear_bias, then gelu.
void linear_bias_gelu(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace) {
  const LinearArgs a = linear_args(w, 0, x, y);
  if (x.dim(0) > 0 && w.rows > 0 && use_dense_wgmma(a, 0, workspace))
    return run_dense_wgmma(a, 0, bias.ptr<float>(), workspace, WGD_GELU);
  linear_bias(w, x, bias, y, workspace);
  gelu(y, true);
}

// use_dense_wgmma for T rows of w, the operands standing in (aligned, the workspace as large as needed):
// what linear_bias_gelu_xb and linear_bias_xb take. No rows: nothing to hand over.
bool linear_bias_xb_supported(const QMatrix& w, int64_t T) {
  alignas(16) static const float aligned[4] = {};
  LinearArgs a;
  a.w = weight_view(w);
  a.x = aligned;
  a.ldx = w.cols;
  a.tiles.M = T;
  const Tensor ws = Tensor::of(const_cast<float*>(aligned), DType::BF16, Device::CUDA, {T * w.cols});
  return T > 0 && w.rows > 0 && w.num_stack == 1 && use_dense_wgmma(a, 0, ws);
}

// The dense product over T rows of w with X given as bf16 in xb's first T x in elements (16-byte aligned:
// its TMA map), y unset.
static LinearArgs dense_xb_product(const char* op, const QMatrix& w, const Tensor& xb, int64_t T) {
  LILY_CHECK(linear_bias_xb_supported(w, T), op, ": ", T, " rows of a ", w.rows, "x", w.cols,
             " matrix do not run on the dense wgmma GEMM");
  LILY_CHECK(is_aligned16(xb.data) && xb.numel() >= T * w.cols, op, ": xb (", xb.numel(),
             " elements) does not hold X as bf16 [", T, ", ", w.cols, "] at a 16-byte address");
  LinearArgs a;
  a.w = weight_view(w);
  a.tiles.M = T;
  return a;
}

// linear_bias_gelu with X given as bf16 in xb and y stored as bf16_rn into yb [T, out] (the next dense
// product's X): the dense GEMM without its conversion, the WGD_GELU_XB epilogue.
void linear_bias_gelu_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& yb) {
  LinearArgs a = dense_xb_product("linear_bias_gelu_xb", w, xb, yb.dim(0));
  a.yb = yb.ptr<uint16_t>();
  run_dense_wgmma(a, 0, bias.ptr<float>(), xb, WGD_GELU_XB, xb.ptr<uint16_t>());
}

// y = X W^T + bias with X given as bf16 in xb: the dense GEMM without its conversion.
void linear_bias_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& y) {
  LinearArgs a = dense_xb_product("linear_bias_xb", w, xb, y.dim(0));
  a.y = y.ptr<float>();
  a.ldy = w.rows;
  run_dense_wgmma(a, 0, bias.ptr<float>(), xb, WGD_PLAIN, xb.ptr<uint16_t>());
}

// The product linear runs over T > GEMV_MAX_TOKENS rows (no GEMV), with X given as Xb at `xb` (16-byte
// aligned: a workspace).
static LinearArgs xb_product(const QMatrix& w, const uint16_t* xb, float* y, int64_t T) {
  LinearArgs a;
  a.w = weight_view(w);
  a.xb = xb;
  a.y = y;
  a.ldy = w.rows;
  a.tiles.M = T;
  return a;
}

// linear takes T rows over w on the wgmma GEMM whenever x is 16-byte aligned: more rows than the GEMVs
// take (T > GEMV_MAX_TOKENS and neither the multi-token GEMV's nor the dense short-prompt kernel's; the
// blocked GEMV below 32 rows only where the
// GEMM does not apply) and use_wgmma_gemm's conditions on w. An aligned stand-in for the workspace: only
// its alignment is read.
bool linear_xb_supported(const QMatrix& w, int64_t T) {
  alignas(16) static const uint16_t aligned[8] = {};
  return T > GEMV_MAX_TOKENS && !gemv_mma_tokens_matrix(w, 0, T) && !dense_small_matrix(w, 0, T) &&
         w.num_stack == 1 &&
         linear_reads_xb(xb_product(w, aligned, nullptr, T));
}

bool linear_stack_supported(const QMatrix& stacked, int64_t T) {
  return T > DS_MAX_TOKENS && T <= LINEAR_STACK_MAX_ROWS && linear_xb_supported(stacked, T);
}

// linear(w, x, y, workspace) with x given as Xb in the workspace's first T * w.cols elements: the same
// product, tiles and split-K choice (the XbCopy holds "X" there, the partials go after it), so the same
// bits as converting x there first.
void linear_xb(const QMatrix& w, const Tensor& workspace, const Tensor& y) {
  const int64_t T = y.dim(0);
  LILY_CHECK(linear_xb_supported(w, T), "linear_xb: ", T, " rows of a ", w.bits, "-bit ", w.rows, "x", w.cols,
             " matrix do not run on the wgmma GEMM");
  LILY_CHECK(is_aligned16(workspace.data) && workspace.numel() >= T * w.cols, "linear_xb: the workspace (",
             workspace.numel(), " elements) does not hold X as bf16 [", T, ", ", w.cols, "] at a 16-byte address");
  const LinearArgs a = xb_product(w, workspace.ptr<uint16_t>(), y.ptr<float>(), T);
  XbCopy xb{workspace.ptr<uint16_t>(), workspace.numel(), nullptr, 0, T, w.cols};
  linear_tiles(a, ceil_div<int64_t>(T, LINEAR_TILE_ROWS), T, xb);
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
  launch(embedding_kernel, grid, threads, 0, p);
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
