// Launcher of the sparse MoE block, all on the device with no host synchronisation.
// Decode (use_moe_decode: T <= 4, fast affine experts), three or four launches:
//   with an 8-bit router over H = 2048 (use_moe_router; also a short prompt's tokens, a cluster each):
//   router logits, shared expert gate logit, softmax and top-k in one kernel (kernels/moe_router.cuh);
//   otherwise router logits and shared expert gate logit (one product over their stacked rows) -> moe_topk
//   -> moe_up (gate and up of the K chosen experts and the shared expert, SwiGLU, routing weight)
//   -> moe_down (all K+1 down products per output as one virtual row, summed into out, or added to it:
//      moe_add, moe_add_rms_norm, moe_rms_normed_add);
//   moe_rms_normed_add (where moe_rms_normed_supported): the fused router and moe_up stage rms_norm(x) * w
//   of the residual row x themselves (their NORM_IN instances), and moe_down adds into x;
//   on integer tensor cores (kernels/moe_mma.cuh) where use_moe_mma holds (one group size, whole
//   64-byte segments), else the fp32 GEMV kernels of kernels/moe_decode.cuh.
// Otherwise (prefill):
//   router logits and shared expert gate logit (one linear over their stacked rows, router_gates, where the
//   loader stacked them; else two)
//   -> moe_topk (softmax, top-k, renormalise, sigmoid of the shared gate)
//   -> moe_count, moe_scatter (rows grouped by expert, tile maps; kernels/moe_routing.cuh)
//   -> grouped gate/up as one gated product (linear.h: y = routing weight * silu(gate) * up; where the
//      fused GEMM does not apply, linear_tiles runs the gate product, then the up product with SwiGLU)
//   -> the shared expert's gate/up, gated the same way (sigmoid gate as the row scale) over all T tokens
//   -> grouped down product (routed rows and shared rows) -> moe_combine (fixed order; the rows as bf16 where
//      both down products run on the wgmma GEMM and a float4-row combine reads them: down_to_bf16);
//   medium prompts (use_moe_small: T in (MOE_DECODE_MAX_TOKENS, MOE_SMALL_MAX_TOKENS], the real dims) run the
//   routed gate/up and down products on kernels/moe_small.cuh (the tokens as the MMA's N, n8 tiles instead
//   of 64-row tiles), same inputs and outputs; the shared expert's stay on the wgmma GEMM.
// Scratch rows (moe_work_rows = C*(K+1)): grouped routed rows [0, T*K), shared rows [T*K, T*K+T).
// The wgmma GEMMs read their X as bf16 from s.xb (linear.h's XbCopy): h converted once for the router,
// the shared-expert gate and the gate/up products over it; the activation rows written there as bf16 by
// the GATED gate/up products themselves (moe_xb_elems' layout, hand_over_xb) where the kernels on both
// sides take it, else converted from the F32 rows by each down product (routed, then shared).
// The grouped products run over an upper bound of tiles; tiles past the device count exit at once. With
// 128-row tiles the routed gate/up product is two launches of the wgmma GEMM: BM = 128 over the 128-row map,
// then BM = 64 over the tail map of the experts' last remainders of at most 64 rows (MoePrompt::tails); the
// down product over the whole map (its 64-row tiles measured slower: 8 k-tiles a tile), then BM = 160 over
// the merge map: an expert past 128 rows whose remainder is at most 32 rows has its last full tile and the
// remainder as one 160-row tile (MoePrompt::merge; one k loop where two tiles cost two).
#include <algorithm>
#include <array>

#include "cuda_ops.h"
#include "kernels/moe_decode.cuh"
#include "kernels/moe_mma.cuh"
#include "kernels/moe_router.cuh"
#include "kernels/moe_routing.cuh"
#include "kernels/moe_small.cuh"
#include "linear.h"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

// The I32 routing words of one call with T tokens (sized for C >= T by moe_routing_words).
struct RoutingTables {
  int32_t* topk_id;      // [T, K]
  float* topk_w;         // [T, K]
  int32_t* topk_row;     // [T, K]
  int32_t* row_token;    // [T*K]
  float* row_weight;     // [T*K]
  int32_t* chunk_count;  // [ceil(T / MOE_ROUTE_TOKENS), E]
  int32_t* row_end;      // [E]
  int32_t* tile_expert;  // [max_tiles] the tile map (moe_scatter_kernel)
  int32_t* tile_row0;    // [max_tiles]
  int32_t* num_tiles;    // [1]
  int32_t* tail_expert;  // [E] the tail map of 64-row tiles beside a 128-row map (empty otherwise)
  int32_t* tail_row0;    // [E]
  int32_t* num_tail_tiles;  // [1]
  int32_t* all_expert;   // [max_tiles] the whole map, ceil(n_e / tile rows) tiles an expert (the down product's)
  int32_t* all_row0;     // [max_tiles]
  int32_t* num_all_tiles;  // [1]
  int32_t* merge_expert;   // [E] the merge map: an expert's last 128-row tile and its remainder of <= 32 rows
  int32_t* merge_row0;     // [E]
  int32_t* num_merge_tiles;  // [1]
  int64_t max_tiles, words;
};

// Average routed rows per expert from which the grouped products take 128-row tiles. gemm_lab, 256
// experts, top-8: at 64 rows per expert (T = 2048) gate/up 218 -> 175 us, down 271 -> 242 us; at 128
// (T = 4096) 358 -> 270 and 460 -> 389 us. Below 64 not measured: 64-row tiles stay.
constexpr int64_t MOE_WIDE_TILE_MIN_ROWS = 64;

// An upper bound of the tile count for tiles of LINEAR_TILE_ROWS or more rows.
static int64_t max_routed_tiles(int64_t T, int64_t E, int top_k) {
  const int64_t rows = T * top_k;
  return ceil_div<int64_t>(rows, LINEAR_TILE_ROWS) + std::min(E, rows);
}

static RoutingTables routing_tables(int32_t* base, int64_t T, int64_t E, int top_k) {
  RoutingTables r;
  const int64_t TK = T * top_k;
  r.max_tiles = max_routed_tiles(T, E, top_k);
  int32_t* p = base;
  auto take = [&p](int64_t n) {
    int32_t* q = p;
    p += n;
    return q;
  };
  r.topk_id = take(TK);
  r.topk_w = reinterpret_cast<float*>(take(TK));
  r.topk_row = take(TK);
  r.row_token = take(TK);
  r.row_weight = reinterpret_cast<float*>(take(TK));
  r.chunk_count = take(ceil_div<int64_t>(T, MOE_ROUTE_TOKENS) * E);
  r.row_end = take(E);
  r.tile_expert = take(r.max_tiles);
  r.tile_row0 = take(r.max_tiles);
  r.num_tiles = take(1);
  r.tail_expert = take(E);
  r.tail_row0 = take(E);
  r.num_tail_tiles = take(1);
  r.all_expert = take(r.max_tiles);
  r.all_row0 = take(r.max_tiles);
  r.num_all_tiles = take(1);
  r.merge_expert = take(E);
  r.merge_row0 = take(E);
  r.num_merge_tiles = take(1);
  r.words = p - base;
  return r;
}

int64_t moe_routing_words(int64_t C, int64_t E, int top_k) {
  return routing_tables(nullptr, C, E, top_k).words;
}

