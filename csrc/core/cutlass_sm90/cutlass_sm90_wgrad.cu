#include "core/cutlass_sm90/cutlass_sm90_common.cuh"  // first: it turns CUTLASS's device asserts off
#include "core/cutlass_sm90/cutlass_sm90_wgrad.h"

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

namespace fused_dense::core {
namespace {

using namespace cutlass_sm90;

// cutlass_sm90_wgrad.h has the layout. One kernel per tile configuration.
template <class Element, int TM, int TN, int CM, bool Cooperative>
struct WgradKernel {
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::_1, cute::_1>;
  using Schedule = cute::conditional_t<Cooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                       cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = cute::conditional_t<Cooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                               cutlass::epilogue::TmaWarpSpecialized>;
  // CUTLASS's automatic sub-tile spelled out (its deduction does not compile in gcc's host pass for
  // the cooperative schedule): 128 rows (cooperative) or 64 (ping-pong) by 32 columns.
  using EpilogueTile = cute::Shape<cute::Int<Cooperative ? 128 : 64>, cute::_32>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
      Element, cutlass::layout::RowMajor, kAlign, Element, cutlass::layout::RowMajor, kAlign,
      EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class K, class Element>
bool run_wgrad(int order, const CutlassSm90WgradArgs& a, const Workspace& ws, cudaStream_t stream) {
  using Gemm = typename K::Gemm;
  using GK = typename Gemm::GemmKernel;
  const int m = static_cast<int>(a.out_rows), n = static_cast<int>(a.out_cols), k = static_cast<int>(a.rows);
  auto* dw = static_cast<Element*>(a.weight_grad);
  const auto stride_d = cutlass::make_cute_packed_stride(typename GK::StrideD{}, cute::make_shape(m, n, 1));
  const auto stride_c = cutlass::make_cute_packed_stride(typename GK::StrideC{}, cute::make_shape(m, n, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(a.grad), cutlass::make_cute_packed_stride(typename GK::StrideA{}, cute::make_shape(m, k, 1)),
       static_cast<const Element*>(a.input), cutlass::make_cute_packed_stride(typename GK::StrideB{}, cute::make_shape(n, k, 1))},
      {{}, dw, stride_c, dw, stride_d}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 1.f;
  set_scheduler(args, order, a.device);
  return launch<Gemm>(args, ws.ptr, ws.bytes, stream);
}

constexpr int kConfigs = 3;

template <class Element>
bool run_config(int config, int order, const CutlassSm90WgradArgs& a, const Workspace& ws, cudaStream_t stream) {
  switch (config) {
    case 0: return run_wgrad<WgradKernel<Element, 128, 128, 1, false>, Element>(order, a, ws, stream);
    case 1: return run_wgrad<WgradKernel<Element, 128, 128, 2, false>, Element>(order, a, ws, stream);
    case 2: return run_wgrad<WgradKernel<Element, 256, 128, 2, true>, Element>(order, a, ws, stream);
    default: return false;
  }
}

bool fits(const CutlassSm90WgradArgs& a) {
  return (a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16) && widths_fit(a.rows, a.out_rows, a.out_cols) &&
         aligned16(a.grad) && aligned16(a.input) && aligned16(a.weight_grad);
}

}  // namespace

int cutlass_sm90_wgrad_variants(const CutlassSm90WgradArgs& a) {
  return fits(a) && is_sm90(a.device) ? kConfigs * kCutlassOrders : 0;
}

bool cutlass_sm90_wgrad(int variant, const CutlassSm90WgradArgs& a, const Workspace& ws, cudaStream_t stream) {
  if (variant < 0 || variant >= kConfigs * kCutlassOrders || cutlass_sm90_wgrad_variants(a) == 0) return false;
  const int config = variant / kCutlassOrders, order = variant % kCutlassOrders;
  if (a.dtype == DType::kBFloat16) return run_config<cutlass::bfloat16_t>(config, order, a, ws, stream);
  return run_config<cutlass::half_t>(config, order, a, ws, stream);
}

}  // namespace fused_dense::core

#else  // built without CUTLASS or without sm_90a: no variant

namespace fused_dense::core {

int cutlass_sm90_wgrad_variants(const CutlassSm90WgradArgs&) { return 0; }

bool cutlass_sm90_wgrad(int, const CutlassSm90WgradArgs&, const Workspace&, cudaStream_t) { return false; }

}  // namespace fused_dense::core

#endif
