// Device memory and non-owning tensor views. Every op takes views; buffers own the bytes.
#pragma once
#include <array>
#include <initializer_list>
#include <memory>
#include <vector>

#include "common.h"

namespace lily {

// Owning, aligned, device-tagged allocation, or a borrowed range of one (view()). Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, size_t nbytes);
  // nbytes at offset of `base`, not owned: `base` must outlive it and stay where it is.
  static Buffer view(const Buffer& base, size_t offset, size_t nbytes);
  ~Buffer();
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  void upload(const void* host, size_t nbytes, size_t offset = 0);
  void download(void* host, size_t nbytes, size_t offset = 0) const;
  // The same queued on the device's stream, returning at once (on the CPU they copy at once). `host`
  // is page-locked memory (a HostBuffer of this device); it must not change (upload) or be read
  // (download) until a DeviceFence recorded after the copy has been waited on.
  void upload_async(const void* host, size_t nbytes, size_t offset = 0);
  void download_async(void* host, size_t nbytes, size_t offset = 0) const;
  void copy_from(const Buffer& src, size_t nbytes, size_t offset = 0);  // into this at offset
  void zero();
  bool owned() const { return owned_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_ = Device::CPU;
  bool owned_ = true;
};

// Host memory that `device` copies to and from asynchronously (Buffer::upload_async / download_async):
// page-locked on GPUs, plain on the CPU. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(Device device, size_t nbytes);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_ = Device::CPU;
};

// A contiguous row-major view: shape[0] is the slowest axis.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  std::array<int64_t, 4> shape{};

  static Tensor of(void* data, DType dtype, Device device, std::initializer_list<int64_t> dims);
  int64_t numel() const;
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  std::string shape_str() const;
};

// A [rows, cols] float32 view of a buffer, the workhorse of activations.
Tensor f32_view(const Buffer& b, int64_t rows, int64_t cols);

}  // namespace lily