// s.xb of a prefill call with T tokens: from the start the XbCopy of the products (h's bf16 copy, a down
// product's converted X, split-K partials after it: moe_xb_min_elems at least); at the end, where s.xb has
// room for them (moe_xb_elems), the activation rows as the down products' Xb (hand_over_xb), routed
// [T*K, I] then shared [T, Is], each block starting on 64 elements (128 B; TMA wants 16). Taken from the
// end, the XbCopy keeps what it had before the hand-over existed less the blocks: the split-K choices of
// short prompts stay where the workspace is large (the session's), so do their bits.
static int64_t xb_block(int64_t n) { return (n + 63) / 64 * 64; }

int64_t moe_xb_min_elems(int64_t C, int64_t H, int64_t I, int64_t Is, int top_k) {
  return C * std::max({H, top_k * I, Is});
}

int64_t moe_xb_elems(int64_t C, int64_t H, int64_t I, int64_t Is, int top_k) {
  return xb_block(moe_xb_min_elems(C, H, I, Is, top_k)) + xb_block(C * top_k * I) + xb_block(C * Is);
}

// The gated product g writes its activation rows as the down product p's Xb at xb (LinearArgs::yb and
// ::xb) where both kernels take it (returns true); otherwise both stay as they are (F32 rows, converted
// by p).
static bool hand_over_xb(LinearArgs& g, LinearArgs& p, uint16_t* xb) {
  LinearArgs gx = g, px = p;
  gx.yb = xb;
  gx.y = nullptr;
  gx.ldy = 0;
  px.xb = xb;
  px.x = nullptr;
  px.ldx = 0;
  if (!linear_writes_xb(gx) || !linear_reads_xb(px)) return false;
  g = gx;
  p = px;
  return true;
}

static Tensor rows_of(const Tensor& t, int64_t row0, int64_t n) {
  return Tensor::of(t.ptr<float>() + row0 * t.dim(1), DType::F32, t.device, {n, t.dim(1)});
}

// One product of the block: y rows [.., ldy] from x rows [.., ldx] over dense or grouped tiles.
static LinearArgs product(const QMatrix& w, const float* x, int64_t ldx, float* y, int64_t ldy) {
  LinearArgs a;
  a.w = weight_view(w);
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  return a;
}

// a over one of the routing tables' tile maps (expert and first row a tile, the tile count), tile_rows rows a tile.
static LinearArgs on_map(LinearArgs a, const RoutingTables& r, int32_t* expert, int32_t* row0, int32_t* count,
                         int tile_rows) {
  a.tiles.tile_expert = expert;
  a.tiles.tile_row0 = row0;
  a.tiles.row_end = r.row_end;
  a.tiles.num_tiles = count;
  a.tiles.tile_rows = tile_rows;
  return a;
}

// a over the tile map (tile_rows rows a tile; its tail map: tail_of).
static LinearArgs grouped(LinearArgs a, const RoutingTables& r, int tile_rows) {
  return on_map(a, r, r.tile_expert, r.tile_row0, r.num_tiles, tile_rows);
}

// a over the whole map (each expert's ceil(n_e / tile_rows) tiles, less a merged expert's last two).
static LinearArgs grouped_whole(LinearArgs a, const RoutingTables& r, int tile_rows) {
  return on_map(a, r, r.all_expert, r.all_row0, r.num_all_tiles, tile_rows);
}

// The grouped product a over the merge map of LINEAR_MERGE_TILE_ROWS-row tiles instead.
static LinearArgs merge_of(const LinearArgs& a, const RoutingTables& r) {
  return on_map(a, r, r.merge_expert, r.merge_row0, r.num_merge_tiles, LINEAR_MERGE_TILE_ROWS);
}

// The grouped product a over the tail map of 64-row tiles instead (rows, hand-overs and the rest as a's).
static LinearArgs tail_of(const LinearArgs& a, const RoutingTables& r) {
  return on_map(a, r, r.tail_expert, r.tail_row0, r.num_tail_tiles, LINEAR_TILE_ROWS);
}

static LinearArgs dense(LinearArgs a, int64_t M) {
  a.tiles.M = M;
  return a;
}

// The product of a's matrix (the gate) gated by up over the same rows: y = row_scale * silu(gate) * up.
static LinearArgs gated(LinearArgs a, const QMatrix& up, const float* row_scale) {
  a.up = weight_view(up);
  a.row_scale = row_scale;
  return a;
}

static AffineStack affine_stack(const QMatrix& m) {
  return AffineStack{static_cast<const uint32_t*>(m.weight.data()), static_cast<const uint16_t*>(m.scales.data()),
                     static_cast<const uint16_t*>(m.biases.data()), int(m.rows), int(m.cols), m.group_size};
}

static size_t staged_bytes(int64_t rows, int64_t cols, int bits) {
  return size_t(rows) * (size_t(cols) * 4 + size_t(cols) / (128 / bits) * 4);  // x, one sum per 16-byte chunk
}

// The decode chain: few tokens, every expert matrix in the GEMV form with one bit width, the
// activation rows [T, K+1, ld] and h 16-byte aligned, the staged rows within a CTA's shared memory.
static bool use_moe_decode(const MoeWeights& w, const Tensor& h, const ops::MoeScratch& s, int top_k) {
  const QMatrix* mats[] = {w.gate_proj, w.up_proj, w.down_proj, w.shared_gate_proj, w.shared_up_proj,
                           w.shared_down_proj};
  for (const QMatrix* m : mats)
    if (!is_fast_affine(weight_view(*m)) || m->bits != w.gate_proj->bits) return false;
  const int64_t T = h.dim(0), I = w.gate_proj->rows, Is = w.shared_gate_proj->rows, ld = s.gate.dim(1);
  const int bits = w.gate_proj->bits;
  return T <= MOE_DECODE_MAX_TOKENS && I % MOE_UP_PAIRS == 0 && Is % MOE_UP_PAIRS == 0 && is_aligned16(h.data) &&
         is_aligned16(s.gate.data) && ld % 4 == 0 && staged_bytes(1, h.dim(1), bits) <= GEMV_MAX_SMEM &&
         staged_bytes(top_k + 1, std::max(I, Is), bits) <= GEMV_MAX_SMEM;
}

template <typename Kernel>
static void allow_gemv_smem(Kernel* kernel) {
  LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GEMV_MAX_SMEM)));
}

