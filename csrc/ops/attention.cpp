#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int nH) {
  const char* op = "split_q_gate";
  const OpSpan span(op);
  check_tensor(op, "p", p, DType::F32, 2);
  check_tensor(op, "q", q, DType::F32, 2);
  check_tensor(op, "gate", gate, DType::F32, 2);
  LILY_CHECK(nH > 0 && p.dim(1) % (2 * nH) == 0, op, ": p width ", p.dim(1), " is not 2 * heads * head_dim");
  for (const Tensor* t : {&q, &gate}) {
    check_shape(op, "q/gate", *t, 0, p.dim(0));
    check_shape(op, "q/gate", *t, 1, p.dim(1) / 2);
  }
  check_same_device(op, {p, q, gate});
  if (p.device == Device::CPU) return cpu::split_q_gate(p, q, gate, nH);
  LILY_CUDA_CASE(p.device, split_q_gate(p, q, gate, nH));
  no_backend(op, p.device);
}

// The cache holds F32 on the CPU and BF16 on GPUs (half the bytes of the decode's KV reads).
static DType cache_dtype(Device d) { return d == Device::CPU ? DType::F32 : DType::BF16; }

static void check_position(const char* op, const Position& pos, Device d, int64_t T, int64_t capacity) {
  LILY_CHECK(pos.host >= 0 && pos.host + T <= capacity, op, ": positions [", pos.host, ", ", pos.host + T,
             ") exceed the cache of ", capacity);
  LILY_CHECK(d == Device::CPU || pos.device != nullptr, op, ": a GPU op needs the position in device memory");
}

// Rotary positions stay in [0, INT32_MAX) (the kernels add the delta to the int32 position word).
static void check_rope_delta(const char* op, const Position& pos, int64_t T) {
  LILY_CHECK(pos.host + pos.rope_delta >= 0 && pos.host + pos.rope_delta + T <= INT32_MAX, op, ": rotary positions [",
             pos.host + pos.rope_delta, ", ", pos.host + pos.rope_delta + T, ") are outside [0, ", INT32_MAX, ")");
}

void rope(const Tensor& x, int nH, int rotary_dim, double theta, const Position& pos) {
  const char* op = "rope";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  LILY_CHECK(nH > 0 && x.dim(1) % nH == 0, op, ": width ", x.dim(1), " is not heads * head_dim");
  LILY_CHECK(rotary_dim % 2 == 0 && rotary_dim <= x.dim(1) / nH, op, ": bad rotary_dim ", rotary_dim);
  check_position(op, pos, x.device, x.dim(0), INT32_MAX);
  check_rope_delta(op, pos, x.dim(0));
  if (x.device == Device::CPU) return cpu::rope(x, nH, rotary_dim, theta, pos.host + pos.rope_delta);
  LILY_CUDA_CASE(x.device, rope(x, nH, rotary_dim, theta, pos.device, pos.rope_delta));
  no_backend(op, x.device);
}

void kv_cache_write(const Tensor& x, const Tensor& cache, const Position& pos) {
  const char* op = "kv_cache_write";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "cache", cache, cache_dtype(x.device), 2);
  check_shape(op, "cache", cache, 1, x.dim(1));
  check_same_device(op, {x, cache});
  check_position(op, pos, x.device, x.dim(0), cache.dim(0));
  if (x.device == Device::CPU) return cpu::kv_cache_write(x, cache, pos.host);
  LILY_CUDA_CASE(x.device, kv_cache_write(x, cache, pos.device));
  no_backend(op, x.device);
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o, int nH,
               int nKV, const Position& pos, const Tensor& workspace) {
  const char* op = "attention";
  const OpSpan span(op);
  check_tensor(op, "q", q, DType::F32, 2);
  check_tensor(op, "o", o, DType::F32, 2);
  check_tensor(op, "k_cache", k_cache, cache_dtype(q.device), 2);
  check_tensor(op, "v_cache", v_cache, cache_dtype(q.device), 2);
  LILY_CHECK(nH > 0 && nKV > 0 && nH % nKV == 0 && q.dim(1) % nH == 0, op, ": bad head counts ", nH, "/", nKV);
  const int64_t D = q.dim(1) / nH;
  check_shape(op, "k_cache", k_cache, 1, nKV * D);
  check_shape(op, "v_cache", v_cache, 1, nKV * D);
  check_shape(op, "v_cache", v_cache, 0, k_cache.dim(0));
  check_shape(op, "o", o, 0, q.dim(0));
  check_shape(op, "o", o, 1, q.dim(1));
  check_same_device(op, {q, k_cache, v_cache, o});
  check_position(op, pos, q.device, q.dim(0), k_cache.dim(0));
  if (workspace.data != nullptr) {
    LILY_CHECK(workspace.dtype == DType::BF16, op, ": the workspace must be BF16, not ", dtype_name(workspace.dtype));
    check_same_device(op, {q, workspace});
  }
  if (q.device == Device::CPU) return cpu::attention(q, k_cache, v_cache, o, nH, nKV, pos.host);
  LILY_CUDA_CASE(q.device, attention(q, k_cache, v_cache, o, nH, nKV, pos.device, workspace));
  no_backend(op, q.device);
}

