#include "session.h"

#include <algorithm>

#include "engine.h"

namespace lily {

size_t Snapshot::nbytes() const {
  size_t n = 0;
  for (const LayerState& l : layers) n += l.conv.nbytes() + l.recurrent.nbytes() + l.k.nbytes() + l.v.nbytes();
  return n;
}

Session::Session(std::shared_ptr<const Engine> engine, int64_t max_context, int64_t chunk)
    : engine_(std::move(engine)), max_context_(max_context), chunk_(chunk) {
  const ModelConfig& c = engine_->config();
  const Device d = engine_->device();
  LILY_CHECK(max_context > 0, "max_context must be positive, got ", max_context);
  LILY_CHECK(chunk > 0, "prefill chunk must be positive, got ", chunk);
  auto f32 = [d](int64_t rows, int64_t cols) { return Buffer(d, size_t(rows * cols) * 4); };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerState st;
    if (c.is_full_attention[l]) {
      st.k = f32(max_context, c.kv_dim());
      st.v = f32(max_context, c.kv_dim());
    } else {
      st.conv = f32(c.linear_conv_kernel_dim - 1, c.conv_dim());
      st.recurrent = f32(c.linear_num_value_heads, int64_t(c.linear_key_head_dim) * c.linear_value_head_dim);
    }
    layers_.push_back(std::move(st));
  }
  const int64_t C = chunk, H = c.hidden_size;
  const int64_t wide = std::max({int64_t(c.conv_dim()), int64_t(c.q_proj_dim()), int64_t(c.value_dim()),
                                 int64_t(c.attn_dim())});
  const int64_t inter = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  s_.ids = Buffer(d, size_t(C) * 4);
  s_.x = f32(C, H);
  s_.h = f32(C, H);
  s_.mix = f32(C, H);
  s_.proj = f32(C, wide);
  s_.conv_out = f32(C, wide);
  s_.z = f32(C, wide);
  s_.o = f32(C, wide);
  s_.normed = f32(C, wide);
  s_.a = f32(C, c.linear_num_value_heads);
  s_.b = f32(C, c.linear_num_value_heads);
  s_.kbuf = f32(C, c.kv_dim());
  s_.vbuf = f32(C, c.kv_dim());
  s_.router_logits = f32(C, c.num_experts);
  s_.gathered = f32(C, H);
  s_.gate = f32(C, inter);
  s_.up = f32(C, inter);
  s_.down = f32(C, H);
  s_.shared_gate = f32(C, 1);
  s_.logit_rows = std::min<int64_t>(C, 16);
  s_.final_h = f32(s_.logit_rows, H);
  s_.logits = f32(s_.logit_rows, c.vocab_size);
  reset();
}

void Session::reset() {
  for (LayerState& st : layers_) {
    st.conv.zero();
    st.recurrent.zero();
  }
  position_ = 0;
}

void Session::prefill(const int32_t* ids, int64_t T, float* logits, bool all_logits) {
  const int64_t V = engine_->config().vocab_size;
  LILY_CHECK(T > 0, "prefill needs at least one token");
  LILY_CHECK(position_ + T <= max_context_, "context overflow: ", position_, " tokens in the session + ", T,
             " new exceed max_context ", max_context_);
  // Validate every id before any state changes, so a bad id leaves the session untouched.
  for (int64_t t = 0; t < T; ++t)
    LILY_CHECK(ids[t] >= 0 && ids[t] < V, "token id ", ids[t], " at index ", t, " is outside the vocabulary [0, ",
               V, ")");
  for (int64_t t0 = 0; t0 < T; t0 += chunk_) {
    const int64_t n = std::min(chunk_, T - t0);
    const bool last = t0 + n == T;
    float* out = all_logits ? logits + t0 * V : (last ? logits : nullptr);
    engine_->forward_chunk(*this, ids + t0, n, out, all_logits);
  }
}

std::shared_ptr<Snapshot> Session::snapshot() const {
  auto snap = std::make_shared<Snapshot>();
  snap->engine = engine_.get();
  snap->position = position_;
  const int64_t kv_row = int64_t(engine_->config().kv_dim()) * 4;
  for (const LayerState& st : layers_) {
    LayerState c;
    auto copy = [](const Buffer& src, size_t n) {
      Buffer b(src.device(), n);
      b.copy_from(src, n);
      return b;
    };
    if (st.recurrent.nbytes()) {
      c.conv = copy(st.conv, st.conv.nbytes());
      c.recurrent = copy(st.recurrent, st.recurrent.nbytes());
    } else {
      c.k = copy(st.k, size_t(position_ * kv_row));
      c.v = copy(st.v, size_t(position_ * kv_row));
    }
    snap->layers.push_back(std::move(c));
  }
  return snap;
}

void Session::restore(const Snapshot& snap) {
  LILY_CHECK(snap.engine == engine_.get(), "restore: the snapshot was taken from a session of another model");
  LILY_CHECK(snap.position <= max_context_, "restore: the snapshot holds ", snap.position,
             " tokens but this session's max_context is ", max_context_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerState& st = layers_[l];
    const LayerState& c = snap.layers[l];
    if (st.recurrent.nbytes()) {
      st.conv.copy_from(c.conv, c.conv.nbytes());
      st.recurrent.copy_from(c.recurrent, c.recurrent.nbytes());
    } else {
      st.k.copy_from(c.k, c.k.nbytes());
      st.v.copy_from(c.v, c.v.nbytes());
    }
  }
  position_ = snap.position;
}

std::vector<Session::StateView> Session::state_views() const {
  const ModelConfig& c = engine_->config();
  std::vector<StateView> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const LayerState& st = layers_[l];
    if (st.recurrent.nbytes()) {
      out.push_back({p + "conv_state", {c.linear_conv_kernel_dim - 1, c.conv_dim()}, &st.conv});
      out.push_back({p + "recurrent_state",
                     {c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}, &st.recurrent});
    } else {
      out.push_back({p + "k_cache", {position_, c.num_key_value_heads, c.head_dim}, &st.k});
      out.push_back({p + "v_cache", {position_, c.num_key_value_heads, c.head_dim}, &st.v});
    }
  }
  return out;
}

}  // namespace lily
