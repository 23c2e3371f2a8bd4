// The FP8 quantize pass (fp8_quantize.h): an amax pass (current scaling, unless the amax is known),
// then one pass that writes the row-major and the transposed FP8 copies, the column sums, (delayed
// scaling) the amax and (input_scale_inv_out set) the input's own e4m3 copy.
#include <cuda_fp8.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <type_traits>

#include "core/common/activation_math.cuh"
#include "core/common/cuda_check.h"
#include "core/common/device_info.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/fp8_quantize.h"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = 64;          // a block's tile: 128 rows x 64 columns (in place: CastLayout)
constexpr int kTileRows = 128;
constexpr int kVec = 8;                // elements per thread and load (16 bytes of a 16-bit type)
constexpr int kColGroups = kTileCols / kVec;          // 8 threads span a tile row
constexpr int kRowsPerPass = kThreads / kColGroups;   // 32 rows per pass
constexpr int kPasses = kTileRows / kRowsPerPass;     // 4 passes per tile, their loads issued together

// |v| as the bits of a non-negative float: their unsigned order is the float order, and every NaN
// sorts above +inf, so an unsigned max over them is an amax that propagates NaN.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The value quantized (fp8.h, Fp8QuantizeArgs), by kMode:
//   0  v = x                 1  v = act(x)             2  v = x * act'(pre)
//   3  v = act(g) * u        (gated forward: x is the packed pre-activation gu [rows, 2 cols])
//   4  v = d_h * u * act'(g) at a gate column, d_h * act(g) at an up column (gated backward:
//      x is d_h [rows, cols / 2], pre the packed gu [rows, cols])
//   5, 6  modes 2 and 4 with pre in e4m3 bytes, read as round_T(e4m3 value * pre_scale_inv)
// Each thread's 8 values are 8 consecutive columns of the quantized tensor [rows, cols]. In the
// gated modes those are one interleave block (types.h, kGatedInterleave = 8): mode 3's 8 units
// read the block's 8 gate and 8 up values, one 16-element run of gu; mode 4's 8 columns are the
// block's gate or its up half, and read the block's 8 d_h values and its 16 gu values.
static_assert(kGatedInterleave == kVec, "a thread's 8 values are one gated interleave block");

template <int kMode>
constexpr int x_factor() { return kMode == 3 ? 2 : 1; }  // x elements per value: mode 3 reads g and u
template <int kMode>
constexpr int pre_factor() {  // pre elements per value
  return (kMode == 2 || kMode == 5) ? 1 : ((kMode == 4 || kMode == 6) ? 2 : 0);
}
template <int kMode>
constexpr bool pre_fp8() { return kMode == 5 || kMode == 6; }
template <int kMode>
constexpr int base_mode() { return kMode == 5 ? 2 : (kMode == 6 ? 4 : kMode); }  // the value's formula

// The raw 16-byte words of a thread's 8 values' inputs (x, and pre), loaded now and converted
// later, so that the cast kernel can keep the next tile's loads in flight while it stores the
// current one.
template <typename T, int kMode>
struct Raw8 {
  static constexpr int kWords = sizeof(T) * kVec / 16;  // per 8 elements: 1 (16-bit types) or 2 (fp32)
  static constexpr int kXWords = kWords * x_factor<kMode>();
  // e4m3 pre: 8 bytes (mode 5, in the first word's x, y) or 16 (mode 6) per thread's 8 values
  static constexpr int kPreWords = pre_fp8<kMode>() ? 1 : kWords * (pre_factor<kMode>() > 0 ? pre_factor<kMode>() : 1);
  uint4 x[kXWords];
  uint4 pre[kPreWords];
};

// Loads the inputs of the 8 values at offset `off` = row * cols + col of the quantized tensor
// (zeros where !valid).
template <typename T, int kMode>
__device__ __forceinline__ void load_raw(const T* x, const T* pre, int64_t off, bool valid, Raw8<T, kMode>& r) {
  using R = Raw8<T, kMode>;
  int64_t x_off = off, pre_off = off;
  if constexpr (kMode == 3) x_off = 2 * off;
  if constexpr (base_mode<kMode>() == 4) {
    pre_off = off - off % (2 * kGatedInterleave);  // the block's first gate column (cols % 16 == 0)
    x_off = pre_off / 2;
  }
#pragma unroll
  for (int w = 0; w < R::kXWords; ++w)
    r.x[w] = valid ? reinterpret_cast<const uint4*>(x + x_off)[w] : make_uint4(0, 0, 0, 0);
  if constexpr (kMode == 5) {  // 8 bytes: pre_off is a multiple of 8
    const uint2 b = valid ? *reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(pre) + pre_off)
                          : make_uint2(0, 0);
    r.pre[0] = make_uint4(b.x, b.y, 0, 0);
  } else if constexpr (kMode == 6) {  // 16 bytes: pre_off is a multiple of 16
    r.pre[0] = valid ? *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(pre) + pre_off)
                     : make_uint4(0, 0, 0, 0);
  } else if constexpr (pre_factor<kMode>() > 0) {
#pragma unroll
    for (int w = 0; w < R::kPreWords; ++w)
      r.pre[w] = valid ? reinterpret_cast<const uint4*>(pre + pre_off)[w] : make_uint4(0, 0, 0, 0);
  }
}

// The i-th pre element of a thread's raw words as a float: in dtype, or (modes 5, 6) an e4m3 byte
// dequantized with scale_inv and rounded to T.
template <typename T, int kMode>
__device__ __forceinline__ float pre_at(const Raw8<T, kMode>& r, int i, float scale_inv) {
  if constexpr (pre_fp8<kMode>()) {
    const uint8_t b = reinterpret_cast<const uint8_t*>(r.pre)[i];
    const float q = __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));  // exact
    return Cvt<T>::to_float(Cvt<T>::from_float(q * scale_inv));
  } else {
    return Cvt<T>::to_float(reinterpret_cast<const T*>(r.pre)[i]);
  }
}

