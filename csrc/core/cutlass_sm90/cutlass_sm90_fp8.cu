// The amax is reset by the launch below (cudaMemsetAsync), not by CUTLASS's workspace fill,
// which calls the driver API (cuMemsetD32Async) the extension does not link.
#define CUTLASS_SKIP_REDUCTION_INIT
#include "core/cutlass_sm90/cutlass_sm90_common.cuh"  // first: it turns CUTLASS's device asserts off
#include "core/cutlass_sm90/cutlass_sm90_fp8.h"

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>

#include "core/cutlass_sm90/cutlass_sm90_fp8_common.cuh"

namespace fused_dense::core {
namespace {

using namespace cutlass_sm90;
namespace fusion = cutlass::epilogue::fusion;
using cute::_0;
using cute::_1;
using cute::_2;
using cute::_32;
using cute::_64;
using cute::_128;
using cute::Shape;
using cute::Stride;

// A visitor node that names Element as the tree's auxiliary element: with no D, the epilogue's
// builder takes its element from the root (cutlass::epilogue::fusion::get_element_aux_t).
template <class Node, class Element>
struct NamingAux : Node {
  using Node::Node;
  using ElementAux = Element;
};

// cutlass_sm90_fp8.h has the contract and the layout. Both kernels' trees start with these nodes,
// from the accumulator:
//   Z = (s_x * s_w) * acc + bias           (fp32)
//   P = round(Z) in Element                -> stored as pre; its amax reduced where pre_amax is set
//   V = act(P)                             (fp32 from the rounded P), its amax reduced
// and use the same mainloop (Config), so their P are the same bits for the same problem.
template <class Element, Activation A, class Config>
struct Fp8ActAmax {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using EpilogueTile = typename Config::EpilogueTile;
  using Z = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>,
                            fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>, 2>, fusion::Sm90AccFetch,
                            fusion::Sm90ColBroadcast<0, typename Config::TileShape, Element, float,
                                                     Stride<_1, _0, int64_t>, 8>>;
  using Rounded = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float, kRound>, Z>;
  using PreStore = fusion::Sm90AuxStore<Config::kStagesD, EpilogueTile, Element, kRound, StrideFeatures,
                                        AuxSmemAtom<StrideFeatures, Element, EpilogueTile>,
                                        AuxStoreOp<StrideFeatures, Element, EpilogueTile>, 8>;
  using Stored = fusion::Sm90EVT<PreStore, Rounded>;
  // A null pointer makes the node a pass-through (CUTLASS's EnableNullptr): no reduction, no atomic.
  using PreAmax = fusion::Sm90EVT<fusion::Sm90ScalarReduction<AbsMaxBits, WarpAtomicMaxBits, float, float, kRound>,
                                  Stored>;
  using Activated = fusion::Sm90EVT<fusion::Sm90Compute<Act<A>::template Fn, float, float, kRound>, PreAmax>;
  using Amax = NamingAux<fusion::Sm90ScalarReduction<AbsMaxBits, WarpAtomicMaxBits, float, float, kRound>, Element>;
  using Tree = fusion::Sm90EVT<Amax, Activated>;

  static typename Tree::Arguments arguments(const CutlassSm90Fp8ForwardArgs& a, int m, int n) {
    const auto stride_pre = cutlass::make_cute_packed_stride(StrideFeatures{}, cute::make_shape(m, n, 1));
    return {{{{{{{{1.f, 1.f}, {a.input_scale_inv, a.weight_scale_inv}},    // Z
                 {},
                 {static_cast<const Element*>(a.bias), Element(0), {}},
                 {}},
                {}},                                                     // P
               {static_cast<Element*>(a.pre), stride_pre}},              // stored as pre
              {a.pre_amax, 0.f, {}}},                                    // its amax
             {}},                                                        // V
            {a.amax, 0.f, {}}};                                          // its amax
  }
};

// The GEMM of a visitor tree Root whose D has element ElementD (the mainloop: Config's, e4m3 x e4m3).
template <class Root, class ElementD, class Config>
struct Fp8Gemm {
  using E4M3 = cutlass::float_e4m3_t;
  static constexpr int kAlignD = cute::is_void_v<ElementD> ? 8 : 16 / static_cast<int>(sizeof(ElementD));
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape, typename Config::ClusterShape,
      typename Config::EpilogueTile, float, float, void, cutlass::layout::ColumnMajor, kAlignD, ElementD,
      cutlass::layout::ColumnMajor, kAlignD, typename Config::EpilogueSchedule, Root>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E4M3, cutlass::layout::RowMajor, 16, E4M3,
      cutlass::layout::ColumnMajor, 16, float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Delayed scaling (a.scale set). After Fp8ActAmax's nodes:
//   Q = V * scale                          -> stored as data_t (e4m3, row-major [N, B]) and
//                                             returned for D (data, e4m3, the collective's store)
// The FP8 conversions are CUTLASS's (cvt.rn.satfinite on sm_90), the quantize pass's rounding.
template <class Element, Activation A, class Config>
struct Fp8ForwardKernel {
  using E4M3 = cutlass::float_e4m3_t;
  using EpilogueTile = typename Config::EpilogueTile;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Prefix = Fp8ActAmax<Element, A, Config>;
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                 typename Prefix::Tree, fusion::Sm90ScalarBroadcast<float>>;
  using TStore = fusion::Sm90AuxStore<Config::kStagesD, EpilogueTile, E4M3, kRound, StrideTokens,
                                      AuxSmemAtom<StrideTokens, E4M3, EpilogueTile>,
                                      AuxStoreOp<StrideTokens, E4M3, EpilogueTile>, 16>;
  using Root = fusion::Sm90EVT<TStore, Scaled>;
  using ElementOut = E4M3;
  using G = Fp8Gemm<Root, E4M3, Config>;
  using Gemm = typename G::Gemm;
  static_assert(G::Epilogue::DispatchPolicy::StagesD == Config::kStagesD, "the aux stores' stages are the epilogue's");

