// cluster_lab: what does one dependent hand-over cost inside a thread-block cluster, against the whole GPU?
//
// A decode layer is a chain of ~6 dependent phases (docs/perf-notes.md, chain lab parts 1-3): each ends
// with every CTA's outputs published and the next phase's CTAs reading all of them. Through device
// memory (a counter: release add, acquire poll) a hand-over costs ~1-2 us. Phases whose consumers need
// only a small part of the outputs (the GDN mixer needs only its head's in_proj rows; the router's top-k
// needs 257 logits) could hand over inside a cluster instead: distributed shared memory (DSMEM) stores
// and a cluster barrier. This lab times one hand-over of each kind in a loop of P dependent phases:
//   grid     G CTAs (one per SM, a cooperative launch so all are resident): phase p, every CTA stores
//            one float (its value, derived from what it read in phase p - 1) to global memory, thread 0
//            adds 1 to the phase's counter with release semantics (after a CTA barrier), polls it with
//            acquire loads until it reaches G, a CTA barrier, then every CTA reads all G values (L2,
//            ld.cg; thread i reads value i) and sums them (block reduction).
//   cluster  C CTAs a cluster (C = 8 portable, 16 non-portable), G / C clusters: phase p, every CTA
//            stores its value into slot [p % 2][rank] of every CTA's shared memory in the cluster (DSMEM,
//            C remote stores by C threads), then barrier.cluster.arrive.release / wait.acquire, then
//            sums its C slots (local shared memory). Double-buffered slots: a CTA can run one phase
//            ahead of a slower one's reads without overwriting them (two barriers apart).
//   barrier  the cluster barrier alone (no stores), C = 8 and 16.
//   cta      a CTA barrier and a block reduction alone (the loop's own cost).
// Each kernel runs P = 512 phases; us per phase = median over 15 launches of the launch time / P
// (cudaEvent around each launch). The values are checked: every CTA's final value equals the host's
// recurrence (v_{p+1} = f(sum of the group's v_p)), so a missing or stale read FAILs.
//   Run: bash benchmarks/cluster_lab.sh
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace cg = cooperative_groups;

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "cluster_lab: %s failed: %s (cluster_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

constexpr int THREADS = 256, PHASES = 512, MAX_G = 256, MAX_C = 16;

// The next phase's value of a CTA from the sum of its group's values: bounded, exact in float for the
// small integers it produces (the host repeats it to check).
__host__ __device__ inline float next_value(float sum, int rank) { return float((int(sum) * 7 + rank) % 1009); }

__device__ float block_sum(float v) {
  __shared__ float part[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) s += part[w];  // fixed order: every thread the same sum
  __syncthreads();
  return s;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// grid: values [PHASES][G] and counters [PHASES] in global memory (zeroed before each launch)
__global__ void __launch_bounds__(THREADS) grid_kernel(float* values, unsigned* counters, float* out) {
  const int G = gridDim.x, rank = blockIdx.x;
  float v = float(rank);
  for (int p = 0; p < PHASES; ++p) {
    if (threadIdx.x == 0) values[p * G + rank] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      red_release_add(counters + p, 1u);
      while (ld_acquire(counters + p) < unsigned(G)) {
      }
    }
    __syncthreads();
    const float s = block_sum(threadIdx.x < G ? __ldcg(values + p * G + threadIdx.x) : 0.f);
    v = next_value(s, rank);
  }
  if (threadIdx.x == 0) out[rank] = v;
}

// cluster: C CTAs a cluster; slots [2][MAX_C] in each CTA's shared memory
template <bool DATA>
__global__ void __launch_bounds__(THREADS) cluster_kernel(float* out) {
  __shared__ float slots[2][MAX_C];
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  float v = float(rank);
  cluster.sync();  // every CTA of the cluster has started (its shared memory exists) before remote stores
  for (int p = 0; p < PHASES; ++p) {
    if (DATA && threadIdx.x < C) {
      float* remote = cluster.map_shared_rank(&slots[p & 1][rank], int(threadIdx.x));
      *remote = v;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (DATA) {
      const float s = block_sum(threadIdx.x < C ? slots[p & 1][threadIdx.x] : 0.f);
      v = next_value(s, rank);
    }
  }
  if (threadIdx.x == 0) out[blockIdx.x] = DATA ? v : 0.f;
}

// cta: the loop's own cost (a block reduction a phase)
__global__ void __launch_bounds__(THREADS) cta_kernel(float* out) {
  float v = 0.f;  // rank 0 of a group of one
  for (int p = 0; p < PHASES; ++p) v = next_value(block_sum(threadIdx.x == 0 ? v : 0.f), 0);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// The host's recurrence for a group of n CTAs (ranks 0..n-1): the final value of rank r.
static std::vector<float> expected(int n) {
  std::vector<float> v(n);
  for (int r = 0; r < n; ++r) v[r] = float(r);
  for (int p = 0; p < PHASES; ++p) {
    float s = 0.f;
    for (int r = 0; r < n; ++r) s += v[r];
    for (int r = 0; r < n; ++r) v[r] = next_value(s, r);
  }
  return v;
}

static int failures = 0;

template <class Launch>
static double time_us(Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < 16; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) t.push_back(ms * 1e3);  // the first launch warms up
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2] / PHASES;
}

