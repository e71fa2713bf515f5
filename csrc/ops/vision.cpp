// Checked entries of the vision tower's ops (ops.h; docs/model.md section 8), dispatched to the CPU or CUDA
// backend. Index arguments the kernels trust (the patches' positions of vision_position_embedding, the image
// starts of vision_attention) are checked on the host: on a GPU they are downloaded first (8 bytes a patch,
// 4 an image; these ops run eagerly, never inside a captured graph).
#include <algorithm>
#include <vector>

#include "../cpu/cpu_ops.h"
#include "../runtime/backend.h"
#include "check.h"

namespace lily::ops {

// The values of a small I32 tensor on the host (a copy from GPU memory).
static std::vector<int32_t> host_ints(const Tensor& t) {
  std::vector<int32_t> v(size_t(t.numel()));
  if (t.device == Device::CPU) std::copy(t.ptr<int32_t>(), t.ptr<int32_t>() + v.size(), v.begin());
  else if (!v.empty()) backend_download(t.device, v.data(), t.data, v.size() * 4);
  return v;
}

static void check_rows(const char* op, const char* arg, const Tensor& t, int64_t rows, int64_t cols) {
  check_shape(op, arg, t, 0, rows);
  check_shape(op, arg, t, 1, cols);
}

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y) {
  const char* op = "layer_norm";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_tensor(op, "bias", bias, DType::F32, 1);
  check_shape(op, "weight", weight, 0, x.dim(1));
  check_shape(op, "bias", bias, 0, x.dim(1));
  check_rows(op, "y", y, x.dim(0), x.dim(1));
  check_same_device(op, {x, y, weight, bias});
  if (x.device == Device::CPU) return cpu::layer_norm(x, weight, bias, eps, y);
  LILY_CUDA_CASE(x.device, layer_norm(x, weight, bias, eps, y));
  no_backend(op, x.device);
}

void layer_norm_xb(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& xb) {
  const char* op = "layer_norm_xb";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "xb", xb, DType::BF16, 1);
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_tensor(op, "bias", bias, DType::F32, 1);
  check_shape(op, "weight", weight, 0, x.dim(1));
  check_shape(op, "bias", bias, 0, x.dim(1));
  LILY_CHECK(xb.numel() >= x.numel(), op, ": xb ", xb.shape_str(), " is smaller than x ", x.shape_str());
  check_same_device(op, {x, xb, weight, bias});
  LILY_CUDA_CASE(x.device, layer_norm_xb(x, weight, bias, eps, xb));
  no_backend(op, x.device);
}

void add_bias(const Tensor& x, const Tensor& bias) {
  const char* op = "add_bias";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "bias", bias, DType::F32, 1);
  check_shape(op, "bias", bias, 0, x.dim(1));
  check_same_device(op, {x, bias});
  if (x.device == Device::CPU) return cpu::add_bias(x, bias);
  LILY_CUDA_CASE(x.device, add_bias(x, bias));
  no_backend(op, x.device);
}

void gelu(const Tensor& x, bool tanh_approx) {
  const char* op = "gelu";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  if (x.device == Device::CPU) return cpu::gelu(x, tanh_approx);
  LILY_CUDA_CASE(x.device, gelu(x, tanh_approx));
  no_backend(op, x.device);
}

