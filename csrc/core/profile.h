// Where a forward pass spends its time: named spans around groups of ops, timed with device events
// on GPUs (host clock on the CPU). Only eager passes are profiled; the decode graph is bypassed.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "common.h"

namespace lily {

class Profiler {
 public:
  explicit Profiler(Device device) : device_(device) {}
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void begin(const char* name);
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

// Times the enclosing scope as one span when a profiler is given.
class ProfileScope {
 public:
  ProfileScope(Profiler* p, const char* name) : p_(p) {
    if (p_) p_->begin(name);
  }
  ~ProfileScope() {
    if (p_) p_->end();
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* p_;
};

}  // namespace lily
