// gdn_fused_lab: the GDN decode layer's in_proj GEMV + mixer as two kernels (today: linear_gemv_mma_kernel
// with the input norm, then gdn_decode_mixer_kernel) against one (gdn_in_proj_mixer_kernel: clusters of 16
// CTAs, one a key head; first printed: how many are resident at once, Hk = 16 needed), at the model's dims
// (hidden 2048, Hk 16, Hv 32, Dk = Dv = 128, conv 4; in_proj 12352 x 2048, 4-bit, groups of 64).
// L = 30 layers, each with its own weights and state (378 MB of in_proj: no L2 reuse between layers), all
// reading one residual row; each variant captured once into a CUDA graph with programmatic dependent
// launches (as the decode graph), replayed; us per layer = median replay time / L over 21 replays.
// Check first: one eager run of each variant from the same state, y / conv state / S compared bit for bit.
//   Run: bash benchmarks/gdn_fused_lab.sh
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/gemv_plan.h"
#include "cuda/kernels/gdn_in_proj_mixer.cuh"

using namespace lily::cuda;

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gdn_fused_lab: %s failed: %s (gdn_fused_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

constexpr int H = 2048, Hk = 16, Hv = 32, DK = 128, DV = 128, KC = 4, L = 30;
constexpr int C = 2 * Hk * DK + Hv * DV, Vd = Hv * DV, R = C + Vd + 2 * Hv, WPR = H * 4 / 32, GPR = H / 64;

template <typename Kernel, typename... Args>
static void launch(Kernel kernel, dim3 grid, dim3 block, dim3 cluster, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster.x, attr[1].val.clusterDim.y = cluster.y, attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = s;
  cfg.attrs = attr, cfg.numAttrs = cluster.x * cluster.y > 1 ? 2 : 1;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static uint32_t rng_state = 12345u;
static uint32_t next_u32() { return rng_state = rng_state * 1664525u + 1013904223u; }
static float uniform(float a, float b) { return a + (b - a) * float(next_u32() >> 8) * (1.f / 16777216.f); }
static uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T>
static T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
static std::vector<float> floats(size_t n, float a, float b) {
  std::vector<float> v(n);
  for (float& x : v) x = uniform(a, b);
  return v;
}

struct Layer {
  uint32_t* w;
  uint16_t *s, *b;
  float *conv_w, *conv_state, *A_log, *dt_bias, *S, *norm_w;
};

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const auto gemv = linear_gemv_mma_kernel<4, 2, true>;
  const auto mixer = gdn_decode_mixer_kernel<128, 4>;
  const auto fused = gdn_in_proj_mixer_kernel<true>;
  const size_t smem = mma_x_bytes(H, 64);
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, linear_gemv_mma_kernel<4, 2, false>, MMA_THREADS, smem));
  const MmaPlan plan = mma_plan_for((R + 15) / 16, H / 128, int64_t(sms) * std::max(per_sm, 1));
  std::printf("%d SMs, GEMV plan: ks %d, %d CTAs (%d CTAs/SM)\n", sms, plan.ks, plan.grid, per_sm);
  int clusters = 0, fused_per_sm = 0;  // Hk clusters of 16 resident at once: the engine's condition
  const bool fits = gipm_clusters_fit(fused, smem, Hk, &clusters);
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fused_per_sm, fused, MMA_THREADS, smem));
  std::printf("fused: %d CTAs/SM, %d clusters of %d resident at once (%d key heads)%s\n", fused_per_sm, clusters,
              GIPM_CLUSTER, Hk, fits ? "" : ": MORE THAN ONE WAVE, the engine would not fuse (timed anyway)");
  std::vector<float> xh = floats(H, -3.f, 3.f), nwh = floats(H, 0.5f, 1.5f);
  float *x = upload(xh), *in_norm = upload(nwh), *proj, *y[2];
  CK(cudaMalloc(&proj, size_t(L) * R * 4));
  for (float*& p : y) CK(cudaMalloc(&p, size_t(L) * Vd * 4));
  std::vector<Layer> layers(L);
  std::vector<std::vector<float>> conv0(L), S0(L);
  for (Layer& l : layers) {
    std::vector<uint32_t> w(size_t(R) * WPR);
    for (uint32_t& v : w) v = next_u32();
    std::vector<uint16_t> s(size_t(R) * GPR), b(size_t(R) * GPR);
    for (size_t i = 0; i < s.size(); ++i) s[i] = bf16(uniform(0.002f, 0.004f)), b[i] = bf16(uniform(-0.03f, -0.02f));
    l.w = upload(w), l.s = upload(s), l.b = upload(b);
    l.conv_w = upload(floats(size_t(C) * KC, -0.5f, 0.5f));
    std::vector<float> a(Hv);
    for (float& v : a) v = std::log(uniform(1.f, 16.f));
    l.A_log = upload(a), l.dt_bias = upload(floats(Hv, -1.f, 1.f)), l.norm_w = upload(floats(DV, 0.9f, 1.1f));
    const size_t i = &l - layers.data();
    conv0[i] = floats(size_t(KC - 1) * C, -1.f, 1.f), S0[i] = floats(size_t(Hv) * DK * DV, -0.1f, 0.1f);
    l.conv_state = upload(conv0[i]), l.S = upload(S0[i]);
  }
  auto reset = [&] {
    for (int i = 0; i < L; ++i) {
      CK(cudaMemcpy(layers[i].conv_state, conv0[i].data(), conv0[i].size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(layers[i].S, S0[i].data(), S0[i].size() * 4, cudaMemcpyHostToDevice));
    }
  };
  auto mixer_params = [&](int i, float* out) {
    GdnDecodeParams m{};
    const Layer& l = layers[i];
    float* u = proj + size_t(i) * R;
    m.u = u, m.z = u + C, m.b = u + C + Vd, m.a = u + C + Vd + Hv;
    m.conv_w = l.conv_w, m.conv_state = m.conv_state_out = l.conv_state;
    m.A_log = l.A_log, m.dt_bias = l.dt_bias, m.state = m.state_out = l.S, m.norm_w = l.norm_w;
    m.y = out + size_t(i) * Vd, m.Hk = Hk, m.Hv = Hv, m.Dv = DV, m.eps = 1e-6f, m.norm_vec4 = true;
    return m;
  };
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  auto two = [&] {
    for (int i = 0; i < L; ++i) {
      MmaLinearParams p{};
      p.w = layers[i].w, p.scales = layers[i].s, p.biases = layers[i].b, p.x = x, p.y = proj + size_t(i) * R;
      p.rows = R, p.cols = H, p.group_shift = 6, p.ks = plan.ks, p.norm_in = NormIn{in_norm, 1e-6f};
      launch(gemv, dim3(plan.grid), dim3(MMA_THREADS), dim3(1, 1), smem, st, p);
      launch(mixer, dim3(DV / GDN_COLS, Hv), dim3(GDN_THREADS), dim3(DV / GDN_COLS, Hv / Hk), 0, st,
             mixer_params(i, y[0]));
    }
  };
  auto one = [&] {
    for (int i = 0; i < L; ++i) {
      GipmParams p{};
      p.w = layers[i].w, p.scales = layers[i].s, p.biases = layers[i].b, p.x = x, p.norm_in = NormIn{in_norm, 1e-6f};
      p.cols = H, p.group_shift = 6, p.ks = plan.ks, p.m = mixer_params(i, y[1]);
      launch(fused, dim3(Hk * GIPM_CLUSTER), dim3(MMA_THREADS), dim3(GIPM_CLUSTER, 1), smem, st, p);
    }
  };

  // check: the same state and input through both, bit for bit
  std::vector<std::vector<float>> outs;
  for (auto run : {0, 1}) {
    reset();
    run == 0 ? two() : one();
    CK(cudaStreamSynchronize(st));
    std::vector<float> o(size_t(L) * Vd), cs(size_t(L) * (KC - 1) * C), S(size_t(L) * Hv * DK * DV);
    CK(cudaMemcpy(o.data(), y[run], o.size() * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < L; ++i) {
      CK(cudaMemcpy(cs.data() + size_t(i) * (KC - 1) * C, layers[i].conv_state, size_t(KC - 1) * C * 4,
                    cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(S.data() + size_t(i) * Hv * DK * DV, layers[i].S, size_t(Hv) * DK * DV * 4,
                    cudaMemcpyDeviceToHost));
    }
    o.insert(o.end(), cs.begin(), cs.end()), o.insert(o.end(), S.begin(), S.end());
    outs.push_back(std::move(o));
  }
  size_t differ = 0, nonfinite = 0;
  for (size_t i = 0; i < outs[0].size(); ++i) {
    differ += std::memcmp(&outs[0][i], &outs[1][i], 4) != 0;
    nonfinite += !std::isfinite(outs[1][i]);
  }
  std::printf("check: %zu of %zu values differ (y, conv state, S of %d layers), %zu not finite: %s\n", differ,
              outs[0].size(), L, nonfinite, differ == 0 && nonfinite == 0 ? "ok" : "FAIL");

  std::printf("| variant | us / layer |\n|---|---:|\n");
  for (auto run : {0, 1}) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    run == 0 ? two() : one();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)), CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int k = 0; k < 22; ++k) {
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (k > 0) t.push_back(ms);  // the first replay warms up
    }
    std::sort(t.begin(), t.end());
    const char* name = run == 0 ? "in_proj GEMV + gdn_decode_mixer (2 kernels)" : "gdn_in_proj_mixer (1 kernel)";
    std::printf("| %s | %.2f |\n", name, 1e3 * t[t.size() / 2] / L);
  }
  return differ == 0 && nonfinite == 0 ? 0 : 1;
}
