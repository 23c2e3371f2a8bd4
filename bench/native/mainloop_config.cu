// One configuration of the mainloop search (mainloop.h), chosen at compile time:
//   -DMAINLOOP_CONFIG=i -DTILE_M= -DTILE_N= -DTILE_K= -DCLUSTER_M= -DCLUSTER_N= -DCOOPERATIVE=0|1
//   -DSTREAM_K=0|1 -DSTAGES=0|n -DEPI_N= -DSPLIT_N=0|1 -DEPI_NOSMEM=0|1
// (build_mainloop.sh passes them; STAGES 0: as many as the shared memory left by the epilogue
// holds). Defines mainloop_config_<i>(), the configuration and its launcher.
//
// SPLIT_N=1 (cooperative only): the two consumer warp groups split the tile along N, each owning
// TILE_M x TILE_N / 2, where CUTLASS's builder splits along M (so its M tile must be a multiple
// of 128). This is the shape of cuBLASLt's 192 x 192 cooperative kernels (nvjet `coopB`), which
// the M split cannot express. Its epilogue stores the accumulators from registers
// (NoSmemWarpSpecialized): CUTLASS's TMA epilogue for the cooperative schedule wants 128-row
// sub-tiles. STAGES must be given. EPI_NOSMEM=1 gives a configuration of the builder's kind the
// same epilogue, the control that separates the split's effect from the epilogue's.
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's device asserts serialize the wgmma pipeline
#endif

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "mainloop.h"

#define ML_CAT2(a, b) a##b
#define ML_CAT(a, b) ML_CAT2(a, b)
#define ML_STR2(a) #a
#define ML_STR(a) ML_STR2(a)

#ifndef SPLIT_N
#define SPLIT_N 0
#endif
#ifndef EPI_NOSMEM  // 1: the register-store epilogue (NoSmemWarpSpecialized) without the N split
#define EPI_NOSMEM SPLIT_N
#endif

namespace {

using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;
using TileShape = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::Int<TILE_K>>;
using ClusterShape = cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>;
using KernelSchedule = cute::conditional_t<COOPERATIVE, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                           cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
static_assert(!SPLIT_N || (COOPERATIVE && STAGES > 0 && TILE_N % 16 == 0),
              "SPLIT_N: a cooperative configuration with its stage count given and N / 2 a multiple of 8");
using EpilogueSchedule = cute::conditional_t<
    EPI_NOSMEM, cutlass::epilogue::NoSmemWarpSpecialized,
    cute::conditional_t<COOPERATIVE, cutlass::epilogue::TmaWarpSpecializedCooperative,
                        cutlass::epilogue::TmaWarpSpecialized>>;
using Scheduler = cute::conditional_t<STREAM_K, cutlass::gemm::StreamKScheduler, void>;
// The epilogue sub-tile: CUTLASS's automatic one spelled out (EpilogueTileAuto's deduction does not
// compile in gcc's host pass for the cooperative schedules), 128 (cooperative; 64 for 64-row
// tiles) or 64 rows (ping-pong) by EPI_N columns (CUTLASS's choice: 32). The register-store
// epilogue has no sub-tile (EpilogueTileAuto, which it ignores).
using EpilogueTile = cute::conditional_t<
    EPI_NOSMEM, cutlass::epilogue::collective::EpilogueTileAuto,
    cute::Shape<cute::Int<(COOPERATIVE && TILE_M >= 128) ? 128 : 64>, cute::Int<EPI_N>>>;
constexpr int kEpiM = EPI_NOSMEM ? 0 : ((COOPERATIVE && TILE_M >= 128) ? 128 : 64);  // 0: no sub-tile
template <class Epilogue>
using Stages = cute::conditional_t<(STAGES > 0), cutlass::gemm::collective::StageCount<(STAGES > 0 ? STAGES : 1)>,
                                   cutlass::gemm::collective::StageCountAutoCarveout<
                                       static_cast<int>(sizeof(typename Epilogue::SharedStorage))>>;

// The mainloop with the warp groups side by side along N (SPLIT_N): the builder's parts but the
// tiled MMA's layout (1, 2, 1) over an atom of N / 2 columns, and the shared-memory swizzle chosen
// for N / 2 columns, so the second warp group's B descriptor starts on a swizzle atom.
template <class LayoutA, class LayoutB>
struct SplitNMainloop {
  static constexpr auto kMajorA = cutlass::gemm::collective::detail::gmma_ss_tag_to_major_A<Element, LayoutA>();
  static constexpr auto kMajorB = cutlass::gemm::collective::detail::gmma_ss_tag_to_major_B<Element, LayoutB>();
  using HalfTile = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N / 2>, cute::Int<TILE_K>>;
  using Atom = decltype(cute::GMMA::ss_op_selector<Element, Element, float, HalfTile, kMajorA, kMajorB>());
  using TiledMma = decltype(cute::make_tiled_mma(Atom{}, cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>{}));
  using GmemTiledCopyA =
      decltype(cutlass::gemm::collective::detail::sm90_cluster_shape_to_tma_atom(cute::shape<1>(ClusterShape{})));
  using GmemTiledCopyB =
      decltype(cutlass::gemm::collective::detail::sm90_cluster_shape_to_tma_atom(cute::shape<0>(ClusterShape{})));
  using SmemLayoutAtomA = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   kMajorA, Element, cute::Int<TILE_M>, cute::Int<TILE_K>>());
  using SmemLayoutAtomB = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   kMajorB, Element, cute::Int<TILE_N / 2>, cute::Int<TILE_K>>());
  using CollectiveOp = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<(STAGES > 0 ? STAGES : 2), ClusterShape, KernelSchedule>,
      TileShape, Element, cutlass::gemm::TagToStrideA_t<LayoutA>, Element, cutlass::gemm::TagToStrideB_t<LayoutB>,
      TiledMma, GmemTiledCopyA, SmemLayoutAtomA, void, cute::identity, GmemTiledCopyB, SmemLayoutAtomB, void,
      cute::identity>;
};
template <bool kSplitN, class LayoutA, class LayoutB, class Epilogue>
struct PickMainloop {  // the builder's (instantiated only where chosen: it refuses a 192-row M split)
  using type = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, TileShape, ClusterShape, Stages<Epilogue>, KernelSchedule>::CollectiveOp;
};
template <class LayoutA, class LayoutB, class Epilogue>
struct PickMainloop<true, LayoutA, LayoutB, Epilogue> {
  using type = typename SplitNMainloop<LayoutA, LayoutB>::CollectiveOp;
};
template <class LayoutA, class LayoutB, class Epilogue>
using MainloopOf = typename PickMainloop<SPLIT_N != 0, LayoutA, LayoutB, Epilogue>::type;

// One kernel per layout of B.
#define ML_KERNEL(NAME, LAYOUT_B)                                                                               \
  struct NAME {                                                                                                \
    using LayoutA = cutlass::layout::RowMajor;                                                                 \
    using LayoutD = cutlass::layout::RowMajor;                                                                 \
    using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<                                         \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,                          \
        EpilogueTile, float, float, void, LayoutD, kAlign, Element, LayoutD,                                  \
        kAlign, EpilogueSchedule>::CollectiveOp;                                                               \
    using Mainloop = MainloopOf<LayoutA, LAYOUT_B, Epilogue>;                                                 \
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
           stages, kEpiM, EPI_NOSMEM ? 0 : EPI_N},
          &run_any};
}