template <int BITS>
static void launch_moe_decode(const MoeWeights& w, const Tensor& h, const Tensor& out, const RoutingTables& r,
                              const float* shared_w, float* act, int64_t ld, int top_k) {
  static const bool configured = [] {
    allow_gemv_smem(moe_up_kernel<BITS>);
    allow_gemv_smem(moe_down_kernel<BITS>);
    return true;
  }();
  (void)configured;
  const int64_t T = h.dim(0), H = h.dim(1);
  MoeUpParams u{affine_stack(*w.gate_proj), affine_stack(*w.up_proj), affine_stack(*w.shared_gate_proj),
                affine_stack(*w.shared_up_proj), h.ptr<float>(), r.topk_id, r.topk_w, shared_w, act, top_k, int(ld),
                gemv_tpr(H / (128 / BITS)), 0};
  u.passes = int(ceil_div<int64_t>(top_k * w.gate_proj->rows + w.shared_gate_proj->rows,
                                   (GEMV_THREADS / u.tpr) * MOE_UP_PAIRS));
  const size_t up_smem = staged_bytes(1, H, BITS);
  const int up_ctas = int(ceil_div<int64_t>(
      gemv_grid(reinterpret_cast<const void*>(moe_up_kernel<BITS>), up_smem, u.passes * T), T));
  launch(moe_up_kernel<BITS>, dim3(unsigned(up_ctas), unsigned(T)), GEMV_THREADS, up_smem, u);
  LILY_CUDA_LAUNCHED();

  const int64_t cmax = std::max(w.down_proj->cols, w.shared_down_proj->cols) / (128 / BITS);
  // one virtual row per output: K routed rows then the shared one; tpr threads take it in one batch
  const int64_t cv = (top_k * w.down_proj->cols + w.shared_down_proj->cols) / (128 / BITS);
  const int down_tpr = gemv_tpr(ceil_div<int64_t>(cv, MOE_DOWN_LOADS));
  MoeDownParams d{affine_stack(*w.down_proj), affine_stack(*w.shared_down_proj), r.topk_id, act, out.ptr<float>(),
                  top_k, int(ld), down_tpr, int(ceil_div<int64_t>(H, GEMV_THREADS / down_tpr))};
  const size_t down_smem = staged_bytes(top_k + 1, cmax * (128 / BITS), BITS);
  const int down_ctas = int(ceil_div<int64_t>(
      gemv_grid(reinterpret_cast<const void*>(moe_down_kernel<BITS>), down_smem, d.passes * T), T));
  launch(moe_down_kernel<BITS>, dim3(unsigned(down_ctas), unsigned(T)), GEMV_THREADS, down_smem, d);
  LILY_CUDA_LAUNCHED();
}

// The tensor-core decode chain: use_moe_decode's conditions, one group size over all six matrices that
// gemv_mma takes (whole segments in H, I and Is; BF16 pairs 4-byte aligned when a group is half a segment),
// and both staged activations within a CTA's shared memory.
static bool use_moe_mma(const MoeWeights& w, const Tensor& h, const ops::MoeScratch& s, int top_k) {
  if (!use_moe_decode(w, h, s, top_k)) return false;
  const QMatrix* mats[] = {w.gate_proj, w.up_proj, w.down_proj, w.shared_gate_proj, w.shared_up_proj,
                           w.shared_down_proj};
  const int bits = w.gate_proj->bits, halves = mma_group_halves(bits, w.gate_proj->group_size);
  const int64_t vals = 512 / bits, I = w.gate_proj->rows, Is = w.shared_gate_proj->rows, H = h.dim(1);
  if (halves == 0 || H % vals != 0 || I % vals != 0 || Is % vals != 0) return false;
  if ((top_k * I + Is) / vals >= 65536) return false;  // moe_down_mma's slot of a virtual segment (umulhi)
  for (const QMatrix* m : mats) {
    if (m->group_size != w.gate_proj->group_size) return false;
    if (halves == 2 && (reinterpret_cast<uintptr_t>(m->scales.data()) % 4 != 0 ||
                        reinterpret_cast<uintptr_t>(m->biases.data()) % 4 != 0))
      return false;
  }
  const int vb = int(vals / halves);
  return mma_x_bytes(H, vb) <= GEMV_MAX_SMEM && mma_x_bytes(top_k * I + Is, vb) <= GEMV_MAX_SMEM;
}

// The up product's NORM_IN instance (norm_in.w set) launches with the plain one's plan, so its K split
// and sums are those of moe_up over the normalised row; both are held to MMA_MIN_CTAS CTAs per SM.
template <int BITS, int NG>
static void launch_moe_mma(const MoeWeights& w, const Tensor& h, const Tensor& out, const RoutingTables& r,
                           const float* shared_w, float* act, int64_t ld, int top_k, bool accumulate,
                           const NormTail& tail, const NormIn& norm_in, const float* router_raw = nullptr,
                           const float* res_add = nullptr) {
  const auto up = moe_up_mma_kernel<BITS, NG, false>, up_normed = moe_up_mma_kernel<BITS, NG, true>;
  const auto down = moe_down_mma_kernel<BITS, NG>;
  static const bool configured = [&] {
    allow_gemv_smem(up);
    allow_gemv_smem(up_normed);
    allow_gemv_smem(down);
    return true;
  }();
  (void)configured;
  constexpr int VALS = MmaSeg<BITS>::VALS, VB = VALS / NG;
  const int64_t T = h.dim(0), H = h.dim(1), I = w.gate_proj->rows, Is = w.shared_gate_proj->rows;
  MoeMmaParams p{affine_stack(*w.gate_proj), affine_stack(*w.up_proj), affine_stack(*w.shared_gate_proj),
                 affine_stack(*w.shared_up_proj), affine_stack(*w.down_proj), affine_stack(*w.shared_down_proj),
                 h.ptr<float>(), r.topk_id, r.topk_w, shared_w, act, out.ptr<float>(), top_k, int(ld),
                 log2_of(w.gate_proj->group_size), 1, 1, accumulate, tail, norm_in, router_raw,
                 int(w.router->rows), res_add};
  const size_t up_smem = mma_x_bytes(H, VB), down_smem = mma_x_bytes(top_k * I + Is, VB);
  const MmaPlan pu = mma_plan(reinterpret_cast<const void*>(up), up_smem, ceil_div<int64_t>(top_k * I + Is, 8),
                              H / VALS, T, true);
  const MmaPlan pd = mma_plan(reinterpret_cast<const void*>(down), down_smem, ceil_div<int64_t>(H, 16),
                              (top_k * I + Is) / VALS, T, true);
  p.ks_up = pu.ks, p.ks_down = pd.ks;
  launch(norm_in.w != nullptr ? up_normed : up, dim3(unsigned(pu.grid), unsigned(T)), MMA_THREADS, up_smem, p);
  LILY_CUDA_LAUNCHED();
  launch(down, dim3(unsigned(pd.grid), unsigned(T)), MMA_THREADS, down_smem, p);
  LILY_CUDA_LAUNCHED();
}

// Medium prompts: the routed gate/up and down products on the few-rows kernels (kernels/moe_small.cuh, the
// tokens as the MMA's N) instead of the wgmma GEMM, whose 64-row expert tiles are mostly padding there (at
// T = 146, top-8 of 256 experts: ~4.6 rows an expert). From MOE_DECODE_MAX_TOKENS + 1 tokens (below, the
// decode chain) up to MOE_SMALL_MAX_TOKENS (gate/up) and MOE_SMALL_DOWN_MAX_TOKENS (down): estimates
// measured (benchmarks/gemm_lab.cu, GEMM_LAB_T; docs/perf-notes.md, ninth session): gate/up 202 against the
// wgmma GEMM's 210 us at T = 300 and 239 against 215 at T = 512, crossing at ~350; down 103 against 116 at
// T = 300 and 119 against 121 at T = 512, so its bound stays at the top of the range.
constexpr int64_t MOE_SMALL_MAX_TOKENS = 352, MOE_SMALL_DOWN_MAX_TOKENS = 512;
// The dims it is built and measured for first (Qwen3.6-35B-A3B): hidden, expert intermediate, experts,
// top-k. Other configurations keep the wgmma GEMM (tests/gpu/test_moe.py says so).
constexpr int64_t MOE_SMALL_H = 2048, MOE_SMALL_I = 512, MOE_SMALL_E = 256;
constexpr int MOE_SMALL_TOP_K = 8;

