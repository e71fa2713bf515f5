#include "engine.h"

#include <array>

#include "../runtime/profile.h"

namespace lily {

Engine::Engine(ModelConfig config, std::unique_ptr<WeightStore> weights)
    : config_(std::move(config)), weights_(std::move(weights)) {
  weights_->resolve(config_);
}

static Tensor view(const Buffer& b, int64_t rows, int64_t cols) { return f32_view(b, rows, cols); }

// The BF16 workspace of ops::linear and MoeScratch::xb (empty on the CPU).
static Tensor xb_work(const Scratch& x, Device d) {
  return Tensor::of(x.xb.data(), DType::BF16, d, {int64_t(x.xb.nbytes() / 2)});
}

// x [T, n*D] seen as [T*n, D]: one row per head.
static Tensor heads(const Tensor& x, int64_t D) { return Tensor::of(x.data, x.dtype, x.device, {x.numel() / D, D}); }

// The column blocks of one row [1, sum(widths)] as views [1, width_i], in order.
template <size_t N>
static std::array<Tensor, N> split(const Tensor& row, const int64_t (&widths)[N]) {
  std::array<Tensor, N> out;
  int64_t at = 0;
  for (size_t i = 0; i < N; ++i) {
    out[i] = Tensor::of(row.ptr<float>() + at, DType::F32, row.device, {1, widths[i]});
    at += widths[i];
  }
  return out;
}

// The projections y_i = x W_i^T of one input x [T, in] by the matrices `parts`: for one token,
// where they are also stacked by rows (`stacked`), one GEMV into the scratch row `row`, split back
// into the parts' outputs; otherwise one linear per part into `outs` (ws: linear's workspace).
template <size_t N>
static std::array<Tensor, N> project(const Tensor& x, const QMatrix* stacked, const QMatrix* const (&parts)[N],
                                     const Buffer& row, const std::array<Tensor, N>& outs, const Tensor& ws) {
  if (x.dim(0) == 1 && stacked) {
    int64_t widths[N];
    for (size_t i = 0; i < N; ++i) widths[i] = parts[i]->rows;
    const Tensor y = view(row, 1, stacked->rows);
    ops::linear(*stacked, x, y, ws);
    return split(y, widths);
  }
  for (size_t i = 0; i < N; ++i) ops::linear(*parts[i], x, outs[i], ws);
  return outs;
}

// Gated DeltaNet mixer (docs/model.md section 2.2): out_proj(gated_rms_norm(delta_rule(conv(h)), z)).
Engine::Projection Engine::gdn_layer(const ForwardContext& f, const LayerWeights& L, LayerState& st, int64_t T) const {
  const ModelConfig& c = config_;
  const GdnWeights& w = L.gdn;
  const Scratch& x = f.scratch;
  const int64_t H = c.hidden_size, C = c.conv_dim(), Vd = c.value_dim(), Hk = c.linear_num_key_heads,
                Hv = c.linear_num_value_heads, Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const ProfileLabel label("gdn");
  // qkv [T, C] (q | k | v before the conv), z [T, Vd] output gate, b, a [T, Hv]
  const auto [qkv, z, b, a] =
      project(view(x.h, T, H), w.in_proj, {w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a}, x.stacked,
              {view(x.proj, T, C), view(x.out_gate, T, Vd), view(x.b, T, Hv), view(x.a, T, Hv)}, xb_work(x, device()));
  const Tensor conv_state = view(st.conv, c.linear_conv_kernel_dim - 1, C);                // [K-1, C]
  const Tensor S = Tensor::of(st.recurrent.data(), DType::F32, device(), {Hv, Dk, Dv});  // [Hv, Dk, Dv]
  const Tensor normed = view(x.normed, T, Vd);                                             // [T, Vd]
  if (T == 1 && ops::gdn_decode_mixer_supported(device(), Hk, Hv, Dk, Dv, c.linear_conv_kernel_dim)) {
    // decode: the three ops below in one (one kernel on CUDA; literally the three on the CPU)
    ops::gdn_decode_mixer(qkv, w.conv1d->view(), conv_state, a, b, w.A_log->view(), w.dt_bias->view(), S, z,
                          w.norm->view(), c.rms_norm_eps, normed, int(Hk), int(Dk));
  } else {
    const Tensor y = view(x.core_in, T, C), o = view(x.core_out, T, Vd);
    const Tensor work = Tensor::of(x.gdn_work.data(), DType::F32, device(), {int64_t(x.gdn_work.nbytes() / 4)});
    ops::conv1d_silu(qkv, w.conv1d->view(), conv_state, y);
    ops::gated_delta_rule(y, a, b, w.A_log->view(), w.dt_bias->view(), S, o, work, int(Hk), int(Dk));
    // prefill where out_proj runs on the GEMM that reads bf16 X: the norm writes that X itself (its head
    // rows [T*Hv, Dv] are out_proj's rows [T, Vd]; docs/cuda.md, "Xb hand-over"); else F32 rows
    if (Dv % 8 == 0 && ops::linear_xb_supported(device(), *w.out_proj, T)) {
      ops::gated_rms_norm_xb(heads(o, Dv), heads(z, Dv), w.norm->view(), c.rms_norm_eps, xb_work(x, device()));
      return {w.out_proj, Tensor{}, true};
    }
    ops::gated_rms_norm(heads(o, Dv), heads(z, Dv), w.norm->view(), c.rms_norm_eps, heads(normed, Dv));
  }
  return {w.out_proj, normed};
}

// Gated full attention (docs/model.md section 2.3): o_proj(attention(rope(norm(q)), cache) * sigmoid(gate)).
Engine::Projection Engine::attention_layer(const ForwardContext& f, const LayerWeights& L, LayerState& st,
                                           int64_t T, const Tensor* rope_pos) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = L.attn;
  const Scratch& x = f.scratch;
  const int64_t H = c.hidden_size, nH = c.num_attention_heads, nKV = c.num_key_value_heads, D = c.head_dim;
  const ProfileLabel label("attn");
  // p [T, nH*2D] (per head: query | gate), k, v [T, nKV*D]
  const auto [p, k, v] = project(view(x.h, T, H), w.qkv_proj, {w.q_proj, w.k_proj, w.v_proj}, x.stacked,
                                 {view(x.proj, T, c.q_proj_dim()), view(x.k, T, nKV * D), view(x.v, T, nKV * D)},
                                 xb_work(x, device()));
  const Tensor q = view(x.core_in, T, nH * D), gate = view(x.out_gate, T, nH * D), o = view(x.core_out, T, nH * D);
  const DType kv_dtype = device() == Device::CPU ? DType::F32 : DType::BF16;
  const Tensor kc = Tensor::of(st.k.data(), kv_dtype, device(), {f.max_context, nKV * D});  // [maxT, nKV*D]
  const Tensor vc = Tensor::of(st.v.data(), kv_dtype, device(), {f.max_context, nKV * D});  // [maxT, nKV*D]
  const ops::Position pos = f.position;
  // After a prompt with images, text tokens turn by their index + rope_delta (docs/model.md section 8.5).
  LILY_CHECK(f.rope_delta == 0 || device() == Device::CPU, "attention: a rope offset (images) on ", device_name(device()));
  const ops::Position rope_at{pos.host + f.rope_delta, pos.device};
  if (T == 1 && !rope_pos && f.rope_delta == 0) {  // decode: the ops of the branch below in one (CUDA: 2 kernels)
    ops::gated_attention(p, k, v, w.q_norm->view(), w.k_norm->view(), c.rms_norm_eps, c.rotary_dim, c.rope_theta,
                         kc, vc, q, gate, o, int(nH), int(nKV), pos);
  } else {
    ops::split_q_gate(p, q, gate, int(nH));
    ops::rms_norm(heads(q, D), w.q_norm->view(), c.rms_norm_eps, heads(q, D));
    ops::rms_norm(heads(k, D), w.k_norm->view(), c.rms_norm_eps, heads(k, D));
    if (rope_pos) {
      ops::mrope(q, int(nH), c.rotary_dim, c.rope_theta, c.mrope_section, *rope_pos);
      ops::mrope(k, int(nKV), c.rotary_dim, c.rope_theta, c.mrope_section, *rope_pos);
    } else {
      ops::rope(q, int(nH), c.rotary_dim, c.rope_theta, rope_at);
      ops::rope(k, int(nKV), c.rotary_dim, c.rope_theta, rope_at);
    }
    ops::kv_cache_write(k, kc, pos);
    ops::kv_cache_write(v, vc, pos);
    ops::attention(q, kc, vc, o, int(nH), int(nKV), pos);
    ops::sigmoid_mul(o, gate);
  }
  return {w.o_proj, o};
}

