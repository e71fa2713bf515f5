// Engine::encode_images: the vision tower (docs/model.md section 8) as a sequence of ops.
#include <algorithm>

#include "engine.h"
#include "../runtime/profile.h"

namespace lily {

// The (row, column) of each patch of a gh x gw grid in merge-block order (m x m blocks row-major, the
// patches of a block row-major): the order of the processor's patches and of the merger's groups.
static std::vector<int32_t> patch_positions(int gh, int gw, int m) {
  std::vector<int32_t> pos;
  for (int br = 0; br < gh / m; ++br)
    for (int bc = 0; bc < gw / m; ++bc)
      for (int r = 0; r < m; ++r)
        for (int c = 0; c < m; ++c) {
          pos.push_back(br * m + r);
          pos.push_back(bc * m + c);
        }
  return pos;
}

// y = x W^T + b (ws: ops::linear's workspace).
static void biased_linear(const BiasedLinear& l, const Tensor& x, const Tensor& y, const Tensor& ws) {
  ops::linear_bias(*l.w, x, l.b->view(), y, ws);
}

void Engine::encode_images(const float* pixels, int64_t N, const std::vector<std::array<int, 3>>& grids,
                           float* out) const {
  const VisionConfig& v = config_.vision;
  LILY_CHECK(v.present(), "encode_images: this checkpoint has no vision tower (its config.json has no "
             "vision_config, or its files no model.visual.* tensors), so it cannot read images");
  const int m = v.spatial_merge_size, mm = m * m;
  const int64_t W = v.hidden_size, I = v.intermediate_size, M = v.merged_dim(), H = config_.hidden_size;
  std::vector<int32_t> pos, starts{0};
  for (const auto& [t, gh, gw] : grids) {
    LILY_CHECK(t == 1 && gh > 0 && gw > 0 && gh % m == 0 && gw % m == 0, "encode_images: grid (", t, ", ", gh, ", ",
               gw, ") is not one frame of whole ", m, " x ", m, " merge blocks");
    const std::vector<int32_t> p = patch_positions(gh, gw, m);
    pos.insert(pos.end(), p.begin(), p.end());
    starts.push_back(starts.back() + gh * gw);
  }
  LILY_CHECK(!grids.empty() && starts.back() == N, "encode_images: the grids hold ", starts.back(),
             " patches but pixels has ", N, " rows");
  const Device d = device();
  auto f32 = [d](int64_t rows, int64_t cols) { return Buffer(d, size_t(rows * cols) * 4); };
  Buffer px = f32(N, v.patch_dim()), x = f32(N, W), h = f32(N, W), qkv = f32(N, 3 * W), o = f32(N, W),
         mlp = f32(N, I), merged = f32(N / mm, M), y = f32(N / mm, H), pos_b(d, pos.size() * 4),
         starts_b(d, starts.size() * 4);
  // BF16 work space of the products (for the widest input: the patches, W or the MLP's I; the merger's M
  // over N / m^2 rows) and of the attention; both empty on the CPU
  const int64_t lin_ws = std::max(ops::linear_workspace_elems(d, N, std::max<int64_t>({v.patch_dim(), W, I})),
                                  ops::linear_workspace_elems(d, N / mm, M));
  const int64_t attn_ws = ops::vision_attention_workspace_elems(d, N, v.num_heads, W / v.num_heads);
  Buffer lin_b(d, size_t(lin_ws) * 2), attn_b(d, size_t(attn_ws) * 2);
  const Tensor ws = Tensor::of(lin_b.data(), DType::BF16, d, {lin_ws});
  const Tensor attn_work = Tensor::of(attn_b.data(), DType::BF16, d, {attn_ws});
  px.upload(pixels, px.nbytes());
  pos_b.upload(pos.data(), pos_b.nbytes());
  starts_b.upload(starts.data(), starts_b.nbytes());
  const Tensor xs = f32_view(x, N, W), hs = f32_view(h, N, W);
  // the MLP's hidden as bf16 in the mlp buffer (CUDA, half its bytes): fc1's output [N, I], fc2's X
  const Tensor mlp_yb = Tensor::of(mlp.data(), DType::BF16, d, {N, I});
  const Tensor mlp_xb = Tensor::of(mlp.data(), DType::BF16, d, {N * I});
  const Tensor pos_t = Tensor::of(pos_b.data(), DType::I32, d, {N, 2});
  const Tensor starts_t = Tensor::of(starts_b.data(), DType::I32, d, {int64_t(starts.size())});
  const VisionWeights& vw = weights_->vision;
  const float eps = 1e-6f;  // every LayerNorm of the tower
  const ProfileLabel label("vision");
  biased_linear(vw.patch_embed, f32_view(px, N, v.patch_dim()), xs, ws);
  for (size_t i = 0; i < grids.size(); ++i) {  // each image's resampled position table
    const int64_t n = starts[i + 1] - starts[i];
    const Tensor rows = Tensor::of(xs.ptr<float>() + starts[i] * W, DType::F32, d, {n, W});
    const Tensor p = Tensor::of(pos_t.ptr<int32_t>() + 2 * starts[i], DType::I32, d, {n, 2});
    ops::vision_position_embedding(vw.pos_embed->view(), p, grids[i][1], grids[i][2], rows);
  }
  for (const VisionBlockWeights& B : vw.blocks) {
    // Where qkv, fc1 and fc2 run on the dense wgmma GEMM (CUDA), their inputs are handed over as bf16 with
    // the bits the GEMM's own conversion would give: the norms write it into ws, fc1's epilogue into the
    // mlp buffer (mlp_yb), and the products read it there
    const bool handover = ops::linear_bias_xb_supported(d, *B.qkv.w, N) &&
                          ops::linear_bias_xb_supported(d, *B.fc1.w, N) && ops::linear_bias_xb_supported(d, *B.fc2.w, N);
    // x += proj(attention(rope(qkv(norm1(x)))))
    if (handover) {
      ops::layer_norm_xb(xs, B.norm1.weight->view(), B.norm1.bias->view(), eps, ws);
      ops::linear_bias_xb(*B.qkv.w, ws, B.qkv.b->view(), f32_view(qkv, N, 3 * W));
    } else {
      ops::layer_norm(xs, B.norm1.weight->view(), B.norm1.bias->view(), eps, hs);
      biased_linear(B.qkv, hs, f32_view(qkv, N, 3 * W), ws);
    }
    ops::vision_rope(f32_view(qkv, N, 3 * W), pos_t, v.num_heads, v.rope_theta);
    ops::vision_attention(f32_view(qkv, N, 3 * W), f32_view(o, N, W), starts_t, v.num_heads, attn_work);
    biased_linear(B.proj, f32_view(o, N, W), hs, ws);
    ops::add(xs, hs);
    // x += fc2(gelu_tanh(fc1(norm2(x))))
    if (handover) {
      ops::layer_norm_xb(xs, B.norm2.weight->view(), B.norm2.bias->view(), eps, ws);
      ops::linear_bias_gelu_xb(*B.fc1.w, ws, B.fc1.b->view(), mlp_yb);
      ops::linear_bias_xb(*B.fc2.w, mlp_xb, B.fc2.b->view(), hs);
    } else {
      ops::layer_norm(xs, B.norm2.weight->view(), B.norm2.bias->view(), eps, hs);
      ops::linear_bias_gelu(*B.fc1.w, hs, B.fc1.b->view(), f32_view(mlp, N, I), ws);
      biased_linear(B.fc2, f32_view(mlp, N, I), hs, ws);
    }
    ops::add(xs, hs);
  }
  // merger: LayerNorm per patch, then each m x m block's patches side by side [N/m^2, m^2 W] -> MLP
  ops::layer_norm(xs, vw.merger_norm.weight->view(), vw.merger_norm.bias->view(), eps, hs);
  biased_linear(vw.merger_fc1, f32_view(h, N / mm, M), f32_view(merged, N / mm, M), ws);
  ops::gelu(f32_view(merged, N / mm, M), false);
  biased_linear(vw.merger_fc2, f32_view(merged, N / mm, M), f32_view(y, N / mm, H), ws);
  y.download(out, y.nbytes());
}

}  // namespace lily
