// Launchers of the Gated DeltaNet kernels (kernels/gated_delta.cuh): the causal conv1d + SiLU and
// the delta-rule recurrence, both reading their carried state from one buffer and writing it to
// another or the same one (in place); and the decode token's conv -> recurrence -> gated norm in one
// kernel (kernels/gdn_decode.cuh).
#include "cuda_ops.h"
#include "kernels/gated_delta.cuh"
#include "kernels/gdn_chunk.cuh"
#include "kernels/gdn_decode.cuh"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

template <int K>
static void launch_conv1d(const Conv1dParams& p) {
  const dim3 grid{unsigned(ceil_div(p.C, CONV_THREADS)), unsigned(ceil_div(p.T, CONV_STEPS))};
  launch(conv1d_silu_kernel<K>, grid, CONV_THREADS, 0, p);
  LILY_CUDA_LAUNCHED();
}

void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y) {
  const int64_t T = u.dim(0), C = u.dim(1), K = weight.dim(1);
  LILY_CHECK(T <= 0x7fffffff && C <= 0x7fffffff, "conv1d_silu: sizes exceed the CUDA kernel's int range");
  if (T == 0) return;
  const Conv1dParams p{u.ptr<float>(), weight.ptr<float>(),    state.ptr<float>(),
                       state_out.ptr<float>(), y.ptr<float>(), int(T), int(C)};
  switch (K) {  // the taps live in registers, so the kernel size is a template constant
    case 2: return launch_conv1d<2>(p);
    case 3: return launch_conv1d<3>(p);
    case 4: return launch_conv1d<4>(p);
    case 5: return launch_conv1d<5>(p);
    case 6: return launch_conv1d<6>(p);
    case 7: return launch_conv1d<7>(p);
    case 8: return launch_conv1d<8>(p);
    default: fail("conv1d_silu: unsupported kernel size ", K, " on CUDA (2..8)");
  }
}

// The register-resident fast path needs Dk as a template constant, a multiple of 4*GDN_KSPLIT rows.
static bool gdn_has_fast_path(int Dk) { return Dk == 16 || Dk == 32 || Dk == 64 || Dk == 128 || Dk == 256; }

template <int DK>
static void launch_gdn_fast(const GatedDeltaParams& p, const dim3& grid) {
  launch(gated_delta_kernel<DK>, grid, GDN_THREADS, 0, p);
  LILY_CUDA_LAUNCHED();
}

// The chunked (WY) prefill (kernels/gdn_chunk.cuh) from GDN_CHUNK_MIN_T tokens, at Dk = Dv = 128.
// Below, the token-by-token kernel: its cost grows with T, while the chunked pair costs about the same
// for any T <= 64 (one padded chunk per head), so there is a crossover; benchmarks/gdn_lab.cu's second
// table measures both at T = 8..256, and it puts the crossover at about 64 tokens (docs/perf-notes.md,
// "Decisions in the code"). 64 also makes every chunked call at least one full chunk and leaves decode
// (T = 1, inside the captured graph) and all short calls on the token kernel.
constexpr int64_t GDN_CHUNK_MIN_T = 64;

static bool gdn_chunked(int64_t T, int64_t Dk, int64_t Dv) {
  return T >= GDN_CHUNK_MIN_T && Dk == gdn_chunk::D && Dv == gdn_chunk::D;
}

int64_t gated_delta_workspace_floats(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv) {
  return gdn_chunked(T, Dk, Dv) ? ceil_div<int64_t>(T, gdn_chunk::C) * Hv * gdn_chunk::BLOCK : 0;
}

static bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

static void launch_gdn_chunked(const gdn_chunk::Params& p) {
  static const bool raised = [] {  // > 48 KB of dynamic shared memory
    LILY_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk::prep_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(gdn_chunk::PrepSmem))));
    LILY_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk::scan_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(gdn_chunk::ScanSmem))));
    return true;
  }();
  (void)raised;
  launch(gdn_chunk::prep_kernel<>, dim3(unsigned(p.num_chunks), unsigned(gdn_chunk::prep_pairs(p.Hk, p.Hv))),
         gdn_chunk::PREP_THREADS, sizeof(gdn_chunk::PrepSmem), p);
  LILY_CUDA_LAUNCHED();
  launch(gdn_chunk::scan_kernel<>, dim3(unsigned(p.Hv), unsigned(gdn_chunk::D / gdn_chunk::COLS)), gdn_chunk::SCAN_THREADS,
         sizeof(gdn_chunk::ScanSmem), p);
  LILY_CUDA_LAUNCHED();
}

