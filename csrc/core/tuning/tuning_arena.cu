#include "core/tuning/tuning_arena.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "core/common/cuda_check.h"

namespace fused_dense::core {
namespace {

__device__ __forceinline__ uint32_t mix(uint64_t i) {
  // SplitMix64's finaliser: consecutive indices give unrelated words
  i += 0x9E3779B97F4A7C15ull;
  i = (i ^ (i >> 30)) * 0xBF58476D1CE4E5B9ull;
  i = (i ^ (i >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(i ^ (i >> 31));
}

__device__ __forceinline__ float unit(uint64_t i) {
  return static_cast<float>(mix(i) >> 8) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void fill_values(T* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(unit(static_cast<uint64_t>(i)));
}

// Roughly normal values (a sum of four uniforms: sigma 1, |v| <= 3.46) at sigma = max / 5, as a
// tensor quantized at its amax (amax ~ 5 sigma over millions of elements) spreads over the
// format's exponents: a GEMM's power, and so its clock and ranking, follow its operands' bits.
__global__ void fill_fp8(uint8_t* out, int64_t n, bool e5m2) {
  const float sigma = (e5m2 ? 57344.f : 448.f) / 5.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t j = 4 * static_cast<uint64_t>(i);
    const float v = (unit(j) + unit(j + 1) + unit(j + 2) + unit(j + 3)) * 0.8660254f * sigma;
    out[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
  }
}

__global__ void fill_bytes(uint8_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<uint8_t>(mix(static_cast<uint64_t>(i)));
}

constexpr int kThreads = 256;
unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 4096));
}

}  // namespace

TuningArena::~TuningArena() {
  // (A destructor has no caller to report a failed free to, so its status is dropped.)
  for (void* p : buffers_) cudaFreeAsync(p, stream_);
}

// Every buffer starts on a 256-byte boundary: the algorithms measured on them were listed for
// operands that aligned (gemm.h).
void* TuningArena::allocate(std::size_t n) {
  if (!ok_) return nullptr;
  constexpr std::size_t kAlign = 256;
  void* p = nullptr;
  const cudaError_t status = cudaMallocAsync(&p, n + kAlign, stream_);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky, but leave no error behind for the caller's checks
    ok_ = false;
    return nullptr;
  }
  FD_CUDA_CHECK(status);
  buffers_.push_back(p);
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<void*>((addr + kAlign - 1) / kAlign * kAlign);
}

void* TuningArena::values(int64_t elements, DType dtype) {
  void* p = allocate(static_cast<std::size_t>(elements) * dtype_size(dtype));
  if (p == nullptr || elements <= 0) return p;
  switch (dtype) {
    case DType::kFloat32: fill_values<<<grid_for(elements), kThreads, 0, stream_>>>(static_cast<float*>(p), elements); break;
    case DType::kFloat16: fill_values<<<grid_for(elements), kThreads, 0, stream_>>>(static_cast<__half*>(p), elements); break;
    case DType::kBFloat16:
      fill_values<<<grid_for(elements), kThreads, 0, stream_>>>(static_cast<__nv_bfloat16*>(p), elements);
      break;
  }
  FD_CHECK_LAUNCH();
  return p;
}

void* TuningArena::fp8_values(int64_t elements, Fp8Format format) {
  void* p = allocate(static_cast<std::size_t>(elements));
  if (p == nullptr || elements <= 0) return p;
  fill_fp8<<<grid_for(elements), kThreads, 0, stream_>>>(static_cast<uint8_t*>(p), elements,
                                                          format == Fp8Format::kE5M2);
  FD_CHECK_LAUNCH();
  return p;
}

void* TuningArena::random_bytes(std::size_t n) {
  void* p = allocate(n);
  if (p == nullptr || n == 0) return p;
  const auto count = static_cast<int64_t>(n);
  fill_bytes<<<grid_for(count), kThreads, 0, stream_>>>(static_cast<uint8_t*>(p), count);
  FD_CHECK_LAUNCH();
  return p;
}

void* TuningArena::scratch(std::size_t n) { return allocate(n); }

}  // namespace fused_dense::core
