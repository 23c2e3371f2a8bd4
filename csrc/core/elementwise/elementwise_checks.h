// Argument checks of the elementwise entry points (elementwise.h; internal to their files): each
// failure throws Error naming the entry point, so a bad call is refused before any launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/common/types.h"

namespace fused_dense::core::elementwise_detail {

[[noreturn]] void fail(const char* fn, const std::string& what);

// rows, cols >= 0, and the byte offsets of a [rows, cols] fp32 matrix fit in int64.
void check_shape(const char* fn, int64_t rows, int64_t cols);
// dtype and act are values of their enums (the codes may come from a cast integer); act is
// not gated.
void check_codes(const char* fn, DType dtype, Activation act);
// As check_codes, for the gating kernels: act is kSwiGLU or kGeGLU.
void check_gated_codes(const char* fn, DType dtype, Activation act);

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Element-for-element in-place use is safe (each thread reads its elements before writing
// them); any other overlap makes threads read what others already overwrote. Null or empty
// buffers overlap nothing.
void require_same_or_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                              const void* b, std::size_t bbytes);
void require_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                      const void* b, std::size_t bbytes);

}  // namespace fused_dense::core::elementwise_detail