// One product's matrix on moe_small_kernel: 4-bit affine, BF16 scales, whole 128-value segments, a power-of-two
// group of 32 or more values, an even number of groups a row and 4-byte aligned scale and bias arrays (the
// ring copies aligned pairs of them), rows in whole warp tiles (gated 16, plain 32).
static bool moe_small_matrix(const WeightView& w, bool gated) {
  const int64_t gs = w.group_size;
  return is_fast_affine(w) && w.bits == 4 && w.cols % MS_SEG_VALS == 0 && gs >= 32 && (gs & (gs - 1)) == 0 &&
         w.cols % gs == 0 && (w.cols / gs) % 2 == 0 && reinterpret_cast<uintptr_t>(w.scales) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(w.biases) % 4 == 0 && w.rows % (gated ? 16 : 32) == 0;
}

// Which routed products (g: gated gate/up over h's rows through x_rows, d: down over g's output) of T tokens
// run on moe_small_kernel: s.moe_small, T in the product's range, the real dims (both products' shapes checked
// for either), both matrices of g alike, and X readable as the kernel stages it (F32 rows 16-byte aligned,
// or Xb).
struct MoeSmall {
  bool up = false, down = false;
};
static MoeSmall use_moe_small(const LinearArgs& g, const LinearArgs& d, int64_t T, int64_t E, int top_k,
                              const ops::MoeScratch& s) {
  if (!s.moe_small || T <= MOE_DECODE_MAX_TOKENS) return {};
  if (E != MOE_SMALL_E || top_k != MOE_SMALL_TOP_K || g.w.cols != MOE_SMALL_H || g.w.rows != MOE_SMALL_I ||
      d.w.cols != MOE_SMALL_I || d.w.rows != MOE_SMALL_H)
    return {};
  MoeSmall m;
  m.up = T <= MOE_SMALL_MAX_TOKENS && moe_small_matrix(g.w, true) && moe_small_matrix(g.up, true) &&
         g.up.rows == g.w.rows && g.up.cols == g.w.cols && g.up.group_size == g.w.group_size &&
         is_aligned16(g.x) && g.ldx % 4 == 0;
  m.down = T <= MOE_SMALL_DOWN_MAX_TOKENS && moe_small_matrix(d.w, false) &&
           (d.xb != nullptr ? is_aligned16(d.xb) : is_aligned16(d.x) && d.ldx % 4 == 0);
  return m;
}

// One routed product on the few-rows expert kernels: grid (slices of the outputs, E experts), the rows of
// each expert from the routing tables (a.tiles.row_end), the kernel and NT n8 tiles a pass by ms_plan; the
// ring as deep as the product's dims leave room for (K: use_moe_small's). Each instance sets its own
// attributes once; only the ring kernels take the maximum shared-memory carveout (two or three CTAs an SM
// need nearly all of it; the register-pipeline kernel keeps the default, whose larger L1 it runs faster
// with: 138.7 against 171.1 us at T = 146, thirteenth session).
template <bool GATED, int NT, bool RING>
static void launch_moe_small(const LinearArgs& a, int64_t E) {
  constexpr int64_t K = GATED ? MOE_SMALL_H : MOE_SMALL_I;
  using L = MsLaunch<GATED, NT, RING, K>;
  const auto kernel = L::kernel();
  constexpr size_t smem = L::smem;
  static const bool configured = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (RING)
      LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    return true;
  }();
  (void)configured;
  LILY_CHECK(a.w.cols == K, "moe: the few-rows expert kernel is built for ", K, " inputs, not ", a.w.cols);
  launch(kernel, dim3(unsigned(ceil_div<int64_t>(a.w.rows, L::cta_rows)), unsigned(E)), MS_THREADS, smem, a);
  LILY_CUDA_LAUNCHED();
}

// ms_plan's choices: gated 16-row passes on either kernel, down 16 or 24 on the ring.
static void run_moe_small_gated(const LinearArgs& a, int64_t T, int64_t E, int top_k) {
  if (ms_plan(true, T * top_k, E).ring) return launch_moe_small<true, 2, true>(a, E);
  launch_moe_small<true, 2, false>(a, E);
}
static void run_moe_small_down(const LinearArgs& a, int64_t T, int64_t E, int top_k) {
  if (ms_plan(false, T * top_k, E).nt == 2) return launch_moe_small<false, 2, true>(a, E);
  launch_moe_small<false, 3, true>(a, E);
}

// CTAs of moe_router_kernel for E experts: 16 router rows each, one cluster.
static int router_ctas(int64_t E) { return int(ceil_div<int64_t>(E, ROUTER_ROWS)); }

// Whether a cluster of n moe_router_kernel<NORM_IN> CTAs can be resident at all (n > 8 needs the
// non-portable cluster size, granted per device; a CTA's 544 or 576 threads at 96 registers take more than
// half an SM's registers, so n SMs of one GPC). One CTA (a plain launch) always fits; the others are queried once
// per instance; a refusal leaves that n on the GEMV + moe_topk path.
template <bool NORM_IN>
static bool router_cluster_fits(int n) {
  static const std::array<bool, ROUTER_MAX_CTAS + 1> fits = [] {
    std::array<bool, ROUTER_MAX_CTAS + 1> f{};
    f[1] = true;
    for (int c = 2; c <= ROUTER_MAX_CTAS; ++c) f[c] = cluster_fits(moe_router_kernel<NORM_IN>, c, router_threads(NORM_IN));
    return f;
  }();
  return fits[n];
}

// The fused router: one token (decode) or a short prompt's T <= MOE_DECODE_MAX_TOKENS (a cluster per token,
// the one-token bits; it replaces two multi-token GEMVs and moe_topk); router and shared expert gate both
// 8-bit affine with BF16 scales, whole 16-value chunks in a group, over H = ROUTER_COLS; E <= 256 and its
// cluster resident (of the NORM_IN instance when `normed`); h 16-byte aligned (its float4 loads).
static bool use_moe_router(const MoeWeights& w, const Tensor& h, bool normed) {
  const QMatrix* mats[] = {w.router, w.shared_expert_gate};
  for (const QMatrix* m : mats)
    if (!is_fast_affine(weight_view(*m)) || m->bits != 8 || m->num_stack != 1 || m->cols != ROUTER_COLS ||
        m->group_size <= 0 || m->group_size % 16 != 0 || ROUTER_COLS % m->group_size != 0)
      return false;
  const int64_t E = w.router->rows;
  const int n = router_ctas(E);
  return h.dim(0) >= 1 && h.dim(0) <= MOE_DECODE_MAX_TOKENS && h.dim(1) == ROUTER_COLS &&
         w.shared_expert_gate->rows == 1 && E >= 1 && E <= ROUTER_MAX_EXPERTS && is_aligned16(h.data) &&
         (normed ? router_cluster_fits<true>(n) : router_cluster_fits<false>(n));
}

