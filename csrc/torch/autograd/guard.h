// The Autograd kernel of the raw ops (guard.cpp), registered where each op's schema is defined.
#pragma once

#include <torch/library.h>

namespace fused_dense {

// Defines the op of `schema` and registers the guard as its Autograd kernel. Every op without a
// derivative of its own is defined this way, in its family's file (csrc/torch/README.md).
void def_raw_op(torch::Library& m, const char* schema);

}  // namespace fused_dense
