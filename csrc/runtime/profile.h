// Where a forward pass spends its time: one span per op entry (ops/*.cpp), named "<label>.<op>"
// ("gdn.linear", "attn.gated_attention"; "moe" where no label is set), timed with device events on
// GPUs (host clock on the CPU). Only eager passes are profiled; the decode graph is bypassed.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "common.h"

namespace lily {

// While a Profiler exists, the op entries called on the thread that made it record spans into it.
class Profiler {
 public:
  explicit Profiler(Device device);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void begin(std::string name);
  void end();
  // Waits for the device, then folds the recorded spans into `totals`.
  void collect();

  struct Entry {
    double ms = 0;
    int64_t calls = 0;
  };
  std::map<std::string, Entry> totals;

 private:
  struct Span {
    std::string name;
    void* start = nullptr;  // device events (GPU)
    void* stop = nullptr;
    double t0 = 0, t1 = 0;  // host clock in ms (CPU)
  };
  void* event();
  Device device_;
  std::vector<Span> spans_;
  std::vector<void*> free_events_;
};

// Times one op entry as a span when this thread has an active profiler. Every ops:: entry opens
// one, so the forward pass itself carries no profiling code; an op that calls other entries (the
// per-op fallback of a fused op) is one span.
class OpSpan {
 public:
  explicit OpSpan(const char* op);
  ~OpSpan();
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;

 private:
  Profiler* p_;
};

// Names the ops run in its scope: their spans become "<label>.<op>" (a layer kind: "gdn", "attn").
class ProfileLabel {
 public:
  explicit ProfileLabel(const char* label);
  ~ProfileLabel();
  ProfileLabel(const ProfileLabel&) = delete;
  ProfileLabel& operator=(const ProfileLabel&) = delete;

 private:
  const char* outer_;
};

}  // namespace lily
