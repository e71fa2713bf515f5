// Launchers of the gated-attention ops (kernels/attention_*.cuh; mrope: rope with the (t, h, w) positions
// of a prompt with images). attention() picks a variant:
//   head_dim in {32, 64, 128, 256} (tensor cores):
//     T <= 4 and T * group <= 32 -> split-KV decode (one wave of CTAs per device) with the LSE merge
//                                   by its last CTAs (one launch)
//     otherwise                  -> 64-query-row flash attention (prefill)
//   any other head_dim           -> the generic fp32 kernel.
// gated_attention (T = 1, tensor-core head dims): the split-KV decode kernel with the q/k prep and
// cache-row write fused in (kPrep) and sigmoid(gate) in the merge: one launch for what the per-op
// sequence does in nine (split_q_gate, 2 rms_norm, 2 rope, 2 kv_cache_write, attention,
// sigmoid_mul).
// No grid depends on the position: the decode step is captured once and replayed at every pos.
#include <algorithm>
#include <cmath>

#include "cuda_ops.h"
#include "kernels/attention_decode.cuh"
#include "kernels/attention_generic.cuh"
#include "kernels/attention_prep.cuh"
#include "kernels/attention_prefill.cuh"
#include "kernels/attention_rope.cuh"
#include "kernels/attention_wgmma.cuh"
#include "tensor_map.h"
#include "../runtime/cuda_device.h"

namespace lily::cuda {
namespace {

using namespace attn;

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// Four elements per thread when rows are a multiple of 4 long and every base is 16-byte aligned.
bool can_use_vec4(int64_t row_elems, std::initializer_list<const void*> ptrs16) {
  if (row_elems % 4 != 0) return false;
  for (const void* p : ptrs16)
    if (!aligned(p, 16)) return false;
  return true;
}

unsigned elementwise_blocks(const char* op, int64_t items) {
  const int64_t blocks = ceil_div<int64_t>(items, kElementwiseThreads);
  LILY_CHECK(blocks <= 0x7fffffff, op, ": too many elements for the CUDA grid (", items, ")");
  return unsigned(blocks);
}

// RoPE's inverse frequencies as the CPU computes them: 1 / theta^(2j / rotary_dim), a double power rounded
// to float, j < half.
void rope_inv_freq(float* inv_freq, int64_t half, double theta, int rotary_dim) {
  for (int64_t j = 0; j < half; ++j) inv_freq[j] = float(1.0 / std::pow(theta, double(2 * j) / rotary_dim));
}

bool is_mma_head_dim(int64_t D) { return D == 32 || D == 64 || D == 128 || D == 256; }

bool use_split_kv_decode(int64_t T, int64_t group) { return T <= kMaxDecodeTokens && T * group <= kMaxDecodeRows; }

// Decode CTAs per KV head: one wave over the device at per_sm CTAs a multiprocessor (as many as its
// shared memory holds), within the merge's statistics (kMaxDecodeCtas) and the partial scratch.
int64_t decode_ctas_per_head(int64_t T, int64_t nH, int64_t nKV, int64_t D, int per_sm) {
  const int64_t fit = kDecodeScratchFloats / (T * nH * D);
  LILY_CHECK(fit >= 1, "attention: ", T, " tokens x ", nH, " heads x ", D, " dims exceed the decode scratch of ",
             kDecodeScratchFloats, " floats");
  return std::min({std::max<int64_t>(1, num_sms() * per_sm / nKV), int64_t(kMaxDecodeCtas), fit});
}

// Raise a kernel's dynamic shared memory limit above 48 KB (once per kernel).
template <auto kKernel>
void raise_smem(int smem_bytes) {
  static const bool raised = [&] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    return true;
  }();
  (void)raised;
}

template <auto kKernel, typename... Params>
void launch_big_smem(dim3 grid, int threads, int smem_bytes, const Params&... p) {
  raise_smem<kKernel>(smem_bytes);
  launch(kKernel, grid, threads, smem_bytes, p...);
  LILY_CUDA_LAUNCHED();
}

// CTAs of kKernel that one multiprocessor holds at once (asked once per kernel).
template <auto kKernel>
int ctas_per_sm(int threads, int smem_bytes) {
  static const int n = [&] {
    raise_smem<kKernel>(smem_bytes);
    int blocks = 0;
    LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, smem_bytes));
    return std::max(blocks, 1);
  }();
  return n;
}

