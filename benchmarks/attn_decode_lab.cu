// attn_decode_lab: the split-KV decode attention (kernels/attention_decode.cuh, attention_decode_kernel
// at head_dim 256, one token, 16 query heads over 2 KV heads: the engine's shape) at contexts 4K, 32K and
// 128K, for the CTA shape it is compiled with (-DLILY_DECODE_WARPS, -DLILY_DECODE_TILE,
// -DLILY_DECODE_MIN_ROWS; attn_decode_lab.sh builds several). One table row per context: us a call (median of 7 batches of 20 plain launches after a
// warm-up; the caches are 268 MB a layer at 128K, far past L2), the KV bytes read over that time, P (CTAs a
// KV head) and CTAs a multiprocessor. o is written to $OUT_DIR/o_<tag>_<ctx>.bin for attn_decode_lab.sh to
// compare across shapes (max relative difference), and checked here against an fp64 host reference over
// 4 heads (err = max |o - ref| / max |ref|; FAIL above 1e-3).
// Inputs: k, v ~ U(-1, 1) bf16, q ~ U(-2, 2) f32 (fixed seed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/kernels/attention_decode.cuh"

using namespace lily::cuda::attn;

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));  \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void fill_bf16(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffffff) / float(1 << 23) - 1.f);
  }
}

int main() {
  constexpr int kD = 256, nH = 16, nKV = 2, group = 8;
  const int maxT = 131072 + 64;
  const int64_t n = int64_t(maxT) * nKV * kD;
  bf16 *k, *v;
  float *q, *o;
  int* pos;
  CK(cudaMalloc(&k, n * 2));
  CK(cudaMalloc(&v, n * 2));
  CK(cudaMalloc(&q, nH * kD * 4));
  CK(cudaMalloc(&o, nH * kD * 4));
  CK(cudaMalloc(&pos, 4));
  fill_bf16<<<1024, 256>>>(k, n, 17u);
  fill_bf16<<<1024, 256>>>(v, n, 91u);
  std::vector<float> hq(nH * kD);
  uint32_t s = 5;
  for (auto& x : hq) { s = s * 1664525u + 1013904223u; x = float(s >> 8) / float(1 << 24) * 4.f - 2.f; }
  CK(cudaMemcpy(q, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
  constexpr auto kernel = attention_decode_kernel<kD, 1, false>;
  constexpr int smem = decode_smem_bytes<kD, 1>();
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDecodeThreads, smem));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int P = std::min(sms * per_sm / nKV, kMaxDecodeCtas);
  const char* dir = std::getenv("OUT_DIR");
  char tag[64];
  std::snprintf(tag, sizeof tag, "w%d_t%d_r%d", kDecodeWarps, kDecodeTile, kDecodeMinRows);
  std::printf("| shape | context | us | TB/s (KV) | P | CTAs/SM | stages | smem KB | err |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  int fail = 0;
  for (int ctx : {4096, 32768, 131072}) {
    const int pos0 = ctx - 1;
    CK(cudaMemcpy(pos, &pos0, 4, cudaMemcpyHostToDevice));
    const DecodeParams p{q, k, v, pos, o, 1, nH, nKV, group, P, float(1.4426950408889634 / 16.0)};
    const DecodePrepParams pp{};
    kernel<<<dim3(P, nKV), kDecodeThreads, smem>>>(p, pp);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int b = 0; b < 7; ++b) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < 20; ++i) kernel<<<dim3(P, nKV), kDecodeThreads, smem>>>(p, pp);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.f / 20.f);
    }
    std::sort(t.begin(), t.end());
    std::vector<float> ho(nH * kD);
    CK(cudaMemcpy(ho.data(), o, ho.size() * 4, cudaMemcpyDeviceToHost));
    // fp64 reference over heads 0, 7, 8, 15
    std::vector<bf16> kh(int64_t(ctx) * nKV * kD), vh(kh.size());
    CK(cudaMemcpy(kh.data(), k, kh.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(vh.data(), v, vh.size() * 2, cudaMemcpyDeviceToHost));
    double err = 0, mref = 0;
    for (int h : {0, 7, 8, 15}) {
      const int kvh = h / group;
      std::vector<double> sc(ctx);
      double mx = -1e300;
      for (int j = 0; j < ctx; ++j) {
        double d = 0;
        for (int x = 0; x < kD; ++x) d += double(hq[h * kD + x]) * double(__bfloat162float(kh[(int64_t(j) * nKV + kvh) * kD + x]));
        sc[j] = d / 16.0;
        mx = std::max(mx, sc[j]);
      }
      double l = 0;
      for (int j = 0; j < ctx; ++j) l += (sc[j] = std::exp(sc[j] - mx));
      for (int x = 0; x < kD; ++x) {
        double acc = 0;
        for (int j = 0; j < ctx; ++j) acc += sc[j] * double(__bfloat162float(vh[(int64_t(j) * nKV + kvh) * kD + x]));
        acc /= l;
        err = std::max(err, std::fabs(acc - ho[h * kD + x]));
        mref = std::max(mref, std::fabs(acc));
      }
    }
    err /= mref;
    const double bytes = double(ctx) * nKV * kD * 2 * 2;
    std::printf("| %s | %d | %.2f | %.2f | %d | %d | %d | %.1f | %.1e%s |\n", tag, ctx, t[3], bytes / (t[3] * 1e-6) / 1e12,
                P, per_sm, decode_stages<kD, 1>(), smem / 1024.0, err, err > 1e-3 ? " FAIL" : "");
    fail |= err > 1e-3;
    if (dir) {
      const std::string f = std::string(dir) + "/o_" + tag + "_" + std::to_string(ctx) + ".bin";
      if (FILE* fp = std::fopen(f.c_str(), "wb")) { std::fwrite(ho.data(), 4, ho.size(), fp); std::fclose(fp); }
    }
  }
  return fail;
}
