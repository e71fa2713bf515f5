#include "session.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine.h"

namespace lily {

size_t Snapshot::nbytes() const {
  size_t n = 0;
  for (const LayerState& l : layers) n += l.conv.nbytes() + l.recurrent.nbytes() + l.k.nbytes() + l.v.nbytes();
  return n;
}

std::vector<Snapshot::Part> Snapshot::layout(const Engine& engine, int64_t position) {
  const ModelConfig& c = engine.config();
  const DType kv = engine.device() == Device::CPU ? DType::F32 : DType::BF16;
  LILY_CHECK(position >= 0 && position <= INT32_MAX, "snapshot position ", position, " is outside [0, ", INT32_MAX, "]");
  auto bytes = [](const std::vector<int64_t>& shape, DType t) {
    size_t n = dtype_size(t);
    for (int64_t d : shape) LILY_CHECK(!__builtin_mul_overflow(n, size_t(d), &n), "snapshot part size overflows");
    return n;
  };
  std::vector<Part> out;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    if (c.is_full_attention[l]) {
      const std::vector<int64_t> kv_shape{position, c.num_key_value_heads, c.head_dim};
      out.push_back({p + "k_cache", kv_shape, kv, bytes(kv_shape, kv)});
      out.push_back({p + "v_cache", kv_shape, kv, bytes(kv_shape, kv)});
    } else {
      const std::vector<int64_t> conv{c.linear_conv_kernel_dim - 1, c.conv_dim()},
          rec{c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim};
      out.push_back({p + "conv_state", conv, DType::F32, bytes(conv, DType::F32)});
      out.push_back({p + "recurrent_state", rec, DType::F32, bytes(rec, DType::F32)});
    }
  }
  return out;
}

const Buffer& Snapshot::part(size_t i) const {
  LILY_CHECK(i < 2 * layers.size(), "snapshot part ", i, " of ", 2 * layers.size());
  const LayerState& st = layers[i / 2];
  const bool second = i % 2;
  if (st.recurrent.nbytes() == 0) return second ? st.v : st.k;  // attention
  return second ? st.recurrent : st.conv;
}

std::shared_ptr<Snapshot> Snapshot::blank(const Engine& engine, int64_t position) {
  const std::vector<Part> parts = layout(engine, position);
  auto snap = std::make_shared<Snapshot>();
  snap->engine = &engine;
  snap->position = position;
  constexpr size_t ALIGN = 256;  // every part starts 256-byte aligned, as a device allocation would
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const Part& p : parts) {
    offsets.push_back(total);
    LILY_CHECK(!__builtin_add_overflow(total, (p.nbytes + ALIGN - 1) / ALIGN * ALIGN, &total),
               "snapshot size overflows");
  }
  snap->storage = Buffer(engine.device(), total);
  const ModelConfig& c = engine.config();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerState st;
    const size_t i = 2 * size_t(l);
    Buffer a = Buffer::view(snap->storage, offsets[i], parts[i].nbytes),
           b = Buffer::view(snap->storage, offsets[i + 1], parts[i + 1].nbytes);
    if (c.is_full_attention[l]) {
      st.k = std::move(a);
      st.v = std::move(b);
    } else {
      st.conv = std::move(a);
      st.recurrent = std::move(b);
    }
    snap->layers.push_back(std::move(st));
  }
  return snap;
}