  static typename Root::Arguments fusion_args(const CutlassSm90Fp8ForwardArgs& a, int m, int n) {
    const auto stride_t = cutlass::make_cute_packed_stride(StrideTokens{}, cute::make_shape(m, n, 1));
    return {{Prefix::arguments(a, m, n), {{1.f}, {a.scale}}, {}},            // Q = V * scale
            {reinterpret_cast<E4M3*>(a.data_t), stride_t}};                  // data_t
  }
  static void* d_ptr(const CutlassSm90Fp8ForwardArgs& a) { return a.data; }
};

// Current scaling (a.scale null): Fp8ActAmax's nodes alone, and no D (the collective stores
// nothing).
template <class Element, Activation A, class Config>
struct Fp8ForwardAmaxKernel {
  using Prefix = Fp8ActAmax<Element, A, Config>;
  using Root = typename Prefix::Tree;
  using ElementOut = Element;  // no D: its pointer is null
  using Gemm = typename Fp8Gemm<Root, void, Config>::Gemm;

  static typename Root::Arguments fusion_args(const CutlassSm90Fp8ForwardArgs& a, int m, int n) {
    return Prefix::arguments(a, m, n);
  }
  static void* d_ptr(const CutlassSm90Fp8ForwardArgs&) { return nullptr; }
};

template <class K>
bool run(int order, const CutlassSm90Fp8ForwardArgs& a, const Workspace& ws, cudaStream_t stream) {
  using Gemm = typename K::Gemm;
  using E4M3 = cutlass::float_e4m3_t;
  using ElementD = typename K::ElementOut;  // of D's pointer
  const int m = static_cast<int>(a.out_features), n = static_cast<int>(a.batch), k = static_cast<int>(a.in_features);
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  const auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  const auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(StrideFeatures{}, cute::make_shape(m, n, 1));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                {static_cast<const E4M3*>(a.weight), stride_a, static_cast<const E4M3*>(a.input),
                                 stride_b},
                                {K::fusion_args(a, m, n), nullptr, stride_d, static_cast<ElementD*>(K::d_ptr(a)),
                                 stride_d}};
  set_scheduler(args, order, a.device);
  // Reset before the launch; should launch refuse the problem, the caller raises.
  FD_CUDA_CHECK(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  if (a.pre_amax != nullptr) FD_CUDA_CHECK(cudaMemsetAsync(a.pre_amax, 0, sizeof(float), stream));
  return launch<Gemm>(args, ws.ptr, ws.bytes, stream);
}

bool fits_shape(const CutlassSm90Fp8ForwardArgs& a) {
  const auto mult16 = [](int64_t v) { return v > 0 && v <= INT32_MAX && v % 16 == 0; };
  const auto ok = [](const void* p) { return p != nullptr && aligned16(p); };
  return a.activation == Activation::kGeluTanh && a.dtype == DType::kBFloat16 && mult16(a.batch) &&
         mult16(a.in_features) && mult16(a.out_features) && ok(a.input) && ok(a.weight) &&
         (a.bias == nullptr || aligned16(a.bias));
}

// The outputs and scalars, checked at the launch (the caller allocates them once the inputs fit).
bool outputs_ok(const CutlassSm90Fp8ForwardArgs& a) {
  const auto ok = [](const void* p) { return p != nullptr && aligned16(p); };
  const bool quantized = a.scale == nullptr || (ok(a.data) && (a.data_t == nullptr || aligned16(a.data_t)));
  return ok(a.pre) && quantized && a.input_scale_inv != nullptr && a.weight_scale_inv != nullptr &&
         a.amax != nullptr;
}

}  // namespace

bool cutlass_sm90_fp8_forward_fits(const CutlassSm90Fp8ForwardArgs& a) { return fits_shape(a) && is_sm90(a.device); }

bool cutlass_sm90_fp8_forward(const CutlassSm90Fp8ForwardArgs& a, const Workspace& ws, cudaStream_t stream) {
  if (!cutlass_sm90_fp8_forward_fits(a) || !outputs_ok(a)) return false;
  using Config = Fp8GemmConfig<cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>;
  using Bf16 = cutlass::bfloat16_t;
  if (a.scale == nullptr)
    return run<Fp8ForwardAmaxKernel<Bf16, Activation::kGeluTanh, Config>>(Config::kOrder, a, ws, stream);
  return run<Fp8ForwardKernel<Bf16, Activation::kGeluTanh, Config>>(Config::kOrder, a, ws, stream);
}

}  // namespace fused_dense::core

#else  // built without CUTLASS or without sm_90a

namespace fused_dense::core {

bool cutlass_sm90_fp8_forward_fits(const CutlassSm90Fp8ForwardArgs&) { return false; }

bool cutlass_sm90_fp8_forward(const CutlassSm90Fp8ForwardArgs&, const Workspace&, cudaStream_t) { return false; }

}  // namespace fused_dense::core

#endif