void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y) {
  const char* op = "vision_position_embedding";
  const OpSpan span(op);
  check_tensor(op, "table", table, DType::F32, 2);
  check_tensor(op, "pos", pos, DType::I32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  int64_t side = 0;
  while ((side + 1) * (side + 1) <= table.dim(0)) ++side;
  LILY_CHECK(side * side == table.dim(0), op, ": table ", table.shape_str(), " is not a square grid of rows");
  LILY_CHECK(grid_h > 0 && grid_w > 0, op, ": grid ", grid_h, " x ", grid_w, " is empty");
  check_rows(op, "y", y, pos.dim(0), table.dim(1));
  check_shape(op, "pos", pos, 1, 2);
  check_same_device(op, {table, pos, y});
  const std::vector<int32_t> p = host_ints(pos);
  for (int64_t i = 0; i < pos.dim(0); ++i) {
    const int32_t r = p[2 * i], c = p[2 * i + 1];
    LILY_CHECK(r >= 0 && r < grid_h && c >= 0 && c < grid_w, op, ": pos[", i, "] = (", r, ", ", c,
               ") is outside the ", grid_h, " x ", grid_w, " grid");
  }
  if (y.device == Device::CPU) return cpu::vision_position_embedding(table, pos, grid_h, grid_w, y);
  LILY_CUDA_CASE(y.device, vision_position_embedding(table, pos, grid_h, grid_w, y));
  no_backend(op, y.device);
}

void vision_rope(const Tensor& qkv, const Tensor& pos, int num_heads, double theta) {
  const char* op = "vision_rope";
  const OpSpan span(op);
  check_tensor(op, "qkv", qkv, DType::F32, 2);
  check_tensor(op, "pos", pos, DType::I32, 2);
  LILY_CHECK(num_heads > 0 && qkv.dim(1) % (3 * num_heads) == 0 && (qkv.dim(1) / (3 * num_heads)) % 4 == 0, op,
             ": qkv ", qkv.shape_str(), " does not split into 3 x ", num_heads, " heads of a multiple of 4 dims");
  LILY_CHECK(theta > 0, op, ": theta must be positive");
  check_rows(op, "pos", pos, qkv.dim(0), 2);
  check_same_device(op, {qkv, pos});
  if (qkv.device == Device::CPU) return cpu::vision_rope(qkv, pos, num_heads, theta);
  LILY_CUDA_CASE(qkv.device, vision_rope(qkv, pos, num_heads, theta));
  no_backend(op, qkv.device);
}

void mrope(const Tensor& x, int num_heads, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos) {
  const char* op = "mrope";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "pos", pos, DType::I32, 2);
  LILY_CHECK(num_heads > 0 && x.dim(1) % num_heads == 0, op, ": x ", x.shape_str(), " does not split into ",
             num_heads, " heads");
  LILY_CHECK(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= x.dim(1) / num_heads, op, ": rotary_dim ",
             rotary_dim, " must be even and at most the head size");
  check_rows(op, "pos", pos, x.dim(0), 3);
  check_same_device(op, {x, pos});
  for (int s : sections) LILY_CHECK(s >= 0, op, ": negative mrope section ", s);
  if (x.device == Device::CPU) return cpu::mrope(x, num_heads, rotary_dim, theta, sections, pos);
  LILY_CUDA_CASE(x.device, mrope(x, num_heads, rotary_dim, theta, sections, pos));
  no_backend(op, x.device);
}

int64_t vision_attention_workspace_elems(Device device, int64_t N, int64_t num_heads, int64_t head_dim) {
  if (device == Device::CPU) return 0;
#ifdef LILY_WITH_CUDA
  if (device == Device::CUDA) return cuda::vision_attention_workspace_elems(N, num_heads, head_dim);
#endif
  no_backend("vision_attention", device);
}

void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int num_heads,
                      const Tensor& workspace) {
  const char* op = "vision_attention";
  const OpSpan span(op);
  check_tensor(op, "qkv", qkv, DType::F32, 2);
  check_tensor(op, "o", o, DType::F32, 2);
  check_tensor(op, "starts", starts, DType::I32, 1);
  LILY_CHECK(num_heads > 0 && qkv.dim(1) % (3 * num_heads) == 0, op, ": qkv ", qkv.shape_str(),
             " does not split into 3 x ", num_heads, " heads");
  check_rows(op, "o", o, qkv.dim(0), qkv.dim(1) / 3);
  check_same_device(op, {qkv, o, starts});
  const int64_t N = qkv.dim(0), D = qkv.dim(1) / (3 * num_heads);
  const int64_t need = vision_attention_workspace_elems(qkv.device, N, num_heads, D);
  if (need > 0) {
    check_tensor(op, "workspace", workspace, DType::BF16, 1);
    LILY_CHECK(workspace.numel() >= need, op, ": workspace ", workspace.shape_str(), " is too small for ", N,
               " rows of ", num_heads, " heads (", need, " elements)");
    check_same_device(op, {qkv, workspace});
  }
  const std::vector<int32_t> s = host_ints(starts);
  const int64_t n = int64_t(s.size()) - 1;
  LILY_CHECK(n >= 1 && s[0] == 0 && s[n] == N, op, ": starts must run from 0 to ", N);
  for (int64_t i = 0; i < n; ++i) LILY_CHECK(s[i] < s[i + 1], op, ": starts must increase (image ", i, " is empty)");
  if (qkv.device == Device::CPU) return cpu::vision_attention(qkv, o, starts, num_heads);
  LILY_CUDA_CASE(qkv.device, vision_attention(qkv, o, starts, num_heads, workspace));
  no_backend(op, qkv.device);
}

}  // namespace lily::ops
