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
