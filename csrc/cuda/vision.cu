// Launchers of the vision tower's ops (kernels/vision.cuh, kernels/vision_attention.cuh), docs/model.md
// section 8 (the multimodal RoPE of the text model, mrope, is in attention.cu). The tower runs eagerly.
//   layer_norm, layer_norm_xb: one block per row, 32..256 threads (about 8 values each)
//   add_bias, gelu, vision_rope: one thread per element (add_bias: per 4 when aligned)
//   vision_position_embedding: one thread per (patch, column)
//   vision_attention: pack q, k, v to bf16 per head, then flash attention per (64-row query tile, head) for
//                     head sizes up to 128 (padded to a multiple of 16)
#include <algorithm>
#include <cmath>

#include "cuda_ops.h"
#include "kernels/vision.cuh"
#include "kernels/vision_attention.cuh"
#include "../runtime/cuda_device.h"

namespace lily::cuda {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned blocks_for(const char* op, int64_t items, int threads) {
  const int64_t blocks = ceil_div<int64_t>(items, threads);
  LILY_CHECK(blocks <= 0x7fffffff, op, ": too many elements for the CUDA grid (", items, ")");
  return unsigned(blocks);
}

// About eight values per thread, a warp at least and 256 at most.
int row_threads(int64_t D) {
  int t = 32;
  while (t < 256 && t * 8 < D) t *= 2;
  return t;
}

template <int kDP>
void launch_vision_attention(dim3 grid, const attn::VisionAttnParams& p) {
  constexpr int smem = attn::vision_smem_bytes<kDP>();
  static const bool raised = [] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(attn::vision_attention_kernel<kDP>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)raised;
  launch(attn::vision_attention_kernel<kDP>, grid, attn::kVisionThreads, smem, p);
  LILY_CUDA_LAUNCHED();
}

}  // namespace

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y) {
  const int64_t R = x.dim(0), D = x.dim(1);
  if (R == 0) return;
  LILY_CHECK(R <= 0x7fffffff, "layer_norm: too many rows for the CUDA grid (", R, ")");
  const vision::LayerNormParams p{x.ptr<float>(), weight.ptr<float>(), bias.ptr<float>(), y.ptr<float>(), int(D),
                                  eps};
  launch(vision::layer_norm_kernel<false>, unsigned(R), row_threads(D), 0, p);
  LILY_CUDA_LAUNCHED();
}

void layer_norm_xb(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& xb) {
  const int64_t R = x.dim(0), D = x.dim(1);
  if (R == 0) return;
  LILY_CHECK(R <= 0x7fffffff, "layer_norm_xb: too many rows for the CUDA grid (", R, ")");
  vision::LayerNormParams p{x.ptr<float>(), weight.ptr<float>(), bias.ptr<float>(), nullptr, int(D), eps};
  p.yb = xb.ptr<uint16_t>();
  launch(vision::layer_norm_kernel<true>, unsigned(R), row_threads(D), 0, p);
  LILY_CUDA_LAUNCHED();
}

void add_bias(const Tensor& x, const Tensor& bias) {
  const vision::AddBiasParams p{x.ptr<float>(), bias.ptr<float>(), x.numel(), x.dim(1)};
  if (p.n == 0) return;
  if (p.C % 4 == 0 && aligned16(p.x) && aligned16(p.bias))
    launch(vision::add_bias_kernel<true>, blocks_for("add_bias", p.n / 4, vision::kThreads), vision::kThreads, 0, p);
  else
    launch(vision::add_bias_kernel<false>, blocks_for("add_bias", p.n, vision::kThreads), vision::kThreads, 0, p);
  LILY_CUDA_LAUNCHED();
}

void gelu(const Tensor& x, bool tanh_approx) {
  const vision::GeluParams p{x.ptr<float>(), x.numel(), gelu_tanh_k(), gelu_erf_c()};
  if (p.n == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>(ceil_div<int64_t>(p.n, vision::kThreads), int64_t(num_sms()) * 16));
  launch(tanh_approx ? vision::gelu_kernel<true> : vision::gelu_kernel<false>, grid, vision::kThreads, 0, p);
  LILY_CUDA_LAUNCHED();
}

