// Shared basics of the C++ core: the error type, checks, dtypes, devices and half-float conversion.
#pragma once
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace lily {

// Every error the core raises on purpose; Python sees it as lily.LilyError.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(const Args&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw Error(s.str());
}

#define LILY_CHECK(cond, ...)            \
  do {                                   \
    if (!(cond)) ::lily::fail(__VA_ARGS__); \
  } while (0)

enum class DType : uint8_t { F32, F16, BF16, U32, I32 };
enum class Device : uint8_t { CPU, CUDA, Metal };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::U32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
  }
  fail("unsupported dtype");
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::U32: return "U32";
    case DType::I32: return "I32";
  }
  return "?";
}

DType parse_dtype(const std::string& name);
Device parse_device(const std::string& name);
const char* device_name(Device d);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// binary32 -> bfloat16 bits, round to nearest even (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, subnormals and inf/NaN included.
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace lily