// Mode 6: two e4m3 bytes as pre_at reads them, both at once: one conversion of the two bytes to
// half2 (exact), two products and one packed rounding to T. Mode 6's passes are bound by
// instruction issue, and one byte at a time (7 instructions an element) made them 1.6x mode 4's
// (H200, 16384 x 28672). Mode 5 keeps pre_at: its pass was not slower than mode 2's, and the pairs
// would cost it a block an SM (80 registers uncapped, 128 in pairs).
template <typename T>
__device__ __forceinline__ float2 e4m3_pair(__nv_fp8x2_storage_t two, float scale_inv) {
  const float2 q = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
  const float2 v = make_float2(q.x * scale_inv, q.y * scale_inv);
  if constexpr (sizeof(T) == 2) return Cvt<T>::to_float2(Cvt<T>::from_float2(v.x, v.y));
  return v;
}

template <typename T, int kMode>
__device__ __forceinline__ float2 pre_pair_fp8(const Raw8<T, kMode>& r, int j, float scale_inv) {
  return e4m3_pair<T>(reinterpret_cast<const __nv_fp8x2_storage_t*>(r.pre)[j], scale_inv);
}

// Modes 4 and 6: both halves of an interleave block from its raw words (its 8 d_h and 16 gu
// values), f(i, gate column i's value, up column i's value) for i = 0 .. 7: d_h * u * act'(g) and
// d_h * act(g), from one act(g) and act'(g).
template <typename T, Activation A, int kMode, typename F>
__device__ __forceinline__ void gated_grad_values(const Raw8<T, kMode>& r, float pre_scale_inv, F&& f) {
  static_assert(base_mode<kMode>() == 4, "the gated backward's values");
  constexpr bool kFast = sizeof(T) == 2;
  const T* e = reinterpret_cast<const T*>(r.x);
  const auto gated = [&](int i, float g, float u) {
    float deriv;
    const float a = gate_act<A, kFast>(g, &deriv);
    const float d = Cvt<T>::to_float(e[i]);
    f(i, (d * u) * deriv, d * a);
  };
  if constexpr (pre_fp8<kMode>()) {
#pragma unroll
    for (int i = 0; i < kVec; i += 2) {
      const float2 g = pre_pair_fp8<T, kMode>(r, i / 2, pre_scale_inv);
      const float2 u = pre_pair_fp8<T, kMode>(r, (kVec + i) / 2, pre_scale_inv);
      gated(i, g.x, u.x);
      gated(i + 1, g.y, u.y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      gated(i, pre_at<T, kMode>(r, i, pre_scale_inv), pre_at<T, kMode>(r, kVec + i, pre_scale_inv));
  }
}

// The 8 values of raw words; `up` (mode 4): the columns are the block's up half. Zero words give
// v = 0 in every mode (act(0) = 0, 0 * act'(p) = 0, act(0) * 0 = 0).
template <typename T, Activation A, int kMode>
__device__ __forceinline__ void values_of(const Raw8<T, kMode>& r, bool up, float pre_scale_inv, float (&v)[kVec]) {
  constexpr bool kFast = sizeof(T) == 2;
  constexpr int kBase = base_mode<kMode>();
  const T* e = reinterpret_cast<const T*>(r.x);
  if constexpr (kBase == 3) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = gate_act<A, kFast>(Cvt<T>::to_float(e[i])) * Cvt<T>::to_float(e[kVec + i]);
    return;
  } else if constexpr (kBase == 4) {
    gated_grad_values<T, A, kMode>(r, pre_scale_inv, [&](int i, float gate, float up_value) {
      v[i] = up ? up_value : gate;
    });
    return;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = Cvt<T>::to_float(e[i]);
    if constexpr (kBase == 1) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = act_forward<A, kFast>(v[i]);
    } else if constexpr (kBase == 2) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = v[i] * act_derivative<A, kFast>(pre_at<T, kMode>(r, i, pre_scale_inv));
    }
  }
}

// Mode 4: the columns from `off` are an up half (the second 8 of their 16-column block).
__device__ __forceinline__ bool up_half(int64_t off) { return off % (2 * kGatedInterleave) >= kGatedInterleave; }

// The cast pass in mode 6: the two lanes of an interleave block (lane bit 0 = the up half;
// cg = threadIdx.x % 8, and a block's halves are cg 2b, 2b + 1) split its elements: lane h takes
// elements 4h .. 4h + 3 of d_h, g and u, evaluates act(g) there and both columns' values, keeps its
// own half's and hands the partner the other's (4 shuffles). With each lane evaluating all 8 act(g),
// the pair evaluated every act(g) twice: mode 6's pass took 0.845 ms against 0.824 (SwiGLU,
// 16384 x 28672, each pass alone on an H100; GeGLU 0.859 against 0.831). Both lanes load the
// block's 16 gu bytes in one 16-byte load (the pair's requests are one transaction) and each picks
// its quarter's words: with a lane's own 4-byte g and u loads, each request used 16 of a sector's
// 32 bytes (ncu), and the pass took 0.655 ms against 0.604 out of place, 0.919 against 0.896 in
// place (H100, the same shape, 5 interleaved rounds). Mode 4 (bf16 gu) is bound by memory and
// keeps Raw8: split, its pass took 0.966 against 0.964 ms (SwiGLU) and 0.984 against 0.971 (GeGLU).
template <typename T, int kMode>
struct RawGatedHalf {
  static constexpr int kQuarter = kVec / 2;  // elements a lane takes of each of d_h, g and u
  static constexpr int kDWords = kQuarter * static_cast<int>(sizeof(T)) / 4;
  uint32_t d[kDWords];
  uint32_t gu[4];  // the block's 16 e4m3 bytes: g's 8, then u's; lane h's quarter is words h, 2 + h
};

