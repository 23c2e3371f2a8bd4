// Hash for the caches' fixed-size integer keys (gemm plans, tuned choices).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace fused_dense::core {

// FNV-1a over the key's integers: cheap, and the keys are small and mostly distinct in shape.
struct IntArrayHash {
  template <std::size_t N>
  std::size_t operator()(const std::array<int64_t, N>& v) const {
    std::size_t h = 1469598103934665603ull;
    for (int64_t x : v) h = (h ^ static_cast<std::size_t>(x)) * 1099511628211ull;
    return h;
  }
};

}  // namespace fused_dense::core
