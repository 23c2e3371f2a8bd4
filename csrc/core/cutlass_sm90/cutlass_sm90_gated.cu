#include "core/cutlass_sm90/cutlass_sm90_common.cuh"  // first: it turns CUTLASS's device asserts off
#include "core/cutlass_sm90/cutlass_sm90_gated.h"

#include <cstdint>

#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>

namespace fused_dense::core::cutlass_sm90 {

// Two neighbouring 16-bit values as one 4-byte word: the unit of every global access of the
// gated epilogue. The first value sits at the lower address.
template <class Element>
struct Pair;

template <>
struct Pair<cutlass::bfloat16_t> {
  using Word = __nv_bfloat162;
  static CUTLASS_DEVICE Word pack(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  static CUTLASS_DEVICE float2 unpack(Word w) { return __bfloat1622float2(w); }
};

template <>
struct Pair<cutlass::half_t> {
  using Word = __half2;
  static CUTLASS_DEVICE Word pack(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  static CUTLASS_DEVICE float2 unpack(Word w) { return __half22float2(w); }
};

// The epilogue of both gated kernels (cutlass_sm90_gated.h says why it is not a stock one), in
// the form of CUTLASS's DefaultEpilogue: a functor over the accumulator registers of one output
// tile, run in the warp-specialized kernels through detail::Sm90TmaWarpSpecializedAdapter
// (no shared memory, no TMA, no epilogue load warp).
//
// The GEMM is row-major D[M, N] (M = batch). The accumulator fragment of a thread is cute's
// CLayout_64xN partitioned by the tiled MMA: (V, MMA_M, MMA_N) with V = (2, 2, n / 8) over one
// 64 x n wgmma atom, where value (v0, v1, v2) sits at row 8 v1 + r and column 8 v2 + 2 q + v0 of
// the atom (r, q: the thread's row and column pair). So v0 steps one column, v2 eight: with
// G = kGatedInterleave a multiple of 8 (kGroupsPerBlock = G / 8 groups of 8 columns) and 2G
// dividing the atom's width, the packed blocks of 2G columns are aligned to the atoms, and in
// the forward the values at a gate group v2 and at v2 + kGroupsPerBlock are the gate and up of
// the same two units; (v0 = 0, 1) is one 4-byte word of every tensor touched.
//
// kDgrad = false, forward, N = 2h: out[M, h] = act(g) * u; gu[M, 2h] = the accumulator (rounded)
//   when gu is set.
// kDgrad = true, data gradient, N = h: the accumulator is d_h[M, h]; g, u come from gu[M, 2h],
//   d_gu[M, 2h] gets d_h * u * act'(g) and d_h * act(g), act_out[M, h] act(g) * u when set.
//   d_gu may be gu itself: each thread reads every word it writes before it writes it, and no
//   other thread touches it.
template <class Element, bool kDgrad>
class GatedEpilogue {
 public:
  using ElementC = Element;
  using ElementD = Element;
  using ElementAccumulator = float;
  using StrideC = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;
  using StrideD = StrideC;
  // Named by CUTLASS's device adapter only; never run.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 2, float, float>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};

  struct Arguments {
    bool geglu = false;             // act = GELU tanh approximation, else SiLU
    Element* gu = nullptr;          // forward: written when set; data gradient: read
    Element* act_out = nullptr;     // forward: out (required); data gradient: h, written when set
    Element* d_gu = nullptr;        // data gradient only
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }

  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // The packed layout needs whole blocks (h % G == 0).
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    const int n = cute::get<1>(problem_shape);
    const bool pointers = kDgrad ? (args.gu != nullptr && args.d_gu != nullptr) : args.act_out != nullptr;
    return pointers && n % (kDgrad ? kGatedInterleave : 2 * kGatedInterleave) == 0;
  }

  CUTLASS_HOST_DEVICE
  GatedEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    if (params_.geglu)
      tile<Activation::kGeGLU>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
    else
      tile<Activation::kSwiGLU>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
  }

 private:
  using Word = typename Pair<Element>::Word;
  static_assert(sizeof(Word) == 4, "two 16-bit values");
  static constexpr int kG = static_cast<int>(kGatedInterleave);
  static constexpr int kGroupsPerBlock = kG / 8;

