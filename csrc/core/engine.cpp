#include "engine.h"

#include "profile.h"

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

void Engine::gdn_layer(Session& s, const LayerWeights& L, LayerState& st, int64_t T) const {
  const ModelConfig& c = config_;
  const GdnWeights& w = L.gdn;
  const Scratch& x = s.s_;
  const Tensor ws = xb_work(x, device());  // linear's BF16 workspace
  const int64_t H = c.hidden_size, C = c.conv_dim(), Hv = c.linear_num_value_heads, Vd = c.value_dim();
  Tensor h = view(x.h, T, H);                 // [T, H]
  Tensor y = view(x.conv_out, T, C);          // [T, conv_dim] after conv + SiLU
  Tensor o = view(x.o, T, Vd);                // [T, Hv*Dv]
  Tensor qkv, z, a, b;                        // [T, conv_dim] pre-conv q | k | v, [T, Hv*Dv], [T, Hv] x2
  Profiler* prof = s.profiler.get();
  {
    ProfileScope p(prof, "gdn.in_proj");
    if (T == 1 && w.in_proj) {  // one GEMV; the four outputs lie back to back in one row
      float* row = static_cast<float*>(x.stacked.data());
      qkv = Tensor::of(row, DType::F32, device(), {1, C});
      z = Tensor::of(row + C, DType::F32, device(), {1, Vd});
      b = Tensor::of(row + C + Vd, DType::F32, device(), {1, Hv});
      a = Tensor::of(row + C + Vd + Hv, DType::F32, device(), {1, Hv});
      ops::linear(*w.in_proj, 0, h, view(x.stacked, 1, C + Vd + 2 * Hv), ws);
    } else {
      qkv = view(x.proj, T, C), z = view(x.z, T, Vd), a = view(x.a, T, Hv), b = view(x.b, T, Hv);
      ops::linear(*w.in_proj_qkv, 0, h, qkv, ws);
      ops::linear(*w.in_proj_z, 0, h, z, ws);
      ops::linear(*w.in_proj_b, 0, h, b, ws);
      ops::linear(*w.in_proj_a, 0, h, a, ws);
    }
  }
  const Tensor conv_state = view(st.conv, c.linear_conv_kernel_dim - 1, C);  // [K-1, C]
  Tensor S = Tensor::of(st.recurrent.data(), DType::F32, device(),
                        {Hv, c.linear_key_head_dim, c.linear_value_head_dim});  // [Hv, Dk, Dv]
  if (T == 1 && ops::gdn_decode_mixer_supported(device(), c.linear_num_key_heads, Hv, c.linear_key_head_dim,
                                                c.linear_value_head_dim, c.linear_conv_kernel_dim)) {
    // decode: the three ops below in one (one kernel on CUDA; literally the three on the CPU)
    ProfileScope p(prof, "gdn.decode_mixer");
    ops::gdn_decode_mixer(qkv, w.conv1d->view(), conv_state, a, b, w.A_log->view(), w.dt_bias->view(), S, z,
                          w.norm->view(), c.rms_norm_eps, view(x.normed, 1, Vd), c.linear_num_key_heads,
                          c.linear_key_head_dim);
  } else {
    {
      ProfileScope p(prof, "gdn.conv1d_silu");
      ops::conv1d_silu(qkv, w.conv1d->view(), conv_state, y);
    }
    {
      ProfileScope p(prof, "gdn.gated_delta_rule");
      const Tensor work = Tensor::of(x.gdn_work.data(), DType::F32, device(), {int64_t(x.gdn_work.nbytes() / 4)});
      ops::gated_delta_rule(y, a, b, w.A_log->view(), w.dt_bias->view(), S, o, work, c.linear_num_key_heads,
                            c.linear_key_head_dim);
    }
    ProfileScope p(prof, "gdn.gated_rms_norm");
    ops::gated_rms_norm(view(x.o, T * Hv, c.linear_value_head_dim),
                        Tensor::of(z.data, DType::F32, device(), {T * Hv, c.linear_value_head_dim}), w.norm->view(),
                        c.rms_norm_eps, view(x.normed, T * Hv, c.linear_value_head_dim));
  }
  ProfileScope p(prof, "gdn.out_proj");
  ops::linear(*w.out_proj, 0, view(x.normed, T, Vd), view(x.mix, T, H), ws);
}

