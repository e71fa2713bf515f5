// lily._core.ops: each op of the forward pass on numpy arrays, on a chosen device, so tests can
// compare backends op by op. Every call uploads its inputs, runs the op, and downloads the outputs;
// it is a test and debugging surface, not a fast path.
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <vector>

#include "../ops/ops.h"
#include "arrays.h"

namespace nb = nanobind;
using namespace lily;
using namespace lily::bind;

namespace {

using F32In = nb::ndarray<const float, nb::device::cpu, nb::c_contig>;
using I32In = nb::ndarray<const int32_t, nb::device::cpu, nb::c_contig>;
using U16In = nb::ndarray<const uint16_t, nb::device::cpu, nb::c_contig>;

// A device copy of a host array with the tensor view ops take.
struct Dev {
  Buffer buf;
  Tensor t;
  Dev(Device d, const void* data, size_t nbytes, DType dtype, std::vector<int64_t> shape) : buf(d, nbytes) {
    if (nbytes) buf.upload(data, nbytes);
    t = Tensor::of(buf.data(), dtype, d, {});
    for (int64_t s : shape) t.shape[t.ndim++] = s;
  }
  Dev(Device d, DType dtype, std::vector<int64_t> shape) : Dev(d, nullptr, 0, dtype, {}) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    buf = Buffer(d, size_t(n) * dtype_size(dtype));
    t = Tensor::of(buf.data(), dtype, d, {});
    for (int64_t s : shape) t.shape[t.ndim++] = s;
  }
};

template <typename A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < a.ndim(); ++i) s.push_back(int64_t(a.shape(i)));
  return s;
}

Dev f32(Device d, const F32In& a) { return Dev(d, a.data(), a.nbytes(), DType::F32, shape_of(a)); }
Dev i32(Device d, const I32In& a) { return Dev(d, a.data(), a.nbytes(), DType::I32, shape_of(a)); }

FloatArray out_f32(const Dev& x) {
  std::vector<size_t> shape(x.t.shape.begin(), x.t.shape.begin() + x.t.ndim);
  FloatArray a = new_floats(shape);
  x.buf.download(a.data(), a.size() * 4);
  return a;
}

IntArray out_i32(const Dev& x) {
  std::vector<size_t> shape(x.t.shape.begin(), x.t.shape.begin() + x.t.ndim);
  IntArray a = new_array<int32_t>(shape);
  x.buf.download(a.data(), a.size() * 4);
  return a;
}

// A device F32 array shaped like a, every element NaN.
Dev nan_like(Device d, const F32In& a) {
  const std::vector<float> nan(a.size(), std::numeric_limits<float>::quiet_NaN());
  return Dev(d, nan.data(), nan.size() * 4, DType::F32, shape_of(a));
}

// A device U16 array's contents (a bf16 Xb) as a numpy array [rows, cols] of its first rows * cols values.
nb::ndarray<nb::numpy, uint16_t> out_u16(const Dev& x, int64_t rows, int64_t cols) {
  nb::ndarray<nb::numpy, uint16_t> a = new_array<uint16_t>({size_t(rows), size_t(cols)});
  x.buf.download(a.data(), a.size() * 2);
  return a;
}

// The work space of one MoE call over T tokens (ops::MoeScratch); xb_elems 0: ops::moe_xb_elems.
struct MoeDev {
  Dev logits, gathered, g, u, dn, sg, routing, xb;
  ops::MoeScratch s;
  MoeDev(Device d, const MoeWeights& w, int64_t T, int64_t H, int top_k, int64_t xb_elems = 0, bool small = true,
         bool down_bf16 = true)
      : logits(d, DType::F32, {T, w.router->rows}),
        gathered(d, DType::F32, {ops::moe_work_rows(d, T, top_k), H}),
        g(d, DType::F32, {ops::moe_work_rows(d, T, top_k), std::max(w.gate_proj->rows, w.shared_gate_proj->rows)}),
        u(d, DType::F32, {ops::moe_work_rows(d, T, top_k), std::max(w.gate_proj->rows, w.shared_gate_proj->rows)}),
        dn(d, DType::F32, {ops::moe_work_rows(d, T, top_k), H}),
        sg(d, DType::F32, {T, 1}),
        routing(d, DType::I32, {std::max<int64_t>(1, ops::moe_routing_words(d, T, w.router->rows, top_k))}),
        xb(d, DType::BF16, {std::max<int64_t>(1, xb_elems > 0 ? xb_elems
                                                              : ops::moe_xb_elems(d, T, H, w.down_proj->cols,
                                                                                  w.shared_down_proj->cols, top_k))}),
        s{logits.t, gathered.t, g.t, u.t, dn.t, sg.t, routing.t, xb.t, small, down_bf16} {}
};

// How a binding's h reaches a MoE op: h_xb (h's bf16 X, [T, H] uint16) uploaded to the start of m's xb, with
// (F32_AND_XB) or without (XB) h's F32 rows; none: F32 (h_f32 must be set).
ops::MoeInput moe_input(MoeDev& m, const std::optional<U16In>& h_xb, bool h_f32, int64_t n) {
  if (!h_xb) {
    LILY_CHECK(h_f32, "moe: h_f32 = False needs h_xb, h's bf16 X");
    return ops::MoeInput::F32;
  }
  LILY_CHECK(int64_t(h_xb->size()) == n && int64_t(m.xb.t.numel()) >= n, "moe: h_xb holds ", h_xb->size(),
             " values for h's ", n, " (the workspace ", m.xb.t.numel(), ")");
  m.xb.buf.upload(h_xb->data(), size_t(n) * 2);
  return h_f32 ? ops::MoeInput::F32_AND_XB : ops::MoeInput::XB;
}

