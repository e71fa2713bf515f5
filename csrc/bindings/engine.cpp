// Bindings of ModelConfig, WeightStore, Engine, Session and Snapshot.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../engine/engine.h"
#include "../engine/session.h"
#include "../engine/tensors.h"
#include "../runtime/backend.h"
#include "arrays.h"

namespace nb = nanobind;
using namespace lily;

using namespace lily::bind;

namespace {

// The store is filled from Python, then handed to an Engine exactly once.
struct StoreHandle {
  std::unique_ptr<WeightStore> store;
  WeightStore& get() {
    LILY_CHECK(store, "this WeightStore was already given to an Engine");
    return *store;
  }
};

// A token mask from Python: int32 words, bit v of word v/32 set = id v allowed (llguidance's layout).
using MaskIn = nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

const int32_t* mask_words(const Session& s, const std::optional<MaskIn>& mask) {
  if (!mask) return nullptr;
  const int64_t V = s.engine().config().vocab_size, words = (V + 31) / 32;
  LILY_CHECK(int64_t(mask->shape(0)) == words, "token mask: expected ", words, " int32 words for a vocabulary of ",
             V, ", got ", mask->shape(0));
  return mask->data();
}

}  // namespace

namespace lily::bind {

QMatrix make_qmatrix(Device d, const std::string& name, const HostArray& weight, const std::string& dtype,
                     int64_t num_stack, int64_t rows, int64_t cols, int bits, int group_size,
                     const std::optional<HostArray>& scales, const std::optional<HostArray>& biases,
                     const std::string& scale_dtype) {
  QMatrix q;
  q.num_stack = num_stack, q.rows = rows, q.cols = cols, q.bits = bits, q.group_size = group_size;
  q.dtype = parse_dtype(dtype);
  const int64_t n = num_stack * rows;
  if (bits == 0) {
    LILY_CHECK(q.dtype != DType::U32 && q.dtype != DType::I32, "tensor '", name, "': dense weights must be float");
    LILY_CHECK(weight.nbytes() == size_t(n * cols) * dtype_size(q.dtype), "tensor '", name,
               "': byte size does not match ", q.describe());
  } else {
    LILY_CHECK(q.dtype == DType::U32, "tensor '", name, "': quantized weights must be U32");
    LILY_CHECK(group_size > 0 && cols % group_size == 0 && (cols * bits) % 32 == 0, "tensor '", name, "': ", cols,
               " input columns do not split into groups of ", group_size, " at ", bits, " bits");
    LILY_CHECK(scales && biases, "tensor '", name, "': quantized weights need scales and biases");
    q.scale_dtype = parse_dtype(scale_dtype);
    LILY_CHECK(weight.nbytes() == size_t(n * q.words_per_row()) * 4, "tensor '", name,
               "': packed byte size does not match ", q.describe());
    const size_t sb = size_t(n * q.groups_per_row()) * dtype_size(q.scale_dtype);
    LILY_CHECK(scales->nbytes() == sb && biases->nbytes() == sb, "tensor '", name,
               "': scales/biases byte size does not match ", q.describe());
    q.scales = to_device(d, *scales);
    q.biases = to_device(d, *biases);
  }
  q.weight = to_device(d, weight);
  return q;
}

}  // namespace lily::bind

// PromptImages from Python: (embeds [n, H] f32, rows [n] i32, positions [T, 3] i32, rope_delta), checked
// against the prompt of T tokens; the arrays must outlive the call.
using F32Rows = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu, nb::c_contig>;
using I32Vec = nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using I32Rows = nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;
using ImagesIn = std::tuple<F32Rows, I32Vec, I32Rows, int64_t>;

static PromptImages prompt_images(const Session& s, const ImagesIn& in, int64_t T) {
  const auto& [embeds, rows, positions, delta] = in;
  const int64_t H = s.engine().config().hidden_size;
  LILY_CHECK(int64_t(embeds.shape(1)) == H && embeds.shape(0) == rows.shape(0), "images: embeds must be [",
             rows.shape(0), ", ", H, "], got [", embeds.shape(0), ", ", embeds.shape(1), "]");
  LILY_CHECK(int64_t(positions.shape(0)) == T && positions.shape(1) == 3, "images: positions must be [", T, ", 3]");
  return {embeds.data(), rows.data(), int64_t(rows.shape(0)), positions.data(), delta};
}

