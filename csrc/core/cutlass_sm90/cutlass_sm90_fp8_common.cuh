// The pieces of the cutlass_sm90 FP8 kernel (cutlass_sm90_fp8.h) that are not its own: the
// activation functor of its visitor tree, the amax reduction, the tile configuration and the
// auxiliary tensors' layouts. Include after cutlass_sm90_common.cuh, inside
// FUSED_DENSE_WITH_CUTLASS_SM90A.
#pragma once

namespace fused_dense::core::cutlass_sm90 {

// act_forward<A> (activation_math.cuh, the fast form the quantize pass uses for 16-bit inputs)
// in both forms CUTLASS's Sm90Compute calls (cutlass_sm90_common.cuh says why).
template <Activation A, class T>
struct ActOf {
  CUTLASS_DEVICE T operator()(T const& p) const { return act_forward<A, true>(p); }
};

template <Activation A, int n>
struct ActOf<A, cutlass::Array<float, n>> {
  CUTLASS_DEVICE cutlass::Array<float, n> operator()(cutlass::Array<float, n> const& p) const {
    cutlass::Array<float, n> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < n; ++i) out[i] = act_forward<A, true>(p[i]);
    return out;
  }
};

template <Activation A>
struct Act {
  template <class T>
  using Fn = ActOf<A, T>;
};

// The amax with fp8_quantize's rule: the bits of |v| under an unsigned max, so that NaN (above
// +inf in that order) propagates; the reduction functions of CUTLASS's scalar-reduction visitor.
template <class T>
struct AbsMaxBits {
  CUTLASS_DEVICE T operator()(T const& acc, T const& v) const {
    return __uint_as_float(max(__float_as_uint(acc), __float_as_uint(v) & 0x7fffffffu));
  }
};

// The per-thread amax is reduced across the warp before one atomic (a thread's atomic per tile
// would be 128 a tile on one address). Called by every thread of the epilogue's warps together,
// at the end of each tile.
template <class T>
struct WarpAtomicMaxBits {
  CUTLASS_DEVICE void operator()(T* ptr, T value) const {
    unsigned m = __float_as_uint(value);
    CUTLASS_PRAGMA_UNROLL
    for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0 && m != 0u) atomicMax(reinterpret_cast<unsigned*>(ptr), m);
  }
};

// The tile configuration and tile order, measured on the H200 against 2 x 1 clusters, 128 x 256
// and 256 x 128 cooperative tiles and the three orders of cutlass_sm90_common.cuh: 128 x 128
// ping-pong, 1 x 2 clusters, tiles grouped 8 along M (docs/performance.md, "FP8": the cutlass_sm90
// FP8 fc1 GEMM's configuration). A fixed choice keeps the bits of a recomputation the
// forward's without a tuner entry. Schedule: the mainloop's FP8 accumulation (the forward's fast
// one, as the library's other forward FP8 GEMMs).
template <class MainloopSchedule>
struct Fp8GemmConfig {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using EpilogueTile = cute::Shape<cute::_64, cute::_32>;
  using Schedule = MainloopSchedule;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
  static constexpr int kOrder = 1;  // kOrders[1]: 8 tiles along M
  static constexpr int kStagesD = 2;  // the builder's for 8 sub-tiles a tile (min(sub-tiles, 2))
};

// The shared-memory layout and copy operations of an auxiliary tensor of the epilogue with
// global stride Stride_ and element E, as CUTLASS's builder picks them for its own.
template <class Stride_, class E, class EpilogueTile>
using AuxSmemAtom = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                             Stride_, E, EpilogueTile>());
template <class Stride_, class E, class EpilogueTile>
using AuxStoreOp = decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<
                            Stride_, E, EpilogueTile>());

// In CUTLASS's column-major terms the kernel computes D[features, tokens]: D and the
// pre-activation are M-major (row-major [tokens, features] in memory), the transposed FP8 copy
// N-major (row-major [features, tokens]).
using StrideFeatures = cutlass::detail::TagToStrideC_t<cutlass::layout::ColumnMajor>;
using StrideTokens = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;

}  // namespace fused_dense::core::cutlass_sm90

namespace cutlass {
template <class T>
struct is_atomic<fused_dense::core::cutlass_sm90::WarpAtomicMaxBits<T>> : platform::true_type {};
}  // namespace cutlass