// KV caches are F32 on the CPU and BF16 (round to nearest even) on GPUs.
Dev cache_in(Device d, const F32In& a) {
  if (d == Device::CPU) return f32(d, a);
  std::vector<uint16_t> h(a.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(a.data()[i]);
  return Dev(d, h.data(), h.size() * 2, DType::BF16, shape_of(a));
}

FloatArray cache_out(const Dev& x) {
  if (x.t.dtype == DType::F32) return out_f32(x);
  std::vector<uint16_t> h(size_t(x.t.numel()));
  x.buf.download(h.data(), h.size() * 2);
  FloatArray a = new_floats({size_t(x.t.dim(0)), size_t(x.t.dim(1))});
  for (size_t i = 0; i < h.size(); ++i) a.data()[i] = bf16_to_f32(h[i]);
  return a;
}

// The position of a chunk, in host and device memory as the engine keeps it, and the rope offset.
struct Pos {
  Dev dev;
  ops::Position pos;
  Pos(Device d, int64_t p, int64_t rope_delta = 0) : dev(d, DType::I32, {1}) {
    const int32_t v = int32_t(p);
    dev.buf.upload(&v, 4);
    pos = {p, d == Device::CPU ? nullptr : dev.t.ptr<int32_t>(), rope_delta};
  }
};

}  // namespace

