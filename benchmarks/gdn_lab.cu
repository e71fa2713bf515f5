// gdn_lab: the chunked Gated DeltaNet prefill kernels (3xBF16 mma.sync, csrc/cuda/kernels/gdn_chunk.cuh)
// and the token-by-token kernel, at the model's shapes (the fp32 SIMT kernels they replaced measured
// 594 us per call here: docs/perf-notes.md): Hv = 32 value heads, Hk = 16 key heads, Dk = Dv = 128.
//   Run: bash benchmarks/gdn_lab.sh   (nvcc ~30 s, then ~5-10 s on an H200: most of it the host fp64 reference)
// Inputs (benchmarks/gdn_ref.h): q, k, v ~ N(0, 1) before the L2 norm, a, b ~ N(0, 1) (beta in (0, 1),
// g = -exp(A_log) softplus(a + dt_bias) in log space), S0 ~ 0.1 N(0, 1); every third chunk's first 40
// tokens decay hard (g ~ -10 .. -100: exp(G) underflows inside the chunk).
// Table 1 (T = 2048): us per call = mean over REPS launches between cudaEvents after a warm-up (each
// launch continues from the state the last left, as in a prefill). err = |x - ref| / |ref| over one
// value head's o [T, 128] and final state [128, 128], the worst of heads 0, 17, 31, against the fp64
// sequential recurrence (one fresh call from S0 per kernel); "vs token": the chunked pair's o and state
// over all heads against the token kernel's, the metric of tests/gpu/test_gated_delta.py's
// gated_delta_chunked_vs_steps. FAIL above 2e-5 on either (the tests' chunked-vs-token-kernel
// tolerance; the fp32 sequential CPU op itself is ~3e-7 from fp64, printed too).
// Table 2: the token kernel against the new chunked pair at short T, for GDN_CHUNK_MIN_T (the chunked
// kernels accept any T >= 1; the dispatcher sends only T >= GDN_CHUNK_MIN_T to them).
// Bits: an FNV-1a hash of the whole o, final state and workspace of the fresh prep + scan call, printed
// as "gdn_lab bits: ..."; gdn_lab.sh with BASE=<commit> also builds the lab against that commit's
// gdn_chunk.cuh and FAILs unless the two lines match (value-preserving kernel changes).
// With OUT set the tables also go to $OUT/gdn_lab.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../benchmarks/gdn_ref.h"
#include "cuda/kernels/gdn_chunk.cuh"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gdn_lab: %s failed: %s (gdn_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

using namespace lily::cuda;

constexpr int T_MAX = 2048, HK = 16, HV = 32, D = 128, REPS = 20;

struct Dev {
  float *qkv, *a, *b, *A_log, *dt_bias, *state, *o, *ws;
};

enum Kind { TOKEN, NEW_PREP, NEW_SCAN, NEW_BOTH };
static const char* kind_name[] = {"token-by-token (gated_delta_kernel<128>)", "prep (chunked)", "scan (chunked)",
                                  "prep + scan"};

static void launch(Kind k, const Dev& d, int T) {
  const int nch = (T + gdn_chunk::C - 1) / gdn_chunk::C;
  if (k == TOKEN) {
    const GatedDeltaParams p{d.qkv, d.a, d.b, d.A_log, d.dt_bias, d.state, d.state, d.o, T, HK, HV, D, D};  // in place
    gated_delta_kernel<128><<<dim3(HV, (D + GDN_COLS - 1) / GDN_COLS), GDN_THREADS>>>(p);
  }
  if (k == NEW_PREP || k == NEW_SCAN || k == NEW_BOTH) {
    const gdn_chunk::Params p{d.qkv, d.a, d.b, d.A_log, d.dt_bias, d.state, d.o, d.ws, T, HK, HV, nch};
    if (k != NEW_SCAN) gdn_chunk::prep_kernel<><<<dim3(nch, gdn_chunk::prep_pairs(HK, HV)), gdn_chunk::PREP_THREADS, sizeof(gdn_chunk::PrepSmem)>>>(p);
    if (k != NEW_PREP) gdn_chunk::scan_kernel<><<<dim3(HV, D / gdn_chunk::COLS), gdn_chunk::SCAN_THREADS, sizeof(gdn_chunk::ScanSmem)>>>(p);
  }
  CK(cudaGetLastError());
}

static double time_us(Kind k, const Dev& d, int T, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch(k, d, T);
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) launch(k, d, T);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return 1e3 * ms / reps;
}

