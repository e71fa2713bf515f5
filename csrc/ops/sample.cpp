#include <cmath>

#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

static void check_params(const SamplerParams& p) {
  LILY_CHECK(p.temperature >= 0.f && std::isfinite(p.temperature), "sample: temperature must be >= 0, got ",
             p.temperature);
  LILY_CHECK(p.top_k >= 0, "sample: top_k must be >= 0 (0 = off), got ", p.top_k);
  LILY_CHECK(p.top_p > 0.f && p.top_p <= 1.f, "sample: top_p must be in (0, 1], got ", p.top_p);
  LILY_CHECK(p.min_p >= 0.f && p.min_p <= 1.f, "sample: min_p must be in [0, 1], got ", p.min_p);
  LILY_CHECK(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty),
             "sample: penalties must be finite");
  LILY_CHECK(p.repetition_penalty > 0.f && std::isfinite(p.repetition_penalty),
             "sample: repetition_penalty must be > 0, got ", p.repetition_penalty);
  LILY_CHECK(p.num_logprobs >= -1 && p.num_logprobs <= MAX_LOGPROBS, "sample: logprobs must be in [0, ",
             MAX_LOGPROBS, "], got ", p.num_logprobs);
}

static void check_state(const char* op, const SamplerState& s, int64_t V, Device d) {
  check_tensor(op, "counts", s.counts, DType::I32, 1);
  check_tensor(op, "seen", s.seen, DType::I32, 1);
  check_tensor(op, "token", s.token, DType::I32, 1);
  check_tensor(op, "logprob_ids", s.logprob_ids, DType::I32, 1);
  check_tensor(op, "logprob_values", s.logprob_values, DType::F32, 1);
  check_shape(op, "counts", s.counts, 0, V);
  check_shape(op, "seen", s.seen, 0, V);
  check_shape(op, "logprob_ids", s.logprob_ids, 0, 1 + MAX_LOGPROBS);
  check_shape(op, "logprob_values", s.logprob_values, 0, 1 + MAX_LOGPROBS);
  LILY_CHECK(s.counts.device == d && s.seen.device == d && s.token.device == d && s.logprob_ids.device == d &&
                 s.logprob_values.device == d,
             op, ": sampler state and logits live on different devices");
}

void sample(const Tensor& logits, const SamplerParams& params, uint64_t step, const SamplerState& state) {
  const char* op = "sample";
  const OpSpan span(op);
  check_tensor(op, "logits", logits, DType::F32, 1);
  check_params(params);
  check_state(op, state, logits.dim(0), logits.device);
  if (logits.device == Device::CPU) return cpu::sample(logits, params, step, state);
  LILY_CUDA_CASE(logits.device, sample(logits, params, step, state));
  no_backend(op, logits.device);
}

void apply_token_mask(const Tensor& logits, const Tensor& mask) {
  const char* op = "apply_token_mask";
  const OpSpan span(op);
  check_tensor(op, "logits", logits, DType::F32, 1);
  check_tensor(op, "mask", mask, DType::I32, 1);
  const int64_t V = logits.dim(0), words = (V + 31) / 32;
  LILY_CHECK(mask.dim(0) >= words, op, ": mask has ", mask.dim(0), " words; ", V, " logits need at least ", words);
  LILY_CHECK(mask.device == logits.device, op, ": logits and mask live on different devices");
  if (logits.device == Device::CPU) return cpu::apply_token_mask(logits, mask);
  LILY_CUDA_CASE(logits.device, apply_token_mask(logits, mask));
  no_backend(op, logits.device);
}

void sampler_mark_seen(const Tensor& ids, const SamplerState& state) {
  const char* op = "sampler_mark_seen";
  const OpSpan span(op);
  check_tensor(op, "ids", ids, DType::I32, 1);
  check_state(op, state, state.seen.dim(0), ids.device);
  if (ids.device == Device::CPU) return cpu::sampler_mark_seen(ids, state);
  LILY_CUDA_CASE(ids.device, sampler_mark_seen(ids, state));
  no_backend(op, ids.device);
}

void advance_position(int32_t* pos_device, Device d, int64_t T) {
  const OpSpan span("advance_position");
  if (d == Device::CPU) return;
  LILY_CUDA_CASE(d, advance_position(pos_device, T));
  no_backend("advance_position", d);
}

}  // namespace lily::ops