bool gated_attention_xb_supported(Device device, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D) {
#ifdef LILY_WITH_CUDA
  if (device == Device::CUDA) return cuda::gated_attention_prefill_shapes(T, num_heads, num_kv_heads, D);
#endif
  (void)T, (void)num_heads, (void)num_kv_heads, (void)D;
  return false;
}

int64_t attention_workspace_elems(Device device, int64_t T, int64_t num_heads, int64_t D) {
  return device == Device::CPU ? 0 : T * num_heads * D;
}

void gated_attention(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm, const Tensor& k_norm,
                     float eps, int rotary_dim, double theta, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q, const Tensor& gate, const Tensor& o, int nH, int nKV, const Position& pos,
                     const Tensor& workspace, bool o_as_xb) {
  const char* op = "gated_attention";
  const OpSpan span(op);
  check_tensor(op, "p", p, DType::F32, 2);
  for (const Tensor* t : {&k, &v}) check_tensor(op, "k/v", *t, DType::F32, 2);
  check_tensor(op, "q_norm", q_norm, DType::F32, 1);
  check_tensor(op, "k_norm", k_norm, DType::F32, 1);
  LILY_CHECK(nH > 0 && nKV > 0 && nH % nKV == 0 && p.dim(1) % (2 * nH) == 0, op, ": bad head counts ", nH, "/",
             nKV, " for p ", p.shape_str());
  const int64_t T = p.dim(0), D = p.dim(1) / (2 * nH);
  for (const Tensor* t : {&k, &v}) {
    check_shape(op, "k/v", *t, 0, T);
    check_shape(op, "k/v", *t, 1, nKV * D);
  }
  check_shape(op, "q_norm", q_norm, 0, D);
  check_shape(op, "k_norm", k_norm, 0, D);
  check_same_device(op, {p, k, v, q_norm, k_norm, k_cache, v_cache, q, gate, o});
  if (workspace.data != nullptr) {
    LILY_CHECK(workspace.dtype == DType::BF16, op, ": the workspace must be BF16, not ", dtype_name(workspace.dtype));
    check_same_device(op, {p, workspace});
  }
#ifdef LILY_WITH_CUDA
  // The remaining checks are the ops' own; the fused kernels assume the shapes they verify.
  const bool decode = p.device == Device::CUDA &&
                      cuda::gated_attention_fits(p, k, v, q_norm, k_norm, k_cache, v_cache, q, gate, o, nH, nKV);
  const bool prefill = p.device == Device::CUDA && !decode &&
                       cuda::gated_attention_prefill_fits(p, k, v, q_norm, k_norm, k_cache, v_cache, o, nH, nKV,
                                                          workspace);
  LILY_CHECK(!o_as_xb || prefill, op, ": o as the GEMM's bf16 X needs CUDA's prompt path (gated_attention_xb_supported, "
             "a BF16 workspace of T * heads * head_dim, 16-byte aligned tensors)");
  if (decode || prefill) {
    for (const Tensor* t : {&q, &gate, &o}) {
      check_tensor(op, "q/gate/o", *t, DType::F32, 2);
      check_shape(op, "q/gate/o", *t, 0, T);
      check_shape(op, "q/gate/o", *t, 1, nH * D);
    }
    for (const Tensor* t : {&k_cache, &v_cache}) {
      check_tensor(op, "k_cache/v_cache", *t, cache_dtype(p.device), 2);
      check_shape(op, "k_cache/v_cache", *t, 1, nKV * D);
      check_shape(op, "k_cache/v_cache", *t, 0, k_cache.dim(0));
    }
    LILY_CHECK(rotary_dim % 2 == 0 && rotary_dim >= 0 && rotary_dim <= D, op, ": bad rotary_dim ", rotary_dim);
    check_position(op, pos, p.device, T, k_cache.dim(0));
    check_rope_delta(op, pos, T);
    if (prefill)
      return cuda::gated_attention_prefill(p, k, v, q_norm, k_norm, eps, rotary_dim, theta, k_cache, v_cache, o, nH,
                                           nKV, pos.device, pos.rope_delta, workspace, o_as_xb);
    return cuda::gated_attention(p, k, v, q_norm, k_norm, eps, rotary_dim, theta, k_cache, v_cache, q, gate, o, nH,
                                 nKV, pos.device, pos.rope_delta);
  }
#else
  LILY_CHECK(!o_as_xb, op, ": o as the GEMM's bf16 X needs CUDA's prompt path");
#endif
  // The per-op sequence: the CPU reference, and the fallback of every other case.
  split_q_gate(p, q, gate, nH);
  const Tensor qh = Tensor::of(q.data, DType::F32, q.device, {T * nH, D});   // [T*nH, D]
  const Tensor kh = Tensor::of(k.data, DType::F32, k.device, {T * nKV, D});  // [T*nKV, D]
  rms_norm(qh, q_norm, eps, qh);
  rms_norm(kh, k_norm, eps, kh);
  rope(q, nH, rotary_dim, theta, pos);
  rope(k, nKV, rotary_dim, theta, pos);
  kv_cache_write(k, k_cache, pos);
  kv_cache_write(v, v_cache, pos);
  attention(q, k_cache, v_cache, o, nH, nKV, pos, workspace);
  sigmoid_mul(o, gate);
}

}  // namespace lily::ops
