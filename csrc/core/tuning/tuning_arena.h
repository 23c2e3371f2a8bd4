// Synthetic operands for measuring a problem at its bucket's representative M (tuner.h): device
// buffers from CUDA's stream-ordered allocator, filled with pseudo-random values in [-1, 1) (a
// GEMM on zeros runs at another power and clock than on real data), freed on the same stream
// when the arena goes. A failed allocation is not an error: ok() turns false and the caller
// keeps the rule's choice instead of measuring.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/common/types.h"

namespace fused_dense::core {

class TuningArena {
 public:
  explicit TuningArena(cudaStream_t stream) : stream_(stream) {}
  ~TuningArena();
  TuningArena(const TuningArena&) = delete;
  TuningArena& operator=(const TuningArena&) = delete;

  // `elements` values of dtype in [-1, 1), or null (and ok() false) when allocation failed.
  void* values(int64_t elements, DType dtype);
  // `elements` FP8 values of `format`, roughly normal at a fifth of the format's largest value (as
  // a tensor quantized at its amax), or null (and ok() false) when allocation failed.
  void* fp8_values(int64_t elements, Fp8Format format);
  // `n` pseudo-random bytes (ReLU bit-masks).
  void* random_bytes(std::size_t n);
  // `n` bytes left as they are (outputs, workspace).
  void* scratch(std::size_t n);
  bool ok() const { return ok_; }

 private:
  void* allocate(std::size_t n);
  cudaStream_t stream_;
  bool ok_ = true;
  std::vector<void*> buffers_;
};

}  // namespace fused_dense::core