  // The data gradient's loads of g and u, this many 8-column groups at a time (16 registers),
  // in flight together. Loads cannot move past the stores before them (d_gu may be gu), so
  // rounds do not overlap. 16 groups make ptxas spill, next to the 128 accumulators.
  static constexpr int kLoadGroups = 8;

  template <Activation A, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void tile(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                           BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                           TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value && is_static<BlockShapeMNK>::value, "static tile");
    // The value mode of the wgmma accumulator, (2, 2, n / 8) as the class comment says.
    static_assert(rank<0>(FrgLayout{}) == 3 && size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2,
                  "a wgmma accumulator fragment (CLayout_64xN)");
    constexpr int kGroups = size<0, 2>(FrgLayout{});  // 8-column groups per atom
    static_assert(kG % 8 == 0 && kGroups % (2 * kGroupsPerBlock) == 0,
                  "packed blocks of whole groups, whole in an atom");
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});
    constexpr int kTileM = size<0>(BlockShapeMNK{});
    constexpr int kTileN = size<1>(BlockShapeMNK{});
    static_assert(kTileN % (2 * kGatedInterleave) == 0, "gate / up blocks whole in a tile");

    const int m = get<0>(problem_shape_mnkl);
    const int n = get<1>(problem_shape_mnkl);
    const int m0 = static_cast<int>(get<0>(blk_coord_mnkl)) * kTileM;
    const int n0 = static_cast<int>(get<1>(blk_coord_mnkl)) * kTileN;

    // Coordinates of each accumulator value inside the tile.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor t_coord = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    static_assert(decltype(size(t_coord))::value == decltype(size(acc))::value, "one coordinate per value");
    // What the pairing rests on, read off the coordinates: (v0, v1, v2) step (row, column) by
    // (0, 1), (8, 0) and (0, 8).
    static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(stride<0>(t_coord))>,
                                  cute::remove_cvref_t<decltype(make_stride(E<1>{}, Int<8>{} * E<0>{},
                                                                            Int<8>{} * E<1>{}))>>,
                  "the wgmma accumulator layout CLayout_64xN");

    if constexpr (kDgrad) prefetch_gu<kTileM, kTileN, decltype(size(tiled_mma))::value>(m0, n0, m, n, thread_idx);

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = m0 + get<0>(t_coord(make_coord(0, v1, 0), mm, 0));
        if (row >= m) continue;
        CUTLASS_PRAGMA_UNROLL
        for (int nn = 0; nn < kMmaN; ++nn) {
          if constexpr (kDgrad)
            dgrad_row<A, kGroups>(acc, t_coord, row, n0, n, mm, v1, nn);
          else
            forward_row<A, kGroups>(acc, t_coord, row, n0, n, mm, v1, nn);
        }
      }
    }
  }

  // Asks L2 for the part of gu the data gradient's epilogue of this tile reads (rows m0 on, the
  // packed columns of units n0 on: 4 kTileN bytes per row, 16-byte aligned, so kLines 128-byte
  // lines cover it), the threads of the tile sharing the lines: the rounds of loads that follow
  // then wait on L2 rather than on DRAM.
  template <int kTileM, int kTileN, int kThreads>
  CUTLASS_DEVICE void prefetch_gu(int m0, int n0, int m, int n, int thread_idx) const {
    constexpr int kLines = 4 * kTileN / 128 + 1;
    const int bytes = 4 * (n - n0 < kTileN ? n - n0 : kTileN);  // of each row's part, > 0
    const char* const part = reinterpret_cast<const char*>(params_.gu) + 4 * static_cast<int64_t>(n0);
    CUTLASS_PRAGMA_UNROLL
    for (int i = thread_idx; i < kTileM * kLines; i += kThreads) {
      const int row = m0 + i / kLines;
      const int offset = (i % kLines) * 128 < bytes - 2 ? (i % kLines) * 128 : bytes - 2;
      if (row < m) asm volatile("prefetch.global.L2 [%0];" : : "l"(part + 4 * static_cast<int64_t>(row) * n + offset));
    }
  }

  // One row of one atom of the forward: kGroups / 2 (gate, up) pairs of groups.
  template <Activation A, int kGroups, class Acc, class Coord>
  CUTLASS_DEVICE void forward_row(Acc const& acc, Coord const& t_coord, int row, int n0, int n, int mm, int v1,
                                  int nn) {
    using namespace cute;
    const int64_t half_n = n / 2;
    Word* const out_row = reinterpret_cast<Word*>(params_.act_out) + (static_cast<int64_t>(row) * half_n) / 2;
    Word* const gu_row =
        params_.gu == nullptr ? nullptr : reinterpret_cast<Word*>(params_.gu) + (static_cast<int64_t>(row) * n) / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int p = 0; p < kGroups / 2; ++p) {
      // the p-th gate group of the atom and its up group
      const int vg = (p / kGroupsPerBlock) * 2 * kGroupsPerBlock + p % kGroupsPerBlock;
      const int vu = vg + kGroupsPerBlock;
      const int col = n0 + get<1>(t_coord(make_coord(0, v1, vg), mm, nn));  // gate column, even
      if (col >= n) continue;  // whole packed blocks: n % 2G == 0
      const float g0 = acc(make_coord(0, v1, vg), mm, nn), g1 = acc(make_coord(1, v1, vg), mm, nn);
      const float u0 = acc(make_coord(0, v1, vu), mm, nn), u1 = acc(make_coord(1, v1, vu), mm, nn);
      // unit of column col: block col / 2G, place col % 2G (< G)
      const int unit = (col / (2 * kG)) * kG + col % (2 * kG);
      out_row[unit >> 1] = Pair<Element>::pack(gate_act<A, true>(g0) * u0, gate_act<A, true>(g1) * u1);
      if (gu_row != nullptr) {
        gu_row[col >> 1] = Pair<Element>::pack(g0, g1);
        gu_row[(col + kG) >> 1] = Pair<Element>::pack(u0, u1);  // the column of u0 (static_assert above)
      }
    }
  }

  // One row of one atom of the data gradient: kGroups groups of 8 units, their g and u loaded
  // kLoadGroups groups at a time before any of them is written.
  template <Activation A, int kGroups, class Acc, class Coord>
  CUTLASS_DEVICE void dgrad_row(Acc const& acc, Coord const& t_coord, int row, int n0, int n, int mm, int v1,
                                int nn) {
    using namespace cute;
    constexpr int kChunk = kGroups < kLoadGroups ? kGroups : kLoadGroups;
    static_assert(kGroups % kChunk == 0, "whole chunks");
    const int64_t row_words = static_cast<int64_t>(row) * n;  // 2n 16-bit values per row of gu
    Word const* const gu_row = reinterpret_cast<Word const*>(params_.gu) + row_words;
    Word* const d_gu_row = reinterpret_cast<Word*>(params_.d_gu) + row_words;
    Word* const act_row = params_.act_out == nullptr
                              ? nullptr
                              : reinterpret_cast<Word*>(params_.act_out) + (static_cast<int64_t>(row) * n) / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int c0 = 0; c0 < kGroups; c0 += kChunk) {
      Word g[kChunk], u[kChunk];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChunk; ++c) {
        const int unit = n0 + get<1>(t_coord(make_coord(0, v1, c0 + c), mm, nn));  // even
        if (unit < n) {  // whole 8-unit groups: n % G == 0
          const int pos = (unit / kG) * (2 * kG) + unit % kG;  // gate column in gu
          g[c] = gu_row[pos >> 1];
          u[c] = gu_row[(pos + kG) >> 1];
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChunk; ++c) {
        const int unit = n0 + get<1>(t_coord(make_coord(0, v1, c0 + c), mm, nn));
        if (unit >= n) continue;
        const int pos = (unit / kG) * (2 * kG) + unit % kG;
        const float2 gf = Pair<Element>::unpack(g[c]), uf = Pair<Element>::unpack(u[c]);
        const float d0 = acc(make_coord(0, v1, c0 + c), mm, nn), d1 = acc(make_coord(1, v1, c0 + c), mm, nn);
        float a0, a1;
        float da0;
        a0 = gate_act<A, true>(gf.x, &da0);
        float da1;
        a1 = gate_act<A, true>(gf.y, &da1);
        d_gu_row[pos >> 1] = Pair<Element>::pack(d0 * uf.x * da0, d1 * uf.y * da1);
        d_gu_row[(pos + kG) >> 1] = Pair<Element>::pack(d0 * a0, d1 * a1);
        if (act_row != nullptr) act_row[unit >> 1] = Pair<Element>::pack(a0 * uf.x, a1 * uf.y);
      }
    }
  }

  Params params_;
};

}  // namespace fused_dense::core::cutlass_sm90

