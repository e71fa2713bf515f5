// What one forward pass reads and writes: a session's per-layer state and work space, handed to the
// engine for each call as a ForwardContext. The engine holds no session and sees no more of one.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "../ops/ops.h"
#include "../runtime/tensor.h"

namespace lily {

// One layer's state in a session: a GDN layer's conv and recurrent state, or an attention layer's KV cache.
struct LayerState {
  Buffer conv;       // GDN: [K-1, conv_dim] f32, raw pre-conv inputs, oldest first
  Buffer recurrent;  // GDN: [Hv, Dk, Dv] f32 delta-rule state S (k-major, as transformers)
  Buffer k, v;       // attention: [max_context, nKV*D] f32 (CPU) or bf16 (GPU), K after q/k norm and RoPE
};

// Scratch activations for up to `chunk` tokens ([chunk, width] f32 each).
struct Scratch {
  Buffer ids;                        // [C] I32
  Buffer x, h, mix;                  // [C, H] residual stream, normed input, mixer/MoE output
  // The mixers' activations, [C, widest] each, by role (GDN | attention):
  Buffer proj;                       // the input projection: q|k|v before the conv | per head query|gate
  Buffer core_in;                    // what the core reads: the conv1d output | the queries
  Buffer out_gate;                   // the output gate: z | gate
  Buffer core_out;                   // the core's output: the delta rule's o | attention's o
  Buffer normed;                     // GDN: the gated norm's output, out_proj's input
  Buffer a, b;                       // GDN: [C, Hv] decay and write-strength inputs
  Buffer k, v;                       // attention: [C, nKV*D] new keys and values
  Buffer stacked;  // [ops::linear_stack_rows, widest stacked projection]: the stacked projections' outputs
  Buffer router_logits, gathered, gate, up, down, shared_gate, routing;  // MoE work space
  Buffer gdn_work;                   // gated_delta_rule's workspace for C tokens (empty on the CPU)
  Buffer xb;                         // BF16 linear workspace and MoeScratch::xb for C tokens (empty on the CPU)
  Buffer final_h, logits;            // [R, H], [R, V] for R = logit rows per pass
  int64_t logit_rows = 0;
  Buffer position;                   // [1] I32 on GPUs: the next token's position (ops::Position)
  Buffer rope_pos;                   // [C, 3] I32: a chunk's (t, h, w) rope positions when the prompt has images
  Buffer sync;                       // [1] I32, zero: the fused residual norms' completion counter
};

// Named activations recorded by a traced forward pass: [rows, width] f32, rows appended chunk after chunk.
struct Trace {
  int64_t width = 0;
  std::vector<float> data;
};

// The images of a prompt (docs/model.md section 8.5): the vision tower's merged tokens, which replace the
// embeddings of the prompt's image tokens, and every token's (t, h, w) rope position.
struct PromptImages {
  const float* embeds = nullptr;       // [n, H] host, in prompt order
  const int32_t* rows = nullptr;       // [n] increasing indices into the prompt: where each goes
  int64_t n = 0;
  const int32_t* positions = nullptr;  // [T, 3] host: each prompt token's (t, h, w) rope position
  int64_t rope_delta = 0;              // after the prompt: a token at index p has rope position p + rope_delta
};

// A session as the engine sees it during one call (Session::forward_context): the work space and
// state the session allocated, the sizes it allocated them for, where the chunk starts, and where
// traced activations go (null when not tracing).
struct ForwardContext {
  Scratch& scratch;
  std::vector<LayerState>& layers;  // one per model layer: the state the chunk continues from
  // Where the GDN layers write their new conv and recurrent state: `layers` itself (in place: prefill),
  // or the other copy of the session's ping-pong pair (a decode step, which the session can then take
  // back by keeping the copy it read; docs/generation.md "Pipelined decoding"). Attention layers append
  // to their KV caches in `layers` either way.
  std::vector<LayerState>& next;
  int64_t max_context;              // rows of each KV cache
  int64_t chunk;                    // tokens the scratch holds
  ops::Position position;           // the chunk's first token; rope_delta: text after images rotates by
                                    // index + rope_delta
  std::map<std::string, Trace>* trace;
};

}  // namespace lily
