#include "core/cutlass_sm90/cutlass_sm90_common.cuh"  // first: it turns CUTLASS's device asserts off
#include "core/cutlass_sm90/cutlass_sm90_forward.h"

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

namespace fused_dense::core {
namespace {

using namespace cutlass_sm90;

// In CUTLASS's column-major terms the forward is D[N, B] = W[N, K] * x^T[K, B]: the weight is a
// K-major A, the input a K-major B, out and pre_act M-major [N, B], the bias one value per row
// of D. The tile configuration of the data gradient's GELU kernel, whose epilogue also moves a
// second 16-bit matrix: 128 x 128 tiles, 2 x 1 clusters, ping-pong; one kernel per epilogue
// sub-tile (with_epilogue_tile).
template <class Element, class EpilogueTile>
struct ForwardKernel {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::ColumnMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Fusion = cutlass::epilogue::fusion::LinCombPerRowBiasEltActAux<LayoutD, GeluApprox, Element, float,
                                                                       /*aux*/ Element, /*bias*/ Element,
                                                                       /*source*/ Element, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
      void, LayoutD, kAlign, Element, LayoutD, kAlign, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class Element, class EpilogueTile>
bool run_forward(int order, const CutlassSm90ForwardArgs& a, const Workspace& ws, cudaStream_t stream) {
  using Gemm = typename ForwardKernel<Element, EpilogueTile>::Gemm;
  const int m = static_cast<int>(a.out_features), n = static_cast<int>(a.batch), k = static_cast<int>(a.in_features);
  auto args = gemm_arguments<Gemm>(m, n, k, static_cast<const Element*>(a.weight),
                                   static_cast<const Element*>(a.input), static_cast<Element*>(a.out));
  auto& fusion = args.epilogue.thread;
  fusion.bias_ptr = static_cast<const Element*>(a.bias);
  fusion.aux_ptr = static_cast<Element*>(a.pre_act);
  fusion.dAux = args.epilogue.dD;
  set_scheduler(args, order, a.device);
  return launch<Gemm>(args, ws.ptr, ws.bytes, stream);
}

bool fits(const CutlassSm90ForwardArgs& a) {
  return a.activation == Activation::kGeluTanh && a.dtype != DType::kFloat32 && a.bias != nullptr &&
         a.pre_act != nullptr && widths_fit(a.batch, a.in_features, a.out_features) && aligned16(a.input) &&
         aligned16(a.weight) && aligned16(a.bias) && aligned16(a.out) && aligned16(a.pre_act);
}

}  // namespace

int cutlass_sm90_forward_variants(const CutlassSm90ForwardArgs& a) {
  return fits(a) && is_sm90(a.device) ? kNumEpilogueTiles * kCutlassOrders : 0;
}

bool cutlass_sm90_forward(int variant, const CutlassSm90ForwardArgs& a, const Workspace& ws, cudaStream_t stream) {
  if (variant < 0 || variant >= kNumEpilogueTiles * kCutlassOrders || !fits(a)) return false;
  const int order = variant % kCutlassOrders;
  return with_epilogue_tile(variant / kCutlassOrders, [&](auto tile) {
    using Tile = decltype(tile);
    if (a.dtype == DType::kBFloat16) return run_forward<cutlass::bfloat16_t, Tile>(order, a, ws, stream);
    return run_forward<cutlass::half_t, Tile>(order, a, ws, stream);
  });
}

}  // namespace fused_dense::core

#else  // built without CUTLASS or without sm_90a: no variant

namespace fused_dense::core {

int cutlass_sm90_forward_variants(const CutlassSm90ForwardArgs&) { return 0; }

bool cutlass_sm90_forward(int, const CutlassSm90ForwardArgs&, const Workspace&, cudaStream_t) { return false; }

}  // namespace fused_dense::core

#endif
