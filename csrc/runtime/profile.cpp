#include "profile.h"

#include <chrono>

#include "backend.h"

namespace lily {

static thread_local Profiler* active_profiler = nullptr;
static thread_local const char* active_label = nullptr;
static thread_local int op_depth = 0;  // op entries open on this thread (gated_attention calls others)

static double host_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

Profiler::Profiler(Device device) : device_(device) {
  LILY_CHECK(!active_profiler, "profiler: another profiler is active on this thread");
  active_profiler = this;
}

Profiler::~Profiler() {
  if (active_profiler == this) active_profiler = nullptr;
  for (Span& s : spans_) {
    if (s.start) free_events_.push_back(s.start);
    if (s.stop) free_events_.push_back(s.stop);
  }
  for (void* e : free_events_) backend_event_destroy(device_, e);
}

void* Profiler::event() {
  if (free_events_.empty()) return backend_event_create(device_, true);
  void* e = free_events_.back();
  free_events_.pop_back();
  return e;
}

void Profiler::begin(std::string name) {
  Span s;
  s.name = std::move(name);
  if (device_ == Device::CPU) {
    s.t0 = host_ms();
  } else {
    s.start = event();
    backend_event_record(device_, s.start);
  }
  spans_.push_back(std::move(s));
}

void Profiler::end() {
  LILY_CHECK(!spans_.empty(), "profiler: end() without begin()");
  Span& s = spans_.back();
  if (device_ == Device::CPU) {
    s.t1 = host_ms();
  } else {
    s.stop = event();
    backend_event_record(device_, s.stop);
  }
}

void Profiler::collect() {
  if (device_ != Device::CPU) backend_synchronize(device_);
  for (Span& s : spans_) {
    Entry& e = totals[s.name];
    e.calls += 1;
    if (device_ == Device::CPU) {
      e.ms += s.t1 - s.t0;
    } else {
      e.ms += backend_event_elapsed_ms(device_, s.start, s.stop);
      free_events_.push_back(s.start);
      free_events_.push_back(s.stop);
    }
  }
  spans_.clear();
}

OpSpan::OpSpan(const char* op) : p_(op_depth++ == 0 ? active_profiler : nullptr) {
  if (p_) p_->begin(active_label ? std::string(active_label) + "." + op : std::string(op));
}

OpSpan::~OpSpan() {
  --op_depth;
  if (p_) p_->end();
}

ProfileLabel::ProfileLabel(const char* label) : outer_(active_label) { active_label = label; }

ProfileLabel::~ProfileLabel() { active_label = outer_; }

}  // namespace lily
