// Launcher of the sparse MoE block, all on the device with no host synchronisation:
//   router logits (linear) and shared expert gate logit (linear)
//   -> moe_topk (softmax, top-k, renormalise, sigmoid of the shared gate)
//   -> moe_count, moe_scatter (rows grouped by expert, tile map; kernels/moe_routing.cuh)
//   -> grouped gate product, grouped up product with SwiGLU and the routing weight in its epilogue
//   -> the shared expert's gate, up (SwiGLU, sigmoid gate in the epilogue) over all T tokens
//   -> grouped down product (routed rows and shared rows) -> moe_combine (fixed order).
// Scratch rows (moe_work_rows = C*(K+1)): grouped routed rows [0, T*K), shared rows [T*K, T*K+T).
// The grouped products run over an upper bound of tiles; tiles past the device count exit at once.
#include "cuda_ops.h"
#include "kernels/moe_routing.cuh"
#include "linear.cuh"
#include "runtime.cuh"

namespace lily::cuda {

// The I32 routing words of one call with T tokens (sized for C >= T by moe_routing_words).
struct RoutingTables {
  int32_t* topk_id;      // [T, K]
  float* topk_w;         // [T, K]
  int32_t* topk_row;     // [T, K]
  int32_t* row_token;    // [T*K]
  float* row_weight;     // [T*K]
  int32_t* count;        // [E]
  int32_t* row_end;      // [E]
  int32_t* tile_expert;  // [max_tiles]
  int32_t* tile_row0;    // [max_tiles]
  int32_t* num_tiles;    // [1]
  int64_t max_tiles, words;
};

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
  r.count = take(E);
  r.row_end = take(E);
  r.tile_expert = take(r.max_tiles);
  r.tile_row0 = take(r.max_tiles);
  r.num_tiles = take(1);
  r.words = p - base;
  return r;
}

int64_t moe_routing_words(int64_t C, int64_t E, int top_k) {
  return routing_tables(nullptr, C, E, top_k).words;
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

static LinearArgs grouped(LinearArgs a, const RoutingTables& r) {
  a.tiles.tile_expert = r.tile_expert;
  a.tiles.tile_row0 = r.tile_row0;
  a.tiles.row_end = r.row_end;
  a.tiles.num_tiles = r.num_tiles;
  return a;
}

static LinearArgs dense(LinearArgs a, int64_t M) {
  a.tiles.M = M;
  return a;
}

static LinearArgs swiglu(LinearArgs a, const float* row_scale) {
  a.swiglu = true;
  a.row_scale = row_scale;
  return a;
}

void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int top_k) {
  const int64_t T = h.dim(0), H = h.dim(1), E = w.router->rows, TK = T * top_k;
  if (T == 0) return;
  LILY_CHECK(top_k <= MOE_MAX_TOP_K, "moe: top_k ", top_k, " above the CUDA limit ", MOE_MAX_TOP_K);
  LILY_CHECK(s.down.dim(1) == H && s.gate.dim(1) >= std::max(w.gate_proj->rows, w.shared_gate_proj->rows),
             "moe: scratch rows are too narrow");
  const RoutingTables r = routing_tables(s.routing.ptr<int32_t>(), T, E, top_k);
  const Tensor logits = rows_of(s.router_logits, 0, T);  // [T, E]
  const Tensor sg = rows_of(s.shared_gate, 0, T);        // [T, 1]
  linear(*w.router, 0, h, logits);
  linear(*w.shared_expert_gate, 0, h, sg);

  MoeTopkParams tp{logits.ptr<float>(), sg.ptr<float>(), r.topk_id, r.topk_w, int(T), int(E), top_k};
  const size_t topk_smem = size_t(MOE_TOPK_WARPS) * E * sizeof(float);
  LILY_CHECK(topk_smem <= 48 * 1024, "moe: ", E, " experts exceed the top-k kernel's shared memory");
  moe_topk_kernel<<<unsigned(ceil_div<int64_t>(T, MOE_TOPK_WARPS)), MOE_TOPK_WARPS * 32, topk_smem, stream()>>>(tp);
  LILY_CUDA_LAUNCHED();

  constexpr int warps = 8;  // one expert per warp
  const unsigned expert_ctas = unsigned(ceil_div<int64_t>(E, warps));
  MoeCountParams cp{r.topk_id, r.count, int(T), int(E), top_k};
  moe_count_kernel<<<expert_ctas, warps * 32, 0, stream()>>>(cp);
  LILY_CUDA_LAUNCHED();
  MoeScatterParams sp{r.topk_id, r.topk_w, r.count, r.topk_row, r.row_end, r.row_token, r.row_weight,
                      r.tile_expert, r.tile_row0, r.num_tiles, int(T), int(E), top_k, LINEAR_TILE_ROWS};
  moe_scatter_kernel<<<expert_ctas, warps * 32, 0, stream()>>>(sp);
  LILY_CUDA_LAUNCHED();

  const int64_t ld = s.gate.dim(1);
  float* act = s.gate.ptr<float>();  // [T*K + T, ld]: gate products, then silu(gate)*up*weight in place
  float* shared_act = act + TK * ld;
  float* down = s.down.ptr<float>();  // [T*K + T, H]
  const int64_t shared_tiles = ceil_div<int64_t>(T, LINEAR_TILE_ROWS);

  LinearArgs gate = grouped(product(*w.gate_proj, h.ptr<float>(), H, act, ld), r);
  gate.x_rows = r.row_token;
  linear_tiles(gate, r.max_tiles);
  LinearArgs up = swiglu(grouped(product(*w.up_proj, h.ptr<float>(), H, act, ld), r), r.row_weight);
  up.x_rows = r.row_token;
  linear_tiles(up, r.max_tiles);
  linear_tiles(dense(product(*w.shared_gate_proj, h.ptr<float>(), H, shared_act, ld), T), shared_tiles);
  linear_tiles(swiglu(dense(product(*w.shared_up_proj, h.ptr<float>(), H, shared_act, ld), T), sg.ptr<float>()),
               shared_tiles);
  linear_tiles(grouped(product(*w.down_proj, act, ld, down, H), r), r.max_tiles);
  linear_tiles(dense(product(*w.shared_down_proj, shared_act, ld, down + TK * H, H), T), shared_tiles);

  MoeCombineParams mp{down, r.topk_row, out.ptr<float>(), int(T), int(H), top_k};
  moe_combine_kernel<<<dim3(unsigned(T), unsigned(ceil_div<int64_t>(H, 256))), 256, 0, stream()>>>(mp);
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