// kPrep: pp carries the raw projections (gated_attention); otherwise pp is unused. Sets P (num_ctas).
template <int kD, int kMTiles, bool kPrep>
void launch_decode_tiles(DecodeParams p, const DecodePrepParams& pp) {
  constexpr auto kKernel = attention_decode_kernel<kD, kMTiles, kPrep>;
  constexpr int kSmem = decode_smem_bytes<kD, kMTiles>();
  p.num_ctas = int(decode_ctas_per_head(p.T, p.nH, p.nKV, kD, ctas_per_sm<kKernel>(kDecodeThreads, kSmem)));
  launch_big_smem<kKernel>(dim3(unsigned(p.num_ctas), unsigned(p.nKV)), kDecodeThreads, kSmem, p, pp);
}

template <int kD, bool kPrep = false>
void launch_decode(const DecodeParams& p, int64_t M, const DecodePrepParams& pp) {
  if (M <= 16)
    launch_decode_tiles<kD, 1, kPrep>(p, pp);
  else
    launch_decode_tiles<kD, 2, kPrep>(p, pp);
}

template <int kD>
void launch_prefill(const PrefillParams& p) {
  const dim3 grid(unsigned(ceil_div(p.T, kPrefillRows)), unsigned(p.nH));
  launch_big_smem<attention_prefill_kernel<kD>>(grid, kPrefillThreads, prefill_smem_bytes<kD>(), p);
}

template <bool kPrep = false>
void launch_decode_for_dim(const DecodeParams& p, int64_t M, int64_t D, const DecodePrepParams& pp = {}) {
  switch (D) {
    case 32: return launch_decode<32, kPrep>(p, M, pp);
    case 64: return launch_decode<64, kPrep>(p, M, pp);
    case 128: return launch_decode<128, kPrep>(p, M, pp);
    case 256: return launch_decode<256, kPrep>(p, M, pp);
  }
  fail("attention: unsupported head_dim ", D, " for the split-KV decode kernel");
}

// Prefill at head_dim 256 on wgmma (kernels/attention_wgmma.cuh, FlashAttention-3's structure with the
// intra-warpgroup overlap) from q as bf16 in qb (the workspace): the kernel with TMA maps of qb and the
// caches, encoded here per call (kernel parameters: nothing is captured, prefill runs eagerly).
void launch_prefill_wgmma_qb(const uint16_t* qb, const bf16* k, const bf16* v, int64_t maxT, float* o,
                             const int32_t* pos, int T, int nH, int nKV, int group, float scale_log2) {
  const int64_t row = int64_t(nKV) * AWG_D;
  CUtensorMap mq, mk, mv;
  check_tensor_map(make_xb_tensor_map(mq, qb, T, int64_t(nH) * AWG_D, 64), "attention", "q");
  check_tensor_map(make_xb_tensor_map(mk, k, maxT, row, 64), "attention", "k cache");
  check_tensor_map(make_xb_tensor_map(mv, v, maxT, row, 64), "attention", "v cache");
  const AwgParams ap{o, pos, T, nH, nKV, group, scale_log2};
  launch_big_smem<attention_prefill_wgmma_kernel>(
      dim3(unsigned(ceil_div<int64_t>(T, AWG_ROWS) * nH)), AWG_THREADS, AWG_SMEM_BYTES, ap, mq, mk, mv);
}

