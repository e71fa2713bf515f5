// Device memory services (device_api.h) and the backend stream. Copies that the host waits for
// (upload, download) synchronise the stream; device-to-device copies, memsets and the copies to and
// from page-locked host memory (upload_async, download_async) stay asynchronous and ordered with the
// kernels on the same stream.
#include <cstdio>

#include "cuda_device.h"
#include "device_api.h"

namespace lily::cuda {

void fail_cuda(cudaError_t e, const char* what, const char* file, int line) {
  fail("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", what, " at ", file, ":", line);
}

cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}

int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    LILY_CUDA_CHECK(cudaGetDevice(&dev));
    LILY_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// The kernels are built for sm_90a only, so a usable device must be compute capability 9.0.
bool available() {
  static bool ok = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();  // clear the sticky "no device" error
      return false;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return false;
    return p.major == 9 && p.minor == 0;
  }();
  return ok;
}

void* alloc(size_t n) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, n);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("out of GPU memory allocating ", n, " bytes (", free_b, " of ", total_b, " bytes free)");
  }
  LILY_CUDA_CHECK(e);
  return p;
}

void free(void* p) { cudaFree(p); }

void upload(void* dst, const void* host, size_t n) {
  LILY_CUDA_CHECK(cudaMemcpyAsync(dst, host, n, cudaMemcpyHostToDevice, stream()));
  LILY_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void download(void* host, const void* src, size_t n) {
  LILY_CUDA_CHECK(cudaMemcpyAsync(host, src, n, cudaMemcpyDeviceToHost, stream()));
  LILY_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void* host_alloc(size_t n) {
  void* p = nullptr;
  LILY_CUDA_CHECK(cudaMallocHost(&p, n));
  return p;
}

void host_free(void* p) { cudaFreeHost(p); }

void upload_async(void* dst, const void* host, size_t n) {
  LILY_CUDA_CHECK(cudaMemcpyAsync(dst, host, n, cudaMemcpyHostToDevice, stream()));
}

void download_async(void* host, const void* src, size_t n) {
  LILY_CUDA_CHECK(cudaMemcpyAsync(host, src, n, cudaMemcpyDeviceToHost, stream()));
}

void copy(void* dst, const void* src, size_t n) {
  LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream()));
}

void memset(void* dst, int value, size_t n) { LILY_CUDA_CHECK(cudaMemsetAsync(dst, value, n, stream())); }

void synchronize() { LILY_CUDA_CHECK(cudaStreamSynchronize(stream())); }

static thread_local bool capturing = false, programmatic = false;

bool programmatic_launches() { return capturing || programmatic; }

void programmatic_run(const std::function<void()>& body) {
  const bool was = programmatic;
  programmatic = true;
  try {
    body();
  } catch (...) {
    programmatic = was;
    throw;
  }
  programmatic = was;
}

// Captures on the backend stream; an error inside body() ends the capture before it propagates so
// the stream is usable again.
void* graph_capture(const std::function<void()>& body, size_t* num_nodes) {
  LILY_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
  try {
    capturing = true;
    body();
    capturing = false;
  } catch (...) {
    capturing = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream(), &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t g = nullptr;
  LILY_CUDA_CHECK(cudaStreamEndCapture(stream(), &g));
  LILY_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, num_nodes));
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  LILY_CUDA_CHECK(e);
  return exec;
}

void graph_launch(void* g) { LILY_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g), stream())); }

void graph_destroy(void* g) { cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g)); }

void* event_create(bool timing) {
  cudaEvent_t e;
  LILY_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}

void event_record(void* e) { LILY_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), stream())); }

// With the default device flags and one context, the host spins while it waits (no sleep, no
// wake-up latency): the decode pipeline waits here once per token.
void event_wait(void* e) { LILY_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); }

float event_elapsed_ms(void* a, void* b) {
  float ms = 0.f;
  LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)));
  return ms;
}

void event_destroy(void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }

}  // namespace lily::cuda