void Engine::attention_layer(Session& s, const LayerWeights& L, LayerState& st, int64_t T) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = L.attn;
  const Scratch& x = s.s_;
  const Tensor ws = xb_work(x, device());  // linear's BF16 workspace
  const int64_t H = c.hidden_size, nH = c.num_attention_heads, nKV = c.num_key_value_heads, D = c.head_dim;
  Tensor h = view(x.h, T, H);                      // [T, H]
  Tensor q = view(x.conv_out, T, nH * D);          // [T, nH*D]
  Tensor gate = view(x.z, T, nH * D);              // [T, nH*D]
  Tensor o = view(x.o, T, nH * D);                 // [T, nH*D]
  Tensor p, k, v;                                  // [T, nH*2D] per head query | gate; [T, nKV*D] x2
  Profiler* prof = s.profiler.get();
  {
    ProfileScope ps(prof, "attn.qkv_proj");
    if (T == 1 && w.qkv_proj) {  // one GEMV; q|gate, k and v lie back to back in one row
      float* row = static_cast<float*>(x.stacked.data());
      const int64_t P = c.q_proj_dim(), KV = nKV * D;
      p = Tensor::of(row, DType::F32, device(), {1, P});
      k = Tensor::of(row + P, DType::F32, device(), {1, KV});
      v = Tensor::of(row + P + KV, DType::F32, device(), {1, KV});
      ops::linear(*w.qkv_proj, 0, h, view(x.stacked, 1, P + 2 * KV), ws);
    } else {
      p = view(x.proj, T, c.q_proj_dim()), k = view(x.kbuf, T, nKV * D), v = view(x.vbuf, T, nKV * D);
      ops::linear(*w.q_proj, 0, h, p, ws);
      ops::linear(*w.k_proj, 0, h, k, ws);
      ops::linear(*w.v_proj, 0, h, v, ws);
    }
    if (T > 1) ops::split_q_gate(p, q, gate, int(nH));  // decode splits inside gated_attention
  }
  const ops::Position pos = s.position_arg();
  const DType kv_dtype = device() == Device::CPU ? DType::F32 : DType::BF16;
  Tensor kc = Tensor::of(st.k.data(), kv_dtype, device(), {s.max_context_, nKV * D});  // [maxT, nKV*D]
  Tensor vc = Tensor::of(st.v.data(), kv_dtype, device(), {s.max_context_, nKV * D});  // [maxT, nKV*D]
  if (T == 1) {  // decode: split, q/k norm + RoPE, cache rows, attention, gate in one op (CUDA: 2 kernels)
    {
      ProfileScope ps(prof, "attn.attention");
      ops::gated_attention(p, k, v, w.q_norm->view(), w.k_norm->view(), c.rms_norm_eps, c.rotary_dim, c.rope_theta,
                           kc, vc, q, gate, o, int(nH), int(nKV), pos);
    }
    ProfileScope ps(prof, "attn.gate_o_proj");
    ops::linear(*w.o_proj, 0, o, view(x.mix, T, H), ws);
    return;
  }
  {
    ProfileScope ps(prof, "attn.qk_norm_rope");
    ops::rms_norm(view(x.conv_out, T * nH, D), w.q_norm->view(), c.rms_norm_eps, view(x.conv_out, T * nH, D));
    const Tensor kh = Tensor::of(k.data, DType::F32, device(), {T * nKV, D});  // [T*nKV, D]
    ops::rms_norm(kh, w.k_norm->view(), c.rms_norm_eps, kh);
    ops::rope(q, int(nH), c.rotary_dim, c.rope_theta, pos);
    ops::rope(k, int(nKV), c.rotary_dim, c.rope_theta, pos);
  }
  {
    ProfileScope ps(prof, "attn.kv_cache_write");
    ops::kv_cache_write(k, kc, pos);
    ops::kv_cache_write(v, vc, pos);
  }
  {
    ProfileScope ps(prof, "attn.attention");
    ops::attention(q, kc, vc, o, int(nH), int(nKV), pos);
  }
  ProfileScope ps(prof, "attn.gate_o_proj");
  ops::sigmoid_mul(o, gate);
  ops::linear(*w.o_proj, 0, o, view(x.mix, T, H), ws);
}

