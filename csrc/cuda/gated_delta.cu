// Launchers of the Gated DeltaNet kernels (kernels/gated_delta.cuh): the causal conv1d + SiLU and
// the delta-rule recurrence, both reading their carried state from one buffer and writing it to
// another or the same one (in place); the decode token's conv -> recurrence -> gated norm in one
// kernel (kernels/gdn_decode.cuh), and that with the in_proj GEMV before it (kernels/gdn_in_proj_mixer.cuh).
#include <map>
#include <mutex>

#include "cuda_ops.h"
#include "kernels/gated_delta.cuh"
#include "kernels/gdn_chunk.cuh"
#include "kernels/gdn_decode.cuh"
#include "kernels/gdn_in_proj_mixer.cuh"
#include "linear.h"
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
    LILY_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk::prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(gdn_chunk::PrepSmem))));
    LILY_CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk::scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(gdn_chunk::ScanSmem))));
    return true;
  }();
  (void)raised;
  launch(gdn_chunk::prep_kernel, dim3(unsigned(p.num_chunks), unsigned(p.Hv)), gdn_chunk::THREADS,
         sizeof(gdn_chunk::PrepSmem), p);
  LILY_CUDA_LAUNCHED();
  launch(gdn_chunk::scan_kernel, dim3(unsigned(p.Hv), unsigned(gdn_chunk::D / gdn_chunk::COLS)), gdn_chunk::THREADS,
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

// gipm_clusters_fit for `smem` bytes of staged x and Hk key heads, queried once per instance, size and Hk.
template <bool NORM_IN>
static bool gipm_fits(size_t smem, int Hk) {
  static std::mutex mu;
  static std::map<std::pair<size_t, int>, bool> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(smem, Hk);
  const auto it = known.find(key);
  int clusters = 0;
  return it != known.end() ? it->second
                           : known[key] = gipm_clusters_fit(gdn_in_proj_mixer_kernel<NORM_IN>, smem, Hk, &clusters);
}

static size_t gipm_smem(const QMatrix& in_proj) { return mma_x_bytes(in_proj.cols, MmaSeg<GIPM_BITS>::VALS / GIPM_NG); }

// The fused decode layer (kernels/gdn_in_proj_mixer.cuh): the model's dims (Dk = Dv = 128, Hv = 2 Hk,
// conv kernel 4), in_proj the stacked [q | k | v | z | b | a] rows, 4-bit with groups of 64, that linear
// runs on the integer GEMV for x (so its K split is linear's), 16-byte aligned where the kernel copies
// with cp.async or prefetches whole rows (state, conv state and taps; scales and biases: cols % 512 == 0
// makes each row's 16-byte chunks whole); with an input norm, linear_rms_normed's one-kernel conditions;
// Hk clusters of 16 CTAs resident at once (gipm_clusters_fit: the GEMV phase in one wave).
bool gdn_in_proj_mixer_supported(const QMatrix& in_proj, const Tensor& x, const Tensor& in_norm, const Tensor& h,
                                 const Tensor& conv_weight, const Tensor& conv_state, const Tensor& state, int Hk,
                                 int Dk) {
  const int64_t Hv = state.dim(0), Dv = state.dim(2), K = conv_weight.dim(1);
  const int64_t R = 2 * int64_t(Hk) * Dk + 2 * Hv * Dv + 2 * Hv;
  const WeightView v = weight_view(in_proj);
  const bool normed = in_norm.data != nullptr;
  return Dk == GIPM_DK && Dv == GIPM_DV && Hv == int64_t(GIPM_GROUP) * Hk && K == GIPM_K && Hv <= 0xffff &&
         in_proj.num_stack == 1 && in_proj.bits == GIPM_BITS && in_proj.group_size == 64 && in_proj.rows == R &&
         in_proj.cols % 512 == 0 && linear_gemv_mma(in_proj, x) && is_aligned16(v.scales) &&
         is_aligned16(v.biases) && aligned16(state.data) && aligned16(conv_state.data) &&
         aligned16(conv_weight.data) && (!normed || linear_rms_normed_supported(in_proj, x, in_norm, h)) &&
         (normed ? gipm_fits<true>(gipm_smem(in_proj), Hk) : gipm_fits<false>(gipm_smem(in_proj), Hk));
}

void gdn_in_proj_mixer(const QMatrix& in_proj, const Tensor& x, const Tensor& in_norm, float in_eps,
                       const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state,
                       const Tensor& conv_state_out, const Tensor& A_log, const Tensor& dt_bias, const Tensor& state,
                       const Tensor& state_out, const Tensor& norm_weight, float eps, const Tensor& y, int Hk,
                       int Dk) {
  const auto plain = gdn_in_proj_mixer_kernel<false>, normed = gdn_in_proj_mixer_kernel<true>;
  const WeightView v = weight_view(in_proj);
  GipmParams p{};
  p.w = static_cast<const uint32_t*>(v.w);
  p.scales = static_cast<const uint16_t*>(v.scales);
  p.biases = static_cast<const uint16_t*>(v.biases);
  p.x = x.ptr<float>();
  p.norm_in = NormIn{in_norm.data ? in_norm.ptr<float>() : nullptr, in_eps};
  p.cols = int(in_proj.cols);
  p.group_shift = log2_of(in_proj.group_size);
  p.ks = linear_gemv_mma_ks(in_proj);
  GdnDecodeParams& m = p.m;
  m.conv_w = conv_weight.ptr<float>();
  m.conv_state = conv_state.ptr<float>();
  m.conv_state_out = conv_state_out.ptr<float>();
  m.A_log = A_log.ptr<float>();
  m.dt_bias = dt_bias.ptr<float>();
  m.state = state.ptr<float>();
  m.state_out = state_out.ptr<float>();
  m.norm_w = norm_weight.ptr<float>();
  m.y = y.ptr<float>();
  m.Hk = Hk;
  m.Hv = int(state.dim(0));
  m.Dv = GIPM_DV;
  m.eps = eps;
  // gated_rms_norm's float4 choice as gdn_decode_mixer makes it for the unfused op's z = proj[C:] (C % 4 == 0)
  m.norm_vec4 = aligned16(proj.data) && aligned16(norm_weight.data) && aligned16(y.data);
  const size_t smem = gipm_smem(in_proj);
  LILY_CHECK(p.norm_in.w ? gipm_fits<true>(smem, Hk) : gipm_fits<false>(smem, Hk),
             "gdn_in_proj_mixer: its clusters do not fit (gdn_in_proj_mixer_supported)");  // also allows size 16
  (void)Dk;
  launch_clustered(p.norm_in.w ? normed : plain, dim3(unsigned(Hk * GIPM_CLUSTER)), MMA_THREADS,
                   dim3(unsigned(GIPM_CLUSTER)), smem, p);
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