static void launch_moe_router(const MoeWeights& w, const Tensor& h, const RoutingTables& r, float* shared_gate,
                              int top_k, const NormIn& norm_in) {
  const MoeRouterParams p{affine_stack(*w.router), affine_stack(*w.shared_expert_gate), h.ptr<float>(), r.topk_id,
                          r.topk_w, shared_gate, top_k, norm_in};
  const unsigned n = unsigned(router_ctas(w.router->rows));
  const bool normed = norm_in.w != nullptr;
  launch_clustered(normed ? moe_router_kernel<true> : moe_router_kernel<false>, dim3(n, unsigned(h.dim(0))),
                   dim3(unsigned(router_threads(normed))), dim3(n), 0, p);
  LILY_CUDA_LAUNCHED();
}

// Where the router and the shared-expert gate run as one product over their stacked rows (router_gates: E
// logits, then the gate logit, a row of E + 1 a token) when the fused router does not run: the loader stacked
// them and a scratch holds [T, E + 1], decode in router_logits (it has a spare row then), prompts in s.gate
// (free until the gate/up products; T * K rows of I >= E + 1 values). Null: two products. One product instead
// of two saves the second's fixed cost (a prompt's shared gate is one output row for the whole K walk: ~15 us
// at T = 146, docs/perf-notes.md).
static float* router_stack_at(const MoeWeights& w, const ops::MoeScratch& s, int64_t T, bool fused) {
  if (!w.router_gates || fused) return nullptr;
  if (T == 1 && s.router_logits.dim(0) >= 2) return s.router_logits.ptr<float>();
  return s.gate.numel() >= T * (w.router->rows + 1) ? s.gate.ptr<float>() : nullptr;
}

// A prompt's expert products past the decode chain: the routed gate/up and down over the routing tables' tile
// maps (the down product's the whole map; 128-row tiles once the experts average MOE_WIDE_TILE_MIN_ROWS rows and all grouped products have a
// 128-row kernel: docs/perf-notes.md, "MoE prefill tiles"; then `tails`: the gate/up product takes an
// expert's last remainder of at most 64 rows on the tail map's 64-row tiles, whose k-tiles cost ~0.75 of a 128-row one, instead of a
// 128-row tile of mostly padding: docs/perf-notes.md, nineteenth session), the shared expert's pair over
// all T rows, the bf16 hand-overs where both kernels of a pair take them (moe_xb_elems' layout: the activation blocks at the
// end of s.xb, the XbCopy's `xb_capacity` elements before them, all of s.xb when neither pair hands over), and
// which routed products run on moe_small. Built once for run_moe's launches and for moe_xb_only_supported.
struct MoePrompt {
  LinearArgs routed_up, routed_down, shared_up, shared_down;
  int tile_rows;
  bool tails;  // 128-row tiles with the tail map beside them (the routed gate/up also over tail_of)
  bool merge;  // the down product's whole map with the merge map beside it (the routed down also over merge_of)
  int64_t xb_capacity;
  MoeSmall small;
};

static MoePrompt moe_prompt(const MoeWeights& w, const Tensor& h, const ops::MoeScratch& s, const RoutingTables& r,
                            const float* shared_w, int top_k) {
  const int64_t T = h.dim(0), H = h.dim(1), E = w.router->rows, TK = T * top_k, ld = s.gate.dim(1);
  const int64_t I = w.down_proj->cols, Is = w.shared_down_proj->cols;
  // [T*K + T, ld]: silu(gate)*up*weight (the two-product fallback: gate products, then that in place)
  float* act = s.gate.ptr<float>();
  float* shared_act = act + TK * ld;
  float* down = s.down.ptr<float>();  // [T*K + T, H]
  LinearArgs gate_up = gated(product(*w.gate_proj, h.ptr<float>(), H, act, ld), *w.up_proj, r.row_weight);
  gate_up.x_rows = r.row_token;
  const LinearArgs dn = product(*w.down_proj, act, ld, down, H);
  const bool wide = TK >= MOE_WIDE_TILE_MIN_ROWS * E && linear_wide_tiles(gate_up) && linear_wide_tiles(dn);
  MoePrompt p;
  p.tile_rows = wide ? LINEAR_WIDE_TILE_ROWS : LINEAR_TILE_ROWS;
  p.tails = wide;
  p.routed_up = grouped(gate_up, r, p.tile_rows);
  p.routed_down = grouped_whole(dn, r, p.tile_rows);
  p.shared_up = dense(gated(product(*w.shared_gate_proj, h.ptr<float>(), H, shared_act, ld), *w.shared_up_proj,
                            shared_w),
                      T);
  p.shared_down = dense(product(*w.shared_down_proj, shared_act, ld, down + TK * H, H), T);
  p.xb_capacity = s.xb.numel();
  if (s.xb.numel() >= moe_xb_elems(T, H, I, Is, top_k)) {
    const int64_t copy = (s.xb.numel() - xb_block(TK * I) - xb_block(T * Is)) / 64 * 64;
    uint16_t* routed_xb = s.xb.ptr<uint16_t>() + copy;
    const bool routed = hand_over_xb(p.routed_up, p.routed_down, routed_xb);
    const bool shared = hand_over_xb(p.shared_up, p.shared_down, routed_xb + xb_block(TK * I));
    if (routed || shared) p.xb_capacity = copy;
  }
  p.small = use_moe_small(p.routed_up, p.routed_down, T, E, top_k, s);
  // dn: a plain product of non-gathered rows that satisfies linear_wide_tiles (LINEAR_MERGE_TILE_ROWS' rule)
  p.merge = wide && !p.small.down;
  return p;
}

// run_moe reads h's F32 rows in the fused router and the decode chain (T <= MOE_DECODE_MAX_TOKENS) and in
// every product over h off the wgmma GEMM (and, the routed gate/up, off moe_small's gated kernel, which
// gathers the XbCopy's rows when it holds h); elsewhere only the XbCopy, which holds h from the start when h
// arrives as bf16 (F32_AND_XB, XB). The router products run through linear_with_xb, which takes the wgmma
// GEMM exactly where linear_xb_supported holds for an aligned h.
bool moe_xb_only_supported(const MoeWeights& w, const Tensor& h, const ops::MoeScratch& s, int top_k) {
  const int64_t T = h.dim(0);
  if (use_moe_router(w, h, false) || use_moe_decode(w, h, s, top_k) || !is_aligned16(h.data)) return false;
  const bool routers = router_stack_at(w, s, T, false) != nullptr
                           ? linear_xb_supported(*w.router_gates, T)
                           : linear_xb_supported(*w.router, T) && linear_xb_supported(*w.shared_expert_gate, T);
  const RoutingTables r = routing_tables(s.routing.ptr<int32_t>(), T, w.router->rows, top_k);
  const MoePrompt p = moe_prompt(w, h, s, r, s.shared_gate.ptr<float>(), top_k);
  return routers && (p.small.up || linear_tiles_on_wgmma(p.routed_up)) && linear_tiles_on_wgmma(p.shared_up);
}

// moe_combine_add_rms_norm_kernel takes a prompt's combine with the norm n: moe_combine4_at's float4 rows of
// s.down (H % 4 == 0, 16-byte aligned, K <= MOE_COMBINE4_MAX_K) and add_rms_norm's float4 path for n (its bits).
static bool combine_takes_norm(const ops::MoeScratch& s, int64_t H, int top_k, const AddRmsNormLaunch& n) {
  return n.vec4 && n.p.D == H && H % 4 == 0 && top_k <= MOE_COMBINE4_MAX_K && is_aligned16(s.down.data);
}

