// Per-conversation state and the work space of one forward chunk, all allocated at creation.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../ops/ops.h"
#include "tensor.h"

namespace lily {

class Engine;

struct LayerState {
  Buffer conv;       // GDN: [K-1, conv_dim] f32, raw pre-conv inputs, oldest first
  Buffer recurrent;  // GDN: [Hv, Dk, Dv] f32 delta-rule state S (k-major, as transformers)
  Buffer k, v;       // attention: [max_context, nKV*D] f32, K after q/k norm and RoPE
};

// A copy of a session's state at one position; restoring it resumes exactly.
struct Snapshot {
  Snapshot() = default;
  Snapshot(const Snapshot&) = delete;  // owns device buffers
  Snapshot& operator=(const Snapshot&) = delete;
  const Engine* engine = nullptr;
  int64_t position = 0;
  std::vector<LayerState> layers;  // attention buffers hold only rows [0, position)
  size_t nbytes() const;
};

// Scratch activations for up to `chunk` tokens ([chunk, width] f32 each).
struct Scratch {
  Buffer ids;                        // [C] I32
  Buffer x, h, mix;                  // [C, H] residual stream, normed input, mixer/MoE output
  Buffer proj, conv_out, z, o, normed;  // [C, widest projection]
  Buffer a, b;                       // [C, Hv]
  Buffer kbuf, vbuf;                 // [C, nKV*D]
  Buffer router_logits, gathered, gate, up, down, shared_gate;  // MoE work space
  Buffer final_h, logits;            // [R, H], [R, V] for R = logit rows per pass
  int64_t logit_rows = 0;
};

class Session {
 public:
  Session(std::shared_ptr<const Engine> engine, int64_t max_context, int64_t chunk);

  // Runs T tokens; writes the logits of the last token [V], or of every token [T, V] if all_logits.
  void prefill(const int32_t* ids, int64_t T, float* logits, bool all_logits);
  void decode_step(int32_t id, float* logits) { prefill(&id, 1, logits, false); }

  int64_t position() const { return position_; }
  int64_t max_context() const { return max_context_; }
  int64_t chunk() const { return chunk_; }
  const Engine& engine() const { return *engine_; }
  std::shared_ptr<Snapshot> snapshot() const;
  void restore(const Snapshot& s);
  void reset();
  // Named state tensors for inspection: (name, shape, buffer, bytes in use).
  struct StateView { std::string name; std::vector<int64_t> shape; const Buffer* buffer; };
  std::vector<StateView> state_views() const;

  // Debug trace: when on, each forward records named per-layer activations ([rows, width] f32,
  // rows appended chunk after chunk) so a mismatch can be bisected to one op.
  struct Trace { int64_t width = 0; std::vector<float> data; };
  bool tracing = false;
  std::map<std::string, Trace> trace;

 private:
  friend class Engine;
  std::shared_ptr<const Engine> engine_;
  int64_t max_context_, chunk_, position_ = 0;
  std::vector<LayerState> layers_;
  Scratch s_;
};

}  // namespace lily
