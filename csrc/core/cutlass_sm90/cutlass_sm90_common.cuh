// What the library's cutlass_sm90 kernels (cutlass_sm90_dgrad.cu, cutlass_sm90_forward.cu) share:
// the CUTLASS headers, the tile-scheduler orders and epilogue sub-tiles the tuner times as
// variants, the GEMM arguments, the device checks and the operand rules. Include it first: it
// turns CUTLASS's device asserts off.
#pragma once

// CUTLASS's device code asserts; an assert is a call, across which ptxas serializes the wgmma
// pipeline (warning C7510, a large slowdown). Release builds of these files go without them.
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "core/common/cuda_check.h"
#include "core/common/cuda_context.h"
#include "core/common/device_info.h"
#include "core/common/cutlass_variants.h"

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "core/common/activation_math.cuh"

namespace fused_dense::core::cutlass_sm90 {

// CUTLASS calls an epilogue's activation as Fn<Array<float, n>>{}(args...) and looks for
// hyper-parameters in Fn<float>, so each functor has both forms. kFast = true: the math the
// elementwise kernels use for 16-bit outputs.
template <class T>
struct GeluApprox {
  CUTLASS_DEVICE T operator()(T const& p) const { return act_forward<Activation::kGeluTanh, true>(p); }
};

template <int n>
struct GeluApprox<cutlass::Array<float, n>> {
  CUTLASS_DEVICE cutlass::Array<float, n> operator()(cutlass::Array<float, n> const& p) const {
    cutlass::Array<float, n> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < n; ++i) out[i] = act_forward<Activation::kGeluTanh, true>(p[i]);
    return out;
  }
};

template <class T>
struct GeluApproxGrad {
  CUTLASS_DEVICE T operator()(T const& d_act, T const& p) const {
    return d_act * act_derivative<Activation::kGeluTanh, true>(p);
  }
};

template <int n>
struct GeluApproxGrad<cutlass::Array<float, n>> {
  CUTLASS_DEVICE cutlass::Array<float, n> operator()(cutlass::Array<float, n> const& d_act,
                                                     cutlass::Array<float, n> const& p) const {
    cutlass::Array<float, n> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < n; ++i) out[i] = d_act[i] * act_derivative<Activation::kGeluTanh, true>(p[i]);
    return out;
  }
};

// The tile scheduler's orders the tuner times, each with every tile configuration of a kernel
// (variant = configuration * kCutlassOrders + order, cutlass_variants.h): CUTLASS's default, and tiles
// grouped 8 at a time along M or along N, which decides how much of A and of B the tiles running
// at once share in L2. Each is the fastest at some shape on the H200 (docs/performance.md).
using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
struct SchedulerOrder {
  int swizzle;
  RasterOrder raster;
};
inline constexpr SchedulerOrder kOrders[] = {
    {1, RasterOrder::Heuristic}, {8, RasterOrder::AlongM}, {8, RasterOrder::AlongN}};
static_assert(sizeof(kOrders) / sizeof(kOrders[0]) == kCutlassOrders,
              "cutlass_variants.h numbers the variants by kCutlassOrders");

template <class Arguments>
void set_scheduler(Arguments& args, int order, int device) {
  args.hw_info.device_id = device;
  // cached: CUTLASS's persistent scheduler sizes its grid by it and would otherwise query it per call
  args.hw_info.sm_count = device_info(device).sm_count();
  args.scheduler.max_swizzle_size = kOrders[order].swizzle;
  args.scheduler.raster_order = kOrders[order].raster;
}

// The epilogue sub-tiles of the ping-pong 128 x 128 kernels with a second 16-bit matrix in the
// epilogue (the GELU data gradient reads pre_act, the GELU forward writes it): their tile
// configurations. 64 x 32 is CUTLASS's default for that tile (8 sub-tiles; ping-pong allows 64
// rows only); 64 x 64 cuts a tile into 4, so half as many epilogue barriers and TMA issues per
// tile, for twice the registers per sub-tile. Neither wins everywhere on the H200 (64 x 64 takes
// fc2's data gradient and fc1's forward at d = 1024, 64 x 32 most shapes at d = 2048 and 4096:
// docs/performance.md, "Epilogue sub-tiles"), so the tuner times both; 64 x 128 is the fastest
// nowhere and is not offered.
inline constexpr int kNumEpilogueTiles = 2;

template <class Fn>
bool with_epilogue_tile(int config, Fn&& fn) {
  using cute::_32;
  using cute::_64;
  switch (config) {
    case 0: return fn(cute::Shape<_64, _32>{});
    case 1: return fn(cute::Shape<_64, _64>{});
    default: return false;
  }
}