// The combine on vector rows of s.down: moe_combine_add_rms_norm_kernel with a norm (combine_takes_norm,
// checked), else moe_combine4_kernel where its alignment holds (out 16-byte aligned too); otherwise
// moe_combine_kernel (F32 rows only).
static bool combine4(const ops::MoeScratch& s, int64_t H, int top_k, const Tensor& out, bool norm) {
  return norm || (H % 4 == 0 && top_k <= MOE_COMBINE4_MAX_K && is_aligned16(s.down.data) && is_aligned16(out.data));
}

// The bf16 rows' combines (moe_combine8_at: a 16-byte load a row of the pair order's 16-column blocks, H % 16 ==
// 0; with the norm, the token's m row in H * 4 bytes of dynamic shared memory, at most the 48 KB a launch gets
// without opting in).
static bool combine8(int64_t H, bool norm) { return H % 16 == 0 && (!norm || H * 4 <= 48 * 1024); }

// A prompt's down products writing their rows as bf16 into s.down's memory (LinearArgs::y16, pair order; row r at
// r*H elements, half the bytes; routed rows, then the shared rows at T*K*H) where both run on the wgmma GEMM's
// plain epilogue (linear_writes_bf16; not the routed product on moe_small), y unset. The caller takes it only
// for a vector-row combine that reads bf16 rows (combine4 and combine8: moe_combine_bf16_kernel or the norm
// kernel's BF16 instance; MoeScratch::down_bf16, docs/numerics.md). Returns whether p's down products were
// changed.
static bool down_to_bf16(MoePrompt& p, uint16_t* down16, int64_t TK, int64_t H) {
  LinearArgs rd = p.routed_down, sd = p.shared_down;
  rd.y = sd.y = nullptr;
  rd.y16 = down16;
  sd.y16 = down16 + TK * H;
  if (p.small.down || !linear_writes_bf16(rd) || !linear_writes_bf16(sd)) return false;
  p.routed_down = rd;
  p.shared_down = sd;
  return true;
}

