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
// the atom (r, q: the thread's row and column pair; the 4 lanes of a row, lanes 4r .. 4r + 3,
// hold q = 0 .. 3). So v0 steps one column, v2 eight: with G = kGatedInterleave = 8 and 2G
// dividing the atom's width, the packed blocks of 2G columns are aligned to the atoms, and in
// the forward the values at gate group v2 = 2p and up group 2p + 1 are the gate and up of the
// same two units; (v0 = 0, 1) is one 4-byte word of every tensor touched. A lane holds one word
// of each group; the 4 lanes of a row exchange words (quad_transpose) so that every global access
// is 16 bytes: one group's 8 values.
//
// kDgrad = false, forward, N = 2h: out[M, h] = act(g) * u; gu[M, 2h] = the accumulator (rounded)
//   when gu is set.
// kDgrad = true, data gradient, N = h: the accumulator is d_h[M, h]; g, u come from gu[M, 2h],
//   d_gu[M, 2h] gets d_h * u * act'(g) and d_h * act(g), act_out[M, h] act(g) * u when set.
//   d_gu may be gu itself: each thread reads every 16 bytes it writes before it writes them, and
//   no other thread touches them.
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
  static_assert(kG == 8, "a packed block is one 8-column group: a unit group's g and u are 32 contiguous bytes");

  // The data gradient's loads of g and u, this many 8-column groups at a time (32 registers,
  // 8 16-byte loads a lane), in flight together. Loads cannot move past the stores before them
  // (d_gu may be gu), so rounds do not overlap: fewer, larger rounds wait less. ptxas: no spills
  // beside the 128 accumulators (4-byte loads of 16 groups spilled). On the H200 the best variant
  // took 1.263 / 3.197 ms at 8192 x 4096 -> 11008 / 16384 x 4096 -> 14336 against 1.282 / 3.294
  // with 8 groups (swiglu, native test's timings, same call).
  static constexpr int kLoadGroups = 16;

  // A 4 x 4 transpose of words across the quad of lanes that share a row of the accumulator
  // (lanes 4r .. 4r + 3; lane 4r + q holds columns 2q, 2q + 1 of every 8-column group): on entry
  // lane q holds a[j], on exit a[j] is what lane j held in a[q]. So 4 lanes holding one word of each
  // of 4 groups end up each holding the 4 words (16 contiguous bytes) of one group, and back. Every
  // lane of the warp calls it (the shuffles name all 32).
  static CUTLASS_DEVICE void quad_transpose(uint32_t (&a)[4], int lane) {
    quad_exchange<1>(a, lane);
    quad_exchange<2>(a, lane);
  }
  // Lanes kBit apart swap the two words whose index has bit kBit unlike the lane's: a lane with the
  // bit set gives and takes a[0] and a[3 ^ kBit], one without it a[kBit] and a[3].
  template <int kBit>
  static CUTLASS_DEVICE void quad_exchange(uint32_t (&a)[4], int lane) {
    constexpr int kOther = 3 ^ kBit;
    const bool set = (lane & kBit) != 0;
    const uint32_t x0 = __shfl_xor_sync(0xffffffffu, set ? a[0] : a[kBit], kBit);
    const uint32_t x1 = __shfl_xor_sync(0xffffffffu, set ? a[kOther] : a[3], kBit);
    if (set) {
      a[0] = x0;
      a[kOther] = x1;
    } else {
      a[kBit] = x0;
      a[3] = x1;
    }
  }

  static CUTLASS_DEVICE uint32_t bits(Word w) { return reinterpret_cast<uint32_t const&>(w); }
  static CUTLASS_DEVICE Word word(uint32_t b) { return reinterpret_cast<Word const&>(b); }

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
    static_assert(kGroups % 8 == 0, "whole sets of 4 packed blocks (8 groups) in an atom");
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

    // A row past the problem's is computed and not stored: the quads' exchanges need every lane.
    const int lane = static_cast<int>(threadIdx.x % 32);
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = m0 + get<0>(t_coord(make_coord(0, v1, 0), mm, 0));
        CUTLASS_PRAGMA_UNROLL
        for (int nn = 0; nn < kMmaN; ++nn) {
          if constexpr (kDgrad)
            dgrad_row<A, kGroups>(acc, t_coord, row, row < m, n0, n, mm, v1, nn, lane);
          else
            forward_row<A, kGroups>(acc, t_coord, row, row < m, n0, n, mm, v1, nn, lane);
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

  // One row of one atom of the forward: kGroups / 2 (gate, up) pairs of groups, 4 pairs at a time.
  // Gate group 2p and up group 2p + 1 are packed block p (kG == 8): its columns n0 + 16p' on
  // (p' the block's place in the tile), the units of out 8p' on. Each lane forms one word of out,
  // of g and of u for each of the 4 blocks; the quad's transposes give lane q the 4 words of block
  // q, stored as 16 bytes each (out; g and u, adjacent, when gu is set).
  template <Activation A, int kGroups, class Acc, class Coord>
  CUTLASS_DEVICE void forward_row(Acc const& acc, Coord const& t_coord, int row, bool row_in, int n0, int n, int mm,
                                  int v1, int nn, int lane) {
    using namespace cute;
    static_assert(kGroups % 8 == 0, "whole sets of 4 packed blocks in an atom");
    const int64_t half_n = n / 2;
    uint32_t* const out_row = reinterpret_cast<uint32_t*>(params_.act_out) + (static_cast<int64_t>(row) * half_n) / 2;
    uint32_t* const gu_row = params_.gu == nullptr
                                 ? nullptr
                                 : reinterpret_cast<uint32_t*>(params_.gu) + (static_cast<int64_t>(row) * n) / 2;
    const int q = lane & 3;
    CUTLASS_PRAGMA_UNROLL
    for (int set = 0; set < kGroups / 8; ++set) {
      uint32_t o[4], gw[4], uw[4];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int vg = 2 * (4 * set + i), vu = vg + 1;
        const float g0 = acc(make_coord(0, v1, vg), mm, nn), g1 = acc(make_coord(1, v1, vg), mm, nn);
        const float u0 = acc(make_coord(0, v1, vu), mm, nn), u1 = acc(make_coord(1, v1, vu), mm, nn);
        o[i] = bits(Pair<Element>::pack(gate_act<A, true>(g0) * u0, gate_act<A, true>(g1) * u1));
        gw[i] = bits(Pair<Element>::pack(g0, g1));
        uw[i] = bits(Pair<Element>::pack(u0, u1));
      }
      quad_transpose(o, lane);
      if (gu_row != nullptr) {
        quad_transpose(gw, lane);
        quad_transpose(uw, lane);
      }
      // block 4 set + q's first column: this lane's gate column of block 4 set, less 2q, plus 16q
      const int col = n0 + get<1>(t_coord(make_coord(0, v1, 8 * set), mm, nn)) + 14 * q;
      if (!row_in || col >= n) continue;  // whole packed blocks: n % 2G == 0
      *reinterpret_cast<uint4*>(out_row + col / 4) = make_uint4(o[0], o[1], o[2], o[3]);  // unit col / 2
      if (gu_row != nullptr) {
        *reinterpret_cast<uint4*>(gu_row + col / 2) = make_uint4(gw[0], gw[1], gw[2], gw[3]);
        *reinterpret_cast<uint4*>(gu_row + col / 2 + 4) = make_uint4(uw[0], uw[1], uw[2], uw[3]);
      }
    }
  }

  // One row of one atom of the data gradient: kGroups groups of 8 units, kLoadGroups at a time,
  // all their loads before any store. Units u0 .. u0 + 7 (u0 % 8 == 0) are packed block u0 / 8,
  // words u0 .. u0 + 7 of gu's row (g then u, 32 bytes). Lane q loads the 32 bytes of group q of
  // each set of 4; the quad's transposes give each lane the g and u words of its own columns, and
  // give back d_g, d_u and act(g) u as 16 bytes a group.
  template <Activation A, int kGroups, class Acc, class Coord>
  CUTLASS_DEVICE void dgrad_row(Acc const& acc, Coord const& t_coord, int row, bool row_in, int n0, int n, int mm,
                                int v1, int nn, int lane) {
    using namespace cute;
    constexpr int kChunk = kGroups < kLoadGroups ? kGroups : kLoadGroups;
    static_assert(kGroups % kChunk == 0 && kChunk % 4 == 0, "whole chunks of whole sets of 4 groups");
    constexpr int kSets = kChunk / 4;
    const int64_t row_words = static_cast<int64_t>(row) * n;  // 2n 16-bit values per row of gu
    uint32_t const* const gu_row = reinterpret_cast<uint32_t const*>(params_.gu) + row_words;
    uint32_t* const d_gu_row = reinterpret_cast<uint32_t*>(params_.d_gu) + row_words;
    uint32_t* const act_row = params_.act_out == nullptr
                                  ? nullptr
                                  : reinterpret_cast<uint32_t*>(params_.act_out) + (static_cast<int64_t>(row) * n) / 2;
    const int q = lane & 3;
    CUTLASS_PRAGMA_UNROLL
    for (int c0 = 0; c0 < kGroups; c0 += kChunk) {
      uint32_t g[kSets][4], u[kSets][4];
      int unit[kSets];  // the first unit of this lane's group of each set
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSets; ++st) {
        unit[st] = n0 + get<1>(t_coord(make_coord(0, v1, c0 + 4 * st), mm, nn)) + 6 * q;
        if (row_in && unit[st] < n) {  // whole 8-unit groups: n % G == 0
          const uint4 gv = *reinterpret_cast<uint4 const*>(gu_row + unit[st]);
          const uint4 uv = *reinterpret_cast<uint4 const*>(gu_row + unit[st] + 4);
          g[st][0] = gv.x, g[st][1] = gv.y, g[st][2] = gv.z, g[st][3] = gv.w;
          u[st][0] = uv.x, u[st][1] = uv.y, u[st][2] = uv.z, u[st][3] = uv.w;
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < 4; ++i) g[st][i] = u[st][i] = 0u;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSets; ++st) {
        quad_transpose(g[st], lane);
        quad_transpose(u[st], lane);
        uint32_t dg[4], du[4], ag[4];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int v2 = c0 + 4 * st + i;
          const float2 gf = Pair<Element>::unpack(word(g[st][i])), uf = Pair<Element>::unpack(word(u[st][i]));
          const float d0 = acc(make_coord(0, v1, v2), mm, nn), d1 = acc(make_coord(1, v1, v2), mm, nn);
          float da0, da1;
          const float a0 = gate_act<A, true>(gf.x, &da0);
          const float a1 = gate_act<A, true>(gf.y, &da1);
          dg[i] = bits(Pair<Element>::pack(d0 * uf.x * da0, d1 * uf.y * da1));
          du[i] = bits(Pair<Element>::pack(d0 * a0, d1 * a1));
          ag[i] = bits(Pair<Element>::pack(a0 * uf.x, a1 * uf.y));
        }
        quad_transpose(dg, lane);
        quad_transpose(du, lane);
        if (act_row != nullptr) quad_transpose(ag, lane);
        if (!row_in || unit[st] >= n) continue;
        *reinterpret_cast<uint4*>(d_gu_row + unit[st]) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
        *reinterpret_cast<uint4*>(d_gu_row + unit[st] + 4) = make_uint4(du[0], du[1], du[2], du[3]);
        if (act_row != nullptr) *reinterpret_cast<uint4*>(act_row + unit[st] / 2) = make_uint4(ag[0], ag[1], ag[2], ag[3]);
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
