// numpy <-> device helpers shared by the bindings.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>
#include <vector>

#include "../engine/weights.h"

namespace lily::bind {
namespace nb = nanobind;

using HostArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;
using FloatArray = nb::ndarray<nb::numpy, float>;
using IntArray = nb::ndarray<nb::numpy, int32_t>;

inline Buffer to_device(Device d, const HostArray& a) {
  Buffer b(d, a.nbytes());
  b.upload(a.data(), a.nbytes());
  return b;
}

template <typename T>
nb::ndarray<nb::numpy, T> new_array(std::vector<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  T* data = new T[n];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.data(), owner);
}
inline FloatArray new_floats(std::vector<size_t> shape) { return new_array<float>(std::move(shape)); }

// A QMatrix on device d from host arrays in storage form; errors name the tensor.
QMatrix make_qmatrix(Device d, const std::string& name, const HostArray& weight, const std::string& dtype,
                     int64_t num_stack, int64_t rows, int64_t cols, int bits, int group_size,
                     const std::optional<HostArray>& scales, const std::optional<HostArray>& biases,
                     const std::string& scale_dtype);

}  // namespace lily::bind