// moe(), or accumulating (use_moe_mma): out += the MoE output, then with a tail (T = 1) the tail's RMSNorm.
// With norm_in (moe_rms_normed_supported) h is the residual row x and the block's input rms_norm(x) *
// norm_in.w, staged by the fused router and moe_up. h_in: as ops::moe's (checked there). With norm (a prompt
// past the decode chain, combine_takes_norm: moe_add_rms_norm_xb) the combine adds the output into norm->x and
// normalises it (moe_combine_add_rms_norm_kernel) instead of writing out.
static void run_moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int top_k,
                    bool accumulate, const NormTail& tail, const NormIn& norm_in = {},
                    ops::MoeInput h_in = ops::MoeInput::F32, const AddRmsNormLaunch* norm = nullptr,
                    const float* router_raw = nullptr, const float* res_add = nullptr) {
  const int64_t T = h.dim(0), H = h.dim(1), E = w.router->rows, TK = T * top_k;
  if (T == 0) return;
  LILY_CHECK(top_k <= MOE_MAX_TOP_K, "moe: top_k ", top_k, " above the CUDA limit ", MOE_MAX_TOP_K);
  LILY_CHECK(s.down.dim(1) == H && s.gate.dim(1) >= std::max(w.gate_proj->rows, w.shared_gate_proj->rows),
             "moe: scratch rows are too narrow");
  const RoutingTables r = routing_tables(s.routing.ptr<int32_t>(), T, E, top_k);
  // Up to MOE_DECODE_MAX_TOKENS tokens: the fused router kernel where it applies; else the router and the
  // shared-expert gate as one product where router_stack_at says so, or two
  const bool normed = norm_in.w != nullptr, fused = use_moe_router(w, h, normed);
  LILY_CHECK(!normed || (fused && use_moe_mma(w, h, s, top_k)),
             "moe: a normed input needs the fused router and the tensor-core decode chain");
  LILY_CHECK(!norm || (!use_moe_decode(w, h, s, top_k) && combine_takes_norm(s, H, top_k, *norm)),
             "moe: a norm after the combine needs a prompt's combine on float4 rows");
  const float* stack_at = router_stack_at(w, s, T, fused);
  // h as bf16 in s.xb (linear.h): converted by the first wgmma product over it (the router from 33
  // rows, or the expert gate/up), then read by the others (the shared-expert gate, the gate/up products)
  // (F32_AND_XB, XB: add_rms_norm_xb wrote it there already)
  XbCopy xb{s.xb.ptr<uint16_t>(), s.xb.numel()};
  if (h_in != ops::MoeInput::F32) xb.x = h.ptr<float>(), xb.ldx = H, xb.rows = T, xb.K = H;
  const Tensor logits = stack_at ? Tensor::of(const_cast<float*>(stack_at), DType::F32, h.device, {T, E + 1})
                                 : rows_of(s.router_logits, 0, T);  // [T, E + 1] or [T, E]
  const Tensor sg = rows_of(s.shared_gate, 0, T);                   // [T, 1]
  if (router_raw != nullptr) {  // early routing: router_early_kernel ran before the output projection
    LILY_CHECK(normed && use_moe_mma(w, h, s, top_k), "moe: early routing needs the normed tensor-core decode chain");
  } else if (fused) {
    launch_moe_router(w, h, r, sg.ptr<float>(), top_k, norm_in);
  } else {
    if (stack_at) {
      linear_with_xb(*w.router_gates, 0, h, logits, s.xb, xb);
    } else {
      linear_with_xb(*w.router, 0, h, logits, s.xb, xb);
      linear_with_xb(*w.shared_expert_gate, 0, h, sg, s.xb, xb);
    }
    const int64_t ld = logits.dim(1);
    MoeTopkParams tp{logits.ptr<float>(), stack_at ? logits.ptr<float>() + E : sg.ptr<float>(), sg.ptr<float>(),
                     ld, stack_at ? ld : 1, r.topk_id, r.topk_w, int(T), int(E), top_k};
    const unsigned topk_ctas = unsigned(ceil_div<int64_t>(T, MOE_TOPK_WARPS));
    if (E <= 64) launch(moe_topk_kernel<2>, topk_ctas, MOE_TOPK_WARPS * 32, 0, tp);
    else if (E <= 256) launch(moe_topk_kernel<8>, topk_ctas, MOE_TOPK_WARPS * 32, 0, tp);
    else if (E <= 1024) launch(moe_topk_kernel<32>, topk_ctas, MOE_TOPK_WARPS * 32, 0, tp);
    else fail("moe: ", E, " experts exceed the CUDA top-k kernel's 1024");
    LILY_CUDA_LAUNCHED();
  }

  if (use_moe_mma(w, h, s, top_k)) {
    const bool half = mma_group_halves(w.gate_proj->bits, w.gate_proj->group_size) == 2;
    float* act = s.gate.ptr<float>();
    const int64_t ld = s.gate.dim(1);
    if (w.gate_proj->bits == 4)
      return half ? launch_moe_mma<4, 2>(w, h, out, r, sg.ptr<float>(), act, ld, top_k, accumulate, tail, norm_in,
                                         router_raw, res_add)
                  : launch_moe_mma<4, 1>(w, h, out, r, sg.ptr<float>(), act, ld, top_k, accumulate, tail, norm_in,
                                         router_raw, res_add);
    return half ? launch_moe_mma<8, 2>(w, h, out, r, sg.ptr<float>(), act, ld, top_k, accumulate, tail, norm_in,
                                       router_raw, res_add)
                : launch_moe_mma<8, 1>(w, h, out, r, sg.ptr<float>(), act, ld, top_k, accumulate, tail, norm_in,
                                       router_raw, res_add);
  }
  LILY_CHECK(!accumulate, "moe: a fused residual add needs the tensor-core decode path");
  if (use_moe_decode(w, h, s, top_k)) {
    switch (w.gate_proj->bits) {
      case 4: return launch_moe_decode<4>(w, h, out, r, sg.ptr<float>(), s.gate.ptr<float>(), s.gate.dim(1), top_k);
      case 8: return launch_moe_decode<8>(w, h, out, r, sg.ptr<float>(), s.gate.ptr<float>(), s.gate.dim(1), top_k);
      default: fail("moe: unsupported decode bits ", w.gate_proj->bits);
    }
  }

  MoePrompt p = moe_prompt(w, h, s, r, sg.ptr<float>(), top_k);
  const bool vec4 = combine4(s, H, top_k, out, norm != nullptr);
  uint16_t* const down16 = s.down.ptr<uint16_t>();
  const bool bf16 = s.down_bf16 && vec4 && combine8(H, norm != nullptr) && down_to_bf16(p, down16, TK, H);
  // routing tables: a CTA per chunk of MOE_ROUTE_TOKENS tokens; E <= 1024 (moe_topk's limit above)
  const unsigned chunks = unsigned(ceil_div<int64_t>(T, MOE_ROUTE_TOKENS));
  MoeCountParams cp{r.topk_id, r.chunk_count, int(T), int(E), top_k};
  launch(moe_count_kernel, chunks, MOE_ROUTE_TOKENS, E * sizeof(int32_t), cp);
  LILY_CUDA_LAUNCHED();
  MoeScatterParams sp{r.topk_id, r.topk_w, r.chunk_count, r.topk_row, r.row_end, r.row_token, r.row_weight,
                      r.tile_expert, r.tile_row0, r.num_tiles, r.tail_expert, r.tail_row0, r.num_tail_tiles,
                      r.all_expert, r.all_row0, r.num_all_tiles, r.merge_expert, r.merge_row0, r.num_merge_tiles,
                      int(T), int(E), top_k, p.tile_rows, p.tails ? LINEAR_TILE_ROWS : 0,
                      p.merge ? LINEAR_MERGE_TILE_ROWS - p.tile_rows : 0};
  launch(moe_scatter_kernel, chunks, MOE_ROUTE_TOKENS, (2 + MOE_ROUTE_WARPS) * E * sizeof(int32_t), sp);
  LILY_CUDA_LAUNCHED();

  const int64_t shared_tiles = ceil_div<int64_t>(T, LINEAR_TILE_ROWS);
  xb.capacity = p.xb_capacity;
  if (p.small.up) {
    // the shared gate/up first: its wgmma products leave h's Xb in the XbCopy, which the gated kernel
    // then gathers its rows from (else it converts h's F32 rows itself)
    linear_tiles(p.shared_up, shared_tiles, T, xb);
    if (xb.x == h.ptr<float>() && xb.ldx == H && xb.rows == T && xb.K == H) p.routed_up.xb = xb.data;
    run_moe_small_gated(p.routed_up, T, E, top_k);
  } else {
    // the 128-row map first, the tail map's 64-row tiles (at most E) after it. Their rows are disjoint, but
    // each GEMM launch waits for the one before it (PDL), so the order only moves the two launches' last
    // rounds: this way the bulk starts right after its inputs as before, and the product ends on the
    // shorter 64-row units (the next launch's CTAs start on SMs as the tail's last round frees them)
    linear_tiles(p.routed_up, r.max_tiles, T, xb);
    if (p.tails) linear_tiles(tail_of(p.routed_up, r), E, T, xb);
    linear_tiles(p.shared_up, shared_tiles, T, xb);
  }
  if (p.small.down) {
    run_moe_small_down(p.routed_down, T, E, top_k);
  } else {  // the whole map's 128-row tiles, then the merge map's (at most E), as the gate/up's two maps
    linear_tiles(p.routed_down, r.max_tiles, TK, xb);
    if (p.merge) linear_tiles(merge_of(p.routed_down, r), E, TK, xb);
  }
  linear_tiles(p.shared_down, shared_tiles, T, xb);

  MoeCombineParams mp{bf16 ? nullptr : s.down.ptr<float>(), bf16 ? down16 : nullptr, r.topk_row, out.ptr<float>(),
                      int(T), int(H), top_k};
  if (norm)
    launch(bf16 ? moe_combine_add_rms_norm_kernel<true> : moe_combine_add_rms_norm_kernel<false>, unsigned(T),
           unsigned(norm_threads(H)), bf16 ? unsigned(H * 4) : 0u, mp, norm->p);
  else if (bf16)
    launch(moe_combine_bf16_kernel, dim3(unsigned(T), unsigned(ceil_div<int64_t>(H, 2048))), 256, 0, mp);
  else if (vec4)
    launch(moe_combine4_kernel, dim3(unsigned(T), unsigned(ceil_div<int64_t>(H, 1024))), 256, 0, mp);
  else
    launch(moe_combine_kernel, dim3(unsigned(T), unsigned(ceil_div<int64_t>(H, 256))), 256, 0, mp);
  LILY_CUDA_LAUNCHED();
}

void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int top_k,
         ops::MoeInput h_in) {
  run_moe(w, h, out, s, top_k, false, NormTail{}, NormIn{}, h_in);
}

// A prompt past the decode chain whose combine takes the norm (combine_takes_norm): the combine, the residual
// add and the norm in moe_combine_add_rms_norm_kernel, tmp not written; otherwise moe into tmp, then
// add_rms_norm_xb. The Xb goes to s.xb's start, where linear_xb reads it (the products are done by then).
void moe_add_rms_norm_xb(const MoeWeights& w, const Tensor& h, ops::MoeInput h_in, const Tensor& res,
                         const Tensor& weight, float eps, const Tensor& y, const Tensor& tmp, const ops::MoeScratch& s,
                         int top_k) {
  const AddRmsNormLaunch n = add_rms_norm_xb_launch(res, Tensor{}, weight, eps, y, s.xb);
  if (!use_moe_decode(w, h, s, top_k) && combine_takes_norm(s, h.dim(1), top_k, n))
    return run_moe(w, h, tmp, s, top_k, false, NormTail{}, NormIn{}, h_in, &n);
  run_moe(w, h, tmp, s, top_k, false, NormTail{}, NormIn{}, h_in);
  add_rms_norm_xb(res, tmp, weight, eps, y, s.xb);
}

// On the tensor-core path moe_down_mma adds into res; otherwise moe into tmp, then add.
void moe_add(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& tmp, const ops::MoeScratch& s,
             int top_k) {
  if (use_moe_mma(w, h, s, top_k)) return run_moe(w, h, res, s, top_k, true, NormTail{});
  run_moe(w, h, tmp, s, top_k, false, NormTail{});
  add(res, tmp);
}

