#include "weights.h"

#include <algorithm>
#include <sstream>

#include "../ops/backend.h"

namespace lily {

std::string QMatrix::describe() const {
  std::ostringstream s;
  s << "[" << num_stack << ", " << rows << ", " << cols << "] ";
  if (quantized()) s << "affine " << bits << "-bit g" << group_size;
  else s << dtype_name(dtype);
  return s.str();
}

int64_t Vector::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor Vector::view() const {
  Tensor t = Tensor::of(data.data(), DType::F32, data.device(), {});
  LILY_CHECK(shape.size() <= 4, "vector parameter of rank above 4");
  for (int64_t d : shape) t.shape[t.ndim++] = d;
  return t;
}

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const QMatrix* WeightStore::matrix(const std::string& name, int64_t stack, int64_t rows, int64_t cols) const {
  auto it = matrices_.find(name);
  LILY_CHECK(it != matrices_.end(), "missing tensor '", name, "'");
  const QMatrix& m = it->second;
  LILY_CHECK(m.num_stack == stack && m.rows == rows && m.cols == cols, "tensor '", name, "' has shape ",
             m.describe(), " but the config needs [", stack, ", ", rows, ", ", cols, "]");
  return &m;
}

const Vector* WeightStore::vector(const std::string& name, std::vector<int64_t> shape) const {
  auto it = vectors_.find(name);
  LILY_CHECK(it != vectors_.end(), "missing tensor '", name, "'");
  LILY_CHECK(it->second.shape == shape, "tensor '", name, "' has shape ", shape_str(it->second.shape),
             " but the config needs ", shape_str(shape));
  return &it->second;
}

const QMatrix* WeightStore::stack_rows(const std::string& name, const std::vector<std::string>& parts) {
  const QMatrix& first = matrices_.at(parts[0]);
  QMatrix m;
  m.num_stack = 1;
  m.cols = first.cols;
  m.dtype = first.dtype;
  m.bits = first.bits;
  m.group_size = first.group_size;
  m.scale_dtype = first.scale_dtype;
  size_t wb = 0, sb = 0;
  for (const std::string& part : parts) {
    const QMatrix& q = matrices_.at(part);
    if (q.num_stack != 1 || q.cols != m.cols || q.dtype != m.dtype || q.bits != m.bits ||
        q.group_size != m.group_size || q.scale_dtype != m.scale_dtype)
      return nullptr;
    m.rows += q.rows;
    wb += q.weight.nbytes();
    sb += q.scales.nbytes();
  }
  m.weight = Buffer(device_, wb);
  if (m.quantized()) {
    m.scales = Buffer(device_, sb);
    m.biases = Buffer(device_, sb);
  }
  size_t wo = 0, so = 0;
  for (const std::string& part : parts) {  // rows are contiguous: each part is a block of bytes
    const QMatrix& q = matrices_.at(part);
    m.weight.copy_from(q.weight, q.weight.nbytes(), wo);
    if (m.quantized()) {
      m.scales.copy_from(q.scales, q.scales.nbytes(), so);
      m.biases.copy_from(q.biases, q.scales.nbytes(), so);
    }
    wo += q.weight.nbytes();
    so += q.scales.nbytes();
  }
  if (device_ != Device::CPU) backend_synchronize(device_);  // the copies are queued: finish them first
  wo = so = 0;
  for (const std::string& part : parts) {  // then the parts become views (freeing their own bytes)
    QMatrix& q = matrices_.at(part);
    const size_t w = q.weight.nbytes(), sc = q.scales.nbytes();
    q.weight = Buffer::view(m.weight, wo, w);
    if (m.quantized()) {
      q.scales = Buffer::view(m.scales, so, sc);
      q.biases = Buffer::view(m.biases, so, sc);
    }
    wo += w;
    so += sc;
  }
  return &(matrices_[name] = std::move(m));  // map nodes never move: the views stay valid
}

void WeightStore::resolve(const ModelConfig& c) {
  c.validate();
  const int64_t H = c.hidden_size, V = c.vocab_size, E = c.num_experts;
  embed_tokens = matrix("embed_tokens", 1, V, H);
  lm_head = matrix("lm_head", 1, V, H);
  final_norm = vector("norm", {H});
  layers.assign(c.num_hidden_layers, LayerWeights{});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = layers[i];
    L.is_full_attention = c.is_full_attention[i] != 0;
    L.input_layernorm = vector(p + "input_layernorm", {H});
    L.post_attention_layernorm = vector(p + "post_attention_layernorm", {H});
    if (L.is_full_attention) {
      const std::string a = p + "self_attn.";
      L.attn.q_proj = matrix(a + "q_proj", 1, c.q_proj_dim(), H);
      L.attn.k_proj = matrix(a + "k_proj", 1, c.kv_dim(), H);
      L.attn.v_proj = matrix(a + "v_proj", 1, c.kv_dim(), H);
      L.attn.o_proj = matrix(a + "o_proj", 1, H, c.attn_dim());
      L.attn.qkv_proj = stack_rows(a + "qkv_proj", {a + "q_proj", a + "k_proj", a + "v_proj"});
      L.attn.q_norm = vector(a + "q_norm", {c.head_dim});
      L.attn.k_norm = vector(a + "k_norm", {c.head_dim});
    } else {
      const std::string g = p + "linear_attn.";
      const int64_t Hv = c.linear_num_value_heads;
      L.gdn.in_proj_qkv = matrix(g + "in_proj_qkv", 1, c.conv_dim(), H);
      L.gdn.in_proj_z = matrix(g + "in_proj_z", 1, c.value_dim(), H);
      L.gdn.in_proj_b = matrix(g + "in_proj_b", 1, Hv, H);
      L.gdn.in_proj_a = matrix(g + "in_proj_a", 1, Hv, H);
      L.gdn.out_proj = matrix(g + "out_proj", 1, H, c.value_dim());
      L.gdn.in_proj = stack_rows(g + "in_proj", {g + "in_proj_qkv", g + "in_proj_z", g + "in_proj_b", g + "in_proj_a"});
      L.gdn.conv1d = vector(g + "conv1d", {c.conv_dim(), c.linear_conv_kernel_dim});
      L.gdn.A_log = vector(g + "A_log", {Hv});
      L.gdn.dt_bias = vector(g + "dt_bias", {Hv});
      L.gdn.norm = vector(g + "norm", {c.linear_value_head_dim});
    }
    const std::string m = p + "mlp.";
    const int64_t I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
    L.moe.router = matrix(m + "gate", 1, E, H);
    L.moe.gate_proj = matrix(m + "experts.gate_proj", E, I, H);
    L.moe.up_proj = matrix(m + "experts.up_proj", E, I, H);
    L.moe.down_proj = matrix(m + "experts.down_proj", E, H, I);
    L.moe.shared_gate_proj = matrix(m + "shared_expert.gate_proj", 1, Is, H);
    L.moe.shared_up_proj = matrix(m + "shared_expert.up_proj", 1, Is, H);
    L.moe.shared_down_proj = matrix(m + "shared_expert.down_proj", 1, H, Is);
    L.moe.shared_expert_gate = matrix(m + "shared_expert_gate", 1, 1, H);
    L.moe.router_gates = stack_rows(m + "router_gates", {m + "gate", m + "shared_expert_gate"});
  }
}

