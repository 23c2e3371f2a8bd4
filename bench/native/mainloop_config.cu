// One configuration of the mainloop search (mainloop.h), chosen at compile time:
//   -DMAINLOOP_CONFIG=i -DTILE_M= -DTILE_N= -DTILE_K= -DCLUSTER_M= -DCLUSTER_N= -DCOOPERATIVE=0|1
//   -DSTREAM_K=0|1 -DSTAGES=0|n -DEPI_N=
// (build_mainloop.sh passes them; STAGES 0: as many as the shared memory left by the epilogue
// holds). Defines mainloop_config_<i>(), the configuration and its launcher.
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's device asserts serialize the wgmma pipeline
#endif

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "mainloop.h"

#define ML_CAT2(a, b) a##b
#define ML_CAT(a, b) ML_CAT2(a, b)
#define ML_STR2(a) #a
#define ML_STR(a) ML_STR2(a)

namespace {

using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;
using TileShape = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::Int<TILE_K>>;
using ClusterShape = cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>;
using KernelSchedule = cute::conditional_t<COOPERATIVE, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                           cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
using EpilogueSchedule = cute::conditional_t<COOPERATIVE, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                             cutlass::epilogue::TmaWarpSpecialized>;
using Scheduler = cute::conditional_t<STREAM_K, cutlass::gemm::StreamKScheduler, void>;
// The epilogue sub-tile: CUTLASS's automatic one spelled out (EpilogueTileAuto's deduction does not
// compile in gcc's host pass for the cooperative schedules), 128 (cooperative; 64 for 64-row
// tiles) or 64 rows (ping-pong) by EPI_N columns (CUTLASS's choice: 32).
using EpilogueTile = cute::Shape<cute::Int<(COOPERATIVE && TILE_M >= 128) ? 128 : 64>, cute::Int<EPI_N>>;
template <class Epilogue>
using Stages = cute::conditional_t<(STAGES > 0), cutlass::gemm::collective::StageCount<(STAGES > 0 ? STAGES : 1)>,
                                   cutlass::gemm::collective::StageCountAutoCarveout<
                                       static_cast<int>(sizeof(typename Epilogue::SharedStorage))>>;

// One kernel per layout of B.
#define ML_KERNEL(NAME, LAYOUT_B)                                                                               \
  struct NAME {                                                                                                \
    using LayoutA = cutlass::layout::RowMajor;                                                                 \
    using LayoutD = cutlass::layout::RowMajor;                                                                 \
    using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<                                         \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,                          \
        EpilogueTile, float, float, void, LayoutD, kAlign, Element, LayoutD,                                  \
        kAlign, EpilogueSchedule>::CollectiveOp;                                                               \
    using Mainloop = cutlass::gemm::collective::CollectiveBuilder<                                             \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LAYOUT_B,      \
        kAlign, float, TileShape, ClusterShape,                                                                \
        Stages<Epilogue>, KernelSchedule>::CollectiveOp;                                                       \
    using GemmKernel =                                                                                         \
        cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;  \
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;                                      \
  };
ML_KERNEL(KernelBKMajor, cutlass::layout::ColumnMajor)
ML_KERNEL(KernelBNMajor, cutlass::layout::RowMajor)

template <class Kernel>
bool run(mainloop::Order order, int sm_count, int m, int n, int k, const void* a, const void* b, void* d,
         void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  using Gemm = typename Kernel::Gemm;
  using GemmKernel = typename Gemm::GemmKernel;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(a), cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1)),
       static_cast<const Element*>(b), cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1))},
      {{}, nullptr, cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(m, n, 1)), static_cast<Element*>(d),
       cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1))}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order =
      order.raster == 1 ? Raster::AlongM : order.raster == 2 ? Raster::AlongN : Raster::Heuristic;
  args.scheduler.max_swizzle_size = order.swizzle;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  static bool smem_raised = false;  // the harness is single-threaded
  constexpr int smem = static_cast<int>(GemmKernel::SharedStorageSize);
  if (!smem_raised && smem >= (48 << 10)) {
    if (cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return false;
    smem_raised = true;
  }
  if (GemmKernel::initialize_workspace(args, workspace, stream, nullptr) != cutlass::Status::kSuccess) return false;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  return Gemm::run(params, stream) == cutlass::Status::kSuccess && cudaPeekAtLastError() == cudaSuccess;
}

bool run_any(bool b_k_major, mainloop::Order order, int sm_count, int m, int n, int k, const void* a, const void* b,
             void* d, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  return b_k_major ? run<KernelBKMajor>(order, sm_count, m, n, k, a, b, d, workspace,
                                                      workspace_bytes, stream)
                   : run<KernelBNMajor>(order, sm_count, m, n, k, a, b, d, workspace, workspace_bytes,
                                                   stream);
}

}  // namespace

mainloop::Entry ML_CAT(mainloop_config_, MAINLOOP_CONFIG)() {
  constexpr int smem = static_cast<int>(KernelBKMajor::GemmKernel::SharedStorageSize);
  constexpr int stages = KernelBKMajor::Mainloop::DispatchPolicy::Stages;
  static_assert(stages == KernelBNMajor::Mainloop::DispatchPolicy::Stages, "one stage count per configuration");
  return {{ML_STR(CONFIG_NAME), TILE_M, TILE_N, TILE_K, CLUSTER_M, CLUSTER_N, COOPERATIVE != 0, STREAM_K != 0, smem,
           stages, cute::size<0>(EpilogueTile{}), EPI_N},
          &run_any};
}
