// The CUTLASS kernel type behind act_dgrad_sm90.h, instantiated once per tile configuration in
// its own translation unit (config_*.cu), so the slow template builds compile in parallel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "act_dgrad_sm90.h"
#include "activation_math.cuh"

namespace fused_dense_probe {

// gelu_approx'(p) * dy with fused_dense's own formula (csrc/core/activation_math.cuh, the math
// of the library's elementwise kernels for 16-bit outputs).
__device__ __forceinline__ float gelu_approx_grad(float dy, float p) {
  using namespace fused_dense::core;
  return dy * act_derivative<Activation::kGeluTanh, true>(p);
}

// CUTLASS calls the epilogue's activation as Fn<Array<float, N>>{}(d_y, pre_act); it also
// names Fn<float> to look for hyper-parameters, so both forms exist.
template <class T>
struct GeluApproxGrad {
  CUTLASS_DEVICE T operator()(T const& dy, T const& p) const { return gelu_approx_grad(dy, p); }
};

template <int N>
struct GeluApproxGrad<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& dy,
                                                     cutlass::Array<float, N> const& p) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = gelu_approx_grad(dy[i], p[i]);
    return out;
  }
};

// What the epilogue does: d_act only (the same GEMM with a plain epilogue, CUTLASS's own floor),
// the GELU backward without the bias gradient, or both.
enum class Epi { kPlain, kGeluGrad, kGeluGradBias };

template <Epi kEpi, class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule>
struct ActDgradKernel {
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::ColumnMajor;  // weight [N, K] read as W^T: M-major
  using LayoutB = cutlass::layout::ColumnMajor;  // d_output [B, N] read as dY^T: K-major
  using LayoutD = cutlass::layout::ColumnMajor;  // d_input / pre_act [B, K]: M-major
  static constexpr int kAlign = 16 / sizeof(Element);

  using Fusion = cute::conditional_t<
      kEpi == Epi::kGeluGradBias,
      cutlass::epilogue::fusion::LinCombDeEltActDePerRowBias<LayoutD, GeluApproxGrad, Element, float,
                                                             /*aux*/ Element, /*bias*/ Element, /*source*/ Element>,
      cute::conditional_t<kEpi == Epi::kGeluGrad,
                          cutlass::epilogue::fusion::LinCombDeEltAct<LayoutD, GeluApproxGrad, Element, float,
                                                                     /*aux*/ Element, /*source*/ Element>,
                          cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlign, Element,
      LayoutD, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB,
      kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static typename Gemm::Arguments arguments(const ActDgradProblem& p, int sm_count, const Schedule& sched) {
    const int m = static_cast<int>(p.in_features), n = static_cast<int>(p.batch),
              k = static_cast<int>(p.out_features);
    using StrideA = typename GemmKernel::StrideA;
    using StrideB = typename GemmKernel::StrideB;
    using StrideD = typename GemmKernel::StrideD;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const Element*>(p.weight), cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1)),
         static_cast<const Element*>(p.d_output), cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1))},
        {{},
         nullptr,
         cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1)),
         static_cast<Element*>(p.d_input),
         cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1))}};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.f;
    fusion.beta = 0.f;
    if constexpr (kEpi != Epi::kPlain) {
      fusion.aux_ptr = static_cast<const Element*>(p.pre_act);
      fusion.dAux = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));
    }
    if constexpr (kEpi == Epi::kGeluGradBias) fusion.dbias_ptr = static_cast<Element*>(p.d_bias);
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.max_swizzle_size = sched.swizzle;
    args.scheduler.raster_order = sched.raster == 1 ? Raster::AlongM : sched.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = sm_count;
    return args;
  }

  static size_t workspace_bytes(const ActDgradProblem& p, const Schedule& sched, std::string* error) {
    auto args = arguments(p, 132, sched);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
      *error = "CUTLASS cannot implement this problem with this configuration";
      return 0;
    }
    return Gemm::get_workspace_size(args);
  }

  static std::string run(const ActDgradProblem& p, const Schedule& sched, void* workspace, size_t workspace_bytes,
                         int sm_count, cudaStream_t stream) {
    auto args = arguments(p, sm_count, sched);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return "CUTLASS cannot implement this problem with this configuration";
    if (Gemm::get_workspace_size(args) > workspace_bytes) return "workspace too small";
    cutlass::Status s = gemm.initialize(args, workspace, stream);
    if (s != cutlass::Status::kSuccess)
      return std::string("CUTLASS initialize: ") + cutlassGetStatusString(s);
    s = gemm.run(stream);
    if (s != cutlass::Status::kSuccess) return std::string("CUTLASS run: ") + cutlassGetStatusString(s);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorName(e);
    return {};
  }
};

}  // namespace fused_dense_probe

// One configuration per translation unit: defines config_<ID>_workspace / config_<ID>_run.
#define FUSED_DENSE_PROBE_CONFIG(ID, ...)                                                          \
  namespace fused_dense_probe {                                                                   \
  using Kernel##ID = ActDgradKernel<__VA_ARGS__>;                                                 \
  size_t config_##ID##_workspace(const ActDgradProblem& p, const Schedule& sched, std::string* error) { \
    return Kernel##ID::workspace_bytes(p, sched, error);                                           \
  }                                                                                               \
  std::string config_##ID##_run(const ActDgradProblem& p, const Schedule& sched, void* ws, size_t bytes, \
                                int sms, cudaStream_t stream) {                                  \
    return Kernel##ID::run(p, sched, ws, bytes, sms, stream);                                      \
  }                                                                                               \
  }
