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

// A block's input h = rms_norm(x) * norm [T, H] (a layer's input_layernorm before its projections, its
// post_attention_layernorm before its MoE block): already in h, or (`normed`: one token, and
// ops::linear_rms_normed_supported for the layer's stacked projection, ops::moe_rms_normed_supported for
// the MoE block) computed by the block's first op from the residual stream x (ops::linear_rms_normed,
// ops::moe_rms_normed_add; h is then their work space).
struct LayerInput {
  Tensor h, x, norm;  // norm: the RMSNorm's weight [H]
  float eps;
  bool normed;
  bool xb = false;   // linear's workspace already holds h as the prefill GEMM's bf16 X (add_rms_norm_xb)
  bool f32 = true;   // h's F32 rows are written (false: only that bf16 X, which every projection reads)
};

// The projections y_i = h W_i^T of a layer's input by the matrices `parts`: for one token, where they
// are also stacked by rows (`stacked`), one GEMV into the scratch row `row` (with in.normed the input
// norm in it), split back into the parts' outputs (views of it); for a prompt where
// ops::linear_stack_supported, one product into `row`'s first T rows, its columns copied into `outs`
// (split_columns); otherwise one linear per part into `outs` (ws: linear's workspace), where a part runs on
// the wgmma GEMM after one that did, from the bf16 X that one left in ws (ops::linear_xb: the same bits,
// one conversion of h instead of one a part). `tail` (or null): the last tail_parts parts stacked by rows
// (a view of `stacked`'s rows): where it runs on the wgmma GEMM and its [T, rows] output fits `row`, those
// parts are one product into `row`, its columns copied into their outputs: GDN's b and a (32 rows each)
// each cost a whole 256-row weight tile of the GEMM; stacked they share one (the same rows, the same bits).
template <size_t N>
static std::array<Tensor, N> project(const LayerInput& in, const QMatrix* stacked, const QMatrix* const (&parts)[N],
                                     const QMatrix* tail, size_t tail_parts, const Buffer& row,
                                     const std::array<Tensor, N>& outs, const Tensor& ws) {
  const int64_t T = in.h.dim(0);
  if (T > 1 && stacked && ops::linear_stack_supported(in.h.device, *stacked, T)) {  // row: linear_stack_rows
    LILY_CHECK(!in.normed, "project: a normed input for a prompt");
    const Tensor y = view(row, T, stacked->rows);
    if (in.xb) ops::linear_xb(*stacked, ws, y);  // linear_stack_supported: the wgmma GEMM takes it
    else ops::linear(*stacked, in.h, y, ws);
    ops::split_columns(y, outs.data(), int(N));
    return outs;
  }
  if (T == 1 && stacked) {
    int64_t widths[N];
    for (size_t i = 0; i < N; ++i) widths[i] = parts[i]->rows;
    const Tensor y = view(row, 1, stacked->rows);
    if (in.normed) ops::linear_rms_normed(*stacked, in.x, in.norm, in.eps, in.h, y, ws);
    else ops::linear(*stacked, in.h, y, ws);
    return split(y, widths);
  }
  LILY_CHECK(!in.normed, "project: a normed input without the stacked projection");
  bool xb_in_ws = in.xb;  // ws starts with h as the wgmma GEMM's bf16 X
  auto product = [&](const QMatrix& m, const Tensor& y) {
    const bool on_wgmma = ops::linear_xb_supported(in.h.device, m, T);
    if (xb_in_ws && on_wgmma) {
      ops::linear_xb(m, ws, y);
    } else {
      LILY_CHECK(in.f32, "project: a ", m.rows, "-row projection of ", T, " rows reads h's F32 rows, ",
                 "which the norm before it did not write");
      ops::linear(m, in.h, y, ws);
    }
    xb_in_ws = on_wgmma;
  };
  const bool stack_tail = tail && tail_parts > 1 && tail_parts <= N && ops::linear_xb_supported(in.h.device, *tail, T) &&
                          row.nbytes() >= size_t(T * tail->rows) * sizeof(float);
  const size_t single = stack_tail ? N - tail_parts : N;
  for (size_t i = 0; i < single; ++i) product(*parts[i], outs[i]);
  if (stack_tail) {
    const Tensor y = view(row, T, tail->rows);
    product(*tail, y);
    ops::split_columns(y, outs.data() + single, int(tail_parts));
  }
  return outs;
}