void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y) {
  const int64_t n = pos.dim(0), W = table.dim(1);
  if (n == 0 || W == 0) return;
  int side = 0;
  while (int64_t(side + 1) * (side + 1) <= table.dim(0)) ++side;
  LILY_CHECK(n <= 0x7fffffff && ceil_div<int64_t>(W, vision::kThreads) <= 65535, "vision_position_embedding: ", n,
             " x ", W, " exceeds the CUDA grid");
  const vision::PosEmbedParams p{table.ptr<float>(), pos.ptr<int32_t>(), y.ptr<float>(), W, side, grid_h, grid_w};
  const dim3 grid(unsigned(n), unsigned(ceil_div<int64_t>(W, vision::kThreads)));
  launch(vision::vision_position_embedding_kernel, grid, vision::kThreads, 0, p);
  LILY_CUDA_LAUNCHED();
}

void vision_rope(const Tensor& qkv, const Tensor& pos, int num_heads, double theta) {
  const int64_t N = qkv.dim(0), D = qkv.dim(1) / (3 * num_heads), F = D / 4;
  if (N == 0 || F == 0) return;
  LILY_CHECK(F <= vision::kMaxRopeFreqs, "vision_rope: head size ", D, " exceeds the CUDA kernel's ",
             4 * vision::kMaxRopeFreqs);
  vision::VisionRopeParams p{qkv.ptr<float>(), pos.ptr<int32_t>(), N * 2 * num_heads * (D / 2), num_heads, int(D), {}};
  for (int64_t j = 0; j < F; ++j) p.inv_freq[j] = float(1.0 / std::pow(theta, double(2 * j) / double(D / 2)));
  launch(vision::vision_rope_kernel, blocks_for("vision_rope", p.n, vision::kThreads), vision::kThreads, 0, p);
  LILY_CUDA_LAUNCHED();
}

int64_t vision_attention_workspace_elems(int64_t N, int64_t num_heads, int64_t head_dim) {
  return 3 * num_heads * N * attn::vision_padded_dim(head_dim);
}

void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int num_heads,
                      const Tensor& workspace) {
  const int64_t N = qkv.dim(0), D = qkv.dim(1) / (3 * num_heads), DP = attn::vision_padded_dim(D);
  if (N == 0) return;
  LILY_CHECK(DP <= attn::kVisionMaxDP, "vision_attention: head size ", D, " exceeds the CUDA kernel's ",
             attn::kVisionMaxDP);
  LILY_CHECK(N <= 0x7fffffff && num_heads <= 65535, "vision_attention: ", N, " rows x ", num_heads,
             " heads exceed the CUDA grid");
  LILY_CHECK(aligned16(workspace.data), "vision_attention: the workspace must be 16-byte aligned");
  const int num_images = int(starts.dim(0) - 1);
  const attn::VisionPackParams pp{qkv.ptr<float>(), workspace.ptr<attn::bf16>(), 3 * num_heads * N * (DP / 8), int(N),
                                  num_heads, int(D), int(DP)};
  launch(attn::vision_qkv_pack_kernel, blocks_for("vision_attention", pp.n, vision::kThreads),
         vision::kThreads, 0, pp);
  LILY_CUDA_LAUNCHED();
  const attn::VisionAttnParams p{workspace.ptr<attn::bf16>(), starts.ptr<int32_t>(), o.ptr<float>(), int(N), num_heads,
                                 int(D), num_images, float(1.4426950408889634 / std::sqrt(double(D)))};
  // every image's query tiles: at most ceil(N / 64) + one partial tile per image
  const dim3 grid(unsigned(ceil_div<int64_t>(N, attn::kVisionRows) + num_images), unsigned(num_heads));
  switch (DP) {
    case 16: return launch_vision_attention<16>(grid, p);
    case 32: return launch_vision_attention<32>(grid, p);
    case 48: return launch_vision_attention<48>(grid, p);
    case 64: return launch_vision_attention<64>(grid, p);
    case 80: return launch_vision_attention<80>(grid, p);
    case 96: return launch_vision_attention<96>(grid, p);
    case 112: return launch_vision_attention<112>(grid, p);
    case 128: return launch_vision_attention<128>(grid, p);
  }
  fail("vision_attention: unsupported padded head size ", DP);
}

}  // namespace lily::cuda