void Engine::logits_rows(const ForwardContext& f, int64_t row0, int64_t n) const {
  const int64_t H = config_.hidden_size, V = config_.vocab_size;
  const Scratch& x = f.scratch;
  LILY_CHECK(n <= x.logit_rows, "logits_rows: ", n, " rows exceed the ", x.logit_rows, " rows of scratch");
  Tensor xr = Tensor::of(static_cast<float*>(x.x.data()) + row0 * H, DType::F32, device(), {n, H});  // [n, H]
  const ProfileLabel label("lm_head");
  ops::rms_norm(xr, weights_->final_norm->view(), config_.rms_norm_eps, view(x.final_h, n, H));
  ops::linear(*weights_->lm_head, view(x.final_h, n, H), view(x.logits, n, V), xb_work(x, device()));
}

void Engine::write_logits(const ForwardContext& f, int64_t row0, int64_t n, float* out) const {
  const int64_t V = config_.vocab_size, R = f.scratch.logit_rows;
  for (int64_t r = row0; r < row0 + n; r += R) {
    const int64_t m = std::min(R, row0 + n - r);
    logits_rows(f, r, m);
    f.scratch.logits.download(out + (r - row0) * V, size_t(m * V) * 4);
  }
}

// Appends the first T rows of a [T, width] activation to the session's trace.
static void record(const ForwardContext& f, const std::string& name, const Buffer& b, int64_t T, int64_t width) {
  if (!f.trace) return;
  Trace& t = (*f.trace)[name];
  t.width = width;
  const size_t old = t.data.size();
  t.data.resize(old + size_t(T * width));
  b.download(t.data.data() + old, size_t(T * width) * 4);
}