// The same from q in f32: q -> bf16 into qb first.
void launch_prefill_wgmma(const float* q, uint16_t* qb, const bf16* k, const bf16* v, int64_t maxT, float* o,
                          const int32_t* pos, int T, int nH, int nKV, int group, float scale_log2) {
  const int64_t n = int64_t(T) * nH * AWG_D;
  launch(attention_q_bf16_kernel, unsigned(ceil_div<int64_t>(n / 8, 256)), 256, 0, q, qb, n);
  LILY_CUDA_LAUNCHED();
  launch_prefill_wgmma_qb(qb, k, v, maxT, o, pos, T, nH, nKV, group, scale_log2);
}

void launch_prefill_for_dim(const PrefillParams& p, int64_t D) {
  switch (D) {
    case 32: return launch_prefill<32>(p);
    case 64: return launch_prefill<64>(p);
    case 128: return launch_prefill<128>(p);
    case 256: return launch_prefill<256>(p);
  }
  fail("attention: unsupported head_dim ", D, " for the prefill kernel");
}

}  // namespace

void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int num_heads) {
  const int64_t T = p.dim(0), D = p.dim(1) / (2 * num_heads), n = T * num_heads * D;
  if (n == 0) return;
  const SplitQGateParams sp{p.ptr<float>(), q.ptr<float>(), gate.ptr<float>(), n, int(D)};
  if (can_use_vec4(D, {sp.p, sp.q, sp.gate}))
    launch(split_q_gate_kernel<4>, elementwise_blocks("split_q_gate", n / 4), kElementwiseThreads, 0, sp);
  else
    launch(split_q_gate_kernel<1>, elementwise_blocks("split_q_gate", n), kElementwiseThreads, 0, sp);
  LILY_CUDA_LAUNCHED();
}

void rope(const Tensor& x, int num_heads, int rotary_dim, double theta, const int32_t* pos, int64_t rope_delta) {
  const int64_t T = x.dim(0), D = x.dim(1) / num_heads, half = rotary_dim / 2;
  if (T == 0 || half == 0) return;
  LILY_CHECK(half <= kMaxRopeHalf, "rope: rotary_dim ", rotary_dim, " exceeds the CUDA kernel's ", 2 * kMaxRopeHalf);
  RopeParams rp{x.ptr<float>(), pos, T * num_heads * half, num_heads, int(D), int(half), int(rope_delta), {}};
  rope_inv_freq(rp.inv_freq, half, theta, rotary_dim);
  launch(rope_kernel, elementwise_blocks("rope", rp.n), kElementwiseThreads, 0, rp);
  LILY_CUDA_LAUNCHED();
}

void mrope(const Tensor& x, int num_heads, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos) {
  const int64_t T = x.dim(0), D = x.dim(1) / num_heads, half = rotary_dim / 2;
  if (T == 0 || half == 0) return;
  LILY_CHECK(half <= kMaxRopeHalf, "mrope: rotary_dim ", rotary_dim, " exceeds the CUDA kernel's ", 2 * kMaxRopeHalf);
  MropeParams p{x.ptr<float>(), pos.ptr<int32_t>(), T * num_heads * half, num_heads, int(D), int(half),
                sections[1], sections[2], {}};
  rope_inv_freq(p.inv_freq, half, theta, rotary_dim);
  launch(mrope_kernel, elementwise_blocks("mrope", p.n), kElementwiseThreads, 0, p);
  LILY_CUDA_LAUNCHED();
}