template <int kWords>
__device__ __forceinline__ void load_words(const void* src, bool valid, uint32_t (&w)[kWords]) {
  static_assert(kWords == 1 || kWords == 2 || kWords == 4, "4, 8 or 16 bytes");
  if constexpr (kWords == 4) {
    const uint4 v = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (kWords == 2) {
    const uint2 v = valid ? *reinterpret_cast<const uint2*>(src) : make_uint2(0, 0);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = valid ? *reinterpret_cast<const uint32_t*>(src) : 0u;
  }
}

// Loads lane h's quarter of d_h and the whole block's gu bytes, for the 8 values at `off`
// (h = up_half(off)).
template <typename T, int kMode>
__device__ __forceinline__ void load_raw(const T* x, const T* pre, int64_t off, bool valid,
                                         RawGatedHalf<T, kMode>& r) {
  static_assert(kMode == 6, "the gated backward's cast from gu's e4m3 copy");
  constexpr int kQ = RawGatedHalf<T, kMode>::kQuarter;
  const int64_t pre_off = off - off % (2 * kGatedInterleave);  // the block's first gate column
  const int h = up_half(off) ? 1 : 0;
  load_words(x + pre_off / 2 + kQ * h, valid, r.d);
  load_words(reinterpret_cast<const uint8_t*>(pre) + pre_off, valid, r.gu);
}

// The lane's 8 values (its half's columns) from its quarter and its partner's: gated_grad_values'
// products and e4m3_pair's values, so the same bits. Every lane of the warp calls it (the shuffles).
template <typename T, Activation A, int kMode>
__device__ __forceinline__ void values_of(const RawGatedHalf<T, kMode>& r, bool up, float pre_scale_inv,
                                          float (&v)[kVec]) {
  static_assert(kMode == 6, "the gated backward's cast from gu's e4m3 copy");
  constexpr bool kFast = sizeof(T) == 2;
  constexpr int kQ = RawGatedHalf<T, kMode>::kQuarter;
  float g[kQ], u[kQ];
  const uint32_t gw = up ? r.gu[1] : r.gu[0], uw = up ? r.gu[3] : r.gu[2];  // the lane's quarter
  const auto* gb = reinterpret_cast<const __nv_fp8x2_storage_t*>(&gw);
  const auto* ub = reinterpret_cast<const __nv_fp8x2_storage_t*>(&uw);
#pragma unroll
  for (int j = 0; j < kQ / 2; ++j) {
    const float2 gv = e4m3_pair<T>(gb[j], pre_scale_inv), uv = e4m3_pair<T>(ub[j], pre_scale_inv);
    g[2 * j] = gv.x, g[2 * j + 1] = gv.y, u[2 * j] = uv.x, u[2 * j + 1] = uv.y;
  }
  const T* e = reinterpret_cast<const T*>(r.d);
#pragma unroll
  for (int j = 0; j < kQ; ++j) {
    float deriv;
    const float a = gate_act<A, kFast>(g[j], &deriv);
    const float d = Cvt<T>::to_float(e[j]);
    const float gate = (d * u[j]) * deriv, upv = d * a;
    // The gate lane keeps its elements' gate values and sends their up values; the up lane keeps
    // its elements' up values (4 .. 7) and sends their gate values.
    const float got = __shfl_xor_sync(0xffffffffu, up ? gate : upv, 1);
    v[j] = up ? got : gate;
    v[kQ + j] = up ? upv : got;
  }
}

template <int kBlockThreads = kThreads>
__device__ __forceinline__ unsigned block_max(unsigned m) {
  static_assert(kBlockThreads % 32 == 0 && kBlockThreads <= 32 * 32, "a warp's lanes hold the warps' maxima");
  __shared__ unsigned warp_max[kBlockThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kBlockThreads / 32 ? warp_max[threadIdx.x] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  return m;  // valid in thread 0
}

// The input elements of a thread's raw words (forward modes: 8, or mode 3's 16 of gu), in order.
template <typename T, int kMode>
constexpr int input_elements() { return kVec * x_factor<kMode>(); }

// The amaxes the amax pass measures (kWhat bits): 1 the amax of v into amax[0], 2 the amax of the
// input itself (its copy's, forward modes 1 and 3) into amax[1].
constexpr int kAmaxOfV = 1, kAmaxOfInput = 2;

template <typename T, Activation A, int kMode, int kWhat>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, const T* __restrict__ pre, const float* __restrict__ pre_scale_inv,
                int64_t vectors, unsigned* amax) {
  static_assert(!(kWhat & kAmaxOfInput) || kMode == 1 || kMode == 3, "the input's copy is of forward modes 1 and 3");
  // 4 vectors per thread per step: their loads are in flight together.
  constexpr int kUnroll = 4;
  unsigned m = 0, m_in = 0;
  const float psi = pre_fp8<kMode>() ? *pre_scale_inv : 1.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // Modes 4 and 6: a unit is an interleave block, both its halves (2 vectors) from one load and one
  // act(g): the half-block vectors loaded the same words and evaluated act(g) twice.
  constexpr bool kBlocks = base_mode<kMode>() == 4;
  static_assert(!kBlocks || kWhat == kAmaxOfV, "the gated backward measures v's amax only");
  const int64_t units = kBlocks ? vectors / 2 : vectors;  // vectors is even there (cols % 16 == 0)
  for (int64_t i0 = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i0 < units; i0 += kUnroll * stride) {
    Raw8<T, kMode> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * stride;
      load_raw<T, kMode>(x, pre, i * (kBlocks ? 2 * kVec : kVec), i < units, raw[u]);
    }
    if constexpr (kBlocks) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        gated_grad_values<T, A, kMode>(raw[u], psi, [&](int, float gate, float up) {
          m = max(m, max(abs_bits(gate), abs_bits(up)));
        });
    } else if constexpr ((kWhat & kAmaxOfV) != 0) {
      float v[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) values_of<T, A, kMode>(raw[u], up_half((i0 + u * stride) * kVec), psi, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int k = 0; k < kVec; ++k) m = max(m, abs_bits(v[u][k]));
    }
    if constexpr ((kWhat & kAmaxOfInput) != 0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const T* e = reinterpret_cast<const T*>(raw[u].x);
#pragma unroll
        for (int k = 0; k < input_elements<T, kMode>(); ++k) m_in = max(m_in, abs_bits(Cvt<T>::to_float(e[k])));
      }
    }
  }
  if constexpr ((kWhat & kAmaxOfV) != 0) {
    m = block_max(m);
    if (threadIdx.x == 0 && m != 0u) atomicMax(amax, m);
  }
  if constexpr ((kWhat & kAmaxOfInput) != 0) {
    if constexpr ((kWhat & kAmaxOfV) != 0) __syncthreads();  // block_max's shared words are reused
    m_in = block_max(m_in);
    if (threadIdx.x == 0 && m_in != 0u) atomicMax(amax + 1, m_in);
  }
}

__device__ __forceinline__ uint8_t to_fp8(float v, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)
                               : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
}

// The scale outputs of a quantize pass, each where non-null: the scale and its inverse (the factor
// a GEMM of the FP8 tensor multiplies its accumulator by).
__device__ __forceinline__ void store_scales(float scale, float* scale_out, float* scale_inv_out) {
  if (scale_out != nullptr) *scale_out = scale;
  if (scale_inv_out != nullptr) *scale_inv_out = 1.f / scale;
}