void init_engine(nb::module_& m) {
  nb::class_<VisionConfig>(m, "VisionConfig", "Vision-tower hyper-parameters, Hugging Face names (depth 0: none).")
      .def(nb::init<>())
      .def_rw("depth", &VisionConfig::depth)
      .def_rw("hidden_size", &VisionConfig::hidden_size)
      .def_rw("intermediate_size", &VisionConfig::intermediate_size)
      .def_rw("num_heads", &VisionConfig::num_heads)
      .def_rw("in_channels", &VisionConfig::in_channels)
      .def_rw("patch_size", &VisionConfig::patch_size)
      .def_rw("temporal_patch_size", &VisionConfig::temporal_patch_size)
      .def_rw("spatial_merge_size", &VisionConfig::spatial_merge_size)
      .def_rw("out_hidden_size", &VisionConfig::out_hidden_size)
      .def_rw("num_position_embeddings", &VisionConfig::num_position_embeddings)
      .def_rw("rope_theta", &VisionConfig::rope_theta);

  nb::class_<ModelConfig>(m, "ModelConfig", "Text-model hyper-parameters, Hugging Face names.")
      .def(nb::init<>())
      .def_rw("hidden_size", &ModelConfig::hidden_size)
      .def_rw("num_hidden_layers", &ModelConfig::num_hidden_layers)
      .def_rw("vocab_size", &ModelConfig::vocab_size)
      .def_rw("is_full_attention", &ModelConfig::is_full_attention)
      .def_rw("num_attention_heads", &ModelConfig::num_attention_heads)
      .def_rw("num_key_value_heads", &ModelConfig::num_key_value_heads)
      .def_rw("head_dim", &ModelConfig::head_dim)
      .def_rw("rotary_dim", &ModelConfig::rotary_dim)
      .def_rw("rope_theta", &ModelConfig::rope_theta)
      .def_rw("linear_num_key_heads", &ModelConfig::linear_num_key_heads)
      .def_rw("linear_num_value_heads", &ModelConfig::linear_num_value_heads)
      .def_rw("linear_key_head_dim", &ModelConfig::linear_key_head_dim)
      .def_rw("linear_value_head_dim", &ModelConfig::linear_value_head_dim)
      .def_rw("linear_conv_kernel_dim", &ModelConfig::linear_conv_kernel_dim)
      .def_rw("num_experts", &ModelConfig::num_experts)
      .def_rw("num_experts_per_tok", &ModelConfig::num_experts_per_tok)
      .def_rw("moe_intermediate_size", &ModelConfig::moe_intermediate_size)
      .def_rw("shared_expert_intermediate_size", &ModelConfig::shared_expert_intermediate_size)
      .def_rw("rms_norm_eps", &ModelConfig::rms_norm_eps)
      .def_rw("mrope_section", &ModelConfig::mrope_section)
      .def_rw("vision", &ModelConfig::vision)
      .def("validate", &ModelConfig::validate);

  m.def("model_tensors", [](const ModelConfig& c) {
    ModelWeights views;  // what the entries point at: unused, only the table is wanted
    nb::list out;
    for (const TensorSpec& t : model_tensors(c, views))
      out.append(nb::make_tuple(t.name, nb::tuple(nb::cast(t.shape)), t.matrix != nullptr));
    return out;
  }, nb::arg("config"), "Every tensor of the model: [(canonical name, shape, is_matrix)] in checkpoint order "
     "(engine/tensors.cpp, the one description of the tensors).");

  nb::class_<StoreHandle>(m, "WeightStore", "Weights being handed to the device, by canonical name.")
      .def("__init__", [](StoreHandle* h, const std::string& device) {
        Device d = parse_device(device);
        LILY_CHECK(backend_available(d), "device '", device, "' is not available in this build or on this machine");
        new (h) StoreHandle{std::make_unique<WeightStore>(d)};
      })
      .def("set_matrix", [](StoreHandle& h, const std::string& name, const HostArray& weight, const std::string& dtype,
                            int64_t num_stack, int64_t rows, int64_t cols, int bits, int group_size,
                            std::optional<HostArray> scales, std::optional<HostArray> biases,
                            const std::string& scale_dtype) {
        WeightStore& st = h.get();
        QMatrix q = make_qmatrix(st.device(), name, weight, dtype, num_stack, rows, cols, bits, group_size, scales,
                                 biases, scale_dtype);
        st.set_matrix(name, std::move(q));
      }, nb::arg("name"), nb::arg("weight"), nb::arg("dtype"), nb::arg("num_stack"), nb::arg("rows"), nb::arg("cols"),
         nb::arg("bits") = 0, nb::arg("group_size") = 0, nb::arg("scales") = nb::none(), nb::arg("biases") = nb::none(),
         nb::arg("scale_dtype") = "F32")
      .def("set_vector", [](StoreHandle& h, const std::string& name, nb::ndarray<const float, nb::device::cpu, nb::c_contig> a) {
        WeightStore& st = h.get();
        Vector v;
        for (size_t i = 0; i < a.ndim(); ++i) v.shape.push_back(int64_t(a.shape(i)));
        v.data = Buffer(st.device(), a.nbytes());
        v.data.upload(a.data(), a.nbytes());
        st.set_vector(name, std::move(v));
      });

  nb::class_<Engine>(m, "Engine", "A model's weights on one device and its layer loop.")
      .def_static("create", [](const ModelConfig& cfg, StoreHandle& h) {
        std::unique_ptr<WeightStore> store = std::move(h.store);
        LILY_CHECK(store, "this WeightStore was already given to an Engine");
        return std::make_shared<Engine>(cfg, std::move(store));
      })
      .def_prop_ro("device", [](const Engine& e) { return std::string(device_name(e.device())); })
      .def_prop_ro("weight_bytes", [](const Engine& e) { return e.weights().nbytes(); })
      .def("weight_signature", [](const Engine& e) {
        nb::gil_scoped_release release;
        return e.weights().signature();
      }, "Every tensor's name, storage form, shape and a few sampled bytes, one per line (model identity).")
      .def("encode_images", [](const Engine& e, nb::ndarray<const float, nb::ndim<2>, nb::device::cpu, nb::c_contig> pixels,
                               nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig> grids,
                               bool profile) -> nb::object {
        LILY_CHECK(grids.shape(1) == 3, "encode_images: grids must be [n, 3] (t, h, w)");
        const VisionConfig& v = e.config().vision;
        LILY_CHECK(!v.present() || int64_t(pixels.shape(1)) == v.patch_dim(), "encode_images: pixels have ",
                   pixels.shape(1), " columns but a patch has ", v.patch_dim(), " values");
        std::vector<std::array<int, 3>> g(grids.shape(0));
        for (size_t i = 0; i < g.size(); ++i)
          for (int j = 0; j < 3; ++j) g[i][j] = grids.data()[3 * i + j];
        const int64_t N = int64_t(pixels.shape(0)), mm = std::max(1, v.spatial_merge_size * v.spatial_merge_size);
        FloatArray out = new_floats({size_t(N / mm), size_t(e.config().hidden_size)});
        std::map<std::string, Profiler::Entry> totals;
        {
          nb::gil_scoped_release release;
          std::unique_ptr<Profiler> profiler = profile ? std::make_unique<Profiler>(e.device()) : nullptr;
          e.encode_images(pixels.data(), N, g, out.data());
          if (profiler) {
            profiler->collect();
            totals.swap(profiler->totals);
          }
        }
        if (!profile) return nb::cast(out);
        nb::dict d;
        for (const auto& [name, entry] : totals) d[name.c_str()] = nb::make_tuple(entry.ms, entry.calls);
        return nb::make_tuple(out, d);
      }, nb::arg("pixels"), nb::arg("grids"), nb::arg("profile") = false,
         "The vision tower on preprocessed patches [N, patch_dim] of images with grids [n, 3] (t, h, w): "
         "the merged tokens [N / m^2, hidden_size] that replace the images' <|image_pad|> embeddings; with "
         "profile, (tokens, {op: (ms, calls)}) timing each op ('vision.linear', ...) on the device.")
      .def_prop_ro("stacked_projections",
                   [](const Engine& e) {
                     int n = 0;
                     for (const LayerWeights& L : e.weights().layers)
                       n += (L.gdn.in_proj != nullptr) + (L.attn.qkv_proj != nullptr) + (L.moe.router_gates != nullptr);
                     return n;
                   },
                   "Groups of same-input projections (GDN in_proj, attention q|k|v, router + shared-expert "
                   "gate) that run as one stacked GEMV in a decode step.");

  auto parts_list = [](const std::vector<Snapshot::Part>& parts) {
    nb::list out;
    for (const Snapshot::Part& p : parts) {
      nb::list shape;
      for (int64_t d : p.shape) shape.append(d);
      out.append(nb::make_tuple(p.name, dtype_name(p.dtype), nb::tuple(shape), p.nbytes));
    }
    return out;
  };
  using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
  using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
  nb::class_<Snapshot>(m, "Snapshot", "A copy of a session's state at one position.")
      .def_ro("position", &Snapshot::position)
      .def_rw("rope_delta", &Snapshot::rope_delta, "The session's rope_delta at the snapshot.")
      .def_prop_ro("nbytes", &Snapshot::nbytes)
      .def_prop_ro("device", [](const Snapshot& s) { return std::string(device_name(s.engine->device())); })
      .def("parts", [parts_list](const Snapshot& s) { return parts_list(s.parts()); },
           "The state's blobs in file order: [(name, dtype, shape, nbytes)].")
      .def_static("layout", [parts_list](const Engine& e, int64_t position) {
        return parts_list(Snapshot::layout(e, position));
      }, nb::arg("engine"), nb::arg("position"), "parts() of a snapshot of `position` tokens of this engine.")
      .def_static("blank", [](std::shared_ptr<const Engine> e, int64_t position) {
        return Snapshot::blank(*e, position);
      }, nb::arg("engine"), nb::arg("position"), "A snapshot with uninitialised state, to be filled by write().")
      .def("read", [](const Snapshot& s, size_t i, size_t offset, Bytes out) {
        const Buffer& b = s.part(i);
        LILY_CHECK(offset <= b.nbytes() && out.size() <= b.nbytes() - offset, "snapshot read past part ", i);
        nb::gil_scoped_release release;
        b.download(out.data(), out.size(), offset);
      }, nb::arg("part"), nb::arg("offset"), nb::arg("out"), "Copies bytes [offset, offset + out.size) of a part to out.")
      .def("write", [](Snapshot& s, size_t i, size_t offset, ConstBytes data) {
        Buffer& b = s.part(i);
        LILY_CHECK(offset <= b.nbytes() && data.size() <= b.nbytes() - offset, "snapshot write past part ", i);
        nb::gil_scoped_release release;
        b.upload(data.data(), data.size(), offset);
      }, nb::arg("part"), nb::arg("offset"), nb::arg("data"), "Copies data into a part at offset.");

  nb::class_<Session>(m, "Session", "One conversation's caches and recurrent state.")
      .def("__init__", [](Session* s, std::shared_ptr<const Engine> e, int64_t max_context, int64_t chunk,
                          bool use_graph) {
        new (s) Session(std::move(e), max_context, chunk);
        s->use_graph = use_graph;
      }, nb::arg("engine"), nb::arg("max_context"), nb::arg("chunk"), nb::arg("use_graph") = true)
      .def("set_sampler", [](Session& s, float temperature, int top_k, float top_p, float min_p, float presence,
                             float frequency, float repetition, uint64_t seed, int num_logprobs,
                             std::optional<nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>> prompt) {
        ops::SamplerParams p{temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, num_logprobs};
        nb::gil_scoped_release release;
        s.set_sampler(p, prompt ? prompt->data() : nullptr, prompt ? int64_t(prompt->shape(0)) : 0);
      }, nb::arg("temperature") = 0.f, nb::arg("top_k") = 0, nb::arg("top_p") = 1.f, nb::arg("min_p") = 0.f,
         nb::arg("presence_penalty") = 0.f, nb::arg("frequency_penalty") = 0.f, nb::arg("repetition_penalty") = 1.f,
         nb::arg("seed") = 0, nb::arg("num_logprobs") = -1, nb::arg("prompt_ids") = nb::none(),
         "Starts a request: sampling parameters (see docs/sampling.md), counts cleared, prompt ids marked seen.")
      .def("prefill_sample", [](Session& s, nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig> ids,
                                std::optional<MaskIn> mask, std::optional<ImagesIn> images) {
        const int32_t* m = mask_words(s, mask);
        const int64_t T = int64_t(ids.shape(0));
        const std::optional<PromptImages> im = images ? std::optional(prompt_images(s, *images, T)) : std::nullopt;
        nb::gil_scoped_release release;
        return s.prefill_sample(ids.data(), T, m, im ? &*im : nullptr);
      }, nb::arg("ids"), nb::arg("mask") = nb::none(), nb::arg("images") = nb::none(),
         "Prefills ids, then samples the next token on the device and returns it. mask: None, or int32 "
         "[ceil(V/32)] words, bit v set = id v allowed (the others get a -inf logit before the draw).")
      .def("decode_sample", [](Session& s, int64_t id, std::optional<MaskIn> mask) {
        LILY_CHECK(id >= -1 && id <= INT32_MAX, "token id ", id, " is outside the vocabulary");
        const int32_t* m = mask_words(s, mask);
        nb::gil_scoped_release release;
        return s.decode_sample(int32_t(id), m);
      }, nb::arg("token") = -1, nb::arg("mask") = nb::none(),
         "Feeds token (-1: the last sampled one, already on the device) and samples the next (mask: as prefill_sample).")
      .def("decode_launch", [](Session& s, int64_t id) {
        LILY_CHECK(id >= -1 && id <= INT32_MAX, "token id ", id, " is outside the vocabulary");
        nb::gil_scoped_release release;
        s.decode_launch(int32_t(id));
      }, nb::arg("token") = -1,
         "decode_sample's first half: feeds token and queues the step (on GPUs it returns before the step ends).")
      .def("sample_next", [](Session& s, std::optional<MaskIn> mask) {
        const int32_t* m = mask_words(s, mask);
        nb::gil_scoped_release release;
        return s.sample_next(m);
      }, nb::arg("mask") = nb::none(), "decode_sample's second half: masks (optional) and samples the launched step.")
      .def("sample_launch", [](Session& s, std::optional<MaskIn> mask) {
        const int32_t* m = mask_words(s, mask);
        nb::gil_scoped_release release;
        s.sample_launch(m);
      }, nb::arg("mask") = nb::none(),
         "sample_next without the wait: queues the mask, the sample and the copy of its id to the host, and returns "
         "at once on GPUs; decode_launch(-1) may follow before the id is known, sampled() reads it.")
      .def("sampled", [](Session& s) {
        nb::gil_scoped_release release;
        return s.sampled();
      }, "Waits for the last sample_launch and returns its id (raises on NaN logits, taking back a step launched "
         "on it).")
      .def("decode_discard", [](Session& s) {
        nb::gil_scoped_release release;
        s.decode_discard();
      }, "Takes back the launched, unsampled step: the session is as before its decode_launch (docs/generation.md, "
         "'Pipelined decoding').")
      .def_prop_ro("launched", &Session::launched,
                   "A step was launched and its logits not yet sampled (decode_discard takes it back).")
      .def_prop_ro("state_copy", &Session::state_copy,
                   "Which copy of the GDN state pair is current (0 or 1): each decode step flips it.")
      .def("last_logprobs", [](const Session& s) {
        IntArray ids = new_array<int32_t>({size_t(1 + ops::MAX_LOGPROBS)});
        FloatArray vals = new_floats({size_t(1 + ops::MAX_LOGPROBS)});
        s.last_logprobs(ids.data(), vals.data());
        return nb::make_tuple(ids, vals);
      }, "(ids, logprobs) of the last sample: entry 0 is the chosen token, then the top n (id -1 = unused).")
      .def("profile", [](Session& s, nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig> ids,
                         int decode_steps) {
        LILY_CHECK(decode_steps >= 0, "profile: decode_steps must be >= 0, got ", decode_steps);
        using Totals = std::map<std::string, Profiler::Entry>;
        Totals prefill, decode;
        s.profiler = std::make_unique<Profiler>(s.engine().device());
        try {
          nb::gil_scoped_release release;
          s.prefill_sample(ids.data(), int64_t(ids.shape(0)));
          s.profiler->collect();
          prefill.swap(s.profiler->totals);
          for (int i = 0; i < decode_steps; ++i) s.decode_sample(-1);
          s.profiler->collect();
          decode.swap(s.profiler->totals);
        } catch (...) {
          s.profiler.reset();
          throw;
        }
        s.profiler.reset();
        auto to_dict = [](const Totals& t) {
          nb::dict d;
          for (const auto& [name, e] : t) d[name.c_str()] = nb::make_tuple(e.ms, e.calls);
          return d;
        };
        nb::dict out;
        out["prefill"] = to_dict(prefill);
        out["decode"] = to_dict(decode);
        return out;
      }, nb::arg("ids"), nb::arg("decode_steps") = 0,
         "Prefills ids then runs decode_steps sampled steps eagerly, timing each op as '<layer label>.<op>': "
         "{'prefill'|'decode': {name: (total ms, calls)}} (device events on GPUs).")
      .def_rw("use_graph", &Session::use_graph)
      .def_prop_ro("decode_graph_nodes", &Session::decode_graph_nodes)
      .def("prefill", [](Session& s, nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig> ids,
                         bool all_logits, std::optional<ImagesIn> images) {
        const int64_t T = int64_t(ids.shape(0)), V = s.engine().config().vocab_size;
        FloatArray out = all_logits ? new_floats({size_t(T), size_t(V)}) : new_floats({size_t(V)});
        const std::optional<PromptImages> im = images ? std::optional(prompt_images(s, *images, T)) : std::nullopt;
        {
          nb::gil_scoped_release release;
          s.prefill(ids.data(), T, out.data(), all_logits, im ? &*im : nullptr);
        }
        return out;
      }, nb::arg("ids"), nb::arg("all_logits") = false, nb::arg("images") = nb::none(),
         "Runs ids; images: None, or (embeds [n, H] f32, rows [n] i32, positions [T, 3] i32, rope_delta), the "
         "image tokens' embeddings, where they go, every token's (t, h, w) rope position and the offset after.")
      .def("decode_step", [](Session& s, int64_t id) {
        LILY_CHECK(id >= INT32_MIN && id <= INT32_MAX, "token id ", id, " is outside the vocabulary");
        FloatArray out = new_floats({size_t(s.engine().config().vocab_size)});
        {
          nb::gil_scoped_release release;
          s.decode_step(int32_t(id), out.data());
        }
        return out;
      })
      .def("trace", [](Session& s, nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig> ids) {
        const int64_t T = int64_t(ids.shape(0)), V = s.engine().config().vocab_size;
        FloatArray logits = new_floats({size_t(T), size_t(V)});
        s.trace.clear();
        s.tracing = true;
        try {
          nb::gil_scoped_release release;
          s.prefill(ids.data(), T, logits.data(), true);
        } catch (...) {
          s.tracing = false;
          throw;
        }
        s.tracing = false;
        nb::dict out;
        for (auto& [name, t] : s.trace) {
          FloatArray a = new_floats({t.data.size() / size_t(t.width), size_t(t.width)});
          std::copy(t.data.begin(), t.data.end(), a.data());
          out[name.c_str()] = a;
        }
        s.trace.clear();
        out["logits"] = logits;
        return out;
      }, "Prefill that also returns named per-layer activations [T, H] (debug bisection).")
      .def_prop_ro("position", &Session::position)
      .def_prop_ro("rope_delta", &Session::rope_delta)
      .def_prop_ro("max_context", &Session::max_context)
      .def_prop_ro("chunk", &Session::chunk)
      // Without the GIL: a snapshot or restore copies the whole state (~1 ms on the H200), and the
      // server's event loop must not wait for it to write a response (docs/server.md).
      .def("snapshot", [](const Session& s) {
        nb::gil_scoped_release release;
        return s.snapshot();
      })
      .def("restore", [](Session& s, const Snapshot& snap) {
        nb::gil_scoped_release release;
        s.restore(snap);
      })
      .def("reset", [](Session& s) {
        nb::gil_scoped_release release;
        s.reset();
      })
      .def("state", [](const Session& s) {
        nb::dict out;
        for (const auto& v : s.state_views()) {
          std::vector<size_t> shape(v.shape.begin(), v.shape.end());
          FloatArray a = new_floats(shape);
          if (v.dtype == DType::F32) {
            v.buffer->download(a.data(), a.size() * 4);
          } else {  // BF16 KV cache of a GPU session
            std::vector<uint16_t> h(a.size());
            v.buffer->download(h.data(), h.size() * 2);
            for (size_t i = 0; i < h.size(); ++i) a.data()[i] = bf16_to_f32(h[i]);
          }
          out[v.name.c_str()] = a;
        }
        return out;
      }, "Copies of every state tensor (conv, recurrent, KV rows in use) as float32 arrays.");
}
