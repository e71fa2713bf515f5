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
void backend_copy(Device d, void* dst, const void* s, size_t n) { LILY_DISPATCH_DEVICE(d, copy(dst, s, n)); }
void backend_memset(Device d, void* dst, int v, size_t n) { LILY_DISPATCH_DEVICE(d, memset(dst, v, n)); }

}  // namespace lily