static void check(const char* name, const float* dout, int G, int group) {
  std::vector<float> h(G);
  CK(cudaMemcpy(h.data(), dout, G * 4, cudaMemcpyDeviceToHost));
  const std::vector<float> e = expected(group);
  int bad = 0;
  for (int i = 0; i < G; ++i) bad += h[i] != e[i % group];
  if (bad) {
    std::printf("FAIL: %s: %d of %d CTAs end with a wrong value\n", name, bad, G);
    ++failures;
  }
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  float* dout = nullptr;
  float* values = nullptr;
  unsigned* counters = nullptr;
  CK(cudaMalloc(&dout, MAX_G * 4));
  CK(cudaMalloc(&values, size_t(PHASES) * MAX_G * 4));
  CK(cudaMalloc(&counters, PHASES * 4));
  std::printf("cluster_lab on %s (%d SMs), %d phases a launch, medians of 15 launches\n\n", prop.name, sms, PHASES);
  std::printf("| hand-over | CTAs | group | us / phase |\n|---|---:|---:|---:|\n");

  {  // grid: one CTA per SM, all resident (cooperative launch)
    const int G = std::min(sms, MAX_G);
    auto launch = [&] {
      CK(cudaMemsetAsync(counters, 0, PHASES * 4));
      void* args[] = {&values, &counters, &dout};
      CK(cudaLaunchCooperativeKernel((void*)grid_kernel, dim3(G), dim3(THREADS), args, 0, nullptr));
    };
    // the memset is inside the timed interval: time it alone and subtract
    const double t_memset = time_us([&] { CK(cudaMemsetAsync(counters, 0, PHASES * 4)); });
    const double t = time_us(launch) - t_memset;
    CK(cudaDeviceSynchronize());
    check("grid", dout, G, G);
    std::printf("| grid: global values + release counter, acquire poll, L2 reads | %d | %d | %.3f |\n", G, G, t);
  }
  CK(cudaFuncSetAttribute(cluster_kernel<true>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CK(cudaFuncSetAttribute(cluster_kernel<false>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  for (int data = 1; data >= 0; --data)
    for (int C : {8, 16}) {
      const int G = 128;  // a multiple of both cluster sizes, <= the SMs
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(G);
      cfg.blockDim = dim3(THREADS);
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = unsigned(C);
      attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      const auto kernel = data ? cluster_kernel<true> : cluster_kernel<false>;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters == 0) {
        cudaGetLastError();
        std::printf("| cluster of %d: not resident on this device | | | |\n", C);
        continue;
      }
      const double t = time_us([&] { CK(cudaLaunchKernelEx(&cfg, kernel, dout)); });
      CK(cudaDeviceSynchronize());
      if (data) check(C == 8 ? "cluster 8" : "cluster 16", dout, G, C);
      std::printf("| %s, cluster of %d (%d resident at once) | %d | %d | %.3f |\n",
                  data ? "cluster: DSMEM stores to every CTA, cluster barrier, local reads" : "cluster barrier alone",
                  C, clusters, G, C, t);
    }
  {
    const int G = sms;
    const double t = time_us([&] { cta_kernel<<<G, THREADS>>>(dout); });
    CK(cudaDeviceSynchronize());
    check("cta", dout, G, 1);
    std::printf("| cta: a block reduction alone (the loop's cost) | %d | 1 | %.3f |\n", G, t);
  }
  CK(cudaFree(dout));
  CK(cudaFree(values));
  CK(cudaFree(counters));
  if (failures) {
    std::printf("\ncluster_lab: %d FAIL\n", failures);
    return 1;
  }
  std::printf("\ncluster_lab: all checks passed\n");
  return 0;
}
