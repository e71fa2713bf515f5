#include "weights.h"

#include <sstream>

namespace lily {

std::string QMatrix::describe() const {
  std::ostringstream s;
  s << "[" << num_stack << ", " << rows << ", " << cols << "] ";
  if (quantized()) s << "affine " << bits << "-bit g" << group_size;
  else s << dtype_name(dtype);
  return s.str();
}

}  // namespace lily
