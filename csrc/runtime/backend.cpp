#include "backend.h"

#include "device_api.h"

namespace lily {

#define LILY_DISPATCH_DEVICE(device, call)                          \
  switch (device) {                                                 \
    case Device::CUDA: return cuda::call;                           \
    case Device::Metal: return metal::call;                         \
    case Device::CPU: break;                                        \
  }                                                                 \
  fail("internal: host memory passed to a GPU memory service")

bool backend_available(Device d) {
  if (d == Device::CPU) return true;
  LILY_DISPATCH_DEVICE(d, available());
}
void* backend_alloc(Device d, size_t n) { LILY_DISPATCH_DEVICE(d, alloc(n)); }
void backend_free(Device d, void* p) { LILY_DISPATCH_DEVICE(d, free(p)); }
void backend_upload(Device d, void* dst, const void* h, size_t n) { LILY_DISPATCH_DEVICE(d, upload(dst, h, n)); }
void backend_download(Device d, void* h, const void* s, size_t n) { LILY_DISPATCH_DEVICE(d, download(h, s, n)); }
void* backend_host_alloc(Device d, size_t n) { LILY_DISPATCH_DEVICE(d, host_alloc(n)); }
void backend_host_free(Device d, void* p) { LILY_DISPATCH_DEVICE(d, host_free(p)); }
void backend_upload_async(Device d, void* dst, const void* h, size_t n) {
  LILY_DISPATCH_DEVICE(d, upload_async(dst, h, n));
}
void backend_download_async(Device d, void* h, const void* s, size_t n) {
  LILY_DISPATCH_DEVICE(d, download_async(h, s, n));
}
void backend_copy(Device d, void* dst, const void* s, size_t n) { LILY_DISPATCH_DEVICE(d, copy(dst, s, n)); }
void backend_memset(Device d, void* dst, int v, size_t n) { LILY_DISPATCH_DEVICE(d, memset(dst, v, n)); }

void backend_synchronize(Device d) {
  if (d == Device::CPU) return;
  LILY_DISPATCH_DEVICE(d, synchronize());
}

void* backend_event_create(Device d, bool timing) { LILY_DISPATCH_DEVICE(d, event_create(timing)); }
void backend_event_record(Device d, void* e) { LILY_DISPATCH_DEVICE(d, event_record(e)); }
void backend_event_wait(Device d, void* e) { LILY_DISPATCH_DEVICE(d, event_wait(e)); }
float backend_event_elapsed_ms(Device d, void* a, void* b) { LILY_DISPATCH_DEVICE(d, event_elapsed_ms(a, b)); }
void backend_event_destroy(Device d, void* e) { LILY_DISPATCH_DEVICE(d, event_destroy(e)); }

void backend_programmatic_run(Device d, const std::function<void()>& body) {
  if (d == Device::CPU) return body();
  LILY_DISPATCH_DEVICE(d, programmatic_run(body));
}

DeviceFence::DeviceFence(Device device) : device_(device) {
  if (device != Device::CPU) event_ = backend_event_create(device, false);
}

DeviceFence::~DeviceFence() {
  if (event_) backend_event_destroy(device_, event_);
}

DeviceFence& DeviceFence::operator=(DeviceFence&& o) noexcept {
  if (this != &o) {
    if (event_) backend_event_destroy(device_, event_);
    device_ = o.device_;
    event_ = o.event_;
    o.event_ = nullptr;
  }
  return *this;
}

void DeviceFence::record() {
  if (event_) backend_event_record(device_, event_);
}

void DeviceFence::wait() const {
  if (event_) backend_event_wait(device_, event_);
}

static void* graph_capture(Device d, const std::function<void()>& body, size_t* n) {
  LILY_DISPATCH_DEVICE(d, graph_capture(body, n));
}
static void graph_launch(Device d, void* g) { LILY_DISPATCH_DEVICE(d, graph_launch(g)); }
static void graph_destroy(Device d, void* g) { LILY_DISPATCH_DEVICE(d, graph_destroy(g)); }

DeviceGraph::DeviceGraph(Device device, const std::function<void()>& body)
    : device_(device) {
  // In the body: a member initialiser of num_nodes_ would run after handle_'s and reset the count.
  handle_ = graph_capture(device, body, &num_nodes_);
}

DeviceGraph::~DeviceGraph() {
  if (handle_) graph_destroy(device_, handle_);
}

DeviceGraph& DeviceGraph::operator=(DeviceGraph&& o) noexcept {
  if (this != &o) {
    if (handle_) graph_destroy(device_, handle_);
    device_ = o.device_;
    handle_ = o.handle_;
    num_nodes_ = o.num_nodes_;
    o.handle_ = nullptr;
  }
  return *this;
}

void DeviceGraph::launch() const { graph_launch(device_, handle_); }

}  // namespace lily
