// What each GPU backend provides for memory. Implemented by runtime/cuda_device.cu (or, in a build
// without CUDA, by runtime/no_backend.cpp) and by runtime/no_backend.cpp for Metal until a Metal
// backend exists.
#pragma once
#include <cstddef>
#include <functional>

namespace lily {
#define LILY_DEVICE_API                                            \
  bool available();                                                \
  void* alloc(size_t nbytes);                                      \
  void free(void* ptr);                                            \
  void upload(void* dst, const void* host, size_t nbytes);         \
  void download(void* host, const void* src, size_t nbytes);       \
  /* Page-locked host memory, and copies to or from it that are     \
     queued on the stream and return at once. */                    \
  void* host_alloc(size_t nbytes);                                 \
  void host_free(void* ptr);                                       \
  void upload_async(void* dst, const void* host, size_t nbytes);   \
  void download_async(void* host, const void* src, size_t nbytes); \
  void copy(void* dst, const void* src, size_t nbytes);            \
  void memset(void* dst, int value, size_t nbytes);                 \
  void synchronize();                                              \
  /* Records the device work body() enqueues as a graph (nothing   \
     runs; num_nodes gets its kernel and copy count); returns its   \
     handle for graph_launch / graph_destroy. */                    \
  void* graph_capture(const std::function<void()>& body, size_t* num_nodes);          \
  void graph_launch(void* graph);                                  \
  void graph_destroy(void* graph);                                 \
  /* Runs body() with its kernels launched as inside a capture:     \
     programmatic dependent launches (each kernel pdl_waits before  \
     it reads an activation). */                                    \
  void programmatic_run(const std::function<void()>& body);        \
  /* timing: for event_elapsed_ms (profiling); else only waited on */ \
  void* event_create(bool timing);                                 \
  void event_record(void* event);                                  \
  void event_wait(void* event);  /* the host waits for the event */ \
  float event_elapsed_ms(void* start, void* stop);                 \
  void event_destroy(void* event);
namespace cuda { LILY_DEVICE_API }
namespace metal { LILY_DEVICE_API }
#undef LILY_DEVICE_API
}  // namespace lily