void Engine::forward_chunk(const ForwardContext& f, const Tensor& ids, int64_t T, const PromptImages* images,
                           int64_t t0) const {
  const ModelConfig& c = config_;
  Scratch& x = f.scratch;
  const int64_t H = c.hidden_size, I = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  LILY_CHECK(T > 0 && T <= f.chunk, "forward_chunk: ", T, " tokens exceed the chunk of ", f.chunk);
  const Tensor xs = view(x.x, T, H), h = view(x.h, T, H), mix = view(x.mix, T, H);  // [T, H] residual, normed, mixer
  ops::embedding(*weights_->embed_tokens, ids, xs);
  Tensor rope_pos;  // [T, 3] the chunk's multimodal positions, when its prompt has images
  if (images) {     // the image tokens' embeddings are the vision tower's merged tokens
    for (int64_t i = 0; i < images->n; ++i)
      if (images->rows[i] >= t0 && images->rows[i] < t0 + T)
        x.x.upload(images->embeds + i * H, size_t(H) * 4, size_t((images->rows[i] - t0) * H) * 4);
    x.rope_pos.upload(images->positions + 3 * t0, size_t(T) * 12);
    rope_pos = Tensor::of(x.rope_pos.data(), DType::I32, device(), {T, 3});
  }
  record(f, "embedding", x.x, T, H);
  const int64_t R = ops::moe_work_rows(device(), f.chunk, c.num_experts_per_tok);
  const int64_t words = ops::moe_routing_words(device(), f.chunk, c.num_experts, c.num_experts_per_tok);
  ops::MoeScratch ms{view(x.router_logits, f.chunk, c.num_experts), view(x.gathered, R, H), view(x.gate, R, I),
                     view(x.up, R, I), view(x.down, R, H), view(x.shared_gate, f.chunk, 1),
                     Tensor::of(x.routing.data(), DType::I32, device(), {words}), xb_work(x, device())};
  const float eps = c.rms_norm_eps;
  const int K = c.num_experts_per_tok;
  const Tensor sync = Tensor::of(x.sync.data(), DType::I32, device(), {1});
  // One token (and no trace of the blocks' outputs): each residual add and the norm after it run inside
  // the product before them (ops::linear_add_rms_norm, ops::moe_add_rms_norm); mix is then work space.
  const bool fold = T == 1 && !f.trace;
  ops::rms_norm(xs, weights_->layers[0].input_layernorm->view(), eps, h);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = weights_->layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    const Tensor post_norm = L.post_attention_layernorm->view();
    {  // x += mixer(h); h = post_attention_layernorm(x)
      const Projection out = L.is_full_attention ? attention_layer(f, L, f.layers[l], T, images ? &rope_pos : nullptr)
                                                 : gdn_layer(f, L, f.layers[l], T);
      const ProfileLabel label(L.is_full_attention ? "attn" : "gdn");  // the output projection is the mixer's
      if (fold && !out.x_in_xb) {
        ops::linear_add_rms_norm(*out.w, out.x, xs, post_norm, eps, h, mix, xb_work(x, device()), sync);
      } else {
        if (out.x_in_xb) ops::linear_xb(*out.w, xb_work(x, device()), mix);
        else ops::linear(*out.w, out.x, mix, xb_work(x, device()));
        record(f, p + "mixer", x.mix, T, H);
        ops::add_rms_norm(xs, mix, post_norm, eps, h);
      }
    }
    // x += moe(h); h = the next layer's input_layernorm(x) (the last layer: x += moe(h))
    const bool last = l + 1 == c.num_hidden_layers;
    if (fold && !last) {
      ops::moe_add_rms_norm(L.moe, h, xs, weights_->layers[l + 1].input_layernorm->view(), eps, mix, ms, K, sync);
    } else {
      ops::moe(L.moe, h, mix, ms, K);
      record(f, p + "moe", x.mix, T, H);
      if (last) ops::add(xs, mix);
      else ops::add_rms_norm(xs, mix, weights_->layers[l + 1].input_layernorm->view(), eps, h);
    }
    record(f, p + "residual", x.x, T, H);
  }
  ops::advance_position(static_cast<int32_t*>(x.position.data()), device(), T);
}

}  // namespace lily