// Gated DeltaNet mixer (docs/model.md section 2.2): out_proj(gated_rms_norm(delta_rule(conv(h)), z)),
// continuing from the state in `st` and writing the new state to `out` (st itself: in place).
Engine::Projection Engine::gdn_layer(const ForwardContext& f, const LayerWeights& L, const LayerState& st,
                                     LayerState& out, const LayerInput& in) const {
  const ModelConfig& c = config_;
  const GdnWeights& w = L.gdn;
  const Scratch& x = f.scratch;
  const int64_t T = in.h.dim(0), C = c.conv_dim(), Vd = c.value_dim(), Hk = c.linear_num_key_heads,
                Hv = c.linear_num_value_heads, Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const ProfileLabel label("gdn");
  // qkv [T, C] (q | k | v before the conv), z [T, Vd] output gate, b, a [T, Hv]
  const auto [qkv, z, b, a] =
      project(in, w.in_proj, {w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a}, w.in_proj_ba, 2, x.stacked,
              {view(x.proj, T, C), view(x.out_gate, T, Vd), view(x.b, T, Hv), view(x.a, T, Hv)}, xb_work(x, device()));
  auto conv_state = [&](const LayerState& s) { return view(s.conv, c.linear_conv_kernel_dim - 1, C); };  // [K-1, C]
  auto S = [&](const LayerState& s) {  // [Hv, Dk, Dv]
    return Tensor::of(s.recurrent.data(), DType::F32, device(), {Hv, Dk, Dv});
  };
  const Tensor normed = view(x.normed, T, Vd);  // [T, Vd]
  if (T == 1 && ops::gdn_decode_mixer_supported(device(), Hk, Hv, Dk, Dv, c.linear_conv_kernel_dim)) {
    // decode: the three ops below in one (one kernel on CUDA; literally the three on the CPU)
    ops::gdn_decode_mixer(qkv, w.conv1d->view(), conv_state(st), conv_state(out), a, b, w.A_log->view(),
                          w.dt_bias->view(), S(st), S(out), z, w.norm->view(), c.rms_norm_eps, normed, int(Hk),
                          int(Dk));
  } else {
    const Tensor y = view(x.core_in, T, C), o = view(x.core_out, T, Vd);
    const Tensor work = Tensor::of(x.gdn_work.data(), DType::F32, device(), {int64_t(x.gdn_work.nbytes() / 4)});
    ops::conv1d_silu(qkv, w.conv1d->view(), conv_state(st), conv_state(out), y);
    ops::gated_delta_rule(y, a, b, w.A_log->view(), w.dt_bias->view(), S(st), S(out), o, work, int(Hk), int(Dk));
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
                                           const LayerInput& in, const Tensor* rope_pos) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = L.attn;
  const Scratch& x = f.scratch;
  const int64_t T = in.h.dim(0), nH = c.num_attention_heads, nKV = c.num_key_value_heads, D = c.head_dim;
  const ProfileLabel label("attn");
  // p [T, nH*2D] (per head: query | gate), k, v [T, nKV*D]
  const auto [p, k, v] = project(in, w.qkv_proj, {w.q_proj, w.k_proj, w.v_proj}, nullptr, 0, x.stacked,
                                 {view(x.proj, T, c.q_proj_dim()), view(x.k, T, nKV * D), view(x.v, T, nKV * D)},
                                 xb_work(x, device()));
  const Tensor q = view(x.core_in, T, nH * D), gate = view(x.out_gate, T, nH * D), o = view(x.core_out, T, nH * D);
  const DType kv_dtype = device() == Device::CPU ? DType::F32 : DType::BF16;
  const Tensor kc = Tensor::of(st.k.data(), kv_dtype, device(), {f.max_context, nKV * D});  // [maxT, nKV*D]
  const Tensor vc = Tensor::of(st.v.data(), kv_dtype, device(), {f.max_context, nKV * D});  // [maxT, nKV*D]
  // After a prompt with images, text tokens turn by their index + pos.rope_delta (docs/model.md section 8.5).
  const ops::Position pos = f.position;
  if (!rope_pos) {  // the ops of the branch below in one (CUDA: 2 kernels for decode, 3 for a prompt at D = 256)
    // a prompt whose o_proj runs on the wgmma GEMM gets the gated o as that GEMM's bf16 X (docs/cuda.md)
    const bool o_xb = T > 1 && ops::gated_attention_xb_supported(device(), T, nH, nKV, D) &&
                      ops::linear_xb_supported(device(), *w.o_proj, T);
    ops::gated_attention(p, k, v, w.q_norm->view(), w.k_norm->view(), c.rms_norm_eps, c.rotary_dim, c.rope_theta,
                         kc, vc, q, gate, o, int(nH), int(nKV), pos, xb_work(x, device()), o_xb);
    if (o_xb) return {w.o_proj, Tensor{}, true};
  } else {
    ops::split_q_gate(p, q, gate, int(nH));
    ops::rms_norm(heads(q, D), w.q_norm->view(), c.rms_norm_eps, heads(q, D));
    ops::rms_norm(heads(k, D), w.k_norm->view(), c.rms_norm_eps, heads(k, D));
    if (rope_pos) {
      ops::mrope(q, int(nH), c.rotary_dim, c.rope_theta, c.mrope_section, *rope_pos);
      ops::mrope(k, int(nKV), c.rotary_dim, c.rope_theta, c.mrope_section, *rope_pos);
    } else {
      ops::rope(q, int(nH), c.rotary_dim, c.rope_theta, pos);
      ops::rope(k, int(nKV), c.rotary_dim, c.rope_theta, pos);
    }
    ops::kv_cache_write(k, kc, pos);
    ops::kv_cache_write(v, vc, pos);
    ops::attention(q, kc, vc, o, int(nH), int(nKV), pos, xb_work(x, device()));  // its q|k|v input is done
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
  // the final norm inside lm_head's GEMV where linear_rms_normed_supported (one token on CUDA: one launch
  // fewer a step), else rms_norm into final_h, then lm_head: the same bits either way
  ops::linear_rms_normed(*weights_->lm_head, xr, weights_->final_norm->view(), config_.rms_norm_eps,
                         view(x.final_h, n, H), view(x.logits, n, V), xb_work(x, device()));
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
    for (int64_t i = 0; i < images->n;) {
      if (images->rows[i] < t0 || images->rows[i] >= t0 + T) {
        ++i;
        continue;
      }
      int64_t j = i + 1;  // rows i..j-1: consecutive and inside the chunk, one upload
      while (j < images->n && images->rows[j] == images->rows[j - 1] + 1 && images->rows[j] < t0 + T) ++j;
      x.x.upload(images->embeds + i * H, size_t((j - i) * H) * 4, size_t((images->rows[i] - t0) * H) * 4);
      i = j;
    }
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
  // One token (and no trace of the blocks' outputs): each residual add runs inside the product before it
  // (ops::linear_add, ops::moe_add and their _rms_norm forms) and each RMSNorm inside a product next to it;
  // mix is then work space. Where a layer's stacked input projection normalises its input itself
  // (LayerInput::normed), the MoE block before it only adds and layer 0's rms_norm is left out; where the
  // MoE block normalises its own input (post.normed: the router and moe_up stage the post-attention norm,
  // and the next layer's projection takes its input norm), the output projection before it only adds.
  // Elsewhere the norm is written into h by the product before its reader (a last-CTA tail).
  const bool fold = T == 1 && !f.trace;
  auto input_of = [&](int l) {
    const LayerWeights& L = weights_->layers[l];
    const QMatrix* stacked = L.is_full_attention ? L.attn.qkv_proj : L.gdn.in_proj;
    const Tensor norm = L.input_layernorm->view();
    return LayerInput{h, xs, norm, eps, fold && stacked && ops::linear_rms_normed_supported(*stacked, xs, norm, h)};
  };
  // How layer L's input projections read h for T rows (project()): the stacked product where
  // linear_stack_supported, else each part on the wgmma GEMM from the bf16 X in linear's workspace (after a
  // part that was) or from h's F32 rows. xb: the first product reads that X; f32: some product reads the rows.
  struct Reads {
    bool xb, f32;
  };
  auto projection_reads = [&](const LayerWeights& L, int64_t T) {
    const QMatrix* stacked = L.is_full_attention ? L.attn.qkv_proj : L.gdn.in_proj;
    if (stacked && ops::linear_stack_supported(device(), *stacked, T)) return Reads{true, false};
    const std::array<const QMatrix*, 4> parts =
        L.is_full_attention ? std::array<const QMatrix*, 4>{L.attn.q_proj, L.attn.k_proj, L.attn.v_proj, nullptr}
                            : std::array<const QMatrix*, 4>{L.gdn.in_proj_qkv, L.gdn.in_proj_z, L.gdn.in_proj_b,
                                                            L.gdn.in_proj_a};
    Reads r{ops::linear_xb_supported(device(), *parts[0], T), false};
    for (const QMatrix* m : parts) r.f32 = r.f32 || (m && !ops::linear_xb_supported(device(), *m, T));
    return r;
  };
  LayerInput in = input_of(0);
  if (!in.normed) ops::rms_norm(xs, in.norm, eps, h);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = weights_->layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    const bool last = l + 1 == c.num_hidden_layers;
    LayerInput next = last ? LayerInput{h, xs, Tensor(), eps, false} : input_of(l + 1);
    const Tensor post_norm = L.post_attention_layernorm->view();
    // a prompt's post-attention norm also writes h as the MoE's bf16 X where its router runs on the wgmma GEMM,
    // and only as that X where every product of the block reads it (moe_xb_only_supported)
    const QMatrix* router = L.moe.router_gates ? L.moe.router_gates : L.moe.router;
    const ops::MoeInput moe_in = fold                                                      ? ops::MoeInput::F32
                                 : ops::moe_xb_only_supported(L.moe, h, ms, K)             ? ops::MoeInput::XB
                                 : router && ops::linear_xb_supported(device(), *router, T) ? ops::MoeInput::F32_AND_XB
                                                                                            : ops::MoeInput::F32;
    const LayerInput post{h, xs, post_norm, eps,  // the MoE block's input: normed only if the next layer's is
                          fold && (last || next.normed) && ops::moe_rms_normed_supported(L.moe, xs, post_norm, h, ms, K)};
    bool moe_done = false;  // the mixer's output projection and the MoE block as one op (early routing)
    {  // x += mixer(h); h = post_attention_layernorm(x), unless the MoE block computes it
      const Projection out = L.is_full_attention ? attention_layer(f, L, f.layers[l], in, images ? &rope_pos : nullptr)
                                                 : gdn_layer(f, L, f.layers[l], f.next[l], in);
      const ProfileLabel label(L.is_full_attention ? "attn" : "gdn");  // the output projection is the mixer's
      if (post.normed && !out.x_in_xb && ops::linear_add_moe_supported(*out.w, out.x, L.moe, xs, post_norm, h, ms, K)) {
        ops::linear_add_moe_rms_normed_add(*out.w, out.x, L.moe, xs, post_norm, eps, h, mix, ms, K, xb_work(x, device()));
        moe_done = true;
      } else if (post.normed) {
        ops::linear_add(*out.w, out.x, xs, mix, xb_work(x, device()));
      } else if (fold && !out.x_in_xb) {
        ops::linear_add_rms_norm(*out.w, out.x, xs, post_norm, eps, h, mix, xb_work(x, device()), sync);
      } else {
        if (out.x_in_xb) ops::linear_xb(*out.w, xb_work(x, device()), mix);
        else ops::linear(*out.w, out.x, mix, xb_work(x, device()));
        record(f, p + "mixer", x.mix, T, H);
        if (moe_in == ops::MoeInput::F32) ops::add_rms_norm(xs, mix, post_norm, eps, h);
        else ops::add_rms_norm_xb(xs, mix, post_norm, eps, moe_in == ops::MoeInput::XB ? Tensor{} : h,
                                  xb_work(x, device()));
      }
    }
    // x += moe(h); h = the next layer's input_layernorm(x), unless its projection computes it (the last
    // layer: x += moe(h)). Where the next layer's projections read h as the bf16 X (a prompt): h's F32 rows
    // only where one reads them, and untraced (mix not recorded) the MoE's combine, the add and the norm in
    // one op (moe_add_rms_norm_xb: the same bits as moe, then add_rms_norm_xb)
    const Reads reads = fold || last ? Reads{false, true} : projection_reads(weights_->layers[l + 1], T);
    if (moe_done) {  // linear_add_moe_rms_normed_add above
    } else if (post.normed) {
      ops::moe_rms_normed_add(L.moe, xs, post_norm, eps, h, mix, ms, K);
    } else if (fold && !last) {
      if (next.normed) ops::moe_add(L.moe, h, xs, mix, ms, K);
      else ops::moe_add_rms_norm(L.moe, h, xs, next.norm, eps, mix, ms, K, sync);
    } else if (reads.xb && !f.trace) {
      ops::moe_add_rms_norm_xb(L.moe, h, moe_in, xs, next.norm, eps, reads.f32 ? h : Tensor{}, mix, ms, K);
      next.xb = true, next.f32 = reads.f32;
    } else {
      ops::moe(L.moe, h, mix, ms, K, moe_in);
      record(f, p + "moe", x.mix, T, H);
      if (last) {
        ops::add(xs, mix);
      } else if (reads.xb) {
        ops::add_rms_norm_xb(xs, mix, next.norm, eps, reads.f32 ? h : Tensor{}, xb_work(x, device()));
        next.xb = true, next.f32 = reads.f32;
      } else {
        ops::add_rms_norm(xs, mix, next.norm, eps, h);
      }
    }
    record(f, p + "residual", x.x, T, H);
    in = next;
  }
  ops::advance_position(static_cast<int32_t*>(x.position.data()), device(), T);
}

}  // namespace lily