Session::Session(std::shared_ptr<const Engine> engine, int64_t max_context, int64_t chunk)
    : engine_(std::move(engine)), max_context_(max_context), chunk_(std::min(chunk, max_context)) {
  const ModelConfig& c = engine_->config();
  const Device d = engine_->device();
  LILY_CHECK(max_context > 0, "max_context must be positive, got ", max_context);
  LILY_CHECK(chunk > 0, "prefill chunk must be positive, got ", chunk);
  // Positions are int32 on the device; sizes below are products of these and the (bounded) config.
  LILY_CHECK(max_context <= INT32_MAX, "max_context must be at most ", INT32_MAX, ", got ", max_context);
  LILY_CHECK(chunk <= INT32_MAX, "prefill chunk must be at most ", INT32_MAX, ", got ", chunk);
  auto product = [](const char* what, int64_t a, int64_t b) {  // a * b, refusing overflow
    int64_t r = 0;
    LILY_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r), what, " overflows: ", a, " x ", b);
    return r;
  };
  auto f32 = [d, &product](int64_t rows, int64_t cols) {
    return Buffer(d, size_t(product("buffer size", product("buffer size", rows, cols), 4)));
  };
  const size_t kv_bytes = size_t(product("KV cache size", product("KV cache size", max_context, c.kv_dim()),
                                         d == Device::CPU ? 4 : 2));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerState st, other;
    if (c.is_full_attention[l]) {
      st.k = Buffer(d, kv_bytes);
      st.v = Buffer(d, kv_bytes);
    } else {
      for (LayerState* x : {&st, &other}) {
        x->conv = f32(c.linear_conv_kernel_dim - 1, c.conv_dim());
        x->recurrent = f32(c.linear_num_value_heads, int64_t(c.linear_key_head_dim) * c.linear_value_head_dim);
      }
    }
    layers_.push_back(std::move(st));
    spare_.push_back(std::move(other));
  }
  const int64_t C = chunk_, H = c.hidden_size;  // no chunk is longer than the context: scratch for that many
  const int64_t wide = std::max({int64_t(c.conv_dim()), int64_t(c.q_proj_dim()), int64_t(c.value_dim()),
                                 int64_t(c.attn_dim())});
  const int64_t inter = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  s_.ids = Buffer(d, size_t(C) * 4);
  s_.x = f32(C, H);
  s_.h = f32(C, H);
  s_.mix = f32(C, H);
  s_.proj = f32(C, wide);
  s_.core_in = f32(C, wide);
  s_.out_gate = f32(C, wide);
  s_.core_out = f32(C, wide);
  s_.normed = f32(C, wide);
  s_.stacked = f32(ops::linear_stack_rows(d, C),
                   std::max(c.conv_dim() + c.value_dim() + 2 * int64_t(c.linear_num_value_heads),
                            int64_t(c.q_proj_dim()) + 2 * c.kv_dim()));
  s_.a = f32(C, c.linear_num_value_heads);
  s_.b = f32(C, c.linear_num_value_heads);
  s_.k = f32(C, c.kv_dim());
  s_.v = f32(C, c.kv_dim());
  const int64_t R = ops::moe_work_rows(d, C, c.num_experts_per_tok);
  s_.router_logits = f32(C, c.num_experts);
  s_.gathered = f32(R, H);
  s_.gate = f32(R, inter);
  s_.up = f32(R, inter);
  s_.down = f32(R, H);
  s_.shared_gate = f32(C, 1);
  s_.routing = Buffer(d, size_t(ops::moe_routing_words(d, C, c.num_experts, c.num_experts_per_tok)) * 4);
  s_.gdn_work = Buffer(d, size_t(ops::gated_delta_workspace_floats(d, C, c.linear_num_value_heads,
                                                                   c.linear_key_head_dim, c.linear_value_head_dim)) *
                              4);
  const int64_t widest_in = std::max({H, int64_t(c.value_dim()), int64_t(c.attn_dim())});  // linear inputs
  // (each term with the split-K partials' room, docs/cuda.md)
  s_.xb = Buffer(d, size_t(std::max({ops::linear_workspace_elems(d, C, widest_in),
                                     ops::linear_workspace_elems(d, std::min<int64_t>(C, 64), widest_in),
                                     ops::moe_xb_elems(d, C, H, c.moe_intermediate_size,
                                                       c.shared_expert_intermediate_size, c.num_experts_per_tok)})) *
                        2);
  s_.logit_rows = std::min<int64_t>(C, 16);
  s_.final_h = f32(s_.logit_rows, H);
  s_.logits = f32(s_.logit_rows, c.vocab_size);
  if (d != Device::CPU) s_.position = Buffer(d, 4);
  s_.rope_pos = Buffer(d, size_t(C) * 12);
  s_.sync = Buffer(d, 4);
  const int32_t zero = 0;
  s_.sync.upload(&zero, 4);
  const int64_t V = c.vocab_size;
  sampler_.counts = Buffer(d, size_t(V) * 4);
  sampler_.seen = Buffer(d, size_t(V) * 4);
  const size_t lp = size_t(1 + ops::MAX_LOGPROBS) * 4;
  sampler_.result = Buffer(d, SamplerBuffers::RESULT_WORDS * 4);
  sampler_.token = Buffer::view(sampler_.result, 0, 4);
  sampler_.logprob_ids = Buffer::view(sampler_.result, 4, lp);
  sampler_.logprob_values = Buffer::view(sampler_.result, 4 + lp, lp);
  sampler_.mask = Buffer(d, size_t((V + 31) / 32) * 4);
  host_ = HostBuffer(d, sampler_.result.nbytes() + sampler_.mask.nbytes());
  std::memset(host_.data(), 0, host_.nbytes());
  sampled_fence_ = DeviceFence(d);
  set_sampler(ops::SamplerParams{}, nullptr, 0);
  reset();
}