void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o,
                      const Tensor& workspace, int num_key_heads, int key_head_dim) {
  const int64_t T = qkv.dim(0), Hv = state.dim(0), Dv = state.dim(2);
  LILY_CHECK(T <= 0x7fffffff && Hv <= 0xffff && Dv <= 0x7fffffff,
             "gated_delta_rule: sizes exceed the CUDA kernel's range");
  if (T == 0) return;
  // ops/ checked workspace.numel() >= gated_delta_workspace_floats(); float4 and cp.async access
  // needs 16-byte aligned bases (always so for buffers; a misaligned view takes the token path).
  if (gdn_chunked(T, key_head_dim, Dv) && aligned16(qkv.data) && aligned16(state_out.data) && aligned16(o.data) &&
      aligned16(workspace.data)) {
    // The chunked kernels update their state in place (the engine's prefill passes state_out == state):
    // another output buffer starts as a copy of state.
    if (state_out.data != state.data)
      LILY_CUDA_CHECK(cudaMemcpyAsync(state_out.data, state.data, size_t(state.numel()) * 4,
                                      cudaMemcpyDeviceToDevice, stream()));
    const gdn_chunk::Params cp{qkv.ptr<float>(),     a.ptr<float>(),         b.ptr<float>(), A_log.ptr<float>(),
                               dt_bias.ptr<float>(), state_out.ptr<float>(), o.ptr<float>(), workspace.ptr<float>(),
                               int(T),               num_key_heads,          int(Hv),
                               int(ceil_div<int64_t>(T, gdn_chunk::C))};
    return launch_gdn_chunked(cp);
  }
  const GatedDeltaParams p{qkv.ptr<float>(),     a.ptr<float>(),     b.ptr<float>(),         A_log.ptr<float>(),
                           dt_bias.ptr<float>(), state.ptr<float>(), state_out.ptr<float>(), o.ptr<float>(),
                           int(T),               num_key_heads,      int(Hv),                key_head_dim,
                           int(Dv)};
  const dim3 grid{unsigned(Hv), unsigned(ceil_div<int64_t>(Dv, GDN_COLS))};
  if (!gdn_has_fast_path(key_head_dim)) {
    launch(gated_delta_generic_kernel, grid, 32, 0, p);
    LILY_CUDA_LAUNCHED();
    return;
  }
  switch (key_head_dim) {
    case 16: return launch_gdn_fast<16>(p, grid);
    case 32: return launch_gdn_fast<32>(p, grid);
    case 64: return launch_gdn_fast<64>(p, grid);
    case 128: return launch_gdn_fast<128>(p, grid);
    case 256: return launch_gdn_fast<256>(p, grid);
    default: fail("gated_delta_rule: unsupported key head dim ", key_head_dim, " for the fast path");
  }
}

// The conv in the chunked prefill's prep (gdn_chunk::Params::u) where the chunked kernels run, the conv has
// gdn_chunk::CONV_K taps, each key head's value heads fit one prep CTA (Hv <= 2 Hk: no CTA reads the conv state
// columns that another overwrites) and every buffer is 16-byte aligned; else conv1d_silu then gated_delta_rule.
void conv_gated_delta_rule(const Tensor& u, const Tensor& conv_weight, const Tensor& conv_state,
                           const Tensor& conv_state_out, const Tensor& y, const Tensor& a, const Tensor& b,
                           const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& state_out,
                           const Tensor& o, const Tensor& workspace, int num_key_heads, int key_head_dim) {
  const int64_t T = u.dim(0), Hv = state.dim(0), Dv = state.dim(2);
  const bool fused = T <= 0x7fffffff && gdn_chunked(T, key_head_dim, Dv) &&
                     conv_weight.dim(1) == gdn_chunk::CONV_K && Hv <= 2 * int64_t(num_key_heads) &&
                     aligned16(u.data) && aligned16(y.data) && aligned16(conv_weight.data) &&
                     aligned16(conv_state.data) && aligned16(state_out.data) && aligned16(o.data) &&
                     aligned16(workspace.data);
  if (!fused) {
    conv1d_silu(u, conv_weight, conv_state, conv_state_out, y);
    return gated_delta_rule(y, a, b, A_log, dt_bias, state, state_out, o, workspace, num_key_heads, key_head_dim);
  }
  if (state_out.data != state.data)  // the chunked kernels update their state in place (gated_delta_rule)
    LILY_CUDA_CHECK(cudaMemcpyAsync(state_out.data, state.data, size_t(state.numel()) * 4, cudaMemcpyDeviceToDevice,
                                    stream()));
  gdn_chunk::Params cp{y.ptr<float>(),     a.ptr<float>(),         b.ptr<float>(), A_log.ptr<float>(),
                       dt_bias.ptr<float>(), state_out.ptr<float>(), o.ptr<float>(), workspace.ptr<float>(),
                       int(T),               num_key_heads,          int(Hv),
                       int(ceil_div<int64_t>(T, gdn_chunk::C))};
  cp.u = u.ptr<float>();
  cp.conv_w = conv_weight.ptr<float>();
  cp.conv_state = conv_state.ptr<float>();
  cp.conv_state_out = conv_state_out.ptr<float>();
  cp.y_qk = y.ptr<float>();
  launch_gdn_chunked(cp);
}