void kv_cache_write(const Tensor& x, const Tensor& cache, const int32_t* pos) {
  const int64_t W = x.dim(1), n = x.dim(0) * W;
  if (n == 0) return;
  const KvCacheWriteParams kp{x.ptr<float>(), cache.ptr<__nv_bfloat16>(), pos, n, W};
  if (can_use_vec4(W, {kp.x}) && aligned(kp.cache, 8))
    launch(kv_cache_write_kernel<4>, elementwise_blocks("kv_cache_write", n / 4), kElementwiseThreads, 0, kp);
  else
    launch(kv_cache_write_kernel<1>, elementwise_blocks("kv_cache_write", n), kElementwiseThreads, 0, kp);
  LILY_CUDA_LAUNCHED();
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o, int num_heads,
               int num_kv_heads, const int32_t* pos, const Tensor& workspace) {
  const int64_t T = q.dim(0), D = q.dim(1) / num_heads, maxT = k_cache.dim(0), group = num_heads / num_kv_heads;
  if (T == 0) return;
  LILY_CHECK(maxT <= 0x7fffffff, "attention: cache of ", maxT, " rows exceeds int32 positions");
  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(D)));
  const auto* k = k_cache.ptr<__nv_bfloat16>();
  const auto* v = v_cache.ptr<__nv_bfloat16>();

  if (!is_mma_head_dim(D)) {
    const int smem = int((2 * D + kGenericThreads) * sizeof(float));
    LILY_CHECK(smem <= 48 * 1024, "attention: head_dim ", D, " too large for the generic CUDA kernel");
    LILY_CHECK(T * num_heads <= 0x7fffffff, "attention: too many (token, head) rows for the CUDA grid");
    const GenericParams gp{q.ptr<float>(), k, v, o.ptr<float>(), pos, num_heads, num_kv_heads, int(group),
                           int(D), scale_log2};
    launch(attention_generic_kernel, unsigned(T * num_heads), kGenericThreads, smem, gp);
    LILY_CUDA_LAUNCHED();
    return;
  }
  // The tensor-core kernels move q, o and cache rows in 16-byte pieces.
  for (const void* ptr : {q.data, o.data, k_cache.data, v_cache.data})
    LILY_CHECK(aligned(ptr, 16), "attention: q, o and the caches must be 16-byte aligned on CUDA");

  if (use_split_kv_decode(T, group)) {
    const DecodeParams dp{q.ptr<float>(), k, v, pos, o.ptr<float>(), int(T), num_heads, num_kv_heads, int(group),
                          0, scale_log2};  // P: launch_decode_tiles
    launch_decode_for_dim(dp, dp.T * dp.group, D);
    return;
  }
  if (D == AWG_D && workspace.data != nullptr && workspace.numel() >= T * num_heads * D && aligned(workspace.data, 16))
    return launch_prefill_wgmma(q.ptr<float>(), static_cast<uint16_t*>(workspace.data), k, v, maxT, o.ptr<float>(), pos,
                                int(T), num_heads, num_kv_heads, int(group), scale_log2);
  const PrefillParams pp{q.ptr<float>(), k, v, o.ptr<float>(), pos, int(T), num_heads, num_kv_heads, int(group),
                         scale_log2};
  launch_prefill_for_dim(pp, D);
}

bool gated_attention_fits(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                          const Tensor& k_norm, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q,
                          const Tensor& gate, const Tensor& o, int num_heads, int num_kv_heads) {
  const int64_t T = p.dim(0), D = p.dim(1) / (2 * num_heads), group = num_heads / num_kv_heads;
  if (T != 1 || !is_mma_head_dim(D) || !use_split_kv_decode(1, group)) return false;
  if (int64_t(num_heads) * D > kDecodeScratchFloats || k_cache.ndim != 2 || k_cache.dim(0) > 0x7fffffff) return false;
  for (const Tensor* t : {&p, &k, &v, &q_norm, &k_norm, &k_cache, &v_cache, &q, &gate, &o})
    if (!aligned(t->data, 16)) return false;
  return true;
}

bool gated_attention_prefill_shapes(int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D) {
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads) return false;
  return T >= 2 && D == AWG_D && !use_split_kv_decode(T, num_heads / num_kv_heads);
}

bool gated_attention_prefill_fits(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                  const Tensor& k_norm, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
                                  int num_heads, int num_kv_heads, const Tensor& workspace) {
  const int64_t T = p.dim(0), D = p.dim(1) / (2 * num_heads);
  if (!gated_attention_prefill_shapes(T, num_heads, num_kv_heads, D) || k_cache.ndim != 2) return false;
  if (workspace.data == nullptr || workspace.dtype != DType::BF16 || workspace.numel() < T * num_heads * D) return false;
  for (const Tensor* t : {&p, &k, &v, &q_norm, &k_norm, &k_cache, &v_cache, &o, &workspace})
    if (!aligned(t->data, 16)) return false;
  return T * (num_heads + 2 * num_kv_heads) <= int64_t(0x7fffffff) * kPrepWarps;
}

