// The backend seam: memory services of the GPU backends. The CPU backend needs none of these;
// cuda_device.cu implements them when LILY_CUDA is on; otherwise, and for Metal, no_backend.cpp raises a
// clear "not built" error.
#pragma once
#include <cstddef>
#include <functional>

#include "common.h"

namespace lily {

bool backend_available(Device device);
void* backend_alloc(Device device, size_t nbytes);
void backend_free(Device device, void* ptr);
void backend_upload(Device device, void* dst, const void* host, size_t nbytes);
void backend_download(Device device, void* host, const void* src, size_t nbytes);
void backend_copy(Device device, void* dst, const void* src, size_t nbytes);
void backend_memset(Device device, void* dst, int value, size_t nbytes);
void backend_synchronize(Device device);
// Device events on the backend's stream, for profiling.
void* backend_event_create(Device device);
void backend_event_record(Device device, void* event);
float backend_event_elapsed_ms(Device device, void* start, void* stop);
void backend_event_destroy(Device device, void* event);

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
