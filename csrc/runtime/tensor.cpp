#include "tensor.h"

#include <cstdlib>

#include "backend.h"

namespace lily {

DType parse_dtype(const std::string& name) {
  if (name == "F32") return DType::F32;
  if (name == "F16") return DType::F16;
  if (name == "BF16") return DType::BF16;
  if (name == "U32") return DType::U32;
  if (name == "I32") return DType::I32;
  fail("unsupported dtype '", name, "' (expected F32, F16, BF16, U32 or I32)");
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::CPU;
  if (name == "cuda") return Device::CUDA;
  if (name == "metal") return Device::Metal;
  fail("unknown device '", name, "' (expected cpu, cuda or metal)");
}

const char* device_name(Device d) {
  switch (d) {
    case Device::CPU: return "cpu";
    case Device::CUDA: return "cuda";
    case Device::Metal: return "metal";
  }
  return "?";
}

Buffer::Buffer(Device device, size_t nbytes) : nbytes_(nbytes), device_(device) {
  if (nbytes == 0) return;
  if (device == Device::CPU) {
    data_ = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
    LILY_CHECK(data_, "out of host memory allocating ", nbytes, " bytes");
  } else {
    data_ = backend_alloc(device, nbytes);
  }
}

Buffer Buffer::view(const Buffer& base, size_t offset, size_t nbytes) {
  LILY_CHECK(offset + nbytes <= base.nbytes_, "view of ", nbytes, " bytes at ", offset, " past a buffer of ",
             base.nbytes_);
  Buffer b;
  b.data_ = static_cast<char*>(base.data_) + offset;
  b.nbytes_ = nbytes;
  b.device_ = base.device_;
  b.owned_ = false;
  return b;
}

Buffer::~Buffer() { release(); }

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    nbytes_ = o.nbytes_;
    device_ = o.device_;
    owned_ = o.owned_;
    o.data_ = nullptr;
    o.nbytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (data_ && owned_) {
    if (device_ == Device::CPU) std::free(data_);
    else backend_free(device_, data_);
  }
  data_ = nullptr;
  owned_ = true;
}

void Buffer::upload(const void* host, size_t n, size_t offset) {
  LILY_CHECK(offset + n <= nbytes_, "upload of ", n, " bytes past a buffer of ", nbytes_);
  if (n == 0) return;
  if (device_ == Device::CPU) std::memcpy(static_cast<char*>(data_) + offset, host, n);
  else backend_upload(device_, static_cast<char*>(data_) + offset, host, n);
}

void Buffer::download(void* host, size_t n, size_t offset) const {
  LILY_CHECK(offset + n <= nbytes_, "download of ", n, " bytes past a buffer of ", nbytes_);
  if (n == 0) return;
  if (device_ == Device::CPU) std::memcpy(host, static_cast<const char*>(data_) + offset, n);
  else backend_download(device_, host, static_cast<const char*>(data_) + offset, n);
}

void Buffer::upload_async(const void* host, size_t n, size_t offset) {
  LILY_CHECK(offset + n <= nbytes_, "upload of ", n, " bytes past a buffer of ", nbytes_);
  if (n == 0) return;
  if (device_ == Device::CPU) std::memcpy(static_cast<char*>(data_) + offset, host, n);
  else backend_upload_async(device_, static_cast<char*>(data_) + offset, host, n);
}

void Buffer::download_async(void* host, size_t n, size_t offset) const {
  LILY_CHECK(offset + n <= nbytes_, "download of ", n, " bytes past a buffer of ", nbytes_);
  if (n == 0) return;
  if (device_ == Device::CPU) std::memcpy(host, static_cast<const char*>(data_) + offset, n);
  else backend_download_async(device_, host, static_cast<const char*>(data_) + offset, n);
}

void Buffer::copy_from(const Buffer& src, size_t n, size_t offset) {
  LILY_CHECK(offset + n <= nbytes_ && n <= src.nbytes_ && device_ == src.device_, "bad buffer copy");
  if (n == 0) return;
  char* dst = static_cast<char*>(data_) + offset;
  if (device_ == Device::CPU) std::memcpy(dst, src.data_, n);
  else backend_copy(device_, dst, src.data_, n);
}

void Buffer::zero() {
  if (!data_) return;
  if (device_ == Device::CPU) std::memset(data_, 0, nbytes_);
  else backend_memset(device_, data_, 0, nbytes_);
}

HostBuffer::HostBuffer(Device device, size_t nbytes) : nbytes_(nbytes), device_(device) {
  if (nbytes == 0) return;
  if (device == Device::CPU) {
    data_ = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
    LILY_CHECK(data_, "out of host memory allocating ", nbytes, " bytes");
  } else {
    data_ = backend_host_alloc(device, nbytes);
  }
}

HostBuffer::~HostBuffer() { release(); }

void HostBuffer::release() {
  if (data_) {
    if (device_ == Device::CPU) std::free(data_);
    else backend_host_free(device_, data_);
  }
  data_ = nullptr;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    nbytes_ = o.nbytes_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.nbytes_ = 0;
  }
  return *this;
}

Tensor Tensor::of(void* data, DType dtype, Device device, std::initializer_list<int64_t> dims) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  LILY_CHECK(dims.size() <= 4, "tensor rank above 4");
  for (int64_t d : dims) t.shape[t.ndim++] = d;
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Tensor f32_view(const Buffer& b, int64_t rows, int64_t cols) {
  LILY_CHECK(size_t(rows * cols) * 4 <= b.nbytes(), "view [", rows, ", ", cols, "] exceeds buffer");
  return Tensor::of(b.data(), DType::F32, b.device(), {rows, cols});
}

}  // namespace lily
