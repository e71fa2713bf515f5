// Per-conversation state and the work space of one forward chunk, all allocated at creation.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../ops/ops.h"
#include "../runtime/backend.h"
#include "../runtime/profile.h"
#include "../runtime/tensor.h"
#include "forward.h"

namespace lily {

class Engine;

// A copy of a session's state at one position; restoring it resumes exactly.
struct Snapshot {
  Snapshot() = default;
  Snapshot(const Snapshot&) = delete;  // owns device buffers
  Snapshot& operator=(const Snapshot&) = delete;
  const Engine* engine = nullptr;
  int64_t position = 0;
  int64_t rope_delta = 0;  // Session::rope_delta() at the snapshot
  Buffer storage;                  // one allocation: every part below is a view into it
  std::vector<LayerState> layers;  // attention buffers hold only rows [0, position)
  size_t nbytes() const;

  // The state as named blobs, in a fixed order (per layer: GDN conv_state then recurrent_state, or
  // attention k_cache then v_cache with `position` rows): what a snapshot file stores.
  struct Part {
    std::string name;
    std::vector<int64_t> shape;
    DType dtype;
    size_t nbytes;
  };
  static std::vector<Part> layout(const Engine& engine, int64_t position);
  std::vector<Part> parts() const { return layout(*engine, position); }
  // The buffer of part i (layout order).
  const Buffer& part(size_t i) const;
  Buffer& part(size_t i) { return const_cast<Buffer&>(static_cast<const Snapshot*>(this)->part(i)); }
  // Uninitialised buffers shaped for `position` tokens of `engine`'s model on its device, views of one
  // allocation (a device allocation per part cost ~35 us each, 80 of them per snapshot), to be filled
  // part by part (Session::snapshot, loading a snapshot file).
  static std::shared_ptr<Snapshot> blank(const Engine& engine, int64_t position);
};

// Per-request sampling state on the session's device (ops::SamplerState's buffers).
struct SamplerBuffers {
  Buffer counts, seen;              // [V] I32
  // What the host reads of a sample, contiguous so one copy brings it: [RESULT_WORDS] 32-bit words,
  // the views below.
  Buffer result;
  Buffer token;                        // [1] I32 the last sampled id: the next decode step's input
  Buffer logprob_ids, logprob_values;  // [1 + MAX_LOGPROBS] I32, F32
  Buffer mask;                      // [ceil(V/32)] I32 the token mask of constrained decoding
  ops::SamplerParams params;
  uint64_t step = 0;
  // The token buffer holds a sampled id that no launched step has fed yet (or will, once a queued
  // sample_launch has run).
  bool has_token = false;
  static constexpr int RESULT_WORDS = 1 + 2 * (1 + ops::MAX_LOGPROBS);
};

class Session {
 public:
  Session(std::shared_ptr<const Engine> engine, int64_t max_context, int64_t chunk);

  // Runs T tokens; writes the logits of the last token [V], or of every token [T, V] if all_logits.
  // images: the prompt's images, or null.
  void prefill(const int32_t* ids, int64_t T, float* logits, bool all_logits, const PromptImages* images = nullptr);
  // One token; on GPUs a replay of the captured decode graph when use_graph is set.
  void decode_step(int32_t id, float* logits);

