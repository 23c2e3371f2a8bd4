#include "core/cutlass_sm90/cutlass_sm90_common.cuh"  // first: it turns CUTLASS's device asserts off
#include "core/cutlass_sm90/cutlass_sm90_dgrad.h"

#include <cstddef>
#include <cstdint>

#include "core/elementwise/elementwise.h"

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

namespace fused_dense::core::cutlass_sm90 {

// The GELU backward's epilogue that also sums each output tile's rows (fc1's bias gradient, in
// CUTLASS's column-major terms a per-row reduction of D[K, B]) in the fp32 accumulator and
// stores one partial sum per (row, tile column): plain stores, no atomics, no tile counters.
// CUTLASS's stock LinCombDeEltActDePerRowBias finishes the reduction inside the kernel instead:
// the last tile of each row block to arrive adds every other tile's partials one after the other,
// a chain of dependent L2 loads at the end of the kernel that costs more than a separate
// column-sum pass (docs/performance.md). Here a small kernel (sum_partials) adds them.
template <class Element>
struct DeGeluPartialRowSums
    : cutlass::epilogue::fusion::LinCombDeEltActDePerRowBias<cutlass::layout::ColumnMajor, GeluApproxGrad, Element,
                                                             float, /*aux*/ Element, /*bias*/ float,
                                                             /*source*/ Element, float> {};

}  // namespace fused_dense::core::cutlass_sm90