__global__ void scales_kernel(const float* scale, float* scale_out, float* scale_inv_out) {
  store_scales(*scale, scale_out, scale_inv_out);
}

__global__ void scales_of_amax_kernel(const float* amax, Fp8Format format, float* scale_out, float* scale_inv_out) {
  store_scales(fp8_scale_from_amax(*amax, format), scale_out, scale_inv_out);
}

struct CastParams {
  int64_t rows, cols, ld_t, rows_per_block;
  Fp8Format format;
  const float* scale;         // delayed scaling, else null
  const unsigned* amax_bits;  // current scaling: the amax pass's result or the known amax
  const float* pre_scale_inv; // modes 5, 6
  uint8_t* data;
  uint8_t* data_t;
  float* scale_out;
  float* scale_inv_out;
  unsigned* amax_record;      // delayed scaling: the amax, accumulated here
  float* col_partials;        // [gridDim.y, cols] or null
  uint8_t* input_data;        // kInput: the input's e4m3 copy [rows, input cols]
  const unsigned* input_amax_bits;  // kInput: its amax
  float* input_scale_inv_out;       // kInput
};

// A block's tile of FP8 bytes (rows t0 + [0, 128), columns c0 + [0, 64)) in shared memory, as
// 4-byte words (row r, word q = its bytes 4q .. 4q + 3). Rows r and r + 1 (r even) share one
// 32-word line, and word 16 (r % 2) + q of that line sits at that index XOR 2 ((r / 8) % 16). Both
// accesses then hit 32 distinct banks: a warp's row writes (8 bytes of each of 4 rows, a half-warp
// per line) and its transposed reads (word q or q + 1 of 16 rows 8 apart; the XOR spreads the 16
// rows over the 16 even or odd banks and q's parity picks which). A padded row-major tile with
// per-byte reads had 4-way conflicts on the reads.
struct TransposeTile {
  uint32_t words[kTileRows / 2][32];

  // The word's place in its line, which is also its bank.
  static __host__ __device__ constexpr int index(int row, int q) {
    return ((row & 1) * 16 + q) ^ (((row >> 3) & 15) << 1);
  }
  // Row `row`'s bytes 8 cg .. 8 cg + 7 (words 2 cg, 2 cg + 1: adjacent after the XOR, which keeps
  // bit 0).
  __device__ __forceinline__ void put8(int row, int cg, uint32_t lo, uint32_t hi) {
    *reinterpret_cast<uint2*>(&words[row >> 1][index(row, 2 * cg)]) = make_uint2(lo, hi);
  }
  __device__ __forceinline__ uint32_t get4(int row, int q) const { return words[row >> 1][index(row, q)]; }
};

// What the layout promises, checked by the compiler: every (row, word) has its own slot; each
// half-warp's row writes (rows 2s, 2s + 1 of thread k: row pass * 32 + k / 8, words 2 (k % 8) and
// 2 (k % 8) + 1) and each warp's transposed reads (thread k: row 8 (k % 16) + j, word k / 16) hit
// 32 distinct banks.
constexpr bool transpose_tile_is_conflict_free() {
  for (int s = 0; s < kTileRows / 2; ++s) {  // a bijection on each line
    unsigned long long seen = 0;
    for (int r = 2 * s; r < 2 * s + 2; ++r)
      for (int q = 0; q < kTileCols / 4; ++q) seen |= 1ull << TransposeTile::index(r, q);
    if (seen != 0xffffffffull) return false;
  }
  for (int base = 0; base < kThreads; base += 16) {  // row writes, a half-warp at a time
    for (int pass = 0; pass < kPasses; ++pass) {
      unsigned long long banks = 0;
      for (int k = base; k < base + 16; ++k)
        for (int e = 0; e < 2; ++e)
          banks |= 1ull << TransposeTile::index(pass * kRowsPerPass + k / kColGroups, 2 * (k % kColGroups) + e);
      if (banks != 0xffffffffull) return false;
    }
  }
  for (int base = 0; base < kThreads; base += 32) {  // transposed reads, a warp at a time
    for (int j = 0; j < 8; ++j) {
      unsigned long long banks = 0;
      for (int k = base; k < base + 32; ++k) banks |= 1ull << TransposeTile::index(8 * (k % 16) + j, k / 16);
      if (banks != 0xffffffffull) return false;
    }
  }
  return true;
}
static_assert(transpose_tile_is_conflict_free(), "the transposed tile's layout");

