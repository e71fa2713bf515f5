// Placeholder until the kernels land.
#include "cuda_ops.h"