namespace fused_dense::core {
namespace {

using namespace cutlass_sm90;

// Both GEMMs as row-major D[B, n] = A[B, k] * B[k, n]: A is x (forward) or d_out (data
// gradient), K-major; B is the fc1 weight W[2h, d] (K-major) or the fc2 weight W2[N, h] (N-major).
// Three tile configurations, each with the gated epilogue (128 accumulators per thread in all):
//  0: 128 x 128 tiles, 2 x 1 clusters, ping-pong: one warp group's epilogue under the other's
//     MMAs, as the library's other epilogue-heavy kernels;
//  1: 128 x 256 tiles, 2 x 1 clusters, cooperative: the tile the library's plain data gradient
//     runs fastest with; its epilogue does not overlap the MMAs;
//  2: 256 x 128 tiles, 2 x 1 clusters, cooperative: the same with the roles of the operands'
//     tiles swapped (twice the batch rows per tile, half the features).
inline constexpr int kGatedConfigs = 3;

template <class Element, bool kDgrad, int kConfig>
struct GatedKernel {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cute::conditional_t<kDgrad, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = cute::conditional_t<
      kConfig == 0, cute::Shape<cute::_128, cute::_128, cute::_64>,
      cute::conditional_t<kConfig == 1, cute::Shape<cute::_128, cute::_256, cute::_64>,
                          cute::Shape<cute::_256, cute::_128, cute::_64>>>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using MainloopSchedule = cute::conditional_t<kConfig == 0, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GatedEpilogue<Element, kDgrad>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class Element, bool kDgrad, int kConfig>
bool run_gated(int order, int device, int m, int n, int k, const void* a, const void* b,
               typename GatedEpilogue<Element, kDgrad>::Arguments const& epilogue, const Workspace& ws,
               cudaStream_t stream) {
  using Gemm = typename GatedKernel<Element, kDgrad, kConfig>::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(a), cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1)),
       static_cast<const Element*>(b), cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1))},
      epilogue};
  set_scheduler(args, order, device);
  return launch<Gemm>(args, ws.ptr, ws.bytes, stream);
}

