// The backend seam: memory services of the GPU backends. The CPU backend needs none of these;
// cuda/ implements them when LILY_CUDA is on, cuda/no_cuda.cpp and metal/no_metal.cpp otherwise
// raise a clear "not built" error.
#pragma once
#include <cstddef>

#include "../core/common.h"

namespace lily {

bool backend_available(Device device);
void* backend_alloc(Device device, size_t nbytes);
void backend_free(Device device, void* ptr);
void backend_upload(Device device, void* dst, const void* host, size_t nbytes);
void backend_download(Device device, void* host, const void* src, size_t nbytes);
void backend_copy(Device device, void* dst, const void* src, size_t nbytes);
void backend_memset(Device device, void* dst, int value, size_t nbytes);

}  // namespace lily