ForwardContext Session::forward_context(bool decode) {
  const ops::Position position{position_, static_cast<const int32_t*>(s_.position.data()), rope_delta_};
  return {s_, layers_, decode ? spare_ : layers_, max_context_, chunk_, position, tracing ? &trace : nullptr};
}

void Session::flip_state() {
  for (size_t l = 0; l < layers_.size(); ++l) {
    std::swap(layers_[l].conv, spare_[l].conv);
    std::swap(layers_[l].recurrent, spare_[l].recurrent);
  }
  copy_ ^= 1;
}

void Session::settle() {
  if (!pending_) return;
  sampled_fence_.wait();
  pending_ = false;
}

void Session::set_position(int64_t p) {
  position_ = p;
  if (s_.position.data()) {
    const int32_t v = int32_t(p);
    s_.position.upload(&v, 4);
  }
}

void Session::reset() {
  settle();
  for (LayerState& st : layers_) {  // the other copy is written in full before any step reads it
    st.conv.zero();
    st.recurrent.zero();
  }
  sampler_.has_token = false;
  launched_ = false;
  rope_delta_ = 0;
  set_position(0);
}

static Tensor i32_view(const Buffer& b, int64_t n) { return Tensor::of(b.data(), DType::I32, b.device(), {n}); }

static ops::SamplerState sampler_state(const SamplerBuffers& b, int64_t V) {
  return {i32_view(b.counts, V), i32_view(b.seen, V), i32_view(b.token, 1), i32_view(b.logprob_ids, 1 + ops::MAX_LOGPROBS),
          Tensor::of(b.logprob_values.data(), DType::F32, b.logprob_values.device(), {1 + ops::MAX_LOGPROBS})};
}

void Session::set_sampler(const ops::SamplerParams& params, const int32_t* prompt_ids, int64_t n) {
  const int64_t V = engine_->config().vocab_size;
  for (int64_t i = 0; i < n; ++i)
    LILY_CHECK(prompt_ids[i] >= 0 && prompt_ids[i] < V, "token id ", prompt_ids[i], " at index ", i,
               " is outside the vocabulary [0, ", V, ")");
  sampler_.params = params;
  sampler_.step = 0;
  sampler_.counts.zero();
  sampler_.seen.zero();
  for (int64_t i = 0; i < n; i += chunk_) {  // s_.ids holds one chunk of ids
    const int64_t m = std::min(chunk_, n - i);
    s_.ids.upload(prompt_ids + i, size_t(m) * 4);
    ops::sampler_mark_seen(i32_view(s_.ids, m), sampler_state(sampler_, V));
  }
}

void Session::queue_sample(const int32_t* mask) {
  const int64_t V = engine_->config().vocab_size;
  settle();  // the staging words below may still be on their way to the device
  if (mask) {
    const int64_t words = (V + 31) / 32;
    void* staged = static_cast<char*>(host_.data()) + sampler_.result.nbytes();
    std::memcpy(staged, mask, size_t(words) * 4);
    sampler_.mask.upload_async(staged, size_t(words) * 4);
    ops::apply_token_mask(Tensor::of(s_.logits.data(), DType::F32, s_.logits.device(), {V}),
                          i32_view(sampler_.mask, words));
  }
  ops::sample(Tensor::of(s_.logits.data(), DType::F32, s_.logits.device(), {V}), sampler_.params, sampler_.step,
              sampler_state(sampler_, V));
  ++sampler_.step;
  // The id, and the logprobs when asked for, in one copy.
  const size_t n = sampler_.params.num_logprobs >= 0 ? sampler_.result.nbytes() : 4;
  sampler_.result.download_async(host_.data(), n);
  sampled_fence_.record();
  pending_ = true;
  sampler_.has_token = true;  // once the copy has landed: sampled() says whether it is a token
}