namespace cutlass::epilogue::fusion {

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class Element,
          class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom, class CopyOpS2R>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       fused_dense::core::cutlass_sm90::DeGeluPartialRowSums<Element>, CtaTileShapeMNK, EpilogueTile,
                       SmemLayoutAtom, CopyOpS2R>
    : Sm90EVT<Sm90Compute<epilogue::thread::Identity, Element, float, FloatRoundStyle::round_to_nearest>,
              Sm90EVT<Sm90ColReduction<plus, plus, plus, /*Stages*/ 0, CtaTileShapeMNK, /*partials*/ float, float,
                                       FloatRoundStyle::round_to_nearest, Stride<_1, _0, int64_t>,
                                       /*Alignment*/ 4, /*EnableNullptr*/ true, /*FinalReduction*/ false>,
                      Sm90LinCombDeEltAct<CtaTileShapeMNK, EpilogueTile, StagesC,
                                          gemm::TagToStrideC_t<layout::ColumnMajor>, SmemLayoutAtom, CopyOpS2R,
                                          fused_dense::core::cutlass_sm90::GeluApproxGrad, float, float, Element,
                                          Element, float>>> {
  using Impl =
      Sm90EVT<Sm90Compute<epilogue::thread::Identity, Element, float, FloatRoundStyle::round_to_nearest>,
              Sm90EVT<Sm90ColReduction<plus, plus, plus, 0, CtaTileShapeMNK, float, float,
                                       FloatRoundStyle::round_to_nearest, Stride<_1, _0, int64_t>, 4, true, false>,
                      Sm90LinCombDeEltAct<CtaTileShapeMNK, EpilogueTile, StagesC,
                                          gemm::TagToStrideC_t<layout::ColumnMajor>, SmemLayoutAtom, CopyOpS2R,
                                          fused_dense::core::cutlass_sm90::GeluApproxGrad, float, float, Element,
                                          Element, float>>>;
  using Operation = fused_dense::core::cutlass_sm90::DeGeluPartialRowSums<Element>;

  struct Arguments {
    float alpha = 1.f;
    float beta = 0.f;
    using StrideAux = gemm::TagToStrideC_t<layout::ColumnMajor>;
    Element const* aux_ptr = nullptr;  // the pre-activation
    StrideAux dAux = {};
    // [ceil(B / tile N)][ceil(K / tile M) * tile M] fp32 partial row sums; null: none computed
    float* partial_ptr = nullptr;

    operator typename Impl::Arguments() const {
      return {
          {                                                 // partial row sums of
           {                                                // gelu'(aux) * (beta * C + alpha * acc)
            {{{beta}, {nullptr}, {}}, {}, {{{alpha}, {nullptr}, {}}, {}, {}}, {}},
            {aux_ptr, Element(0), dAux},
            {}},
           {partial_ptr, 0.f, {}}},
          {}};  // conversion to Element
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion

namespace fused_dense::core {
namespace {

using namespace cutlass_sm90;

// In CUTLASS's column-major terms the data gradient is D[K, B] = W^T[K, N] * dY^T[N, B]: the
// weight is an M-major A, d_output a K-major B, d_input and pre_act M-major [K, B]. Two kernels,
// each the fastest of the tile configurations timed for its epilogue at d <= 4096 on the H200
// (docs/performance.md):
//  * GELU backward: 128 x 128 tiles, 2 x 1 clusters, ping-pong (one warp group's epilogue, which
//    reads pre_act, runs under the other's MMAs), one per epilogue sub-tile (with_epilogue_tile);
//  * plain (activation none, e.g. fc1's data gradient): 128 x 256 tiles, 2 x 1 clusters,
//    cooperative, CUTLASS's epilogue sub-tile; 0.81-0.95x torch.mm's time for fc2's shapes.
//    One tile configuration.
template <class Element, bool kGelu, class EpilogueTile>
struct DgradKernel {
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::ColumnMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = cute::conditional_t<kGelu, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                        cute::Shape<cute::_128, cute::_256, cute::_64>>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using MainloopSchedule = cute::conditional_t<kGelu, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kGelu, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;

  using Fusion = cute::conditional_t<kGelu, DeGeluPartialRowSums<Element>,
                                     cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
      void, LayoutD, kAlign, Element, LayoutD, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

constexpr std::size_t kPartialsAlignment = 256;

std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

template <class Element, bool kGelu, class EpilogueTile>
bool run_dgrad(int order, const CutlassSm90DgradArgs& a, const Workspace& ws, cudaStream_t stream) {
  using Kernel = DgradKernel<Element, kGelu, EpilogueTile>;
  using Gemm = typename Kernel::Gemm;
  const int m = static_cast<int>(a.in_features), n = static_cast<int>(a.batch), k = static_cast<int>(a.out_features);
  auto args = gemm_arguments<Gemm>(m, n, k, static_cast<const Element*>(a.weight),
                                   static_cast<const Element*>(a.d_output), static_cast<Element*>(a.d_input));
  auto& fusion = args.epilogue.thread;
  if constexpr (kGelu) {
    fusion.aux_ptr = static_cast<const Element*>(a.pre_act);
    fusion.dAux = args.epilogue.dD;
  }
  set_scheduler(args, order, a.device);

  // The bias gradient: partial sums from the epilogue where they fit in the workspace after
  // CUTLASS's part, else the column-sum kernel over the finished d_input.
  float* partials = nullptr;
  int64_t partial_stride = 0, partial_count = 0;
  if constexpr (kGelu) {
    constexpr int64_t tile_m = cute::size<0>(typename Kernel::TileShape{});
    constexpr int64_t tile_n = cute::size<1>(typename Kernel::TileShape{});
    partial_stride = (a.in_features + tile_m - 1) / tile_m * tile_m;
    partial_count = (a.batch + tile_n - 1) / tile_n;
    const std::size_t offset = round_up(Gemm::get_workspace_size(args), kPartialsAlignment);
    const std::size_t bytes = static_cast<std::size_t>(partial_stride) * partial_count * sizeof(float);
    if (a.d_bias != nullptr && ws.ptr != nullptr && offset + bytes <= ws.bytes &&
        reinterpret_cast<std::uintptr_t>(ws.ptr) % kPartialsAlignment == 0) {
      partials = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) + offset);
      fusion.partial_ptr = partials;
    }
  }
  if (!launch<Gemm>(args, ws.ptr, ws.bytes, stream)) return false;

  if (a.d_bias == nullptr) return true;
  if (partials != nullptr)
    sum_partials(a.dtype, partials, partial_stride, partial_count, a.in_features, a.d_bias, stream);
  else  // sums the rounded d_input
    act_backward_bias_grad(a.dtype, Activation::kNone, a.d_input, nullptr, nullptr, a.d_bias, a.batch,
                           a.in_features, ws.ptr, ws.bytes, a.device, stream);
  return true;
}

bool fits(const CutlassSm90DgradArgs& a) {
  const bool gelu = a.activation == Activation::kGeluTanh;
  if (!(gelu || a.activation == Activation::kNone) || a.dtype == DType::kFloat32) return false;
  return widths_fit(a.batch, a.in_features, a.out_features) && aligned16(a.weight) && aligned16(a.d_output) &&
         (!gelu || aligned16(a.pre_act)) && aligned16(a.d_input);
}

// The GELU kernel has kNumEpilogueTiles tile configurations, the plain one a single one.
int configurations(const CutlassSm90DgradArgs& a) {
  return a.activation == Activation::kGeluTanh ? kNumEpilogueTiles : 1;
}

}  // namespace

int cutlass_sm90_dgrad_variants(const CutlassSm90DgradArgs& a) {
  return fits(a) && is_sm90(a.device) ? configurations(a) * kCutlassOrders : 0;
}

bool cutlass_sm90_dgrad(int variant, const CutlassSm90DgradArgs& a, const Workspace& ws, cudaStream_t stream) {
  if (variant < 0 || !fits(a) || variant >= configurations(a) * kCutlassOrders) return false;
  const int order = variant % kCutlassOrders;
  if (a.activation != Activation::kGeluTanh) {
    using Tile = cutlass::epilogue::collective::EpilogueTileAuto;
    return a.dtype == DType::kBFloat16 ? run_dgrad<cutlass::bfloat16_t, false, Tile>(order, a, ws, stream)
                                       : run_dgrad<cutlass::half_t, false, Tile>(order, a, ws, stream);
  }
  return with_epilogue_tile(variant / kCutlassOrders, [&](auto tile) {
    using Tile = decltype(tile);
    return a.dtype == DType::kBFloat16 ? run_dgrad<cutlass::bfloat16_t, true, Tile>(order, a, ws, stream)
                                       : run_dgrad<cutlass::half_t, true, Tile>(order, a, ws, stream);
  });
}

}  // namespace fused_dense::core

#else  // built without CUTLASS or without sm_90a: no variant

namespace fused_dense::core {

int cutlass_sm90_dgrad_variants(const CutlassSm90DgradArgs&) { return 0; }

bool cutlass_sm90_dgrad(int, const CutlassSm90DgradArgs&, const Workspace&, cudaStream_t) { return false; }

}  // namespace fused_dense::core

#endif