// The block's input norm in the router and moe_up (NORM_IN instances) where the fused router and the
// tensor-core chain run for res, rms_norm's threads for D = H are moe_up's CTA (norm_threads(H) =
// MMA_THREADS, as the router's 256 for H = 2048) and the norm kernels would take float4s (res checked by
// use_moe_router; weight and h 16-byte aligned: also the router's cp.async of the weight).
bool moe_rms_normed_supported(const MoeWeights& w, const Tensor& res, const Tensor& weight, const Tensor& h,
                              const ops::MoeScratch& s, int top_k) {
  const int64_t H = res.dim(1);
  return res.dim(0) == 1 && use_moe_router(w, res, true) && use_moe_mma(w, res, s, top_k) &&
         norm_threads(H) == MMA_THREADS && H <= MMA_NORM_MAX_COLS && is_aligned16(weight.data) && is_aligned16(h.data);
}

// res += moe(rms_norm(res) * weight): no kernel writes h where moe_rms_normed_supported; otherwise rms_norm
// into h, then moe_add.
void moe_rms_normed_add(const MoeWeights& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                        const Tensor& tmp, const ops::MoeScratch& s, int top_k) {
  if (cuda::moe_rms_normed_supported(w, res, weight, h, s, top_k))  // cuda::, not ops:: (found by its arguments)
    return run_moe(w, res, res, s, top_k, true, NormTail{}, NormIn{weight.ptr<float>(), eps});
  rms_norm(res, weight, eps, h);
  cuda::moe_add(w, h, res, tmp, s, top_k);
}

// The early router's matrices (kernels/moe_router_early.cuh): R = the stacked router_gates (8-bit, BF16 scales, a
// group of whole 8-value blocks), the post-attention norm's multiplier w [H], the mixer's output projection O
// [H, A] (4- or 8-bit affine, BF16 scales) at the widths router_early_kernel is built for; M F32 [E + 1, A].
static bool fold_matrix(const QMatrix& m) {
  return m.num_stack == 1 && m.quantized() && (m.bits == 4 || m.bits == 8) && m.scale_dtype == DType::BF16 &&
         m.cols % m.group_size == 0 && m.group_size % 8 == 0;
}
bool router_fold_supported(const QMatrix& R, const Tensor& w, const QMatrix& O) {
  return fold_matrix(R) && fold_matrix(O) && R.bits == 8 && R.cols == EARLY_H && O.rows == EARLY_H &&
         O.cols == EARLY_A && R.rows <= ROUTER_EARLY_PL * 32 + 1 && w.device == Device::CUDA &&
         w.dtype == DType::F32 && w.numel() == EARLY_H && is_aligned16(w.data);
}

void router_fold(const QMatrix& R, const Tensor& w, const QMatrix& O, const QMatrix& M) {
  LILY_CHECK(router_fold_supported(R, w, O), "router_fold: unsupported operands");
  LILY_CHECK(M.dtype == DType::F32 && !M.quantized() && M.rows == R.rows && M.cols == O.cols &&
                 M.weight.nbytes() == size_t(M.rows * M.cols) * 4,
             "router_fold: M must be F32 [", R.rows, ", ", O.cols, "]");
  auto fm = [](const QMatrix& m) {
    return FoldMatrix{static_cast<const uint32_t*>(m.weight.data()), static_cast<const uint16_t*>(m.scales.data()),
                      static_cast<const uint16_t*>(m.biases.data()), int(m.cols), m.bits, m.group_size};
  };
  const RouterFoldParams p{fm(R), fm(O), w.ptr<float>(), static_cast<float*>(const_cast<void*>(M.weight.data())),
                           int(O.rows), int(O.cols)};
  router_fold_kernel<<<dim3(unsigned(ceil_div<int64_t>(O.cols, FOLD_THREADS)), unsigned(R.rows)), FOLD_THREADS, 0,
                       stream()>>>(p);
  LILY_CUDA_LAUNCHED();
}

// ops::linear_add_moe_rms_normed_add on one token: router_early_kernel (r and its top-k in s.router_logits'
// first EarlyRoute::floats), the output projection into tmp (its stores after its wait), then the normed
// tensor-core chain routing on the top-k and adding tmp into res (moe_up's staging, moe_down's epilogue).
bool linear_add_moe_supported(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                              const Tensor& weight, const Tensor& h, const ops::MoeScratch& s, int top_k) {
  const QMatrix* R = w.router_gates;
  return R && w.router_fold && cuda::moe_rms_normed_supported(w, res, weight, h, s, top_k) &&
         router_fold_supported(*R, weight, o) && R->rows == w.router->rows + 1 && w.router_fold->rows == R->rows &&
         w.router_fold->cols == o.cols && top_k <= 32 && linear_add_late_supported(o, x) && x.dim(0) == 1 &&
         is_aligned16(x.data) && is_aligned16(res.data) &&
         s.router_logits.numel() >= EarlyRoute::floats(int(w.router->rows), top_k);
}

void linear_add_moe_rms_normed_add(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                                   const Tensor& weight, float eps, const Tensor& h, const Tensor& tmp,
                                   const ops::MoeScratch& s, int top_k) {
  LILY_CHECK(cuda::linear_add_moe_supported(o, x, w, res, weight, h, s, top_k) && is_aligned16(tmp.data),
             "linear_add_moe_rms_normed_add: not the one-token early-routing path");
  const QMatrix& R = *w.router_gates;
  float* r = s.router_logits.ptr<float>();
  const RouterEarlyParams p{static_cast<const uint32_t*>(R.weight.data()), static_cast<const uint16_t*>(R.scales.data()),
                            static_cast<const uint16_t*>(R.biases.data()),
                            static_cast<const float*>(w.router_fold->weight.data()), res.ptr<float>(),
                            weight.ptr<float>(), x.ptr<float>(), r, int(R.rows), R.group_size, top_k};
  launch(router_early_kernel, dim3(unsigned(ceil_div<int64_t>(R.rows, EARLY_ROWS))), dim3(EARLY_THREADS), 0, p);
  LILY_CUDA_LAUNCHED();
  linear_late(o, x, tmp);  // tmp = O a, beside the router; moe_up and moe_down add it to res
  run_moe(w, res, res, s, top_k, true, NormTail{}, NormIn{weight.ptr<float>(), eps}, ops::MoeInput::F32, nullptr, r,
          tmp.ptr<float>());
}

// One token on the tensor-core path: moe_down_mma adds into res and its last CTA writes the norm into h
// (h's last reader, moe_up_mma, has finished by then). Otherwise moe into tmp, then add_rms_norm.
void moe_add_rms_norm(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& weight, float eps,
                      const Tensor& tmp, const ops::MoeScratch& s, int top_k, const Tensor& sync) {
  if (h.dim(0) == 1 && use_moe_mma(w, h, s, top_k))
    return run_moe(w, h, res, s, top_k, true, norm_tail(res, weight, eps, h, sync));
  run_moe(w, h, tmp, s, top_k, false, NormTail{});
  add_rms_norm(res, tmp, weight, eps, h);
}

}  // namespace lily::cuda
