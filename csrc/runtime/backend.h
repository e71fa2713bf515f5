// The backend seam: memory services of the GPU backends. The CPU backend needs none of these;
// cuda_device.cu implements them when LILY_CUDA is on; otherwise, and for Metal, no_backend.cpp raises a
// clear "not built" error.
#pragma once
#include <cstddef>
#include <functional>
#include <utility>

#include "common.h"

namespace lily {

bool backend_available(Device device);
void* backend_alloc(Device device, size_t nbytes);
void backend_free(Device device, void* ptr);
void backend_upload(Device device, void* dst, const void* host, size_t nbytes);
void backend_download(Device device, void* host, const void* src, size_t nbytes);
// Page-locked host memory, and stream-ordered copies to or from it that return at once.
void* backend_host_alloc(Device device, size_t nbytes);
void backend_host_free(Device device, void* ptr);
void backend_upload_async(Device device, void* dst, const void* host, size_t nbytes);
void backend_download_async(Device device, void* host, const void* src, size_t nbytes);
void backend_copy(Device device, void* dst, const void* src, size_t nbytes);
void backend_memset(Device device, void* dst, int value, size_t nbytes);
void backend_synchronize(Device device);
// Device events on the backend's stream: timed ones for profiling, untimed ones to wait on (DeviceFence).
void* backend_event_create(Device device, bool timing);
void backend_event_record(Device device, void* event);
void backend_event_wait(Device device, void* event);
float backend_event_elapsed_ms(Device device, void* start, void* stop);
void backend_event_destroy(Device device, void* event);
// Runs body() with the device's kernels launched as programmatic dependent launches, as a graph capture
// launches them (CUDA: every kernel may start while its predecessor finishes and waits before it reads; the
// prompt's eager kernels, whose kernels all wait first). On the CPU: body().
void backend_programmatic_run(Device device, const std::function<void()>& body);

// A point in a device's stream that the host can wait for: record() marks the work queued so far,
// wait() returns once it is done. On the CPU, where every op has finished when it returns, both do
// nothing. Move-only.
class DeviceFence {
 public:
  DeviceFence() = default;
  explicit DeviceFence(Device device);
  ~DeviceFence();
  DeviceFence(DeviceFence&& o) noexcept { *this = std::move(o); }
  DeviceFence& operator=(DeviceFence&& o) noexcept;
  void record();
  void wait() const;

 private:
  Device device_ = Device::CPU;
  void* event_ = nullptr;
};

// A captured sequence of device work (a CUDA graph), replayed with launch(). Move-only.
class DeviceGraph {
 public:
  DeviceGraph() = default;
  DeviceGraph(Device device, const std::function<void()>& body);
  ~DeviceGraph();
  DeviceGraph(DeviceGraph&& o) noexcept { *this = std::move(o); }
  DeviceGraph& operator=(DeviceGraph&& o) noexcept;
  bool empty() const { return handle_ == nullptr; }
  void launch() const;
  size_t num_nodes() const { return num_nodes_; }  // kernels and copies per launch

 private:
  Device device_ = Device::CPU;
  void* handle_ = nullptr;
  size_t num_nodes_ = 0;
};

}  // namespace lily
