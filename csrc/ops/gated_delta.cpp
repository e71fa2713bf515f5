#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

static void check_conv1d_silu(const char* op, const Tensor& u, const Tensor& weight, const Tensor& state,
                              const Tensor& state_out, const Tensor& y) {
  check_tensor(op, "u", u, DType::F32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  check_tensor(op, "weight", weight, DType::F32, 2);
  check_tensor(op, "state", state, DType::F32, 2);
  check_tensor(op, "state_out", state_out, DType::F32, 2);
  check_state_out(op, "state_out", state_out, state);
  const int64_t C = u.dim(1), K = weight.dim(1);
  check_shape(op, "weight", weight, 0, C);
  check_shape(op, "state", state, 0, K - 1);
  check_shape(op, "state", state, 1, C);
  check_shape(op, "y", y, 0, u.dim(0));
  check_shape(op, "y", y, 1, C);
  LILY_CHECK(y.data != u.data, op, ": y must not alias u");
  LILY_CHECK(y.data != state_out.data, op, ": y must not alias state_out");
  check_same_device(op, {u, weight, state, state_out, y});
}

void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y) {
  const char* op = "conv1d_silu";
  const OpSpan span(op);
  check_conv1d_silu(op, u, weight, state, state_out, y);
  if (u.device == Device::CPU) return cpu::conv1d_silu(u, weight, state, state_out, y);
  LILY_CUDA_CASE(u.device, conv1d_silu(u, weight, state, state_out, y));
  no_backend(op, u.device);
}

int64_t gated_delta_workspace_floats(Device d, int64_t T, int64_t Hv, int64_t Dk, int64_t Dv) {
  if (d == Device::CPU) return 0;
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return cuda::gated_delta_workspace_floats(T, Hv, Dk, Dv);
#endif
  no_backend("gated_delta_rule", d);
}

static void check_gated_delta_rule(const char* op, const Tensor& qkv, const Tensor& a, const Tensor& b,
                                   const Tensor& A_log, const Tensor& dt_bias, const Tensor& state,
                                   const Tensor& state_out, const Tensor& o, const Tensor& workspace, int Hk, int Dk) {
  check_tensor(op, "qkv", qkv, DType::F32, 2);
  check_tensor(op, "a", a, DType::F32, 2);
  check_tensor(op, "b", b, DType::F32, 2);
  check_tensor(op, "A_log", A_log, DType::F32, 1);
  check_tensor(op, "dt_bias", dt_bias, DType::F32, 1);
  check_tensor(op, "state", state, DType::F32, 3);
  check_tensor(op, "state_out", state_out, DType::F32, 3);
  check_state_out(op, "state_out", state_out, state);
  check_tensor(op, "o", o, DType::F32, 2);
  const int64_t T = qkv.dim(0), Hv = state.dim(0), Dv = state.dim(2);
  check_shape(op, "state", state, 1, Dk);
  LILY_CHECK(Hk > 0 && Hv % Hk == 0, op, ": value heads ", Hv, " not a multiple of key heads ", Hk);
  check_shape(op, "qkv", qkv, 1, 2 * Hk * Dk + Hv * Dv);
  for (const Tensor* t : {&a, &b}) {
    check_shape(op, "a/b", *t, 0, T);
    check_shape(op, "a/b", *t, 1, Hv);
  }
  check_shape(op, "A_log", A_log, 0, Hv);
  check_shape(op, "dt_bias", dt_bias, 0, Hv);
  check_shape(op, "o", o, 0, T);
  check_shape(op, "o", o, 1, Hv * Dv);
  check_same_device(op, {qkv, a, b, A_log, dt_bias, state, state_out, o});
  if (qkv.device == Device::CPU) return;
  const int64_t need = gated_delta_workspace_floats(qkv.device, T, Hv, Dk, Dv);
  if (need > 0) {
    check_tensor(op, "workspace", workspace, DType::F32, 1);
    LILY_CHECK(workspace.numel() >= need, op, ": workspace ", workspace.shape_str(), " is too small for ", T,
               " tokens (", need, " floats)");
    check_same_device(op, {qkv, workspace});
  }
}

void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o,
                      const Tensor& workspace, int Hk, int Dk) {
  const char* op = "gated_delta_rule";
  const OpSpan span(op);
  check_gated_delta_rule(op, qkv, a, b, A_log, dt_bias, state, state_out, o, workspace, Hk, Dk);
  if (qkv.device == Device::CPU)
    return cpu::gated_delta_rule(qkv, a, b, A_log, dt_bias, state, state_out, o, Hk, Dk);
  LILY_CUDA_CASE(qkv.device, gated_delta_rule(qkv, a, b, A_log, dt_bias, state, state_out, o, workspace, Hk, Dk));
  no_backend(op, qkv.device);
}