int32_t Session::sampled() {
  LILY_CHECK(pending_, "sampled() needs a sample_launch first (each sample's id is read once)");
  sampled_fence_.wait();
  pending_ = false;
  const int32_t id = *static_cast<const int32_t*>(host_.data());
  if (id < 0) {
    // The samplers write -1 when the logits hold NaN (docs/sampling.md): no token to feed back, and a
    // forward launched on it since is taken back.
    if (launched_ && fed_pending_) decode_discard();
    sampler_.has_token = false;
    fail("sample: the model's logits contain NaN (invalid weights or activations); no token was sampled. Check "
         "the checkpoint with lily.Model.load(..., check_weights=True)");
  }
  return id;
}

int32_t Session::prefill_sample(const int32_t* ids, int64_t T, const int32_t* mask, const PromptImages* images) {
  prefill(ids, T, nullptr, false, images);
  engine_->logits_rows(forward_context(), (T - 1) % chunk_, 1);  // the last chunk's last row
  queue_sample(mask);
  return sampled();
}

void Session::decode_from_device() {
  LILY_CHECK(position_ + 1 <= max_context_, "context overflow: ", position_,
             " tokens in the session + 1 new exceed max_context ", max_context_);
  auto step = [this] {
    engine_->forward_chunk(forward_context(true), i32_view(sampler_.token, 1), 1);
    engine_->logits_rows(forward_context(true), 0, 1);
  };
  // The first step runs eagerly so one-time kernel setup (attributes, lazy module loading) happens
  // outside the capture; later steps replay the graph captured for the current state copy (the two
  // graphs differ only in which copy they read and which they write).
  if (use_graph && engine_->device() != Device::CPU && !tracing && !profiler && eager_steps_ > 0) {
    // The rope offset is a kernel argument (ops::Position): graphs captured with another one are stale.
    if (graph_rope_delta_ != rope_delta_) {
      for (DeviceGraph& g : decode_graph_) g = DeviceGraph();
      graph_rope_delta_ = rope_delta_;
    }
    DeviceGraph& graph = decode_graph_[copy_];
    if (graph.empty()) graph = DeviceGraph(engine_->device(), step);
    graph.launch();
  } else {
    step();
    ++eager_steps_;
  }
  flip_state();
  ++position_;
}

void Session::decode_step(int32_t id, float* logits) {
  const int64_t V = engine_->config().vocab_size;
  LILY_CHECK(id >= 0 && id < V, "token id ", id, " at index 0 is outside the vocabulary [0, ", V, ")");
  sampler_.token.upload(&id, 4);
  launched_ = false;
  decode_from_device();
  if (logits) s_.logits.download(logits, size_t(V) * 4);
}

int32_t Session::decode_sample(int32_t id, const int32_t* mask) {
  decode_launch(id);
  return sample_next(mask);
}

void Session::decode_launch(int32_t id) {
  if (id >= 0) {
    const int64_t V = engine_->config().vocab_size;
    LILY_CHECK(id < V, "token id ", id, " at index 0 is outside the vocabulary [0, ", V, ")");
    sampler_.token.upload(&id, 4);
  } else {
    LILY_CHECK(sampler_.has_token, "decode_sample(-1) needs a sampled token: call prefill_sample first");
    // The CPU sampled at once: a NaN sample raises here, as sampled() would, instead of feeding id -1
    // (which the CPU embedding refuses; GPU kernels clamp it and sampled() takes the step back).
    if (pending_ && engine_->device() == Device::CPU && *static_cast<const int32_t*>(host_.data()) < 0) sampled();
  }
  launched_ = false;
  decode_from_device();
  fed_sampled_ = id < 0;
  fed_pending_ = id < 0 && pending_;
  sampler_.has_token = false;  // the fed token is consumed; sample_next samples the next one
  launched_ = true;
}

int32_t Session::sample_next(const int32_t* mask) {
  sample_launch(mask);
  return sampled();
}

void Session::sample_launch(const int32_t* mask) {
  LILY_CHECK(launched_, "sample_next needs a decode_launch first (each launched step is sampled once)");
  launched_ = false;
  queue_sample(mask);
}

void Session::decode_discard() {
  LILY_CHECK(launched_, "decode_discard needs a launched step whose logits were not sampled (decode_launch)");
  launched_ = false;
  flip_state();  // the copy the step read is current again; the one it wrote is the spare
  --position_;
  ops::advance_position(static_cast<int32_t*>(s_.position.data()), engine_->device(), -1);
  sampler_.has_token = fed_sampled_;
}

