// Stub of the CUDA backend, compiled when the build has no CUDA toolkit (LILY_CUDA=OFF).
#include "../core/common.h"
#include "../ops/device_api.h"

namespace lily::cuda {
namespace {
[[noreturn]] void not_built() {
  fail("device 'cuda' is not available: this build of lily has no CUDA backend (build it on a "
       "machine with the CUDA toolkit, or load with device=\"cpu\")");
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

}  // namespace lily::cuda
