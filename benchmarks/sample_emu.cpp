// sample_emu: runs the CUDA sampler's own source (csrc/cuda/kernels/sample.cuh, sample_cluster.cuh) on the host,
// one cluster of CTAs x 512 threads, to check its index logic, barriers and cluster exchanges without a GPU.
//   Built and driven by tests/test_sample_emu.py (prepare_source: a copy of the two headers in which the one
//   `__shared__ SampleShared sh;` becomes a reference to the emulated CTA's shared memory, with a stub common.cuh
//   and cooperative_groups.h): g++ -O2 -std=c++20 -ffp-contract=off -I <copy> -I <copy>/stub.
//   Input (stdin, binary, little-endian, cases until EOF): i32 V, ctas; f32 temperature, top_p, min_p, presence,
//   frequency, repetition; i32 top_k, num_logprobs; u64 seed, step; then logits f32[V], counts i32[V], seen i32[V].
//   Output (stdout, one line a case): token, then the 21 logprob ids and the 21 values' bits (hex), then the ids
//   whose counts or seen changed.
// How: every CUDA thread is a fiber (ucontext) on one OS thread, run until it blocks at __syncthreads, a cluster
// barrier or a warp collective (shuffles, ballot, match_any, reduce_add, activemask), in a random order each
// round (argv[1]: the seed), so that a missing barrier can show as a different result or an error. A warp
// collective resolves when every lane of its mask has reached it (__activemask: the lanes of the warp that reached
// it once every live lane of the warp is blocked); __syncthreads when every live thread of the CTA is there; the
// cluster barrier when every thread of every CTA is (a CTA that has left while others wait there is an error).
// Shared memory starts as 0xFF bytes (NaN floats, -1 ints), so a read of something never written poisons the
// result; a read of a CTA's shared memory after it has left is an error. Atomics are plain adds (one thread runs
// at a time). Float arithmetic is the host's IEEE f32 (the kernel's __fdiv_rn etc. are single roundings; expf and
// logf are the host's, as in csrc/cpu/sample.cpp, so the candidate path's bits match the CPU reference exactly).
#include <ucontext.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
using std::isfinite;
using std::isnan;

struct float4 {
  float x, y, z, w;
};
struct int4 {
  int x, y, z, w;
};
struct Dim3 {
  unsigned x, y, z;
};