void Session::last_logprobs(int32_t* ids, float* values) const {
  if (pending_) sampled_fence_.wait();
  const size_t n = size_t(1 + ops::MAX_LOGPROBS);
  std::memcpy(ids, static_cast<const int32_t*>(host_.data()) + 1, n * 4);
  std::memcpy(values, static_cast<const float*>(host_.data()) + 1 + n, n * 4);
}

void Session::prefill(const int32_t* ids, int64_t T, float* logits, bool all_logits, const PromptImages* images) {
  const int64_t V = engine_->config().vocab_size;
  LILY_CHECK(T > 0, "prefill needs at least one token");
  LILY_CHECK(position_ + T <= max_context_, "context overflow: ", position_, " tokens in the session + ", T,
             " new exceed max_context ", max_context_);
  // Validate every id before any state changes, so a bad id leaves the session untouched.
  for (int64_t t = 0; t < T; ++t)
    LILY_CHECK(ids[t] >= 0 && ids[t] < V, "token id ", ids[t], " at index ", t, " is outside the vocabulary [0, ",
               V, ")");
  if (images) {
    for (int64_t i = 0; i < images->n; ++i)
      LILY_CHECK(images->rows[i] >= (i ? images->rows[i - 1] + 1 : 0) && images->rows[i] < T, "prefill: image row ",
                 i, " (", images->rows[i], ") is not increasing within the prompt of ", T, " tokens");
    for (int64_t i = 0; i < 3 * T; ++i)
      LILY_CHECK(images->positions[i] >= 0, "prefill: rope positions must be non-negative");
  }
  settle();
  sampler_.has_token = false;
  launched_ = false;
  for (int64_t t0 = 0; t0 < T; t0 += chunk_) {
    const int64_t n = std::min(chunk_, T - t0);
    s_.ids.upload(ids + t0, size_t(n) * 4);
    engine_->forward_chunk(forward_context(), i32_view(s_.ids, n), n, images, t0);
    position_ += n;
    if (all_logits) engine_->write_logits(forward_context(), 0, n, logits + t0 * V);
    else if (logits && t0 + n == T) engine_->write_logits(forward_context(), n - 1, 1, logits);
  }
  if (images) rope_delta_ = images->rope_delta;
}

std::shared_ptr<Snapshot> Session::snapshot() const {
  auto snap = Snapshot::blank(*engine_, position_);
  snap->rope_delta = rope_delta_;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerState& st = layers_[l];
    LayerState& c = snap->layers[l];
    if (st.recurrent.nbytes()) {
      c.conv.copy_from(st.conv, c.conv.nbytes());
      c.recurrent.copy_from(st.recurrent, c.recurrent.nbytes());
    } else {
      c.k.copy_from(st.k, c.k.nbytes());
      c.v.copy_from(st.v, c.v.nbytes());
    }
  }
  return snap;
}

void Session::restore(const Snapshot& snap) {
  LILY_CHECK(snap.engine == engine_.get(), "restore: the snapshot was taken from a session of another model");
  LILY_CHECK(snap.position <= max_context_, "restore: the snapshot holds ", snap.position,
             " tokens but this session's max_context is ", max_context_);
  settle();
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
  sampler_.has_token = false;
  launched_ = false;
  rope_delta_ = snap.rope_delta;
  set_position(snap.position);
}

std::vector<Session::StateView> Session::state_views() const {
  const ModelConfig& c = engine_->config();
  std::vector<StateView> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const LayerState& st = layers_[l];
    if (st.recurrent.nbytes()) {
      out.push_back({p + "conv_state", {c.linear_conv_kernel_dim - 1, c.conv_dim()}, &st.conv, DType::F32});
      out.push_back({p + "recurrent_state",
                     {c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}, &st.recurrent,
                     DType::F32});
    } else {
      const DType kv = engine_->device() == Device::CPU ? DType::F32 : DType::BF16;
      out.push_back({p + "k_cache", {position_, c.num_key_value_heads, c.head_dim}, &st.k, kv});
      out.push_back({p + "v_cache", {position_, c.num_key_value_heads, c.head_dim}, &st.v, kv});
    }
  }
  return out;
}

}  // namespace lily