// The arguments of a GEMM D[M, N] = A[M, K] * B[K, N] (CUTLASS's terms; the layouts are the
// kernel's) with packed strides and no source C; the caller fills in the epilogue's fusion.
template <class Gemm, class Element>
typename Gemm::Arguments gemm_arguments(int m, int n, int k, const Element* a, const Element* b, Element* d) {
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {a, cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1)), b,
       cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1))},
      {{}, nullptr, stride_d, d, stride_d}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  return args;
}

// Raises the kernel's dynamic shared-memory limit on `device` the first time it launches there.
// CUTLASS's GemmUniversalAdapter::initialize() does it on every call: a driver call of ~4 µs on the
// per-call path (H200 host profile), for an attribute that, once set, stays set for the context.
template <class GemmKernel>
void raise_smem_limit_once(int device) {
  constexpr int smem_bytes = static_cast<int>(GemmKernel::SharedStorageSize);
  if constexpr (smem_bytes >= (48 << 10)) {
    static std::atomic<std::uint64_t> done{0};  // a bit per device below 64; setting it twice is harmless
    const std::uint64_t bit = device < 64 ? (std::uint64_t{1} << device) : 0;
    if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
    FD_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       smem_bytes));
    done.fetch_or(bit, std::memory_order_acq_rel);
  }
}

// Launches the kernel on its cluster shape. GemmUniversalAdapter::run() goes through
// ClusterLauncher, which sets cudaFuncAttributeNonPortableClusterSizeAllowed on every launch (a
// driver call of ~4.5 µs on the per-call path: 24 a step of the README's main job in the H200 host
// profile). The attribute matters only above the portable cluster size of 8, which no kernel here
// uses, so the launch is made directly.
template <class GemmKernel>
void launch_on_cluster(typename GemmKernel::Params const& params, cudaStream_t stream) {
  using ClusterShape = typename GemmKernel::DispatchPolicy::ClusterShape;
  static_assert(cute::is_static_v<ClusterShape> && cute::size(ClusterShape{}) <= 8,
                "a cluster above the portable size needs cudaFuncAttributeNonPortableClusterSizeAllowed");
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cute::size<0>(ClusterShape{});
  cluster.val.clusterDim.y = cute::size<1>(ClusterShape{});
  cluster.val.clusterDim.z = cute::size<2>(ClusterShape{});
  cudaLaunchConfig_t config{};
  config.gridDim = GemmKernel::get_grid_shape(params);
  config.blockDim = GemmKernel::get_block_shape();
  config.dynamicSmemBytes = static_cast<std::size_t>(GemmKernel::SharedStorageSize);
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  void* args[] = {const_cast<typename GemmKernel::Params*>(&params)};
  FD_CUDA_CHECK(cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(&cutlass::device_kernel<GemmKernel>), args));
}

// Runs a CUTLASS GEMM, its parameters built on the spot (the TMA descriptors hold this call's
// pointers); false, with nothing launched, when CUTLASS refuses the problem or its workspace does
// not fit. GemmUniversalAdapter's initialize() + run(), without its per-call attribute calls.
template <class Gemm>
bool launch(typename Gemm::Arguments const& args, void* workspace, std::size_t workspace_bytes,
            cudaStream_t stream) {
  using GemmKernel = typename Gemm::GemmKernel;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
  const int device = args.hw_info.device_id;
  ensure_current_context(device);  // to_underlying_arguments() encodes TMA descriptors (driver API)
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  cutlass::Status status = GemmKernel::initialize_workspace(args, workspace, stream, nullptr);
  if (status != cutlass::Status::kSuccess)
    throw_status("CUTLASS initialize_workspace", cutlassGetStatusString(status), __FILE__, __LINE__);
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  raise_smem_limit_once<GemmKernel>(device);
  launch_on_cluster<GemmKernel>(params, stream);
  FD_CHECK_LAUNCH();
  return true;
}

}  // namespace fused_dense::core::cutlass_sm90

#endif  // FUSED_DENSE_WITH_CUTLASS_SM90A

namespace fused_dense::core::cutlass_sm90 {

// True on compute capability 9.0 exactly: an sm_90a cubin runs there only.
inline bool is_sm90(int device) {
  const DeviceInfo& info = device_info(device);
  return info.cc_major() == 9 && info.cc_minor() == 0;
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// TMA needs every row stride a multiple of 16 bytes (8 16-bit elements); CUTLASS's problem
// shape is int.
inline bool widths_fit(int64_t rows, int64_t a, int64_t b) {
  return a % 8 == 0 && b % 8 == 0 && rows > 0 && rows <= INT32_MAX && a > 0 && a <= INT32_MAX && b > 0 &&
         b <= INT32_MAX;
}

}  // namespace fused_dense::core::cutlass_sm90