  // Sampling on the device (ops::sample): set_sampler starts a request (counts cleared, prompt ids
  // marked seen); prefill_sample / decode_sample return the sampled id, which stays on the device as
  // the next step's input (decode_sample(-1) feeds it without a host round trip).
  void set_sampler(const ops::SamplerParams& params, const int32_t* prompt_ids, int64_t n);
  // mask: null, or [ceil(V/32)] I32 host words (bit v of word v/32 set = id v allowed): ids it
  // forbids get a -inf logit on the device before the draw (ops::apply_token_mask).
  int32_t prefill_sample(const int32_t* ids, int64_t T, const int32_t* mask = nullptr,
                         const PromptImages* images = nullptr);
  int32_t decode_sample(int32_t id, const int32_t* mask = nullptr);
  // decode_sample in two halves, so the host can compute the next mask while the device runs the
  // step: decode_launch feeds id (-1: the last sampled one) and queues the forward (on GPUs it
  // returns before the step finishes); sample_next then masks and samples its logits.
  void decode_launch(int32_t id);
  int32_t sample_next(const int32_t* mask);
  // Pipelined decoding (docs/generation.md, "Pipelined decoding"): the device runs step k+1's forward
  // while the host handles token k, and a forward that turns out not to be needed is taken back.
  //   sample_launch(mask)  queues sample_next's work and the copy of the id (and logprobs) to the host,
  //                        and returns at once on GPUs; decode_launch(-1) may follow before the id is known
  //   sampled()            waits for that copy and returns the id (raises on NaN logits, taking back a
  //                        forward launched on the invalid id)
  //   decode_discard()     takes back the launched, unsampled forward: position, GDN state (the other
  //                        copy of the ping-pong pair), the device position and has_token are as before
  //                        decode_launch (after an explicit id the token buffer holds that id, so no
  //                        sampled token is pending); KV rows past the position are simply rewritten later
  // sample_next(mask) is sample_launch(mask) then sampled().
  void sample_launch(const int32_t* mask);
  int32_t sampled();
  void decode_discard();
  // A forward was launched and its logits not yet sampled (decode_discard applies).
  bool launched() const { return launched_; }
  // Which copy of the GDN state pair is current (0 or 1): every decode step flips it, a discard flips it back.
  int state_copy() const { return copy_; }
  // The last sample's logprobs: ids, values [1 + MAX_LOGPROBS] (entry 0 = the chosen token).
  void last_logprobs(int32_t* ids, float* values) const;
  bool use_graph = true;
  // Kernels and copies in a captured decode graph (0 before the first GPU graph replay).
  size_t decode_graph_nodes() const {
    return decode_graph_[0].empty() ? decode_graph_[1].num_nodes() : decode_graph_[0].num_nodes();
  }

  int64_t position() const { return position_; }
  // Rope position minus cache index of the tokens after the last prompt with images (0 without images):
  // text after an image continues from the image's largest position + 1 (docs/model.md section 8.5).
  int64_t rope_delta() const { return rope_delta_; }
  int64_t max_context() const { return max_context_; }
  int64_t chunk() const { return chunk_; }
  const Engine& engine() const { return *engine_; }
  std::shared_ptr<Snapshot> snapshot() const;
  void restore(const Snapshot& s);
  void reset();
  // Named state tensors for inspection: (name, shape, buffer, bytes in use).
  struct StateView { std::string name; std::vector<int64_t> shape; const Buffer* buffer; DType dtype; };
  std::vector<StateView> state_views() const;

  // Debug trace: when on, each forward records named per-layer activations ([rows, width] f32,
  // rows appended chunk after chunk) so a mismatch can be bisected to one op.
  bool tracing = false;
  std::map<std::string, Trace> trace;
  // Profiling: when set, forward passes run eagerly and record named spans (runtime/profile.h).
  std::unique_ptr<Profiler> profiler;

 private:
  std::shared_ptr<const Engine> engine_;
  int64_t max_context_, chunk_, position_ = 0, rope_delta_ = 0;
  // What the engine's next forward call reads and writes of this session; decode: the GDN layers
  // write the spare copy of their state (else they update the current one in place).
  ForwardContext forward_context(bool decode = false);
  void set_position(int64_t p);
  // Queues the mask (optional), the sample and the copy of its result to host_, then the fence.
  void queue_sample(const int32_t* mask);
  bool launched_ = false;        // decode_launch ran and no sample_launch has sampled its logits
  bool fed_sampled_ = false;     // that launch fed the sampled token (-1)
  bool fed_pending_ = false;     // ... while the sample that writes it was still pending
  bool pending_ = false;         // sample_launch ran and sampled() has not read its id
  // Ends a pending sample (its id unread) before work that replaces it: prefill, reset, restore.
  void settle();
  // Feeds the id in sampler_.token (device) and leaves the logits of it in s_.logits row 0; the GDN
  // layers write the other copy of their state, which becomes the current one.
  void decode_from_device();
  // Swaps the current and the other copy of every GDN layer's state.
  void flip_state();
  std::vector<LayerState> layers_;
  // The other copy of each GDN layer's conv and recurrent state (empty for attention layers): a decode
  // step reads layers_ and writes spare_, then the two swap (flip_state), so decode_discard is a swap back.
  std::vector<LayerState> spare_;
  int copy_ = 0;  // which physical copy layers_ holds: decode graph copy_ reads it and writes the other
  Scratch s_;
  SamplerBuffers sampler_;
  // Page-locked: the last sample's result words as copied back (SamplerBuffers::RESULT_WORDS), then the
  // mask words staged for upload.
  HostBuffer host_;
  DeviceFence sampled_fence_;  // recorded after a sample's result copy
  DeviceGraph decode_graph_[2];  // per state copy (each reads one copy and writes the other)
  int64_t graph_rope_delta_ = 0;  // rope_delta_ when decode_graph_ was captured
  int64_t eager_steps_ = 0;
};

}  // namespace lily
