// Launchers of the Gated DeltaNet kernels (kernels/gated_delta.cuh): the causal conv1d + SiLU and
// the delta-rule recurrence, both updating their carried state in place.
#include "cuda_ops.h"
#include "kernels/gated_delta.cuh"
#include "runtime.cuh"

namespace lily::cuda {

template <int K>
static void launch_conv1d(const Conv1dParams& p) {
  const dim3 grid{unsigned(ceil_div(p.C, CONV_THREADS)), unsigned(ceil_div(p.T, CONV_STEPS))};
  launch(conv1d_silu_kernel<K>, grid, CONV_THREADS, 0, p);
  LILY_CUDA_LAUNCHED();
}

void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& y) {
  const int64_t T = u.dim(0), C = u.dim(1), K = weight.dim(1);
  LILY_CHECK(T <= 0x7fffffff && C <= 0x7fffffff, "conv1d_silu: sizes exceed the CUDA kernel's int range");
  if (T == 0) return;
  const Conv1dParams p{u.ptr<float>(), weight.ptr<float>(), state.ptr<float>(), y.ptr<float>(), int(T), int(C)};
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

void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& o, int num_key_heads,
                      int key_head_dim) {
  const int64_t T = qkv.dim(0), Hv = state.dim(0), Dv = state.dim(2);
  LILY_CHECK(T <= 0x7fffffff && Hv <= 0xffff && Dv <= 0x7fffffff,
             "gated_delta_rule: sizes exceed the CUDA kernel's range");
  if (T == 0) return;
  const GatedDeltaParams p{qkv.ptr<float>(), a.ptr<float>(),     b.ptr<float>(),  A_log.ptr<float>(),
                           dt_bias.ptr<float>(), state.ptr<float>(), o.ptr<float>(), int(T),
                           num_key_heads,        int(Hv),            key_head_dim,    int(Dv)};
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

}  // namespace lily::cuda
