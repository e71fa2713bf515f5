#include "weights.h"

#include <algorithm>
#include <sstream>

#include "../ops/ops.h"
#include "../runtime/backend.h"
#include "tensors.h"

namespace lily {

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

const QMatrix* WeightStore::matrix(const std::string& name, const std::vector<int64_t>& shape) const {
  auto it = matrices_.find(name);
  LILY_CHECK(it != matrices_.end(), "missing tensor '", name, "'");
  const QMatrix& m = it->second;
  const int64_t stack = shape.size() == 3 ? shape[0] : 1, rows = shape[shape.size() - 2], cols = shape.back();
  LILY_CHECK(m.num_stack == stack && m.rows == rows && m.cols == cols, "tensor '", name, "' has shape ",
             m.describe(), " but the config needs [", stack, ", ", rows, ", ", cols, "]");
  return &m;
}

const Vector* WeightStore::vector(const std::string& name, const std::vector<int64_t>& shape) const {
  auto it = vectors_.find(name);
  LILY_CHECK(it != vectors_.end(), "missing tensor '", name, "'");
  LILY_CHECK(it->second.shape == shape, "tensor '", name, "' has shape ", shape_str(it->second.shape),
             " but the config needs ", shape_str(shape));
  return &it->second;
}

const QMatrix* WeightStore::stack_rows(const std::string& name, const std::vector<const QMatrix*>& parts) {
  const QMatrix& first = *parts[0];
  QMatrix m;
  m.num_stack = 1;
  m.cols = first.cols;
  m.dtype = first.dtype;
  m.bits = first.bits;
  m.group_size = first.group_size;
  m.scale_dtype = first.scale_dtype;
  size_t wb = 0, sb = 0;
  for (const QMatrix* q : parts) {
    if (q->num_stack != 1 || q->cols != m.cols || q->dtype != m.dtype || q->bits != m.bits ||
        q->group_size != m.group_size || q->scale_dtype != m.scale_dtype)
      return nullptr;
    m.rows += q->rows;
    wb += q->weight.nbytes();
    sb += q->scales.nbytes();
  }
  m.weight = Buffer(device_, wb);
  if (m.quantized()) {
    m.scales = Buffer(device_, sb);
    m.biases = Buffer(device_, sb);
  }
  size_t wo = 0, so = 0;
  for (const QMatrix* q : parts) {  // rows are contiguous: each part is a block of bytes
    m.weight.copy_from(q->weight, q->weight.nbytes(), wo);
    if (m.quantized()) {
      m.scales.copy_from(q->scales, q->scales.nbytes(), so);
      m.biases.copy_from(q->biases, q->scales.nbytes(), so);
    }
    wo += q->weight.nbytes();
    so += q->scales.nbytes();
  }
  if (device_ != Device::CPU) backend_synchronize(device_);  // the copies are queued: finish them first
  wo = so = 0;
  for (const QMatrix* part : parts) {  // then the parts become views (freeing their own bytes)
    QMatrix& q = const_cast<QMatrix&>(*part);  // a matrix of this store, handed out as a const view
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

const QMatrix* WeightStore::row_block(const std::string& name, const QMatrix& m, int64_t row0, int64_t rows) {
  LILY_CHECK(m.num_stack == 1 && row0 >= 0 && rows > 0 && row0 + rows <= m.rows, "row_block '", name, "': rows [",
             row0, ", ", row0 + rows, ") of a ", m.rows, "-row matrix");
  QMatrix v;  // m's format, rows row0.. of its buffers
  v.rows = rows;
  v.cols = m.cols;
  v.dtype = m.dtype;
  v.bits = m.bits;
  v.group_size = m.group_size;
  v.scale_dtype = m.scale_dtype;
  const size_t wr = m.weight.nbytes() / size_t(m.rows), sr = m.quantized() ? m.scales.nbytes() / size_t(m.rows) : 0;
  v.weight = Buffer::view(m.weight, size_t(row0) * wr, size_t(rows) * wr);
  if (m.quantized()) {
    v.scales = Buffer::view(m.scales, size_t(row0) * sr, size_t(rows) * sr);
    v.biases = Buffer::view(m.biases, size_t(row0) * sr, size_t(rows) * sr);
  }
  return &(row_blocks_[name] = std::move(v));
}

void WeightStore::resolve(const ModelConfig& c) {
  for (const TensorSpec& t : model_tensors(c, *this)) {
    if (t.matrix) *t.matrix = matrix(t.name, t.shape);
    else *t.vector = vector(t.name, t.shape);
  }
  for (int i = 0; i < c.num_hidden_layers; ++i) {  // the decode step's one GEMV per same-input group
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = layers[i];
    L.is_full_attention = c.is_full_attention[i] != 0;
    if (L.is_full_attention)
      L.attn.qkv_proj = stack_rows(p + "self_attn.qkv_proj", {L.attn.q_proj, L.attn.k_proj, L.attn.v_proj});
    else if ((L.gdn.in_proj = stack_rows(p + "linear_attn.in_proj",
                                         {L.gdn.in_proj_qkv, L.gdn.in_proj_z, L.gdn.in_proj_b, L.gdn.in_proj_a})))
      L.gdn.in_proj_ba = row_block(p + "linear_attn.in_proj_ba", *L.gdn.in_proj,
                                   L.gdn.in_proj_qkv->rows + L.gdn.in_proj_z->rows,
                                   L.gdn.in_proj_b->rows + L.gdn.in_proj_a->rows);
    L.moe.router_gates = stack_rows(p + "mlp.router_gates", {L.moe.router, L.moe.shared_expert_gate});
    const QMatrix* o = L.is_full_attention ? L.attn.o_proj : L.gdn.out_proj;
    const Tensor post = L.post_attention_layernorm->view();
    if (L.moe.router_gates && o && ops::router_fold_supported(*L.moe.router_gates, post, *o)) {
      QMatrix m;  // MoeWeights::router_fold: derived on the device, F32 [E + 1, A]
      m.rows = L.moe.router_gates->rows;
      m.cols = o->cols;
      m.dtype = DType::F32;
      m.weight = Buffer(device_, size_t(m.rows * m.cols) * 4);
      ops::router_fold(*L.moe.router_gates, post, *o, m);
      L.moe.router_fold = &(folds_[p + "mlp.router_fold"] = std::move(m));
    }
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
  for (auto& [_, m] : folds_) n += m.weight.nbytes();
  return n;
}

}  // namespace lily