template <class T>
static T* upload(const std::vector<T>& v) {
  T* p;
  CK(cudaMalloc(&p, v.size() * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

int main() {
  CK(cudaFuncSetAttribute(gdn_chunk::prep_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(gdn_chunk::PrepSmem))));
  CK(cudaFuncSetAttribute(gdn_chunk::scan_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(gdn_chunk::ScanSmem))));

  const gdn_ref::Inputs x = gdn_ref::make_inputs(T_MAX, HK, HV, D, 42, /*decay=*/1);
  const int nch = T_MAX / gdn_chunk::C;
  const size_t ws_floats = size_t(nch) * HV * size_t(gdn_chunk::BLOCK);
  Dev d{upload(x.qkv), upload(x.a), upload(x.b), upload(x.A_log), upload(x.dt_bias), upload(x.state), nullptr, nullptr};
  CK(cudaMalloc(&d.o, size_t(T_MAX) * HV * D * sizeof(float)));
  CK(cudaMalloc(&d.ws, ws_floats * sizeof(float)));
  CK(cudaMemset(d.ws, 0xff, ws_floats * sizeof(float)));  // NaN: a read of a workspace entry never written shows

  // fp64 (and fp32) sequential references on a few heads
  const int heads[] = {0, 17, 31};
  std::vector<std::vector<double>> ro(3), rs(3);
  double e32 = 0;
  for (int i = 0; i < 3; ++i) {
    gdn_ref::run_head(x, heads[i], ro[i], rs[i]);
    std::vector<float> o32, s32;
    gdn_ref::run_head(x, heads[i], o32, s32);
    e32 = std::max({e32, gdn_ref::rel_err(o32, ro[i]), gdn_ref::rel_err(s32, rs[i])});
  }

  std::string md;
  char line[512];
  auto emit = [&](const char* s) {
    std::fputs(s, stdout);
    md += s;
  };
  bool fail = false;
  std::string bits;
  std::snprintf(line, sizeof line,
                "## GDN prefill lab: T = %d, Hv = %d, Hk = %d, Dk = Dv = 128 (fp32 sequential CPU arithmetic vs fp64: %.2e)\n\n"
                "| kernel | us / call | err o | err state | vs token: o | state | |\n|---|---:|---:|---:|---:|---:|---|\n",
                T_MAX, HV, HK, e32);
  emit(line);
  std::vector<float> o(size_t(T_MAX) * HV * D), st(x.state.size()), o_tok, st_tok;
  for (Kind k : {TOKEN, NEW_PREP, NEW_SCAN, NEW_BOTH}) {
    double eo = -1, es = -1;
    if (k == TOKEN || k == NEW_BOTH) {  // one fresh call from S0, checked
      CK(cudaMemcpy(d.state, x.state.data(), st.size() * sizeof(float), cudaMemcpyHostToDevice));
      CK(cudaMemset(d.o, 0xff, o.size() * sizeof(float)));
      launch(k, d, T_MAX);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(o.data(), d.o, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(st.data(), d.state, st.size() * sizeof(float), cudaMemcpyDeviceToHost));
      if (k == NEW_BOTH) {
        std::vector<float> ws(ws_floats);
        CK(cudaMemcpy(ws.data(), d.ws, ws_floats * sizeof(float), cudaMemcpyDeviceToHost));
        std::snprintf(line, sizeof line, "gdn_lab bits: o %016llx state %016llx ws %016llx\n",
                      (unsigned long long)gdn_ref::fnv1a(o), (unsigned long long)gdn_ref::fnv1a(st), (unsigned long long)gdn_ref::fnv1a(ws));
        bits = line;
      }
      if (k == TOKEN) o_tok = o, st_tok = st;
      eo = es = 0;
      for (int i = 0; i < 3; ++i) {
        eo = std::max(eo, gdn_ref::rel_err(gdn_ref::head_o(o, T_MAX, HV, D, heads[i]), ro[i]));
        es = std::max(es, gdn_ref::rel_err(gdn_ref::head_state(st, D, heads[i]), rs[i]));
      }
    }
    const double us = time_us(k, d, T_MAX, k == TOKEN ? 5 : REPS);
    const double to = k == NEW_BOTH ? gdn_ref::rel_err(o, o_tok) : 0, ts = k == NEW_BOTH ? gdn_ref::rel_err(st, st_tok) : 0;
    const bool bad = eo >= 0 && !(eo <= 2e-5 && es <= 2e-5 && to <= 2e-5 && ts <= 2e-5);
    fail |= bad;
    if (k == NEW_BOTH)
      std::snprintf(line, sizeof line, "| %s | %.1f | %.2e | %.2e | %.2e | %.2e | %s |\n", kind_name[k], us, eo, es, to, ts,
                    bad ? "FAIL" : "ok");
    else if (eo >= 0)
      std::snprintf(line, sizeof line, "| %s | %.1f | %.2e | %.2e | | | %s |\n", kind_name[k], us, eo, es, bad ? "FAIL" : "ok");
    else
      std::snprintf(line, sizeof line, "| %s | %.1f | | | | | |\n", kind_name[k], us);
    emit(line);
  }

  emit("\n## Short prompts: token kernel against the chunked pair (GDN_CHUNK_MIN_T)\n\n"
       "| T | token us | chunked us |\n|---:|---:|---:|\n");
  for (int T : {8, 16, 32, 48, 64, 128, 256}) {
    std::snprintf(line, sizeof line, "| %d | %.1f | %.1f |\n", T, time_us(TOKEN, d, T, REPS), time_us(NEW_BOTH, d, T, REPS));
    emit(line);
  }
  CK(cudaDeviceSynchronize());
  if (const char* out = std::getenv("OUT")) {
    const std::string path = std::string(out) + "/gdn_lab.md";
    if (FILE* f = std::fopen(path.c_str(), "w")) {
      std::fputs(md.c_str(), f);
      std::fclose(f);
    }
  }
  std::fputs(bits.c_str(), stdout);
  std::printf("%s\n", fail ? "gdn_lab: FAIL" : "gdn_lab: all checks ok");
  return fail ? 1 : 0;
}