void gated_attention_prefill(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                             const Tensor& k_norm, float eps, int rotary_dim, double theta, const Tensor& k_cache,
                             const Tensor& v_cache, const Tensor& o, int num_heads, int num_kv_heads,
                             const int32_t* pos, int64_t rope_delta, const Tensor& workspace, bool o_as_xb) {
  const int64_t T = p.dim(0), half = rotary_dim / 2;
  LILY_CHECK(half <= kMaxPrepHalf, "gated_attention: rotary_dim ", rotary_dim, " exceeds ", 2 * kMaxPrepHalf);
  auto* kc = k_cache.ptr<__nv_bfloat16>();
  auto* vc = v_cache.ptr<__nv_bfloat16>();
  auto* qb = static_cast<uint16_t*>(workspace.data);
  PrefillPrepParams pr{{p.ptr<float>(), k.ptr<float>(), v.ptr<float>(), q_norm.ptr<float>(), k_norm.ptr<float>(), kc,
                        vc, nullptr, nullptr, eps, int(half), int(rope_delta), {}},
                       qb, pos, int(T), num_heads, num_kv_heads};
  rope_inv_freq(pr.pp.inv_freq, half, theta, rotary_dim);
  const int64_t warps = T * (num_heads + 2 * num_kv_heads);
  launch(attention_prep_kernel<AWG_D>, unsigned(ceil_div<int64_t>(warps, kPrepWarps)), 32 * kPrepWarps, 0, pr);
  LILY_CUDA_LAUNCHED();
  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(AWG_D)));
  launch_prefill_wgmma_qb(qb, kc, vc, k_cache.dim(0), o.ptr<float>(), pos, int(T), num_heads, num_kv_heads,
                          num_heads / num_kv_heads, scale_log2);
  // o *= sigmoid(gate), in place or (o_as_xb) into the workspace as the next GEMM's bf16 X (qb is spent)
  const GateParams gp{o.ptr<float>(), p.ptr<float>(), qb, T * num_heads * AWG_D / 8};
  const unsigned blocks = unsigned(ceil_div<int64_t>(gp.blocks, kElementwiseThreads));
  if (o_as_xb) launch(gate_o_kernel<AWG_D, true>, blocks, kElementwiseThreads, 0, gp);
  else launch(gate_o_kernel<AWG_D, false>, blocks, kElementwiseThreads, 0, gp);
  LILY_CUDA_LAUNCHED();
}

void gated_attention(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm, const Tensor& k_norm,
                     float eps, int rotary_dim, double theta, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q, const Tensor& gate, const Tensor& o, int num_heads, int num_kv_heads,
                     const int32_t* pos, int64_t rope_delta) {
  const int64_t D = p.dim(1) / (2 * num_heads), group = num_heads / num_kv_heads, half = rotary_dim / 2;
  LILY_CHECK(half <= kMaxPrepHalf, "gated_attention: rotary_dim ", rotary_dim, " exceeds ", 2 * kMaxPrepHalf);
  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(D)));
  auto* kc = k_cache.ptr<__nv_bfloat16>();
  auto* vc = v_cache.ptr<__nv_bfloat16>();
  const DecodeParams dp{q.ptr<float>(), kc, vc, pos, o.ptr<float>(), 1, num_heads, num_kv_heads, int(group), 0,
                        scale_log2};  // P: launch_decode_tiles
  DecodePrepParams pp{p.ptr<float>(), k.ptr<float>(), v.ptr<float>(), q_norm.ptr<float>(), k_norm.ptr<float>(),
                      kc, vc, q.ptr<float>(), gate.ptr<float>(), eps, int(half), int(rope_delta), {}};
  rope_inv_freq(pp.inv_freq, half, theta, rotary_dim);
  launch_decode_for_dim<true>(dp, group, D, pp);
}

}  // namespace lily::cuda