// The tile stored transposed into data_t [cols, ld_t]: thread k reads 8 rows (8 (k % 16) on) of
// the 4 columns 4 (k / 16) .. + 3, transposes the 8 x 4 bytes in registers, and writes 8 bytes to
// each of the 4 output rows (a half-warp writes 128 contiguous bytes of one).
__device__ __forceinline__ void store_tile_transposed(const TransposeTile& tile, int64_t c0, int64_t t0,
                                                      int64_t cols, int64_t ld_t, uint8_t* data_t) {
  static_assert(kThreads == (kTileRows / 8) * (kTileCols / 4), "one 8-row x 4-column block per thread");
  const int rb = threadIdx.x % (kTileRows / 8), q = threadIdx.x / (kTileRows / 8);
  const int64_t out_row = c0 + 4 * q, out_col = t0 + 8 * rb;
  if (out_row >= cols || out_col >= ld_t) return;  // cols % 8 == 0: the 4 columns are wholly in or out
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = tile.get4(8 * rb + j, q);
  // Byte i of output row 4 q + i: byte i of w[0], ..., w[7]. __byte_perm(a, b, s) takes byte k of
  // its result from byte nibble k of s of the pair (a: 0-3, b: 4-7).
  uint32_t col[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo01 = __byte_perm(w[4 * h], w[4 * h + 1], 0x5140);  // w0.b0 w1.b0 w0.b1 w1.b1
    const uint32_t hi01 = __byte_perm(w[4 * h], w[4 * h + 1], 0x7362);  // w0.b2 w1.b2 w0.b3 w1.b3
    const uint32_t lo23 = __byte_perm(w[4 * h + 2], w[4 * h + 3], 0x5140);
    const uint32_t hi23 = __byte_perm(w[4 * h + 2], w[4 * h + 3], 0x7362);
    col[h][0] = __byte_perm(lo01, lo23, 0x5410);  // w0.b0 w1.b0 w2.b0 w3.b0
    col[h][1] = __byte_perm(lo01, lo23, 0x7632);
    col[h][2] = __byte_perm(hi01, hi23, 0x5410);
    col[h][3] = __byte_perm(hi01, hi23, 0x7632);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    *reinterpret_cast<uint2*>(data_t + (out_row + i) * ld_t + out_col) = make_uint2(col[0][i], col[1][i]);
}

// Whether the cast pass quantizes a tile (and writes the input's copy) before issuing the next
// tile's loads, holding 2 words a pass across them, or after, holding the 8 float values. Measured
// apart on an H100 (each pass alone, 16384 rows: SwiGLU's gu of 28672 columns, GELU's pre of
// 32768, x of 8192): before is faster where the values are cheap or the pass also writes the
// input's copy — with the copy 1.042 against 1.096 ms (SwiGLU) and 1.043 against 1.216 (GeGLU,
// whose late form spilled 60 bytes at the 128-register cap), modes 0 / 1 0.198 / 0.870 against
// 0.205 / 0.882 — and after is faster for the backward modes (2: 1.216 against 1.271, 4: 0.966
// against 1.007, 5: 1.060 against 1.107; 6 a tie) and mode 3 without the copy (0.527 against 0.536).
template <int kMode, bool kInput>
constexpr bool quantize_before_loads() { return kInput || kMode == 0 || kMode == 1; }

// A cast block's columns and threads: kCols columns (64, or 128 for the in-place passes), kVec a
// thread, 32 rows a pass (kRowsPerPass) and kPasses passes a tile (kTileRows), so 256 or 512
// threads. In place (data = pre, modes 5 and 6) a block covers 128 columns, whole 128-byte lines
// of the e4m3 bytes it reads and overwrites. With 64, two blocks shared each line, one writing its
// half while the other's read of the other half could be in flight: mode 6's pass took 0.900 ms in
// place against 0.604 out of place (SwiGLU 16384 x 28672, H100, 5 interleaved rounds) at the same
// DRAM and L2 traffic (ncu), and launching the blocks that share a line far apart removed the
// difference (0.755 against 0.749, both slower for the scattered order). With 128 the in-place
// pass takes 0.645 ms against 0.916 before (GeGLU 0.645 against 0.918; the plain GELU cast from
// pre's e4m3 copy 0.427 against 0.475; tools/quantize_passes.py, two builds alternated, H100).
// Each thread still covers the rows r = rl (mod 32) of its columns in the same order, and the row
// groups are those of 64-column blocks (row_groups), so the column sums are the same bits in both
// layouts. The transposed copy's tile is 64 columns wide; in place there is none.
template <int kCols>
struct CastLayout {
  static_assert(kCols == kTileCols || kCols == 2 * kTileCols, "64 or 128 columns a block");
  static constexpr int kColGroups = kCols / kVec;                   // threads across a tile row
  static constexpr int kBlockThreads = kColGroups * kRowsPerPass;   // 256 or 512
};
static_assert(CastLayout<kTileCols>::kBlockThreads == kThreads, "the transposed tile's threads");

// Block (bx, by) covers columns [kCols bx, kCols bx + kCols) of rows [by rows_per_block, ...), one
// tile after another, padded rows (rows <= r < ld_t) quantizing as zeros for data_t (kCols 64 only).
// kInput (forward modes 1 and 3): the input's own e4m3 copy as well, from the same loads.
// pre carries no __restrict__: data may be pre itself (modes 5 and 6, in place; fp8_quantize.h).
template <typename T, Activation A, int kMode, bool kInput, int kCols>
__device__ __forceinline__ void cast_body(const T* __restrict__ x, const T* pre, const CastParams& p) {
  static_assert(!kInput || kMode == 1 || kMode == 3, "the input's copy is of forward modes 1 and 3");
  using L = CastLayout<kCols>;
  constexpr bool kTransposes = kCols == kTileCols;  // data_t only with the 64-column tile
  __shared__ __align__(16) TransposeTile tile;
  __shared__ float sums[kRowsPerPass][kCols];
  const int cg = threadIdx.x % L::kColGroups, rl = threadIdx.x / L::kColGroups;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kCols;
  const int64_t col = c0 + cg * kVec;
  const bool col_in = col < p.cols;  // cols % 8 == 0: a group is wholly in or out
  const float scale = p.scale != nullptr ? *p.scale : fp8_scale_from_amax(__uint_as_float(*p.amax_bits), p.format);
  const float psi = pre_fp8<kMode>() ? *p.pre_scale_inv : 1.f;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) store_scales(scale, p.scale_out, p.scale_inv_out);
  float scale_in = 1.f;
  if constexpr (kInput) {
    scale_in = fp8_scale_from_amax(__uint_as_float(*p.input_amax_bits), Fp8Format::kE4M3);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) store_scales(scale_in, nullptr, p.input_scale_inv_out);
  }
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t r_end = min(r_begin + p.rows_per_block, p.data_t != nullptr ? p.ld_t : p.rows);
  float acc[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  unsigned m = 0;
  using Raw = std::conditional_t<kMode == 6, RawGatedHalf<T, kMode>, Raw8<T, kMode>>;
  Raw raw[kPasses];
  const bool up = up_half(col);
  const auto load_tile = [&](int64_t t) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int64_t row = t + pass * kRowsPerPass + rl;
      load_raw<T, kMode>(x, pre, row * p.cols + col, col_in && row < p.rows, raw[pass]);
    }
  };
  if (r_begin < r_end) load_tile(r_begin);
  // The input's copy of one pass (kInput), from its raw words: mode 1's 8 elements at the values'
  // offset, mode 3's 16 of gu at twice it (its rows are 2 cols wide).
  const auto copy_input = [&](int64_t t0, int pass) {
    if constexpr (kInput) {
      constexpr int kN = input_elements<T, kMode>();
      const int64_t row = t0 + pass * kRowsPerPass + rl;
      if (!col_in || row >= p.rows) return;
      const T* e = reinterpret_cast<const T*>(raw[pass].x);
      __align__(16) uint8_t qi[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) qi[k] = to_fp8(Cvt<T>::to_float(e[k]) * scale_in, Fp8Format::kE4M3);
      uint8_t* dst = p.input_data + (row * p.cols + col) * x_factor<kMode>();
      if constexpr (kN == 16) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(qi);
      } else {
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(qi);
      }
    }
  };
  // A pass's 8 values into the column sums and the amax, and their FP8 bytes.
  const auto quantize = [&](const float (&v)[kVec]) {
    __align__(8) uint8_t q[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      acc[k] += v[k];
      m = max(m, abs_bits(v[k]));
      q[k] = to_fp8(v[k] * scale, p.format);
    }
    return *reinterpret_cast<const uint2*>(q);
  };
  const auto store = [&](int64_t t0, int pass, uint2 q8) {
    const int lr = pass * kRowsPerPass + rl;
    const int64_t row = t0 + lr;
    if (p.data != nullptr && col_in && row < p.rows) *reinterpret_cast<uint2*>(p.data + row * p.cols + col) = q8;
    if constexpr (kTransposes) {
      if (p.data_t != nullptr) tile.put8(lr, cg, q8.x, q8.y);
    }
  };
  // Mode 6 in place: both lanes of an interleave block read all 16 of its gu bytes, and each
  // writes 8 of them; both reads precede both writes (the loop is uniform across the block).
  const auto reads_before_writes = [] {
    if constexpr (kMode == 6) __syncwarp();
  };
  for (int64_t t0 = r_begin; t0 < r_end; t0 += kTileRows) {
    // The next tile's loads are in flight while this one is stored (its bytes made before them,
    // quantize_before_loads) or quantized and stored.
    if constexpr (quantize_before_loads<kMode, kInput>()) {
      uint2 q8[kPasses];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        float v[kVec];
        values_of<T, A, kMode>(raw[pass], up, psi, v);
        copy_input(t0, pass);
        q8[pass] = quantize(v);
      }
      reads_before_writes();
      if (t0 + kTileRows < r_end) load_tile(t0 + kTileRows);
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) store(t0, pass, q8[pass]);
    } else {
      float v[kPasses][kVec];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) values_of<T, A, kMode>(raw[pass], up, psi, v[pass]);
      reads_before_writes();
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) copy_input(t0, pass);
      if (t0 + kTileRows < r_end) load_tile(t0 + kTileRows);
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) store(t0, pass, quantize(v[pass]));
    }
    if constexpr (kTransposes) {
      if (p.data_t != nullptr) {
        __syncthreads();
        store_tile_transposed(tile, c0, t0, p.cols, p.ld_t, p.data_t);
        __syncthreads();  // the tile is rewritten by the next rows
      }
    }
  }
  if (p.amax_record != nullptr) {
    m = block_max<L::kBlockThreads>(m);
    if (threadIdx.x == 0 && m != 0u) atomicMax(p.amax_record, m);
  }
  if (p.col_partials != nullptr) {
    // Column sums of the block's rows: the row lanes of each column group, added in lane order.
#pragma unroll
    for (int k = 0; k < kVec; ++k) sums[rl][cg * kVec + k] = acc[k];
    __syncthreads();
    if (threadIdx.x < kCols && c0 + threadIdx.x < p.cols) {
      float s = 0.f;
      for (int l = 0; l < kRowsPerPass; ++l) s += sums[l][threadIdx.x];
      p.col_partials[static_cast<int64_t>(blockIdx.y) * p.cols + c0 + threadIdx.x] = s;
    }
  }
}

