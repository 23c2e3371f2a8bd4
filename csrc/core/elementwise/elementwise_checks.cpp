#include "core/elementwise/elementwise_checks.h"

#include <sstream>
#include <string>

namespace fused_dense::core::elementwise_detail {
namespace {

bool valid_dtype(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32;
}

bool valid_act(Activation a) {
  return a == Activation::kNone || a == Activation::kGeluTanh || a == Activation::kRelu ||
         a == Activation::kSquaredRelu;
}

bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  if (a == nullptr || b == nullptr || an == 0 || bn == 0) return false;
  const auto ua = reinterpret_cast<std::uintptr_t>(a);
  const auto ub = reinterpret_cast<std::uintptr_t>(b);
  return ua < ub + bn && ub < ua + an;
}

}  // namespace

void fail(const char* fn, const std::string& what) {
  throw Error(std::string("fused_dense: ") + fn + ": " + what);
}

void check_shape(const char* fn, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) {
    std::ostringstream m;
    m << "rows and cols must be non-negative, got rows=" << rows << " cols=" << cols;
    fail(fn, m.str());
  }
  // Byte offsets of a [rows, cols] fp32 matrix (and of the workspace) must fit in int64.
  if (cols > 0 && rows > INT64_MAX / 8 / cols) {
    std::ostringstream m;
    m << "matrix too large: rows=" << rows << " cols=" << cols;
    fail(fn, m.str());
  }
}

void check_codes(const char* fn, DType dtype, Activation act) {
  if (!valid_dtype(dtype)) fail(fn, "unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
  if (!valid_act(act)) fail(fn, "unsupported activation code " + std::to_string(static_cast<int>(act)));
}

void check_gated_codes(const char* fn, DType dtype, Activation act) {
  if (!valid_dtype(dtype)) fail(fn, "unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
  if (!is_gated(act))
    fail(fn, "activation must be gated (swiglu or geglu), got code " + std::to_string(static_cast<int>(act)));
}

void require_same_or_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                              const void* b, std::size_t bbytes) {
  if (overlaps(a, abytes, b, bbytes) && !(a == b && abytes == bbytes)) {
    fail(fn, std::string(an) + " and " + bn + " partially overlap; they must be the same buffer or disjoint");
  }
}

void require_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                      const void* b, std::size_t bbytes) {
  if (overlaps(a, abytes, b, bbytes)) fail(fn, std::string(an) + " and " + bn + " must not overlap");
}

}  // namespace fused_dense::core::elementwise_detail
