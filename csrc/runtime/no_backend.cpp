// The one "backend not built" stub. Every GPU backend implements the services of device_api.h; a
// build without a backend links this file's definitions instead, each of which raises a clear error
// (or does nothing, where releasing nothing is correct). The CUDA stub is compiled when the build has
// no CUDA toolkit (LILY_CUDA=OFF or no nvcc); the Metal one always, since no Metal backend exists yet
// (csrc/metal/README.md).
#include "common.h"
#include "device_api.h"

// Defines every service of device_api.h in namespace lily::NS; `name` and `why` go into the error.
#define LILY_BACKEND_NOT_BUILT(NS, name, why)                                                  \
  namespace NS {                                                                               \
  namespace {                                                                                  \
  [[noreturn]] void not_built() {                                                              \
    fail("device '" #NS "' is not available: this build of lily has no " name                  \
         " backend (" why ")");                                                                \
  }                                                                                            \
  }                                                                                            \
  bool available() { return false; }                                                           \
  void* alloc(size_t) { not_built(); }                                                         \
  void free(void*) {}                                                                          \
  void upload(void*, const void*, size_t) { not_built(); }                                     \
  void download(void*, const void*, size_t) { not_built(); }                                   \
  void* host_alloc(size_t) { not_built(); }                                                    \
  void host_free(void*) {}                                                                     \
  void upload_async(void*, const void*, size_t) { not_built(); }                               \
  void download_async(void*, const void*, size_t) { not_built(); }                             \
  void copy(void*, const void*, size_t) { not_built(); }                                       \
  void memset(void*, int, size_t) { not_built(); }                                             \
  void synchronize() { not_built(); }                                                          \
  void* graph_capture(const std::function<void()>&, size_t*) { not_built(); }                  \
  void graph_launch(void*) { not_built(); }                                                    \
  void graph_destroy(void*) {}                                                                 \
  void programmatic_run(const std::function<void()>&) { not_built(); }                        \
  void* event_create(bool) { not_built(); }                                                    \
  void event_record(void*) { not_built(); }                                                    \
  void event_wait(void*) { not_built(); }                                                      \
  float event_elapsed_ms(void*, void*) { not_built(); }                                        \
  void event_destroy(void*) {}                                                                 \
  }

namespace lily {

#ifndef LILY_WITH_CUDA
LILY_BACKEND_NOT_BUILT(cuda, "CUDA",
                       "build it on a machine with the CUDA toolkit, or load with device=\"cpu\"")
#endif
LILY_BACKEND_NOT_BUILT(metal, "Metal", "Apple GPUs are not supported yet; load with device=\"cpu\"")

}  // namespace lily