template <typename T, Activation A, int kMode, bool kInput, int kCols>
__global__ void __launch_bounds__(CastLayout<kCols>::kBlockThreads) cast_kernel(const T* __restrict__ x, const T* pre, CastParams p) {
  cast_body<T, A, kMode, kInput, kCols>(x, pre, p);
}

// The same pass capped at 128 registers (two blocks an SM), for kInput and mode 6's e4m3 pre, which
// hold more words: uncapped, kInput took 169 registers and one block, and its pass 2.0x the plain
// one's (gated, 16384 x 28672, H200); mode 6's pairwise dequantization takes 200-228. (A minimum of 1 block in the launch bounds is not the same as none: it moves
// every kernel's register count, so the uncapped kernel states none.) The 512-thread blocks of
// 128 columns: one an SM, the same 128 registers.
template <typename T, Activation A, int kMode, bool kInput, int kCols>
__global__ void __launch_bounds__(CastLayout<kCols>::kBlockThreads, kCols == kTileCols ? 2 : 1) cast_kernel_capped(const T* __restrict__ x, const T* pre, CastParams p) {
  cast_body<T, A, kMode, kInput, kCols>(x, pre, p);
}

int mode_of(const Fp8QuantizeArgs& a) {
  const bool pre8 = a.pre_scale_inv != nullptr;
  if (is_gated(a.activation)) return a.backward ? (pre8 ? 6 : 4) : 3;
  if (a.backward) return pre8 ? 5 : 2;
  return a.activation == Activation::kNone ? 0 : 1;
}

// The modes of activation A: 0, 1, 2, 5 for the plain activations, 3, 4, 6 for the gated ones.
template <Activation A, typename F>
void dispatch_mode(int mode, F&& f) {
  if constexpr (is_gated(A)) {
    if (mode == 3) return f(std::integral_constant<int, 3>{});
    if (mode == 6) return f(std::integral_constant<int, 6>{});
    return f(std::integral_constant<int, 4>{});
  } else {
    switch (mode) {
      case 0: f(std::integral_constant<int, 0>{}); return;
      case 1: f(std::integral_constant<int, 1>{}); return;
      case 5: f(std::integral_constant<int, 5>{}); return;
      default: f(std::integral_constant<int, 2>{}); return;
    }
  }
}

// The cast pass of mode M, with the input's copy where p.input_scale_inv_out is set (forward modes 1
// and 3: check_args refuses it elsewhere), in blocks of `cols` columns (cast_cols).
template <typename T, Activation A, int M>
void launch_cast(dim3 grid, int cols, const T* x, const T* pre, const CastParams& p, cudaStream_t stream) {
  if constexpr (M == 1 || M == 3) {
    if (p.input_scale_inv_out != nullptr) {
      cast_kernel_capped<T, A, M, true, kTileCols><<<grid, kThreads, 0, stream>>>(x, pre, p);
      return;
    }
  }
  if constexpr (M == 5 || M == 6) {
    if (cols == 2 * kTileCols) {
      if constexpr (M == 6) {
        cast_kernel_capped<T, A, M, false, 2 * kTileCols><<<grid, CastLayout<2 * kTileCols>::kBlockThreads, 0, stream>>>(x, pre, p);
      } else {
        cast_kernel<T, A, M, false, 2 * kTileCols><<<grid, CastLayout<2 * kTileCols>::kBlockThreads, 0, stream>>>(x, pre, p);
      }
      return;
    }
  }
  if (cols != kTileCols) throw Error("fused_dense: fp8_quantize: 128-column blocks are for the in-place modes 5 and 6");
  if constexpr (M == 6) {
    cast_kernel_capped<T, A, M, false, kTileCols><<<grid, kThreads, 0, stream>>>(x, pre, p);
  } else {
    cast_kernel<T, A, M, false, kTileCols><<<grid, kThreads, 0, stream>>>(x, pre, p);
  }
}

