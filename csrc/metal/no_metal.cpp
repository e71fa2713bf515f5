// Stub of the Metal backend: Apple GPUs are a named seam, not yet built (see csrc/metal/README.md).
#include "../core/common.h"
#include "../ops/device_api.h"

namespace lily::metal {
namespace {
[[noreturn]] void not_built() {
  fail("device 'metal' is not available: this build of lily has no Metal backend (Apple GPUs are "
       "not supported yet; load with device=\"cpu\")");
}
}  // namespace

bool available() { return false; }
void* alloc(size_t) { not_built(); }
void free(void*) {}
void upload(void*, const void*, size_t) { not_built(); }
void download(void*, const void*, size_t) { not_built(); }
void copy(void*, const void*, size_t) { not_built(); }
void memset(void*, int, size_t) { not_built(); }
void synchronize() { not_built(); }
void* graph_capture(const std::function<void()>&, size_t*) { not_built(); }
void graph_launch(void*) { not_built(); }
void graph_destroy(void*) {}
void* event_create() { not_built(); }
void event_record(void*) { not_built(); }
float event_elapsed_ms(void*, void*) { not_built(); }
void event_destroy(void*) {}

}  // namespace lily::metal