// The fused decode kernel: a fast-path Dk, a conv kernel size it is built for, and one key head's
// CTAs (Hv/Hk value heads x ceil(Dv/32) column slices) in one portable cluster.
bool gdn_decode_mixer_supported(int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K) {
  return gdn_has_fast_path(int(Dk)) && K >= 2 && K <= 4 && Hk > 0 && Hv % Hk == 0 && Hv <= 0xffff && Dv > 0 &&
         (Hv / Hk) * ceil_div<int64_t>(Dv, GDN_COLS) <= GDN_DECODE_MAX_CLUSTER;
}

template <int DK>
static void launch_gdn_decode(const GdnDecodeParams& p, int K, const dim3& grid, const dim3& cluster) {
  switch (K) {  // the taps live in registers
    case 2: launch_clustered(gdn_decode_mixer_kernel<DK, 2>, grid, GDN_THREADS, cluster, 0, p); break;
    case 3: launch_clustered(gdn_decode_mixer_kernel<DK, 3>, grid, GDN_THREADS, cluster, 0, p); break;
    case 4: launch_clustered(gdn_decode_mixer_kernel<DK, 4>, grid, GDN_THREADS, cluster, 0, p); break;
    default: fail("gdn_decode_mixer: unsupported conv kernel size ", K, " on CUDA (2..4)");
  }
  LILY_CUDA_LAUNCHED();
}

void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int num_key_heads, int key_head_dim) {
  const int64_t Hv = state.dim(0), Dv = state.dim(2), K = conv_weight.dim(1);
  LILY_CHECK(gdn_decode_mixer_supported(num_key_heads, Hv, key_head_dim, Dv, K),
             "gdn_decode_mixer: no CUDA kernel for Hk ", num_key_heads, ", Hv ", Hv, ", Dk ", key_head_dim, ", Dv ",
             Dv, ", conv kernel ", K, " (check gdn_decode_mixer_supported first)");
  // gated_rms_norm's float4 choice for the same row (its x, the unfused o, is always a fresh buffer)
  const bool vec4 = Dv % 4 == 0 && aligned16(z.data) && aligned16(norm_weight.data) && aligned16(y.data);
  GdnDecodeParams p;
  p.u = qkv.ptr<float>();
  p.conv_w = conv_weight.ptr<float>();
  p.conv_state = conv_state.ptr<float>();
  p.conv_state_out = conv_state_out.ptr<float>();
  p.a = a.ptr<float>();
  p.b = b.ptr<float>();
  p.A_log = A_log.ptr<float>();
  p.dt_bias = dt_bias.ptr<float>();
  p.state = state.ptr<float>();
  p.state_out = state_out.ptr<float>();
  p.z = z.ptr<float>();
  p.norm_w = norm_weight.ptr<float>();
  p.y = y.ptr<float>();
  p.Hk = num_key_heads;
  p.Hv = int(Hv);
  p.Dv = int(Dv);
  p.eps = eps;
  p.norm_vec4 = vec4;
  const unsigned ns = unsigned(ceil_div<int64_t>(Dv, GDN_COLS));
  const dim3 grid{ns, unsigned(Hv)}, cluster{ns, unsigned(Hv / num_key_heads)};
  switch (key_head_dim) {
    case 16: return launch_gdn_decode<16>(p, int(K), grid, cluster);
    case 32: return launch_gdn_decode<32>(p, int(K), grid, cluster);
    case 64: return launch_gdn_decode<64>(p, int(K), grid, cluster);
    case 128: return launch_gdn_decode<128>(p, int(K), grid, cluster);
    case 256: return launch_gdn_decode<256>(p, int(K), grid, cluster);
    default: fail("gdn_decode_mixer: unsupported key head dim ", key_head_dim);
  }
}

}  // namespace lily::cuda