// The packed layouts the epilogue pairs within a thread (the class comment): G a multiple of 8,
// 2G dividing the narrowest atom (128 columns). With another kGatedInterleave the kernels offer
// no variant and are not compiled.
inline constexpr bool kInterleaveFits = kGatedInterleave % 8 == 0 && 128 % (2 * kGatedInterleave) == 0;

template <bool kDgrad, class Element>
bool with_config(int config, Element, int order, int device, int m, int n, int k, const void* a, const void* b,
                 typename GatedEpilogue<Element, kDgrad>::Arguments const& epilogue, const Workspace& ws,
                 cudaStream_t stream) {
  if constexpr (!kInterleaveFits) {
    return false;
  } else {
    switch (config) {
      case 0: return run_gated<Element, kDgrad, 0>(order, device, m, n, k, a, b, epilogue, ws, stream);
      case 1: return run_gated<Element, kDgrad, 1>(order, device, m, n, k, a, b, epilogue, ws, stream);
      case 2: return run_gated<Element, kDgrad, 2>(order, device, m, n, k, a, b, epilogue, ws, stream);
      default: return false;
    }
  }
}

bool gated_activation(Activation act) { return act == Activation::kSwiGLU || act == Activation::kGeGLU; }

bool fits(const CutlassSm90GatedForwardArgs& a) {
  return kInterleaveFits && gated_activation(a.activation) && a.dtype != DType::kFloat32 &&
         a.hidden % kGatedInterleave == 0 && a.hidden <= INT32_MAX / 2 &&
         widths_fit(a.batch, a.in_features, 2 * a.hidden) && aligned16(a.input) &&
         aligned16(a.weight) && a.out != nullptr && aligned16(a.out) && (a.gu == nullptr || aligned16(a.gu));
}