namespace emu {
enum Wait { RUN, BAR, CLUSTER, WARP, ACTIVE, DONE };
enum Op { SHFL_XOR, SHFL_UP, BALLOT, MATCH_ANY, REDUCE_ADD };
struct Fiber {
  ucontext_t ctx;
  int cta;
  Dim3 tid;
  Wait wait = RUN;
  Op op;
  unsigned mask;
  uint64_t val, result;
  int arg;
};
constexpr int THREADS = 512, STACK = 64 * 1024;
int ctas;
std::vector<Fiber> fibers;
std::vector<char> stacks;
std::vector<std::vector<unsigned char>> smem;  // a CTA's shared memory
std::vector<int> cta_live;                      // threads of the CTA not yet returned
int cur;
ucontext_t sched;
Dim3 block;

[[noreturn]] void fail(const char* what) {
  std::printf("ERROR %s (cta %d thread %u)\n", what, fibers[cur].cta, fibers[cur].tid.x);
  std::fflush(stdout);
  std::exit(2);
}
void block_on(Wait w) {
  fibers[cur].wait = w;
  swapcontext(&fibers[cur].ctx, &sched);
}
template <class T>
uint64_t bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
uint64_t collective(Op op, unsigned mask, uint64_t val, int arg) {
  Fiber& f = fibers[cur];
  if (!(mask >> (f.tid.x & 31) & 1u)) fail("warp collective by a lane outside its mask");
  f.op = op, f.mask = mask, f.val = val, f.arg = arg;
  block_on(WARP);
  return fibers[cur].result;
}
template <class T>
T& cta_shared() {
  std::vector<unsigned char>& m = smem[fibers[cur].cta];
  if (m.size() < sizeof(T)) fail("shared memory layout");
  return *reinterpret_cast<T*>(m.data());
}
template <class T>
T* map_rank(T* p, int r) {
  const std::vector<unsigned char>& mine = smem[fibers[cur].cta];
  const auto off = reinterpret_cast<const unsigned char*>(p) - mine.data();
  if (off < 0 || size_t(off) >= mine.size()) fail("map_shared_rank of an address outside shared memory");
  if (r < 0 || r >= ctas) fail("map_shared_rank of a rank outside the cluster");
  if (cta_live[r] == 0) fail("read of the shared memory of a CTA that has left");
  return reinterpret_cast<T*>(smem[r].data() + off);
}
inline Dim3& thread_idx() { return fibers[cur].tid; }
inline Dim3 block_idx() { return {unsigned(fibers[cur].cta), 0, 0}; }
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx())
#define blockDim (emu::block)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncthreads() { emu::block_on(emu::BAR); }
inline unsigned __activemask() {
  emu::block_on(emu::ACTIVE);
  return unsigned(emu::fibers[emu::cur].result);
}
template <class T>
T __shfl_xor_sync(unsigned m, T v, int o) {
  return emu::from_bits<T>(emu::collective(emu::SHFL_XOR, m, emu::bits(v), o));
}
template <class T>
T __shfl_up_sync(unsigned m, T v, unsigned o) {
  return emu::from_bits<T>(emu::collective(emu::SHFL_UP, m, emu::bits(v), int(o)));
}
inline unsigned __ballot_sync(unsigned m, bool p) { return unsigned(emu::collective(emu::BALLOT, m, p, 0)); }
inline unsigned __match_any_sync(unsigned m, unsigned v) { return unsigned(emu::collective(emu::MATCH_ANY, m, v, 0)); }
inline unsigned __reduce_add_sync(unsigned m, unsigned v) { return unsigned(emu::collective(emu::REDUCE_ADD, m, v, 0)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p;
  *p = o + v;
  return o;
}
inline unsigned __float_as_uint(float f) { return emu::from_bits<unsigned>(emu::bits(f)); }
inline float __uint_as_float(unsigned u) { return emu::from_bits<float>(u); }
inline int __float_as_int(float f) { return emu::from_bits<int>(emu::bits(f)); }
inline float __int_as_float(int i) { return emu::from_bits<float>(emu::bits(i)); }
inline float __int2float_rn(int i) { return float(i); }
inline unsigned long long __float2ull_rz(float f) { return (unsigned long long)f; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

namespace cooperative_groups {
struct cluster_group {
  unsigned block_rank() const { return unsigned(emu::fibers[emu::cur].cta); }
  unsigned num_blocks() const { return unsigned(emu::ctas); }
  void sync() const { emu::block_on(emu::CLUSTER); }
  template <class T>
  T* map_shared_rank(T* p, int r) const {
    return emu::map_rank(p, r);
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups

#include "cuda/kernels/sample.cuh"

namespace emu {
lily::cuda::SampleParams params;

void entry() {
  lily::cuda::sample_kernel(params);
  --cta_live[fibers[cur].cta];
  fibers[cur].wait = DONE;
  swapcontext(&fibers[cur].ctx, &sched);
}

// Resolves the warp collectives of warp w of CTA c whose lanes have all arrived; returns whether any did.
bool resolve_warp(int c, int w) {
  Fiber* lane = &fibers[size_t(c) * THREADS + 32 * w];
  bool any = false;
  for (int l = 0; l < 32; ++l) {
    if (lane[l].wait != WARP) continue;
    const unsigned m = lane[l].mask;
    bool ready = true;
    for (int k = 0; k < 32; ++k)
      if (m >> k & 1u) {
        if (lane[k].wait == DONE) fail("warp collective waits for a lane that has returned");
        if (lane[k].wait != WARP) ready = false;
        else if (lane[k].mask != m || lane[k].op != lane[l].op) ready = false;
      }
    if (!ready) continue;
    for (int k = 0; k < 32; ++k) {
      if (!(m >> k & 1u)) continue;
      Fiber& f = lane[k];
      switch (f.op) {
        case SHFL_XOR: {
          const int s = k ^ f.arg;
          f.result = (m >> s & 1u) ? lane[s].val : f.val;
          break;
        }
        case SHFL_UP: {
          const int s = k - f.arg;
          f.result = s >= 0 ? lane[s].val : f.val;
          break;
        }
        case BALLOT:
        case MATCH_ANY:
        case REDUCE_ADD: {
          uint64_t r = 0;
          for (int j = 0; j < 32; ++j) {
            if (!(m >> j & 1u)) continue;
            if (f.op == BALLOT && lane[j].val) r |= 1u << j;
            if (f.op == MATCH_ANY && uint32_t(lane[j].val) == uint32_t(f.val)) r |= 1u << j;
            if (f.op == REDUCE_ADD) r = uint32_t(r + uint32_t(lane[j].val));
          }
          f.result = r;
          break;
        }
      }
    }
    for (int k = 0; k < 32; ++k)
      if (m >> k & 1u) lane[k].wait = RUN;
    any = true;
  }
  if (any) return true;
  unsigned active = 0;  // every live lane blocked (no lane runnable after a round): those at __activemask
  for (int l = 0; l < 32; ++l)
    if (lane[l].wait == ACTIVE) active |= 1u << l;
  if (!active) return false;
  for (int l = 0; l < 32; ++l)
    if (active >> l & 1u) lane[l].result = active, lane[l].wait = RUN;
  return true;
}

void run(unsigned seed) {
  const size_t n = size_t(ctas) * THREADS;
  fibers.assign(n, Fiber{});
  if (stacks.size() < n * STACK) stacks.resize(n * STACK);
  smem.assign(size_t(ctas), std::vector<unsigned char>(sizeof(lily::cuda::SampleShared), 0xFF));
  cta_live.assign(size_t(ctas), THREADS);
  block = {THREADS, 1, 1};
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.cta = int(i / THREADS), f.tid = {unsigned(i % THREADS), 0, 0};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks.data() + i * STACK;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, entry, 0);
  }
  std::vector<int> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = int(i);
  std::mt19937 rng(seed);
  for (;;) {
    std::shuffle(order.begin(), order.end(), rng);
    bool progress = false;
    for (int i : order)
      if (fibers[i].wait == RUN) cur = i, progress = true, swapcontext(&sched, &fibers[i].ctx);
    for (int c = 0; c < ctas; ++c)
      for (int w = 0; w < THREADS / 32; ++w) progress |= resolve_warp(c, w);
    bool all_cluster = true, all_done = true;
    for (int c = 0; c < ctas; ++c) {
      bool bar = true, none_live = true;
      for (int t = 0; t < THREADS; ++t) {
        const Wait s = fibers[size_t(c) * THREADS + t].wait;
        if (s != DONE) none_live = false;
        if (s != BAR && s != DONE) bar = false;
        if (s != CLUSTER) all_cluster = false;
        if (s != DONE) all_done = false;
      }
      if (bar && !none_live) {
        if (cta_live[c] != THREADS) cur = int(size_t(c) * THREADS), fail("__syncthreads after some threads returned");
        for (int t = 0; t < THREADS; ++t) fibers[size_t(c) * THREADS + t].wait = RUN;
        progress = true;
      }
    }
    if (all_done) return;
    if (all_cluster) {
      for (Fiber& f : fibers) f.wait = RUN;
      progress = true;
    }
    if (!progress) {
      int counts[6] = {};
      for (const Fiber& f : fibers) ++counts[f.wait];
      std::printf("ERROR deadlock: bar %d cluster %d warp %d activemask %d done %d\n", counts[BAR], counts[CLUSTER],
                  counts[WARP], counts[ACTIVE], counts[DONE]);
      std::exit(2);
    }
  }
}
}  // namespace emu

template <class T>
static bool read(T* p, size_t n) {
  return std::fread(p, sizeof(T), n, stdin) == n;
}

int main(int argc, char** argv) {
  const unsigned seed = argc > 1 ? unsigned(std::atoi(argv[1])) : 1u;
  for (int cs = 0;; ++cs) {
    int32_t hdr[2];
    if (!read(hdr, 2)) return 0;
    const int V = hdr[0];
    emu::ctas = hdr[1];
    float f[6];
    int32_t k[2];
    uint64_t u[2];
    if (!read(f, 6) || !read(k, 2) || !read(u, 2)) return 1;
    std::vector<float> logits(size_t(V) + 4);
    std::vector<int32_t> counts(size_t(V) + 4), seen(size_t(V) + 4), token(1, -7), lp_ids(21, -7);
    std::vector<float> lp_vals(21, -7.f);
    if (!read(logits.data(), size_t(V)) || !read(counts.data(), size_t(V)) || !read(seen.data(), size_t(V))) return 1;
    const std::vector<int32_t> counts0 = counts, seen0 = seen;
    lily::cuda::SampleParams& p = emu::params;
    p = {};
    p.logits = logits.data(), p.counts = counts.data(), p.seen = seen.data(), p.token = token.data();
    p.logprob_ids = lp_ids.data(), p.logprob_values = lp_vals.data();
    p.V = V, p.top_k = k[0], p.num_logprobs = k[1], p.max_logprobs = 20;
    p.temperature = f[0], p.top_p = f[1], p.min_p = f[2], p.presence = f[3], p.frequency = f[4], p.repetition = f[5];
    p.has_penalty = f[5] != 1.f || f[3] != 0.f || f[4] != 0.f;  // as sample.cu
    p.seed = u[0], p.step = u[1];
    emu::run(seed + unsigned(cs));
    std::printf("%d", token[0]);
    for (int i = 0; i < 21; ++i) std::printf(" %d", lp_ids[i]);
    for (int i = 0; i < 21; ++i) std::printf(" %08x", __float_as_uint(lp_vals[i]));
    std::printf(" |");
    for (int v = 0; v < V; ++v)
      if (counts[v] != counts0[v] || seen[v] != seen0[v]) std::printf(" %d:%d:%d", v, counts[v], seen[v]);
    std::printf("\n");
    std::fflush(stdout);
  }
}