static void sample_bytes(std::ostringstream& s, const Buffer& b) {
  const size_t n = b.nbytes(), k = std::min<size_t>(16, n);
  s << " " << n << ":";
  if (!k) return;
  static const char* hex = "0123456789abcdef";
  for (size_t at : {size_t(0), (n - k) / 2, n - k}) {
    unsigned char buf[16];
    b.download(buf, k, at);
    s << ' ';
    for (size_t i = 0; i < k; ++i) s << hex[buf[i] >> 4] << hex[buf[i] & 15];
  }
}

std::string WeightStore::signature() const {
  std::ostringstream s;
  for (auto& [name, m] : matrices_) {
    s << name << " " << m.describe();
    if (m.quantized()) s << " scales " << dtype_name(m.scale_dtype);
    sample_bytes(s, m.weight);
    sample_bytes(s, m.scales);
    sample_bytes(s, m.biases);
    s << "\n";
  }
  for (auto& [name, v] : vectors_) {
    s << name << " " << shape_str(v.shape);
    sample_bytes(s, v.data);
    s << "\n";
  }
  return s.str();
}

size_t WeightStore::nbytes() const {
  size_t n = 0;
  for (auto& [_, m] : matrices_)
    if (m.weight.owned()) n += m.weight.nbytes() + m.scales.nbytes() + m.biases.nbytes();
  for (auto& [_, v] : vectors_) n += v.data.nbytes();
  return n;
}

}  // namespace lily