void Engine::logits_rows(Session& s, int64_t row0, int64_t n) const {
  const int64_t H = config_.hidden_size, V = config_.vocab_size;
  const Scratch& x = s.s_;
  const Tensor ws = xb_work(x, device());  // linear's BF16 workspace
  LILY_CHECK(n <= x.logit_rows, "logits_rows: ", n, " rows exceed the ", x.logit_rows, " rows of scratch");
  Tensor xr = Tensor::of(static_cast<float*>(x.x.data()) + row0 * H, DType::F32, device(), {n, H});  // [n, H]
  ProfileScope p(s.profiler.get(), "lm_head");
  ops::rms_norm(xr, weights_->final_norm->view(), config_.rms_norm_eps, view(x.final_h, n, H));
  ops::linear(*weights_->lm_head, 0, view(x.final_h, n, H), view(x.logits, n, V), ws);
}

void Engine::write_logits(Session& s, int64_t row0, int64_t n, float* out) const {
  const int64_t V = config_.vocab_size, R = s.s_.logit_rows;
  for (int64_t r = row0; r < row0 + n; r += R) {
    const int64_t m = std::min(R, row0 + n - r);
    logits_rows(s, r, m);
    s.s_.logits.download(out + (r - row0) * V, size_t(m * V) * 4);
  }
}

// Appends the first T rows of a [T, width] activation to the session's trace.
static void record(Session& s, const std::string& name, const Buffer& b, int64_t T, int64_t width) {
  if (!s.tracing) return;
  Session::Trace& t = s.trace[name];
  t.width = width;
  const size_t old = t.data.size();
  t.data.resize(old + size_t(T * width));
  b.download(t.data.data() + old, size_t(T * width) * 4);
}

void Engine::forward_chunk(Session& s, const Tensor& ids, int64_t T) const {
  const ModelConfig& c = config_;
  Scratch& x = s.s_;
  const int64_t H = c.hidden_size, I = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  LILY_CHECK(T > 0 && T <= s.chunk_, "forward_chunk: ", T, " tokens exceed the chunk of ", s.chunk_);
  Tensor xs = view(x.x, T, H);  // [T, H] residual stream
  Profiler* prof = s.profiler.get();
  {
    ProfileScope p(prof, "embedding");
    ops::embedding(*weights_->embed_tokens, ids, xs);
  }
  record(s, "embedding", x.x, T, H);
  const int64_t R = ops::moe_work_rows(device(), s.chunk_, c.num_experts_per_tok);
  const int64_t words = ops::moe_routing_words(device(), s.chunk_, c.num_experts, c.num_experts_per_tok);
  ops::MoeScratch ms{view(x.router_logits, s.chunk_, c.num_experts), view(x.gathered, R, H), view(x.gate, R, I),
                     view(x.up, R, I), view(x.down, R, H), view(x.shared_gate, s.chunk_, 1),
                     Tensor::of(x.routing.data(), DType::I32, device(), {words}), xb_work(x, device())};
  {
    ProfileScope p(prof, "norm");
    ops::rms_norm(xs, weights_->layers[0].input_layernorm->view(), c.rms_norm_eps, view(x.h, T, H));
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = weights_->layers[l];
    if (L.is_full_attention) attention_layer(s, L, s.layers_[l], T);
    else gdn_layer(s, L, s.layers_[l], T);
    const std::string p = "layers." + std::to_string(l) + ".";
    record(s, p + "mixer", x.mix, T, H);
    {
      ProfileScope ps(prof, "norm");  // x += mixer; h = post_attention_layernorm(x)
      ops::add_rms_norm(xs, view(x.mix, T, H), L.post_attention_layernorm->view(), c.rms_norm_eps, view(x.h, T, H));
    }
    {
      ProfileScope ps(prof, "moe");
      ops::moe(L.moe, view(x.h, T, H), view(x.mix, T, H), ms, c.num_experts_per_tok);
    }
    record(s, p + "moe", x.mix, T, H);
    {
      ProfileScope ps(prof, "norm");  // x += moe; h = the next layer's input_layernorm(x)
      if (l + 1 < c.num_hidden_layers)
        ops::add_rms_norm(xs, view(x.mix, T, H), weights_->layers[l + 1].input_layernorm->view(), c.rms_norm_eps,
                          view(x.h, T, H));
      else
        ops::add(xs, view(x.mix, T, H));
    }
    record(s, p + "residual", x.x, T, H);
  }
  ProfileScope ps(prof, "position");
  ops::advance_position(static_cast<int32_t*>(x.position.data()), device(), T);
}

}  // namespace lily