void init_ops(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("ops", "Single ops on numpy arrays, for backend comparisons.");
  nb::class_<QMatrix>(m, "QMatrix", "A weight matrix stack on a device, in storage form.")
      .def("__init__", [](QMatrix* q, const std::string& device, const HostArray& weight, const std::string& dtype,
                          int64_t num_stack, int64_t rows, int64_t cols, int bits, int group_size,
                          std::optional<HostArray> scales, std::optional<HostArray> biases,
                          const std::string& scale_dtype) {
        new (q) QMatrix(make_qmatrix(parse_device(device), "QMatrix", weight, dtype, num_stack, rows, cols, bits,
                                     group_size, scales, biases, scale_dtype));
      }, nb::arg("device"), nb::arg("weight"), nb::arg("dtype"), nb::arg("num_stack"), nb::arg("rows"),
         nb::arg("cols"), nb::arg("bits") = 0, nb::arg("group_size") = 0, nb::arg("scales") = nb::none(),
         nb::arg("biases") = nb::none(), nb::arg("scale_dtype") = "F32")
      .def_prop_ro("device", [](const QMatrix& q) { return std::string(device_name(q.weight.device())); });

  m.def("embedding", [](const QMatrix& table, const I32In& ids) {
    const Device d = table.weight.device();
    Dev i = i32(d, ids), y(d, DType::F32, {int64_t(ids.shape(0)), table.cols});
    ops::embedding(table, i.t, y.t);
    return out_f32(y);
  });
  m.def("linear", [](const QMatrix& w, int64_t e, const F32In& x) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::linear(w, e, xi.t, y.t, ws.t);
    return out_f32(y);
  });
  m.def("linear_add_rms_norm", [](const QMatrix& w, const F32In& x, const F32In& res, const F32In& nw, float eps,
                                  int repeat) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), ri = f32(d, res), wi = f32(d, nw), y(d, DType::F32, {T, w.rows}), tmp(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    Dev sync(d, DType::I32, {1});
    const int32_t zero = 0;
    sync.buf.upload(&zero, 4);
    for (int i = 0; i < repeat; ++i) ops::linear_add_rms_norm(w, xi.t, ri.t, wi.t, eps, y.t, tmp.t, ws.t, sync.t);
    int32_t left = -1;
    sync.buf.download(&left, 4);
    return nb::make_tuple(out_f32(ri), out_f32(y), left);
  }, nb::arg("w"), nb::arg("x"), nb::arg("res"), nb::arg("weight"), nb::arg("eps"), nb::arg("repeat") = 1,
     "(res + x W^T, rms_norm of it, the sync counter after): the op `repeat` times on the same buffers.");
  m.def("linear_add", [](const QMatrix& w, const F32In& x, const F32In& res) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), ri = f32(d, res), tmp(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::linear_add(w, xi.t, ri.t, tmp.t, ws.t);
    return out_f32(ri);
  }, nb::arg("w"), nb::arg("x"), nb::arg("res"), "res + x W^T.");
  m.def("linear_bias", [](const QMatrix& w, const F32In& x, const F32In& b) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), bi = f32(d, b), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::linear_bias(w, xi.t, bi.t, y.t, ws.t);
    return out_f32(y);
  }, nb::arg("w"), nb::arg("x"), nb::arg("bias"), "x W^T + bias.");
  m.def("linear_bias_gelu", [](const QMatrix& w, const F32In& x, const F32In& b) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), bi = f32(d, b), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::linear_bias_gelu(w, xi.t, bi.t, y.t, ws.t);
    return out_f32(y);
  }, nb::arg("w"), nb::arg("x"), nb::arg("bias"), "gelu_tanh(x W^T + bias).");
  m.def("linear_bias_xb_supported", [](const QMatrix& w, int64_t T) {
    return ops::linear_bias_xb_supported(w.weight.device(), w, T);
  }, nb::arg("w"), nb::arg("T"), "Whether linear_bias_gelu_xb / linear_bias_xb take T rows over w (CUDA: the "
     "dense wgmma GEMM).");
  m.def("layer_norm_linear_bias_xb", [](const QMatrix& w, const F32In& x, const F32In& nw, const F32In& nb, float eps,
                                       const F32In& b) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), nwi = f32(d, nw), nbi = f32(d, nb), bi = f32(d, b), y(d, DType::F32, {T, w.rows});
    Dev xb(d, DType::BF16, {std::max<int64_t>(1, T * w.cols)});
    ops::layer_norm_xb(xi.t, nwi.t, nbi.t, eps, xb.t);
    ops::linear_bias_xb(w, xb.t, bi.t, y.t);
    return out_f32(y);
  }, nb::arg("w"), nb::arg("x"), nb::arg("norm_weight"), nb::arg("norm_bias"), nb::arg("eps"), nb::arg("bias"),
     "layer_norm(x) W^T + bias with the norm's output handed over as bf16 (layer_norm_xb, linear_bias_xb).");
  m.def("layer_norm_mlp_xb", [](const F32In& x, const F32In& nw, const F32In& nb, float eps, const QMatrix& w1,
                                const F32In& b1, const QMatrix& w2, const F32In& b2) {
    const Device d = w1.weight.device();
    const int64_t T = int64_t(x.shape(0));
    Dev xi = f32(d, x), nwi = f32(d, nw), nbi = f32(d, nb), b1i = f32(d, b1), b2i = f32(d, b2);
    Dev y(d, DType::F32, {T, w2.rows}), xb(d, DType::BF16, {std::max<int64_t>(1, T * w1.cols)});
    Dev hb(d, DType::BF16, {T, w1.rows});
    ops::layer_norm_xb(xi.t, nwi.t, nbi.t, eps, xb.t);
    ops::linear_bias_gelu_xb(w1, xb.t, b1i.t, hb.t);
    ops::linear_bias_xb(w2, Tensor::of(hb.t.data, DType::BF16, d, {T * w1.rows}), b2i.t, y.t);
    return out_f32(y);
  }, nb::arg("x"), nb::arg("norm_weight"), nb::arg("norm_bias"), nb::arg("eps"), nb::arg("w1"), nb::arg("bias1"),
     nb::arg("w2"), nb::arg("bias2"),
     "fc2(gelu_tanh(fc1(layer_norm(x)))) with both products' inputs handed over as bf16 (layer_norm_xb, "
     "linear_bias_gelu_xb, linear_bias_xb).");
  m.def("linear_rms_normed", [](const QMatrix& w, const F32In& res, const F32In& nw, float eps) {
    const Device d = w.weight.device();
    const int64_t T = int64_t(res.shape(0));
    Dev ri = f32(d, res), wi = f32(d, nw), h(d, DType::F32, {T, w.cols}), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    const bool one_kernel = ops::linear_rms_normed_supported(w, ri.t, wi.t, h.t);
    ops::linear_rms_normed(w, ri.t, wi.t, eps, h.t, y.t, ws.t);
    return nb::make_tuple(out_f32(y), one_kernel);
  }, nb::arg("w"), nb::arg("res"), nb::arg("weight"), nb::arg("eps"),
     "(rms_norm(res) * weight W^T, whether it ran as one kernel: linear_rms_normed_supported).");
  m.def("rms_norm", [](const std::string& device, const F32In& x, const F32In& w, float eps) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), wi = f32(d, w), y(d, DType::F32, shape_of(x));
    ops::rms_norm(xi.t, wi.t, eps, y.t);
    return out_f32(y);
  });
  m.def("add_rms_norm", [](const std::string& device, const F32In& x, const F32In& res, const F32In& w, float eps) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), ri = f32(d, res), wi = f32(d, w), y(d, DType::F32, shape_of(x));
    ops::add_rms_norm(xi.t, ri.t, wi.t, eps, y.t);
    return nb::make_tuple(out_f32(xi), out_f32(y));
  });
  m.def("add_rms_norm_xb", [](const std::string& device, const F32In& x, const F32In& res, const F32In& w, float eps,
                              bool write_y) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), ri = f32(d, res), wi = f32(d, w), y(d, DType::F32, shape_of(x));
    const int64_t R = xi.t.dim(0), D = xi.t.dim(1);
    Dev xb(d, DType::BF16, {std::max<int64_t>(1, R * D)});
    ops::add_rms_norm_xb(xi.t, ri.t, wi.t, eps, write_y ? y.t : Tensor{}, xb.t);
    const nb::object yo = write_y ? nb::cast(out_f32(y)) : nb::none();
    return nb::make_tuple(out_f32(xi), yo, out_u16(xb, R, D));
  }, nb::arg("device"), nb::arg("x"), nb::arg("res"), nb::arg("weight"), nb::arg("eps"), nb::arg("write_y") = true,
     "(x + res, y = rms_norm(x + res) or None where write_y = False (y absent), y's bf16 X [R, D] as uint16).");
  m.def("gated_rms_norm", [](const std::string& device, const F32In& x, const F32In& z, const F32In& w, float eps) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), zi = f32(d, z), wi = f32(d, w), y(d, DType::F32, shape_of(x));
    ops::gated_rms_norm(xi.t, zi.t, wi.t, eps, y.t);
    return out_f32(y);
  });
  m.def("linear_xb_supported", [](const QMatrix& w, int64_t T) {
    return ops::linear_xb_supported(w.weight.device(), w, T);
  }, nb::arg("w"), nb::arg("T"), "Whether linear_xb takes T rows over w (CUDA: the wgmma GEMM).");
  m.def("gated_rms_norm_linear_xb", [](const QMatrix& w, const F32In& x, const F32In& z, const F32In& nw, float eps) {
    const Device d = w.weight.device();
    LILY_CHECK(int64_t(x.size()) % w.cols == 0, "gated_rms_norm_linear_xb: x's ", x.size(),
               " values are no whole rows of ", w.cols);
    const int64_t T = int64_t(x.size()) / w.cols;
    Dev xi = f32(d, x), zi = f32(d, z), wi = f32(d, nw), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::gated_rms_norm_xb(xi.t, zi.t, wi.t, eps, ws.t);
    ops::linear_xb(w, ws.t, y.t);
    return out_f32(y);
  }, nb::arg("w"), nb::arg("x"), nb::arg("z"), nb::arg("weight"), nb::arg("eps"),
     "linear(w, gated_rms_norm(x, z) seen as [T, w.cols]) with the norm writing linear's bf16 X (GDN out_proj).");
  m.def("add_rms_norm_linear_xb", [](const QMatrix& w, const F32In& x, const F32In& res, const F32In& nw,
                                     float eps) {
    const Device d = w.weight.device();
    Dev xi = f32(d, x), ri = f32(d, res), wi = f32(d, nw);
    const int64_t T = xi.t.dim(0);
    Dev h(d, DType::F32, {T, xi.t.dim(1)}), y(d, DType::F32, {T, w.rows});
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, w.cols))});
    ops::add_rms_norm_xb(xi.t, ri.t, wi.t, eps, h.t, ws.t);
    ops::linear_xb(w, ws.t, y.t);
    return nb::make_tuple(out_f32(xi), out_f32(h), out_f32(y));
  }, nb::arg("w"), nb::arg("x"), nb::arg("res"), nb::arg("weight"), nb::arg("eps"),
     "(x + res, h = rms_norm(x + res), linear(w, h)) with the norm also writing linear's bf16 X (a layer's input "
     "and post-attention norms for prompts).");
  // The carried-state ops take out_of_place: False updates the state in place and returns (outputs...,
  // new state); True writes the new state to a separate buffer (pre-filled with NaN, so an element the
  // op fails to write shows) and also returns the input state as the op left it (it must not change).
  m.def("conv1d_silu", [](const std::string& device, const F32In& u, const F32In& w, const F32In& state,
                          bool out_of_place) {
    const Device d = parse_device(device);
    Dev ui = f32(d, u), wi = f32(d, w), st = f32(d, state), y(d, DType::F32, shape_of(u));
    if (!out_of_place) {
      ops::conv1d_silu(ui.t, wi.t, st.t, st.t, y.t);
      return nb::make_tuple(out_f32(y), out_f32(st));
    }
    Dev so = nan_like(d, state);
    ops::conv1d_silu(ui.t, wi.t, st.t, so.t, y.t);
    return nb::make_tuple(out_f32(y), out_f32(so), out_f32(st));
  }, nb::arg("device"), nb::arg("u"), nb::arg("w"), nb::arg("state"), nb::arg("out_of_place") = false);
  m.def("gated_delta_rule", [](const std::string& device, const F32In& qkv, const F32In& a, const F32In& b,
                               const F32In& A_log, const F32In& dt_bias, const F32In& state, int Hk, int Dk,
                               bool out_of_place) {
    const Device d = parse_device(device);
    Dev q = f32(d, qkv), ai = f32(d, a), bi = f32(d, b), al = f32(d, A_log), dt = f32(d, dt_bias), st = f32(d, state);
    const int64_t T = int64_t(qkv.shape(0)), Hv = int64_t(state.shape(0)), Dv = int64_t(state.shape(2));
    Dev o(d, DType::F32, {T, Hv * Dv});
    Dev ws(d, DType::F32, {std::max<int64_t>(1, ops::gated_delta_workspace_floats(d, T, Hv, Dk, Dv))});
    if (!out_of_place) {
      ops::gated_delta_rule(q.t, ai.t, bi.t, al.t, dt.t, st.t, st.t, o.t, ws.t, Hk, Dk);
      return nb::make_tuple(out_f32(o), out_f32(st));
    }
    Dev so = nan_like(d, state);
    ops::gated_delta_rule(q.t, ai.t, bi.t, al.t, dt.t, st.t, so.t, o.t, ws.t, Hk, Dk);
    return nb::make_tuple(out_f32(o), out_f32(so), out_f32(st));
  }, nb::arg("device"), nb::arg("qkv"), nb::arg("a"), nb::arg("b"), nb::arg("A_log"), nb::arg("dt_bias"),
     nb::arg("state"), nb::arg("Hk"), nb::arg("Dk"), nb::arg("out_of_place") = false);
  m.def("gdn_decode_mixer", [](const std::string& device, const F32In& qkv, const F32In& conv_weight,
                               const F32In& conv_state, const F32In& a, const F32In& b, const F32In& A_log,
                               const F32In& dt_bias, const F32In& state, const F32In& z, const F32In& norm_weight,
                               float eps, int Hk, int Dk, bool out_of_place) {
    const Device d = parse_device(device);
    Dev q = f32(d, qkv), cw = f32(d, conv_weight), cs = f32(d, conv_state), ai = f32(d, a), bi = f32(d, b);
    Dev al = f32(d, A_log), dt = f32(d, dt_bias), st = f32(d, state), zi = f32(d, z), nw = f32(d, norm_weight);
    Dev y(d, DType::F32, shape_of(z));
    if (!out_of_place) {
      ops::gdn_decode_mixer(q.t, cw.t, cs.t, cs.t, ai.t, bi.t, al.t, dt.t, st.t, st.t, zi.t, nw.t, eps, y.t, Hk, Dk);
      return nb::make_tuple(out_f32(y), out_f32(cs), out_f32(st));
    }
    Dev cso = nan_like(d, conv_state), so = nan_like(d, state);
    ops::gdn_decode_mixer(q.t, cw.t, cs.t, cso.t, ai.t, bi.t, al.t, dt.t, st.t, so.t, zi.t, nw.t, eps, y.t, Hk, Dk);
    return nb::make_tuple(out_f32(y), out_f32(cso), out_f32(so), out_f32(cs), out_f32(st));
  }, nb::arg("device"), nb::arg("qkv"), nb::arg("conv_weight"), nb::arg("conv_state"), nb::arg("a"), nb::arg("b"),
     nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("state"), nb::arg("z"), nb::arg("norm_weight"), nb::arg("eps"),
     nb::arg("Hk"), nb::arg("Dk"), nb::arg("out_of_place") = false,
     "One decode token's conv1d_silu -> gated_delta_rule -> gated_rms_norm; returns (y, conv_state, state), "
     "out_of_place: (y, new conv_state, new state, input conv_state, input state).");
  m.def("gdn_decode_mixer_supported", [](const std::string& device, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                                         int64_t K) {
    return ops::gdn_decode_mixer_supported(parse_device(device), Hk, Hv, Dk, Dv, K);
  });
  m.def("split_q_gate", [](const std::string& device, const F32In& p, int nH) {
    const Device d = parse_device(device);
    Dev pi = f32(d, p), q(d, DType::F32, {int64_t(p.shape(0)), int64_t(p.shape(1) / 2)});
    Dev g(d, DType::F32, {int64_t(p.shape(0)), int64_t(p.shape(1) / 2)});
    ops::split_q_gate(pi.t, q.t, g.t, nH);
    return nb::make_tuple(out_f32(q), out_f32(g));
  });
  m.def("rope", [](const std::string& device, const F32In& x, int nH, int rotary_dim, double theta, int64_t pos0,
                   int64_t rope_delta) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x);
    Pos p(d, pos0, rope_delta);
    ops::rope(xi.t, nH, rotary_dim, theta, p.pos);
    return out_f32(xi);
  }, nb::arg("device"), nb::arg("x"), nb::arg("num_heads"), nb::arg("rotary_dim"), nb::arg("theta"), nb::arg("pos0"),
     nb::arg("rope_delta") = 0, "x turned by positions pos0 + rope_delta + t.");
  m.def("kv_cache_write", [](const std::string& device, const F32In& x, const F32In& cache, int64_t pos0) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), c = cache_in(d, cache);
    Pos p(d, pos0);
    ops::kv_cache_write(xi.t, c.t, p.pos);
    return cache_out(c);
  });
  m.def("attention", [](const std::string& device, const F32In& q, const F32In& k, const F32In& v, int nH, int nKV,
                        int64_t pos0) {
    const Device d = parse_device(device);
    Dev qi = f32(d, q), kc = cache_in(d, k), vc = cache_in(d, v), o(d, DType::F32, shape_of(q));
    Dev ws(d, DType::BF16, {ops::attention_workspace_elems(d, qi.t.dim(0), nH, nH > 0 ? qi.t.dim(1) / nH : 0)});
    Pos p(d, pos0);
    ops::attention(qi.t, kc.t, vc.t, o.t, nH, nKV, p.pos, ws.t);
    return out_f32(o);
  });
  m.def("gated_attention", [](const std::string& device, const F32In& p, const F32In& k, const F32In& v,
                              const F32In& q_norm, const F32In& k_norm, float eps, int rotary_dim, double theta,
                              const F32In& k_cache, const F32In& v_cache, int nH, int nKV, int64_t pos0,
                              int64_t rope_delta) {
    const Device d = parse_device(device);
    Dev pi = f32(d, p), ki = f32(d, k), vi = f32(d, v), qn = f32(d, q_norm), kn = f32(d, k_norm);
    Dev kc = cache_in(d, k_cache), vc = cache_in(d, v_cache);
    const std::vector<int64_t> qs{int64_t(p.shape(0)), int64_t(p.shape(1) / 2)};
    Dev q(d, DType::F32, qs), g(d, DType::F32, qs), o(d, DType::F32, qs);
    Dev ws(d, DType::BF16, {ops::attention_workspace_elems(d, qs[0], nH, nH > 0 ? qs[1] / nH : 0)});
    Pos ps(d, pos0, rope_delta);
    ops::gated_attention(pi.t, ki.t, vi.t, qn.t, kn.t, eps, rotary_dim, theta, kc.t, vc.t, q.t, g.t, o.t, nH, nKV,
                         ps.pos, ws.t);
    return nb::make_tuple(out_f32(q), out_f32(g), out_f32(o), cache_out(kc), cache_out(vc));
  }, nb::arg("device"), nb::arg("p"), nb::arg("k"), nb::arg("v"), nb::arg("q_norm"), nb::arg("k_norm"), nb::arg("eps"),
     nb::arg("rotary_dim"), nb::arg("theta"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("num_heads"),
     nb::arg("num_kv_heads"), nb::arg("pos0"), nb::arg("rope_delta") = 0,
     "(q, gate, o, k_cache, v_cache) of the gated-attention core: cache rows pos0 + t, rope at pos0 + rope_delta + t "
     "(q and gate not written where CUDA's prompt path at head_dim 256 runs).");
  m.def("gated_attention_linear_xb", [](const QMatrix& w, const F32In& p, const F32In& k, const F32In& v,
                                        const F32In& q_norm, const F32In& k_norm, float eps, int rotary_dim, double theta,
                                        const F32In& k_cache, const F32In& v_cache, int nH, int nKV, int64_t pos0,
                                        int64_t rope_delta) {
    const Device d = w.weight.device();
    Dev pi = f32(d, p), ki = f32(d, k), vi = f32(d, v), qn = f32(d, q_norm), kn = f32(d, k_norm);
    Dev kc = cache_in(d, k_cache), vc = cache_in(d, v_cache);
    const int64_t T = pi.t.dim(0), W = pi.t.dim(1) / 2;
    Dev q(d, DType::F32, {T, W}), g(d, DType::F32, {T, W}), o(d, DType::F32, {T, W}), y(d, DType::F32, {T, w.rows});
    const int64_t ws_elems = std::max<int64_t>(ops::linear_workspace_elems(d, T, w.cols),
                                               ops::attention_workspace_elems(d, T, nH, nH > 0 ? W / nH : 0));
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ws_elems)});
    Pos ps(d, pos0, rope_delta);
    ops::gated_attention(pi.t, ki.t, vi.t, qn.t, kn.t, eps, rotary_dim, theta, kc.t, vc.t, q.t, g.t, o.t, nH, nKV,
                         ps.pos, ws.t, true);
    ops::linear_xb(w, ws.t, y.t);
    return nb::make_tuple(out_f32(y), cache_out(kc), cache_out(vc));
  }, nb::arg("w"), nb::arg("p"), nb::arg("k"), nb::arg("v"), nb::arg("q_norm"), nb::arg("k_norm"), nb::arg("eps"),
     nb::arg("rotary_dim"), nb::arg("theta"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("num_heads"),
     nb::arg("num_kv_heads"), nb::arg("pos0"), nb::arg("rope_delta") = 0,
     "(linear(w, gated o), k_cache, v_cache) with gated_attention writing o as linear's bf16 X (a prompt's o_proj).");
  m.def("gated_attention_xb_supported", [](const std::string& device, int64_t T, int64_t nH, int64_t nKV, int64_t D) {
    return ops::gated_attention_xb_supported(parse_device(device), T, nH, nKV, D);
  });
  m.def("split_columns", [](const std::string& device, const F32In& y, const std::vector<int64_t>& widths) {
    const Device d = parse_device(device);
    Dev yi = f32(d, y);
    std::vector<Dev> parts;
    std::vector<Tensor> ts;
    parts.reserve(widths.size());
    for (int64_t w : widths) parts.emplace_back(d, DType::F32, std::vector<int64_t>{int64_t(y.shape(0)), w});
    for (Dev& p : parts) ts.push_back(p.t);
    ops::split_columns(yi.t, ts.data(), int(ts.size()));
    nb::list out;
    for (Dev& p : parts) out.append(out_f32(p));
    return out;
  }, nb::arg("device"), nb::arg("y"), nb::arg("widths"), "y's column blocks of the given widths, as arrays.");
  m.def("sigmoid_mul", [](const std::string& device, const F32In& x, const F32In& g) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), gi = f32(d, g);
    ops::sigmoid_mul(xi.t, gi.t);
    return out_f32(xi);
  });
  m.def("add", [](const std::string& device, const F32In& x, const F32In& y) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), yi = f32(d, y);
    ops::add(xi.t, yi.t);
    return out_f32(xi);
  });
  m.def("moe", [](const std::string& device, const QMatrix& router, const QMatrix& gate, const QMatrix& up,
                  const QMatrix& down, const QMatrix& sgate, const QMatrix& sup, const QMatrix& sdown,
                  const QMatrix& shared_expert_gate, const F32In& h, int top_k, int64_t xb_elems, bool small,
                  std::optional<U16In> h_xb, bool h_f32, bool down_bf16) {
    const Device d = parse_device(device);
    const int64_t T = int64_t(h.shape(0)), H = int64_t(h.shape(1));
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, H, top_k, xb_elems, small, down_bf16);
    const ops::MoeInput h_in = moe_input(m, h_xb, h_f32, T * H);
    Dev hi = h_f32 ? f32(d, h) : nan_like(d, h), out(d, DType::F32, {T, H});
    ops::moe(w, hi.t, out.t, m.s, top_k, h_in);
    return out_f32(out);
  }, nb::arg("device"), nb::arg("router"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("shared_gate"),
     nb::arg("shared_up"), nb::arg("shared_down"), nb::arg("shared_expert_gate"), nb::arg("h"), nb::arg("top_k"),
     nb::arg("xb_elems") = 0, nb::arg("small") = true, nb::arg("h_xb") = nb::none(), nb::arg("h_f32") = true,
     nb::arg("down_bf16") = true,
     "moe(h); xb_elems: the BF16 workspace's size (0: ops::moe_xb_elems; a smaller one, at least the least the "
     "backend accepts, leaves out the room the CUDA gate/up products hand their activation rows over in); "
     "small = False keeps medium prompts off the CUDA few-rows expert kernels (MoeScratch::moe_small); h_xb: h's "
     "bf16 X [T, H] (uint16, add_rms_norm_xb's), put into the workspace (MoeInput::F32_AND_XB), with h_f32 = False "
     "alone (MoeInput::XB: h's F32 rows NaN); down_bf16 = False keeps a prompt's CUDA down products' rows F32 "
     "(MoeScratch::down_bf16).");
  m.def("moe_xb_only_supported", [](const std::string& device, const QMatrix& router, const QMatrix& gate,
                                    const QMatrix& up, const QMatrix& down, const QMatrix& sgate, const QMatrix& sup,
                                    const QMatrix& sdown, const QMatrix& shared_expert_gate, int64_t T, int top_k,
                                    bool small) {
    const Device d = parse_device(device);
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, router.cols, top_k, 0, small);
    Dev h(d, DType::F32, {T, router.cols});
    return ops::moe_xb_only_supported(w, h.t, m.s, top_k);
  }, nb::arg("device"), nb::arg("router"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("shared_gate"),
     nb::arg("shared_up"), nb::arg("shared_down"), nb::arg("shared_expert_gate"), nb::arg("T"), nb::arg("top_k"),
     nb::arg("small") = true, "Whether moe takes h as its bf16 X alone for T rows (the moe binding's scratch).");
  m.def("moe_add", [](const std::string& device, const QMatrix& router, const QMatrix& gate, const QMatrix& up,
                      const QMatrix& down, const QMatrix& sgate, const QMatrix& sup, const QMatrix& sdown,
                      const QMatrix& shared_expert_gate, const F32In& h, const F32In& res, int top_k) {
    const Device d = parse_device(device);
    const int64_t T = int64_t(h.shape(0)), H = int64_t(h.shape(1));
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, H, top_k);
    Dev hi = f32(d, h), ri = f32(d, res), tmp(d, DType::F32, {T, H});
    ops::moe_add(w, hi.t, ri.t, tmp.t, m.s, top_k);
    return out_f32(ri);
  }, "res + moe(h).");
  m.def("moe_rms_normed_add", [](const std::string& device, const QMatrix& router, const QMatrix& gate,
                                 const QMatrix& up, const QMatrix& down, const QMatrix& sgate, const QMatrix& sup,
                                 const QMatrix& sdown, const QMatrix& shared_expert_gate, const F32In& res,
                                 const F32In& nw, float eps, int top_k) {
    const Device d = parse_device(device);
    const int64_t T = int64_t(res.shape(0)), H = int64_t(res.shape(1));
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, H, top_k);
    Dev ri = f32(d, res), wi = f32(d, nw), h(d, DType::F32, {T, H}), tmp(d, DType::F32, {T, H});
    const bool fused = ops::moe_rms_normed_supported(w, ri.t, wi.t, h.t, m.s, top_k);
    ops::moe_rms_normed_add(w, ri.t, wi.t, eps, h.t, tmp.t, m.s, top_k);
    return nb::make_tuple(out_f32(ri), fused);
  }, "(res + moe(rms_norm(res) * weight), whether the router and moe_up normalised res themselves: "
     "moe_rms_normed_supported).");
  m.def("linear_add_moe_rms_normed_add", [](const QMatrix& o, const QMatrix& router, const QMatrix& gate,
                                            const QMatrix& up, const QMatrix& down, const QMatrix& sgate,
                                            const QMatrix& sup, const QMatrix& sdown, const QMatrix& shared_expert_gate,
                                            const QMatrix& router_gates, const F32In& x, const F32In& res,
                                            const F32In& nw, float eps, int top_k) {
    const Device d = o.weight.device();
    const int64_t T = int64_t(res.shape(0)), H = int64_t(res.shape(1));
    Dev xi = f32(d, x), ri = f32(d, res), wi = f32(d, nw), h(d, DType::F32, {T, H}), tmp(d, DType::F32, {T, H});
    Dev fold(d, DType::F32, {router_gates.rows, o.cols});
    QMatrix M;  // MoeWeights::router_fold, as the engine builds it
    const bool folded = ops::router_fold_supported(router_gates, wi.t, o);
    if (folded) {
      M.rows = router_gates.rows, M.cols = o.cols, M.dtype = DType::F32, M.weight = Buffer::view(fold.buf, 0, fold.buf.nbytes());
      ops::router_fold(router_gates, wi.t, o, M);
    }
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate, &router_gates,
                 folded ? &M : nullptr};
    MoeDev m(d, w, std::max<int64_t>(T, 4), H, top_k);  // router_logits: >= EarlyRoute::floats (the early r, top-k)
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::linear_workspace_elems(d, T, o.cols))});
    const bool early = ops::linear_add_moe_supported(o, xi.t, w, ri.t, wi.t, h.t, m.s, top_k);
    ops::linear_add_moe_rms_normed_add(o, xi.t, w, ri.t, wi.t, eps, h.t, tmp.t, m.s, top_k, ws.t);
    nb::object m_out = nb::none();
    if (folded) m_out = nb::cast(out_f32(fold));
    return nb::make_tuple(out_f32(ri), early, m_out);
  }, nb::arg("o"), nb::arg("router"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("shared_gate"),
     nb::arg("shared_up"), nb::arg("shared_down"), nb::arg("shared_expert_gate"), nb::arg("router_gates"), nb::arg("x"),
     nb::arg("res"), nb::arg("nw"), nb::arg("eps"), nb::arg("top_k"),
     "(res' + moe(rms_norm(res') * nw) with res' = res + x o^T, whether the early-routing path ran "
     "(linear_add_moe_supported), the router fold M [E + 1, A] or None): router_gates = [router; shared_expert_gate].");
  m.def("moe_add_rms_norm", [](const std::string& device, const QMatrix& router, const QMatrix& gate, const QMatrix& up,
                               const QMatrix& down, const QMatrix& sgate, const QMatrix& sup, const QMatrix& sdown,
                               const QMatrix& shared_expert_gate, const F32In& h, const F32In& res, const F32In& nw,
                               float eps, int top_k) {
    const Device d = parse_device(device);
    const int64_t T = int64_t(h.shape(0)), H = int64_t(h.shape(1));
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, H, top_k);
    Dev hi = f32(d, h), ri = f32(d, res), wi = f32(d, nw), tmp(d, DType::F32, {T, H});
    Dev sync(d, DType::I32, {1});
    const int32_t zero = 0;
    sync.buf.upload(&zero, 4);
    ops::moe_add_rms_norm(w, hi.t, ri.t, wi.t, eps, tmp.t, m.s, top_k, sync.t);
    int32_t left = -1;
    sync.buf.download(&left, 4);
    return nb::make_tuple(out_f32(ri), out_f32(hi), left);
  }, "(res + moe(h), rms_norm of it, the sync counter after).");
  m.def("moe_add_rms_norm_xb", [](const std::string& device, const QMatrix& router, const QMatrix& gate,
                                  const QMatrix& up, const QMatrix& down, const QMatrix& sgate, const QMatrix& sup,
                                  const QMatrix& sdown, const QMatrix& shared_expert_gate, const F32In& h,
                                  const F32In& res, const F32In& nw, float eps, int top_k, bool write_y,
                                  std::optional<U16In> h_xb, bool h_f32, bool down_bf16) {
    const Device d = parse_device(device);
    const int64_t T = int64_t(h.shape(0)), H = int64_t(h.shape(1));
    MoeWeights w{&router, &gate, &up, &down, &sgate, &sup, &sdown, &shared_expert_gate};
    MoeDev m(d, w, T, H, top_k, 0, true, down_bf16);
    const ops::MoeInput h_in = moe_input(m, h_xb, h_f32, T * H);
    Dev hi = h_f32 ? f32(d, h) : nan_like(d, h), ri = f32(d, res), wi = f32(d, nw), tmp = nan_like(d, h);
    ops::moe_add_rms_norm_xb(w, hi.t, h_in, ri.t, wi.t, eps, write_y ? hi.t : Tensor{}, tmp.t, m.s, top_k);
    return nb::make_tuple(out_f32(ri), out_f32(hi), out_u16(m.xb, T, H), out_f32(tmp));
  }, nb::arg("device"), nb::arg("router"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("shared_gate"),
     nb::arg("shared_up"), nb::arg("shared_down"), nb::arg("shared_expert_gate"), nb::arg("h"), nb::arg("res"),
     nb::arg("weight"), nb::arg("eps"), nb::arg("top_k"), nb::arg("write_y") = true, nb::arg("h_xb") = nb::none(),
     nb::arg("h_f32") = true, nb::arg("down_bf16") = true,
     "(res + moe(h), h's buffer after (y = rms_norm(res + moe(h)) written into it as the engine does, or left "
     "as it was where write_y = False), y's bf16 X [T, H] (uint16), tmp after (NaN before: still NaN where the "
     "combine took the norm)); h_xb, h_f32, down_bf16 as moe's.");
  m.def("sample", [](const std::string& device, const F32In& logits, const I32In& counts, const I32In& seen,
                     uint64_t step, float temperature, int top_k, float top_p, float min_p, float presence,
                     float frequency, float repetition, uint64_t seed, int num_logprobs) {
    const Device d = parse_device(device);
    ops::SamplerParams p{temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, num_logprobs};
    Dev l = f32(d, logits), c = i32(d, counts), sn = i32(d, seen), tok(d, DType::I32, {1});
    Dev ids(d, DType::I32, {1 + ops::MAX_LOGPROBS}), vals(d, DType::F32, {1 + ops::MAX_LOGPROBS});
    ops::SamplerState st{c.t, sn.t, tok.t, ids.t, vals.t};
    ops::sample(l.t, p, step, st);
    return nb::make_tuple(out_i32(tok).data()[0], out_i32(c), out_i32(sn), out_i32(ids), out_f32(vals));
  }, nb::arg("device"), nb::arg("logits"), nb::arg("counts"), nb::arg("seen"), nb::arg("step"),
     nb::arg("temperature") = 0.f, nb::arg("top_k") = 0, nb::arg("top_p") = 1.f, nb::arg("min_p") = 0.f,
     nb::arg("presence_penalty") = 0.f, nb::arg("frequency_penalty") = 0.f, nb::arg("repetition_penalty") = 1.f,
     nb::arg("seed") = 0, nb::arg("num_logprobs") = -1);
  m.def("apply_token_mask", [](const std::string& device, const F32In& logits, const I32In& mask) {
    const Device d = parse_device(device);
    Dev l = f32(d, logits), mk = i32(d, mask);
    ops::apply_token_mask(l.t, mk.t);
    return out_f32(l);
  }, nb::arg("device"), nb::arg("logits"), nb::arg("mask"),
     "logits with -inf where bit v of mask (int32 words, llguidance's layout) is 0.");
  // The vision tower's ops and the multimodal RoPE.
  m.def("layer_norm", [](const std::string& device, const F32In& x, const F32In& w, const F32In& b, float eps) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), wi = f32(d, w), bi = f32(d, b), y(d, DType::F32, shape_of(x));
    ops::layer_norm(xi.t, wi.t, bi.t, eps, y.t);
    return out_f32(y);
  });
  m.def("add_bias", [](const std::string& device, const F32In& x, const F32In& b) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), bi = f32(d, b);
    ops::add_bias(xi.t, bi.t);
    return out_f32(xi);
  });
  m.def("gelu", [](const std::string& device, const F32In& x, bool tanh_approx) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x);
    ops::gelu(xi.t, tanh_approx);
    return out_f32(xi);
  }, nb::arg("device"), nb::arg("x"), nb::arg("tanh_approx"));
  m.def("vision_position_embedding", [](const std::string& device, const F32In& table, const I32In& pos, int grid_h,
                                        int grid_w, const F32In& y) {
    const Device d = parse_device(device);
    Dev ti = f32(d, table), pi = i32(d, pos), yi = f32(d, y);
    ops::vision_position_embedding(ti.t, pi.t, grid_h, grid_w, yi.t);
    return out_f32(yi);
  }, nb::arg("device"), nb::arg("table"), nb::arg("pos"), nb::arg("grid_h"), nb::arg("grid_w"), nb::arg("y"));
  m.def("vision_rope", [](const std::string& device, const F32In& qkv, const I32In& pos, int num_heads, double theta) {
    const Device d = parse_device(device);
    Dev xi = f32(d, qkv), pi = i32(d, pos);
    ops::vision_rope(xi.t, pi.t, num_heads, theta);
    return out_f32(xi);
  }, nb::arg("device"), nb::arg("qkv"), nb::arg("pos"), nb::arg("num_heads"), nb::arg("theta"));
  m.def("mrope", [](const std::string& device, const F32In& x, int num_heads, int rotary_dim, double theta,
                    std::array<int, 3> sections, const I32In& pos) {
    const Device d = parse_device(device);
    Dev xi = f32(d, x), pi = i32(d, pos);
    ops::mrope(xi.t, num_heads, rotary_dim, theta, sections, pi.t);
    return out_f32(xi);
  }, nb::arg("device"), nb::arg("x"), nb::arg("num_heads"), nb::arg("rotary_dim"), nb::arg("theta"),
     nb::arg("sections"), nb::arg("pos"));
  m.def("vision_attention", [](const std::string& device, const F32In& qkv, const I32In& starts, int num_heads) {
    const Device d = parse_device(device);
    const int64_t N = int64_t(qkv.shape(0)), W = int64_t(qkv.shape(1)) / 3;
    Dev xi = f32(d, qkv), si = i32(d, starts), o(d, DType::F32, {N, W});
    const int64_t D = num_heads > 0 ? W / num_heads : 0;
    Dev ws(d, DType::BF16, {std::max<int64_t>(1, ops::vision_attention_workspace_elems(d, N, num_heads, D))});
    ops::vision_attention(xi.t, o.t, si.t, num_heads, ws.t);
    return out_f32(o);
  }, nb::arg("device"), nb::arg("qkv"), nb::arg("starts"), nb::arg("num_heads"));
}