void conv_gated_delta_rule(const Tensor& u, const Tensor& conv_weight, const Tensor& conv_state,
                           const Tensor& conv_state_out, const Tensor& y, const Tensor& a, const Tensor& b,
                           const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& state_out,
                           const Tensor& o, const Tensor& workspace, int Hk, int Dk) {
  const char* op = "conv_gated_delta_rule";
  const OpSpan span(op);
  check_conv1d_silu(op, u, conv_weight, conv_state, conv_state_out, y);
  check_gated_delta_rule(op, y, a, b, A_log, dt_bias, state, state_out, o, workspace, Hk, Dk);
  if (u.device == Device::CPU) {
    cpu::conv1d_silu(u, conv_weight, conv_state, conv_state_out, y);
    return cpu::gated_delta_rule(y, a, b, A_log, dt_bias, state, state_out, o, Hk, Dk);
  }
  LILY_CUDA_CASE(u.device, conv_gated_delta_rule(u, conv_weight, conv_state, conv_state_out, y, a, b, A_log, dt_bias,
                                                 state, state_out, o, workspace, Hk, Dk));
  no_backend(op, u.device);
}

bool gdn_decode_mixer_supported(Device d, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K) {
  if (d == Device::CPU) return true;
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return cuda::gdn_decode_mixer_supported(Hk, Hv, Dk, Dv, K);
#endif
  (void)Hk, (void)Hv, (void)Dk, (void)Dv, (void)K;
  return false;
}

void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int Hk, int Dk) {
  const char* op = "gdn_decode_mixer";
  const OpSpan span(op);
  check_tensor(op, "qkv", qkv, DType::F32, 2);
  check_tensor(op, "conv_weight", conv_weight, DType::F32, 2);
  check_tensor(op, "conv_state", conv_state, DType::F32, 2);
  check_tensor(op, "a", a, DType::F32, 2);
  check_tensor(op, "b", b, DType::F32, 2);
  check_tensor(op, "A_log", A_log, DType::F32, 1);
  check_tensor(op, "dt_bias", dt_bias, DType::F32, 1);
  check_tensor(op, "state", state, DType::F32, 3);
  check_tensor(op, "z", z, DType::F32, 2);
  check_tensor(op, "norm_weight", norm_weight, DType::F32, 1);
  check_tensor(op, "y", y, DType::F32, 2);
  check_tensor(op, "conv_state_out", conv_state_out, DType::F32, 2);
  check_tensor(op, "state_out", state_out, DType::F32, 3);
  check_state_out(op, "conv_state_out", conv_state_out, conv_state);
  check_state_out(op, "state_out", state_out, state);
  const int64_t Hv = state.dim(0), Dv = state.dim(2), K = conv_weight.dim(1), C = 2 * int64_t(Hk) * Dk + Hv * Dv;
  LILY_CHECK(Hk > 0 && Hv % Hk == 0, op, ": value heads ", Hv, " not a multiple of key heads ", Hk);
  LILY_CHECK(K >= 2, op, ": conv kernel size ", K, " < 2");
  check_shape(op, "qkv", qkv, 0, 1);
  check_shape(op, "qkv", qkv, 1, C);
  check_shape(op, "conv_weight", conv_weight, 0, C);
  check_shape(op, "conv_state", conv_state, 0, K - 1);
  check_shape(op, "conv_state", conv_state, 1, C);
  for (const Tensor* t : {&a, &b}) {
    check_shape(op, "a/b", *t, 0, 1);
    check_shape(op, "a/b", *t, 1, Hv);
  }
  check_shape(op, "A_log", A_log, 0, Hv);
  check_shape(op, "dt_bias", dt_bias, 0, Hv);
  check_shape(op, "state", state, 1, Dk);
  check_shape(op, "norm_weight", norm_weight, 0, Dv);
  for (const Tensor* t : {&z, &y}) {
    check_shape(op, "z/y", *t, 0, 1);
    check_shape(op, "z/y", *t, 1, Hv * Dv);
  }
  LILY_CHECK(y.data != qkv.data && y.data != z.data, op, ": y must not alias qkv or z");
  check_same_device(op, {qkv, conv_weight, conv_state, conv_state_out, a, b, A_log, dt_bias, state, state_out, z,
                         norm_weight, y});
  if (qkv.device == Device::CPU)
    return cpu::gdn_decode_mixer(qkv, conv_weight, conv_state, conv_state_out, a, b, A_log, dt_bias, state,
                                 state_out, z, norm_weight, eps, y, Hk, Dk);
  LILY_CUDA_CASE(qkv.device, gdn_decode_mixer(qkv, conv_weight, conv_state, conv_state_out, a, b, A_log, dt_bias,
                                              state, state_out, z, norm_weight, eps, y, Hk, Dk));
  no_backend(op, qkv.device);
}

}  // namespace lily::ops