// The amax pass of mode M measuring `what` (kAmaxOfV | kAmaxOfInput; the input's amax in forward
// modes 1 and 3 only).
template <typename T, Activation A, int M>
void launch_amax(int what, unsigned blocks, const T* x, const T* pre, const float* pre_scale_inv, int64_t vectors,
                 unsigned* amax, cudaStream_t stream) {
  if constexpr (M == 1 || M == 3) {
    if (what == kAmaxOfInput) {
      amax_kernel<T, A, M, kAmaxOfInput><<<blocks, kThreads, 0, stream>>>(x, pre, pre_scale_inv, vectors, amax);
      return;
    }
    if (what == (kAmaxOfV | kAmaxOfInput)) {
      amax_kernel<T, A, M, kAmaxOfV | kAmaxOfInput><<<blocks, kThreads, 0, stream>>>(x, pre, pre_scale_inv, vectors,
                                                                                    amax);
      return;
    }
  }
  amax_kernel<T, A, M, kAmaxOfV><<<blocks, kThreads, 0, stream>>>(x, pre, pre_scale_inv, vectors, amax);
}

// The cast pass's columns a block (CastLayout): 128 in place (data = pre_act, modes 5 and 6, which
// check_args allows without data_t only), else 64.
int cast_cols(const Fp8QuantizeArgs& a) { return a.data != nullptr && a.data == a.pre_act ? 2 * kTileCols : kTileCols; }

// Row groups per column tile: enough blocks for about 8 per SM, at least one 128-row tile each.
// Counted in 64-column tiles whatever the block's width, so both layouts split the rows alike.
int64_t row_groups(int device, const Fp8QuantizeArgs& a) {
  const int64_t rows = a.data_t != nullptr ? fp8_padded_rows(a.rows) : a.rows;
  const int64_t tiles = std::max<int64_t>(1, (rows + kTileRows - 1) / kTileRows);
  const int64_t col_tiles = (a.cols + kTileCols - 1) / kTileCols;
  const int64_t want = std::max<int64_t>(1, 8 * device_info(device).sm_count() / std::max<int64_t>(1, col_tiles));
  const int64_t groups = std::min<int64_t>(tiles, want);
  const int64_t tiles_per_group = (tiles + groups - 1) / groups;
  return (tiles + tiles_per_group - 1) / tiles_per_group;
}

void check_args(const Fp8QuantizeArgs& a) {
  std::ostringstream msg;
  if (a.cols % kVec != 0) msg << "cols must be a multiple of " << kVec << ", got " << a.cols;
  const auto misaligned = [](const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (misaligned(a.input) || misaligned(a.pre_act) || misaligned(a.data) || misaligned(a.data_t) ||
      misaligned(a.input_data))
    msg << "every matrix pointer must be 16-byte aligned";
  if (a.known_amax != nullptr && a.scale != nullptr) msg << "known_amax is for current scaling (scale null)";
  // An empty tensor's data pointer may be null: pre_act is needed only where there are elements.
  if (a.backward && (a.activation == Activation::kNone || (a.pre_act == nullptr && a.rows > 0 && a.cols > 0)))
    msg << "backward needs pre_act and an activation";
  if (a.pre_scale_inv != nullptr && !a.backward) msg << "pre_scale_inv (an e4m3 pre_act) is read in backward only";
  const bool copy = a.input_scale_inv_out != nullptr;
  if (copy && (a.backward || a.activation == Activation::kNone))
    msg << "the input's e4m3 copy (input_scale_inv_out) is for the forward with an activation";
  if (copy && a.input_data == nullptr && a.rows > 0) msg << "the input's e4m3 copy needs input_data";
  if (!copy && (a.input_data != nullptr || a.input_known_amax != nullptr))
    msg << "input_data and input_known_amax are for the input's copy (input_scale_inv_out)";
  if (a.data != nullptr && a.data == a.pre_act && (a.pre_scale_inv == nullptr || a.data_t != nullptr))
    msg << "data may be pre_act itself (in place) only for an e4m3 pre_act (pre_scale_inv) without data_t";
  if (is_gated(a.activation) && a.backward && a.cols % (2 * kGatedInterleave) != 0)
    msg << "the gated backward's cols (2 hidden) must be a multiple of " << 2 * kGatedInterleave << ", got " << a.cols;
  if (!msg.str().empty()) throw Error("fused_dense: fp8_quantize: " + msg.str());
}

// fp8_transpose: block (bx, by) moves 128-row x 64-column tiles (columns 64 bx; rows 128 by, then
// every gridDim.y tiles on) through shared memory and stores them as the cast pass stores data_t;
// rows past `rows` (up to the padded count) are zeros.
__global__ void __launch_bounds__(kThreads)
    transpose_kernel(const uint8_t* __restrict__ data, int64_t rows, int64_t cols, int64_t ld_t,
                     uint8_t* __restrict__ data_t) {
  __shared__ __align__(16) TransposeTile tile;
  const int cg = threadIdx.x % kColGroups, rl = threadIdx.x / kColGroups;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t col = c0 + cg * kVec;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileRows; t0 < ld_t;
       t0 += static_cast<int64_t>(gridDim.y) * kTileRows) {
    uint2 w[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int64_t row = t0 + pass * kRowsPerPass + rl;
      w[pass] = (col < cols && row < rows) ? *reinterpret_cast<const uint2*>(data + row * cols + col)
                                           : make_uint2(0, 0);
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) tile.put8(pass * kRowsPerPass + rl, cg, w[pass].x, w[pass].y);
    __syncthreads();
    store_tile_transposed(tile, c0, t0, cols, ld_t, data_t);
    __syncthreads();  // the tile is rewritten by the next rows
  }
}

}  // namespace