bool fits(const CutlassSm90GatedDgradArgs& a) {
  return kInterleaveFits && gated_activation(a.activation) && a.dtype != DType::kFloat32 &&
         a.hidden % kGatedInterleave == 0 && a.hidden <= INT32_MAX / 2 &&
         widths_fit(a.batch, a.out_features, a.hidden) && aligned16(a.d_output) &&
         aligned16(a.weight) && a.gu != nullptr && aligned16(a.gu) && a.d_gu != nullptr && aligned16(a.d_gu) &&
         (a.act_out == nullptr || aligned16(a.act_out));
}

template <bool kDgrad, class Element, class Args>
typename GatedEpilogue<Element, kDgrad>::Arguments epilogue_arguments(const Args& a) {
  typename GatedEpilogue<Element, kDgrad>::Arguments e;
  e.geglu = a.activation == Activation::kGeGLU;
  if constexpr (kDgrad) {
    e.gu = static_cast<Element*>(const_cast<void*>(a.gu));
    e.d_gu = static_cast<Element*>(a.d_gu);
    e.act_out = static_cast<Element*>(a.act_out);
  } else {
    e.gu = static_cast<Element*>(a.gu);
    e.act_out = static_cast<Element*>(a.out);
  }
  return e;
}

}  // namespace

int cutlass_sm90_gated_forward_variants(const CutlassSm90GatedForwardArgs& a) {
  return fits(a) && is_sm90(a.device) ? kGatedConfigs * kCutlassOrders : 0;
}

int cutlass_sm90_gated_dgrad_variants(const CutlassSm90GatedDgradArgs& a) {
  return fits(a) && is_sm90(a.device) ? kGatedConfigs * kCutlassOrders : 0;
}

bool cutlass_sm90_gated_forward(int variant, const CutlassSm90GatedForwardArgs& a, const Workspace& ws,
                                cudaStream_t stream) {
  if (variant < 0 || variant >= kGatedConfigs * kCutlassOrders || !fits(a)) return false;
  const int config = variant / kCutlassOrders, order = variant % kCutlassOrders;
  const int m = static_cast<int>(a.batch), n = static_cast<int>(2 * a.hidden), k = static_cast<int>(a.in_features);
  if (a.dtype == DType::kBFloat16)
    return with_config<false>(config, cutlass::bfloat16_t{}, order, a.device, m, n, k, a.input, a.weight,
                              epilogue_arguments<false, cutlass::bfloat16_t>(a), ws, stream);
  return with_config<false>(config, cutlass::half_t{}, order, a.device, m, n, k, a.input, a.weight,
                            epilogue_arguments<false, cutlass::half_t>(a), ws, stream);
}

bool cutlass_sm90_gated_dgrad(int variant, const CutlassSm90GatedDgradArgs& a, const Workspace& ws,
                              cudaStream_t stream) {
  if (variant < 0 || variant >= kGatedConfigs * kCutlassOrders || !fits(a)) return false;
  const int config = variant / kCutlassOrders, order = variant % kCutlassOrders;
  const int m = static_cast<int>(a.batch), n = static_cast<int>(a.hidden), k = static_cast<int>(a.out_features);
  if (a.dtype == DType::kBFloat16)
    return with_config<true>(config, cutlass::bfloat16_t{}, order, a.device, m, n, k, a.d_output, a.weight,
                             epilogue_arguments<true, cutlass::bfloat16_t>(a), ws, stream);
  return with_config<true>(config, cutlass::half_t{}, order, a.device, m, n, k, a.d_output, a.weight,
                           epilogue_arguments<true, cutlass::half_t>(a), ws, stream);
}

}  // namespace fused_dense::core

#else  // built without CUTLASS or without sm_90a: no variant

namespace fused_dense::core {

int cutlass_sm90_gated_forward_variants(const CutlassSm90GatedForwardArgs&) { return 0; }
int cutlass_sm90_gated_dgrad_variants(const CutlassSm90GatedDgradArgs&) { return 0; }

bool cutlass_sm90_gated_forward(int, const CutlassSm90GatedForwardArgs&, const Workspace&, cudaStream_t) {
  return false;
}
bool cutlass_sm90_gated_dgrad(int, const CutlassSm90GatedDgradArgs&, const Workspace&, cudaStream_t) {
  return false;
}

}  // namespace fused_dense::core

#endif