void fp8_transpose(const uint8_t* data, int64_t rows, int64_t cols, uint8_t* data_t, cudaStream_t stream) {
  const auto misaligned = [](const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (cols % 16 != 0 || rows < 0 || misaligned(data) || misaligned(data_t))
    throw Error("fused_dense: fp8_transpose: cols must be a multiple of 16 and the pointers 16-byte aligned, got cols " +
                std::to_string(cols));
  const int64_t ld_t = fp8_padded_rows(rows);
  if (cols == 0 || ld_t == 0) return;
  const int64_t row_tiles = std::min<int64_t>((ld_t + kTileRows - 1) / kTileRows, 65535);
  dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(row_tiles));
  transpose_kernel<<<grid, kThreads, 0, stream>>>(data, rows, cols, ld_t, data_t);
  FD_CHECK_LAUNCH();
}

void fp8_write_scales(const float* scale, float* scale_out, float* scale_inv_out, cudaStream_t stream) {
  scales_kernel<<<1, 1, 0, stream>>>(scale, scale_out, scale_inv_out);
  FD_CHECK_LAUNCH();
}

void fp8_scales_of_amax(const float* amax, Fp8Format format, float* scale_out, float* scale_inv_out,
                        cudaStream_t stream) {
  scales_of_amax_kernel<<<1, 1, 0, stream>>>(amax, format, scale_out, scale_inv_out);
  FD_CHECK_LAUNCH();
}

std::size_t fp8_quantize_workspace_bytes(int device, const Fp8QuantizeArgs& args) {
  std::size_t bytes = 256;  // the amaxes of current scaling: v's, the input's (its copy's)
  if (args.column_sums != nullptr && args.rows > 0)
    bytes += static_cast<std::size_t>(row_groups(device, args)) * static_cast<std::size_t>(args.cols) * sizeof(float);
  return bytes;
}

void fp8_quantize(const Fp8QuantizeArgs& a, void* workspace, std::size_t workspace_bytes, int device,
                  cudaStream_t stream) {
  check_args(a);
  if (workspace_bytes < fp8_quantize_workspace_bytes(device, a))
    throw Error("fused_dense: fp8_quantize: workspace too small");
  auto* partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + 256);
  const bool current = a.scale == nullptr;
  const bool measure = current && a.known_amax == nullptr;  // the amax pass measures v's amax
  const bool measure_input = a.input_scale_inv_out != nullptr && a.input_known_amax == nullptr;  // the input's
  auto* measured = static_cast<unsigned*>(workspace);  // [v's amax, the input's]
  const unsigned* amax_bits = measure ? measured : reinterpret_cast<const unsigned*>(a.known_amax);
  const unsigned* input_amax_bits =
      measure_input ? measured + 1 : reinterpret_cast<const unsigned*>(a.input_known_amax);
  const int what = (measure ? kAmaxOfV : 0) | (measure_input ? kAmaxOfInput : 0);
  // The amaxes start at 0 (all-zero or empty tensors keep it), accumulated by atomicMax.
  if (what != 0) FD_CUDA_CHECK(cudaMemsetAsync(workspace, 0, 2 * sizeof(unsigned), stream));
  if (a.amax_out != nullptr && !current) FD_CUDA_CHECK(cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream));
  const int64_t elements = a.rows * a.cols;
  dispatch_dtype(a.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const auto body = [&](auto act_tag) {
      constexpr Activation A = decltype(act_tag)::value;
      dispatch_mode<A>(mode_of(a), [&](auto mode_tag) {
        constexpr int M = decltype(mode_tag)::value;
        const T* x = static_cast<const T*>(a.input);
        const T* pre = static_cast<const T*>(a.pre_act);
        if (what != 0 && elements > 0) {
          const int64_t vectors = elements / kVec;
          const int64_t blocks =
              std::min<int64_t>((vectors + kThreads - 1) / kThreads, 8 * device_info(device).sm_count());
          launch_amax<T, A, M>(what, static_cast<unsigned>(blocks), x, pre, a.pre_scale_inv, vectors, measured,
                               stream);
          FD_CHECK_LAUNCH();
        }
        CastParams p{};
        p.rows = a.rows, p.cols = a.cols, p.ld_t = fp8_padded_rows(a.rows);
        p.format = a.format;
        p.scale = a.scale;
        p.amax_bits = amax_bits;
        p.pre_scale_inv = a.pre_scale_inv;
        p.data = a.data, p.data_t = a.data_t;
        p.scale_out = a.scale_out, p.scale_inv_out = a.scale_inv_out;
        p.amax_record = current ? nullptr : reinterpret_cast<unsigned*>(a.amax_out);
        const int64_t groups = row_groups(device, a);
        const int cols = cast_cols(a);
        const int64_t rows_cov = a.data_t != nullptr ? p.ld_t : a.rows;
        const int64_t tiles = std::max<int64_t>(1, (rows_cov + kTileRows - 1) / kTileRows);
        p.rows_per_block = ((tiles + groups - 1) / groups) * kTileRows;
        p.col_partials = (a.column_sums != nullptr && a.rows > 0) ? partials : nullptr;
        p.input_data = a.input_data;
        p.input_amax_bits = input_amax_bits;
        p.input_scale_inv_out = a.input_scale_inv_out;
        const int64_t col_tiles = std::max<int64_t>(1, (a.cols + cols - 1) / cols);
        dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(groups));
        launch_cast<T, A, M>(grid, cols, x, pre, p, stream);
        FD_CHECK_LAUNCH();
        if (current && a.amax_out != nullptr && a.amax_out != a.known_amax)
          FD_CUDA_CHECK(cudaMemcpyAsync(a.amax_out, amax_bits, sizeof(float), cudaMemcpyDeviceToDevice, stream));
        if (a.column_sums != nullptr) {
          if (a.rows > 0) {
            sum_partials(a.dtype, partials, a.cols, groups, a.cols, a.column_sums, stream);
          } else if (a.cols > 0) {
            FD_CUDA_CHECK(cudaMemsetAsync(a.column_sums, 0, a.cols * dtype_size(a.dtype), stream));
          }
        }
      });
    };
    if (is_gated(a.activation)) {
      dispatch_gated_act(a.activation, body);
    } else {
      dispatch_act(a.activation, body);
    }
  });
}

}  // namespace fused_dense::core
