// Bias + activation forward and activation backward + bias-gradient kernels.
//
// Design notes:
//  * Everything is memory-bound, so the fast paths move 16 bytes per load/store (8 halfs or
//    4 floats). They are taken only when cols is a multiple of the vector width and every
//    matrix/vector pointer is 16-byte aligned; a scalar path handles all other shapes.
//  * Flat grid-stride loops track (row, col) incrementally instead of dividing per element:
//    a 64-bit division costs more issue slots than the memory system leaves per vector.
//  * Each thread issues several independent loads (kUnroll items in the flat kernels, R rows in
//    the bias-gradient kernel) before any store. The compiler cannot do this reordering itself
//    because x/out and grad/grad_in may alias.
//  * The 16-bit GELU paths are issue-bound rather than memory-bound unless the math is lean:
//    sigmoid-form GELU with hardware ex2/rcp and paired dtype conversions.
//  * The bias gradient is reduced deterministically: per (column tile, row chunk) partial sums
//    in a fixed order into an fp32 workspace, then a second kernel adds the chunks in an order
//    fixed by their count (partial_sums_finalize_kernel).
//    The chunk count depends only on (rows, cols, workspace size), never on the GPU, so the
//    same inputs give bit-identical bias gradients on every device.
//  * No implicit __half/__nv_bfloat16 conversions or operators are used: PyTorch's extension
//    build defines __CUDA_NO_HALF_OPERATORS__ and friends.
#include "elementwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "activation_math.cuh"
#include "cuda_check.h"

namespace fused_dense::core {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;
// 2048 resident threads per SM on sm_80 / sm_90.
constexpr int kBlocksPerSm = 2048 / kThreads;
// Flat kernels get at most this many full-occupancy waves; beyond that the grid-stride loop
// does the work and the per-thread setup (one 64-bit division) is amortised.
constexpr int64_t kMaxWaves = 4;

// Bias-gradient chunking. Fixed constants (an H100/H200 has 132 SMs) instead of a device
// query keep reduction_workspace_bytes and the summation order device-independent.
constexpr int64_t kReduceTargetBlocks = 132 * kBlocksPerSm;
constexpr int64_t kReduceNominalTileCols = 256;
// Keeps the workspace round trip (8 bytes per column per chunk) a few percent of the main
// traffic (>= 4 bytes per element).
constexpr int64_t kMinRowsPerChunk = 64;

// ---------------------------------------------------------------------------------------------
// Element conversions (explicit intrinsics only).

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float f) { return f; }
  __device__ __forceinline__ static float zero() { return 0.f; }
};

// The 16-bit types also convert in pairs: one cvt.rn.{f16,bf16}x2.f32 instead of two, which
// matters because the conversions, not the memory system, bound the 16-bit GELU kernels.
template <>
struct Cvt<__half> {
  using T2 = __half2;
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float f) { return __float2half_rn(f); }
  __device__ __forceinline__ static __half zero() { return __ushort_as_half(0); }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ __forceinline__ static __half2 from_float2(float a, float b) { return __floats2half2_rn(a, b); }
};

template <>
struct Cvt<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  __device__ __forceinline__ static __nv_bfloat16 zero() { return __ushort_as_bfloat16(0); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ __forceinline__ static __nv_bfloat162 from_float2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

// N consecutive elements moved as one (or, for 32 bytes, two) 16-byte transactions.
template <typename T, int N>
struct alignas(N * sizeof(T) >= 16 ? 16 : N * sizeof(T)) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

template <typename T>
constexpr bool kPaired = sizeof(T) == 2;

// f[0..N) -> out, round to nearest even.
template <typename T, int N>
__device__ __forceinline__ void floats_to_pack(Pack<T, N>& out, const float (&f)[N]) {
  if constexpr (kPaired<T> && N % 2 == 0) {
    using T2 = typename Cvt<T>::T2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) reinterpret_cast<T2*>(out.v)[i] = Cvt<T>::from_float2(f[2 * i], f[2 * i + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = Cvt<T>::from_float(f[j]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void pack_to_floats(float (&f)[N], const Pack<T, N>& in) {
  if constexpr (kPaired<T> && N % 2 == 0) {
    using T2 = typename Cvt<T>::T2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 t = Cvt<T>::to_float2(reinterpret_cast<const T2*>(in.v)[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = Cvt<T>::to_float(in.v[j]);
  }
}

// The activations' fp32 math (relu_f, gelu_sigmoid, act_forward, act_derivative) lives in
// activation_math.cuh, shared with the CUTLASS epilogues (own_dgrad_sm90.cu and the probe).

// ---------------------------------------------------------------------------------------------
// Flat grid-stride iteration over a [rows, width] index space with incremental (row, col).

struct FlatPlan {
  int64_t total;   // rows * width items
  int64_t width;   // items per row
  int64_t stride1; // grid size in threads (G)
  int64_t srow1, scol1;  // G split into whole rows and remaining columns
  int64_t strideU;       // kUnroll * G
  int64_t srowU, scolU;
};

struct Cursor {
  int64_t idx, row, col;
};

__device__ __forceinline__ void advance(Cursor& c, int64_t stride, int64_t srow, int64_t scol, int64_t width) {
  c.idx += stride;
  c.row += srow;
  c.col += scol;
  if (c.col >= width) {
    c.col -= width;
    ++c.row;
  }
}

__device__ __forceinline__ void init_cursors(Cursor (&c)[kUnroll], const FlatPlan& plan) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  c[0].idx = tid;
  c[0].row = tid / plan.width;
  c[0].col = tid - c[0].row * plan.width;
#pragma unroll
  for (int k = 1; k < kUnroll; ++k) {
    c[k] = c[k - 1];
    advance(c[k], plan.stride1, plan.srow1, plan.scol1, plan.width);
  }
}

__device__ __forceinline__ void advance_all(Cursor (&c)[kUnroll], const FlatPlan& plan) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) advance(c[k], plan.strideU, plan.srowU, plan.scolU, plan.width);
}

// ---------------------------------------------------------------------------------------------
// Forward kernels.

// out = act(round(x + bias)); pre = round(x + bias). Items are V-element vectors; V == 1 is the
// scalar path for any cols.
template <typename T, Activation A, int V>
__global__ void __launch_bounds__(kThreads)
    bias_act_kernel(const T* x, const T* bias, T* out, T* pre, FlatPlan plan) {
  Cursor c[kUnroll];
  init_cursors(c, plan);
  while (c[0].idx < plan.total) {
    Pack<T, V> xv[kUnroll];
    Pack<T, V> bv[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        xv[k] = load_pack<T, V>(x + c[k].idx * V);
        if (bias != nullptr) bv[k] = load_pack<T, V>(bias + c[k].col * V);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        float p[V];
        pack_to_floats(p, xv[k]);
        Pack<T, V> pv = xv[k], ov;
        if (bias != nullptr) {
          float b[V];
          pack_to_floats(b, bv[k]);
#pragma unroll
          for (int j = 0; j < V; ++j) p[j] += b[j];
          // Activate the rounded sum so a recompute from the stored pre_act is bit-identical.
          // Without a bias x is that value already, and skipping the round trip matters: the
          // 16-bit GELU kernels are issue-bound (bf16 in place at 16384 x 8192, H200: 141 us
          // without a bias, 163 us with one).
          floats_to_pack(pv, p);
          pack_to_floats(p, pv);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) p[j] = act_forward<A, kPaired<T>>(p[j]);
        floats_to_pack(ov, p);
        if (pre != nullptr) store_pack<T, V>(pre + c[k].idx * V, pv);
        store_pack<T, V>(out + c[k].idx * V, ov);
      }
    }
    advance_all(c, plan);
  }
}

// ReLU with bit-mask: one thread per mask byte (8 consecutive columns of one row), so every
// byte is written whole by exactly one thread. Items are mask bytes: width = mask row bytes.
// kVec requires cols % 8 == 0 (then byte index == element index / 8) and 16-byte alignment.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    bias_relu_mask_kernel(const T* x, const T* bias, T* out, uint8_t* mask, int64_t cols, FlatPlan plan) {
  using C = Cvt<T>;
  Cursor c[kUnroll];
  init_cursors(c, plan);
  while (c[0].idx < plan.total) {
    float xf[kUnroll][8];
    float bf[kUnroll][8];
    int n[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      n[k] = 0;
      if (c[k].idx < plan.total) {
        const int64_t col0 = c[k].col * 8;
        if constexpr (kVec) {
          n[k] = 8;
          pack_to_floats(xf[k], load_pack<T, 8>(x + c[k].idx * 8));
          if (bias != nullptr) pack_to_floats(bf[k], load_pack<T, 8>(bias + col0));
        } else {
          n[k] = static_cast<int>(min(cols - col0, static_cast<int64_t>(8)));
          const T* xr = x + c[k].row * cols + col0;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            xf[k][j] = j < n[k] ? C::to_float(xr[j]) : 0.f;
            bf[k][j] = (bias != nullptr && j < n[k]) ? C::to_float(bias[col0 + j]) : 0.f;
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        const int64_t col0 = c[k].col * 8;
        float p[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) p[j] = bias != nullptr ? xf[k][j] + bf[k][j] : xf[k][j];
        Pack<T, 8> op;
        floats_to_pack(op, p);
        pack_to_floats(p, op);
        unsigned bits = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          // Padding columns (j >= n) contribute no bit, as the mask format requires.
          if (j < n[k] && p[j] >= 0.f) bits |= 1u << j;
          p[j] = relu_f(p[j]);
        }
        floats_to_pack(op, p);
        if constexpr (kVec) {
          store_pack<T, 8>(out + c[k].idx * 8, op);
        } else {
          T* orow = out + c[k].row * cols + col0;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (j < n[k]) orow[j] = op.v[j];
        }
        mask[c[k].idx] = static_cast<uint8_t>(bits);
      }
    }
    advance_all(c, plan);
  }
}

// fp32 ReLU with bit-mask, cols % 8 == 0, 16-byte aligned: one 16-byte vector (4 columns) per
// thread keeps each warp load fully coalesced (8 floats per thread would split every warp
// access into two half-used passes); lane pairs then merge their nibbles so the even lane
// writes the whole byte. Items are 4-column vectors.
__global__ void __launch_bounds__(kThreads)
    bias_relu_mask_f32_kernel(const float* x, const float* bias, float* out, uint8_t* mask, FlatPlan plan) {
  Cursor c[kUnroll];
  init_cursors(c, plan);
  const int lane = threadIdx.x & 31;
  // The loop bound is warp-uniform (the grid stride is a multiple of 32) so every lane reaches
  // the shuffles. Lanes 2m and 2m+1 hold vectors 2j and 2j+1 of the same byte; both are valid
  // or neither, since the vector count per row is even.
  while (c[0].idx - lane < plan.total) {
    Pack<float, 4> xv[kUnroll];
    Pack<float, 4> bv[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        xv[k] = load_pack<float, 4>(x + c[k].idx * 4);
        if (bias != nullptr) bv[k] = load_pack<float, 4>(bias + c[k].col * 4);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const bool valid = c[k].idx < plan.total;
      unsigned nib = 0;
      if (valid) {
        Pack<float, 4> ov;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float p = xv[k].v[j];
          if (bias != nullptr) p += bv[k].v[j];
          if (p >= 0.f) nib |= 1u << j;
          ov.v[j] = relu_f(p);
        }
        store_pack<float, 4>(out + c[k].idx * 4, ov);
      }
      const unsigned hi = __shfl_xor_sync(0xffffffffu, nib, 1);
      if (valid && (lane & 1) == 0) mask[c[k].idx >> 1] = static_cast<uint8_t>(nib | (hi << 4));
    }
    advance_all(c, plan);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward kernels.

// Loads what act'(.) needs for V consecutive elements starting at (row, col) / offset `off`.
template <typename T, Activation A, int V>
struct PreLoad {
  Pack<T, V> pre;   // dtype pre-activation (GELU, squared ReLU)
  unsigned bits;    // mask bits for columns col .. col+V-1 in bits 0 .. V-1 (ReLU)

  __device__ __forceinline__ void load(const void* pre_act, int64_t off, int64_t row, int64_t col, int64_t rb) {
    if constexpr (A == Activation::kRelu) {
      // col % 8 + V <= 8 on every path (V == 8 and V == 4 vectors start at multiples of V),
      // so the V bits live in one byte.
      const uint8_t byte = static_cast<const uint8_t*>(pre_act)[row * rb + (col >> 3)];
      bits = static_cast<unsigned>(byte) >> (col & 7);
    } else if constexpr (A != Activation::kNone) {
      pre = load_pack<T, V>(static_cast<const T*>(pre_act) + off);
    }
  }

  // grad_in for V elements: the dtype values and the same values as float (what the bias
  // gradient sums). With `act` non-null (GELU, squared ReLU) also act(pre), bit-identical to
  // bias_act_kernel's output for the same pre: checkpoint level 1 rebuilds the activation output
  // in the backward pass that reads pre_act anyway.
  __device__ __forceinline__ void apply(const Pack<T, V>& g, Pack<T, V>& out, float (&vals)[V],
                                        Pack<T, V>* act = nullptr) const {
    pack_to_floats(vals, g);
    if constexpr (A == Activation::kNone) {
      out = g;
    } else if constexpr (A == Activation::kRelu) {
      // A select, not a multiply: a masked-out NaN/inf gradient must become 0. Selecting the
      // dtype bits also skips a float -> dtype conversion of values that are exact anyway.
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool keep = (bits >> j) & 1u;
        out.v[j] = keep ? g.v[j] : Cvt<T>::zero();
        vals[j] = keep ? vals[j] : 0.f;
      }
    } else {
      float p[V], a[V];
      pack_to_floats(p, pre);
#pragma unroll
      for (int j = 0; j < V; ++j) vals[j] *= act_derivative<A, kPaired<T>>(p[j], act != nullptr ? &a[j] : nullptr);
      floats_to_pack(out, vals);
      pack_to_floats(vals, out);
      if (act != nullptr) floats_to_pack(*act, a);
    }
  }
};

// grad_in = grad * act'(pre), with kAct also act_out = act(pre); items are V-element vectors.
template <typename T, Activation A, int V, bool kAct>
__global__ void __launch_bounds__(kThreads)
    act_backward_kernel(const T* grad, const void* pre_act, T* grad_in, T* act_out, int64_t rb, FlatPlan plan) {
  Cursor c[kUnroll];
  init_cursors(c, plan);
  while (c[0].idx < plan.total) {
    Pack<T, V> gv[kUnroll];
    PreLoad<T, A, V> pl[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        gv[k] = load_pack<T, V>(grad + c[k].idx * V);
        pl[k].load(pre_act, c[k].idx * V, c[k].row, c[k].col * V, rb);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        Pack<T, V> ov, av;
        float vals[V];
        pl[k].apply(gv[k], ov, vals, kAct ? &av : nullptr);
        store_pack<T, V>(grad_in + c[k].idx * V, ov);
        if constexpr (kAct) store_pack<T, V>(act_out + c[k].idx * V, av);
      }
    }
    advance_all(c, plan);
  }
}

// grad_in as above (skipped when grad_in is null) plus fp32 column sums of the rounded grad_in
// over one row chunk: partial[chunk * cols + col]. Block = (TX column-vectors) x (TY rows); a
// tile covers TX * V columns. Summation order is fixed: rows ty, ty+TY, ... per thread, then
// the TY partials in order of ty. kAct: also act_out = act(pre).
template <typename T, Activation A, int V, bool kAct>
__global__ void __launch_bounds__(kThreads)
    act_backward_colsum_kernel(const T* grad, const void* pre_act, T* grad_in, T* act_out, float* partial, int64_t rows,
                               int64_t cols, int64_t rb, int64_t rows_per_chunk, int64_t nchunks, int64_t ntiles) {
  // Rows in flight per thread. Bytes in flight are what keep HBM busy; 4 measured best on H200
  // for every activation (2 leaves bf16 ~15% short, 8 costs occupancy through registers).
  constexpr int R = 4;
  __shared__ float sh[kThreads * V];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int TX = blockDim.x;
  const int TY = blockDim.y;
  const int64_t tile_w = static_cast<int64_t>(TX) * V;

  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    for (int64_t chunk = blockIdx.y; chunk < nchunks; chunk += gridDim.y) {
      const int64_t col = tile * tile_w + static_cast<int64_t>(tx) * V;
      const int64_t r_end = min(rows, (chunk + 1) * rows_per_chunk);
      float acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0.f;

      if (col < cols) {
        int64_t r = chunk * rows_per_chunk + ty;
        // R rows in flight per thread: the compiler cannot hoist the next rows' loads above
        // this row's stores itself because grad_in may alias grad.
        for (; r + static_cast<int64_t>(R - 1) * TY < r_end; r += static_cast<int64_t>(R) * TY) {
          Pack<T, V> g[R];
          PreLoad<T, A, V> pl[R];
#pragma unroll
          for (int k = 0; k < R; ++k) {
            const int64_t rk = r + static_cast<int64_t>(k) * TY;
            g[k] = load_pack<T, V>(grad + rk * cols + col);
            pl[k].load(pre_act, rk * cols + col, rk, col, rb);
          }
#pragma unroll
          for (int k = 0; k < R; ++k) {
            Pack<T, V> o, av;
            float vals[V];
            pl[k].apply(g[k], o, vals, kAct ? &av : nullptr);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += vals[j];
            const int64_t off = (r + static_cast<int64_t>(k) * TY) * cols + col;
            if (grad_in != nullptr) store_pack<T, V>(grad_in + off, o);
            if constexpr (kAct) store_pack<T, V>(act_out + off, av);
          }
        }
        for (; r < r_end; r += TY) {
          const Pack<T, V> g = load_pack<T, V>(grad + r * cols + col);
          PreLoad<T, A, V> pl;
          pl.load(pre_act, r * cols + col, r, col, rb);
          Pack<T, V> o, av;
          float vals[V];
          pl.apply(g, o, vals, kAct ? &av : nullptr);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += vals[j];
          if (grad_in != nullptr) store_pack<T, V>(grad_in + r * cols + col, o);
          if constexpr (kAct) store_pack<T, V>(act_out + r * cols + col, av);
        }
      }

#pragma unroll
      for (int j = 0; j < V; ++j) sh[ty * tile_w + tx * V + j] = acc[j];
      __syncthreads();
      for (int64_t cc = static_cast<int64_t>(ty) * TX + tx; cc < tile_w; cc += static_cast<int64_t>(TX) * TY) {
        const int64_t gc = tile * tile_w + cc;
        if (gc < cols) {
          float s = 0.f;
          for (int y = 0; y < TY; ++y) s += sh[y * tile_w + cc];
          partial[chunk * cols + gc] = s;
        }
      }
      __syncthreads();
    }
  }
}

// out[j] = sum over c < nparts of partial[c * stride + j], in a fixed order: part lane ty of the
// block adds parts ty, ty + kPartLanes, ... in turn, then the kPartLanes sums are added in order
// of ty. Several part lanes and an unrolled loop keep many loads in flight: one thread adding 64
// parts one after the other waits out 64 L2 latencies, a large share of a 20 us pass.
constexpr int kFinalizeCols = 32;
constexpr int kPartLanes = kThreads / kFinalizeCols;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    partial_sums_finalize_kernel(const float* partial, int64_t stride, int64_t nparts, int64_t cols, T* out) {
  __shared__ float lane_sums[kPartLanes][kFinalizeCols];
  const int tx = threadIdx.x % kFinalizeCols, ty = threadIdx.x / kFinalizeCols;
  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kFinalizeCols; j0 < cols;
       j0 += static_cast<int64_t>(gridDim.x) * kFinalizeCols) {
    const int64_t j = j0 + tx;
    float s = 0.f;
    if (j < cols) {
#pragma unroll 4
      for (int64_t c = ty; c < nparts; c += kPartLanes) s += partial[c * stride + j];
    }
    lane_sums[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && j < cols) {
      float total = lane_sums[0][tx];
#pragma unroll
      for (int l = 1; l < kPartLanes; ++l) total += lane_sums[l][tx];
      out[j] = Cvt<T>::from_float(total);
    }
    __syncthreads();  // lane_sums is rewritten by the next column block
  }
}

// ---------------------------------------------------------------------------------------------
// Host helpers.

template <typename T>
struct TypeTag {
  using type = T;
};

template <Activation A>
using ActTag = std::integral_constant<Activation, A>;

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      f(TypeTag<__half>{});
      return;
    case DType::kBFloat16:
      f(TypeTag<__nv_bfloat16>{});
      return;
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
  }
  throw Error("fused_dense: unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
}

template <typename F>
void dispatch_act(Activation act, F&& f) {
  switch (act) {
    case Activation::kNone:
      f(ActTag<Activation::kNone>{});
      return;
    case Activation::kGeluTanh:
      f(ActTag<Activation::kGeluTanh>{});
      return;
    case Activation::kRelu:
      f(ActTag<Activation::kRelu>{});
      return;
    case Activation::kSquaredRelu:
      f(ActTag<Activation::kSquaredRelu>{});
      return;
  }
  throw Error("fused_dense: unsupported activation code " + std::to_string(static_cast<int>(act)));
}

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw Error(std::string("fused_dense: ") + fn + ": " + what);
}

bool valid_dtype(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32;
}

bool valid_act(Activation a) {
  return a == Activation::kNone || a == Activation::kGeluTanh || a == Activation::kRelu ||
         a == Activation::kSquaredRelu;
}

void check_shape(const char* fn, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) {
    std::ostringstream m;
    m << "rows and cols must be non-negative, got rows=" << rows << " cols=" << cols;
    fail(fn, m.str());
  }
  // Byte offsets of a [rows, cols] fp32 matrix (and of the workspace) must fit in int64.
  if (cols > 0 && rows > INT64_MAX / 8 / cols) {
    std::ostringstream m;
    m << "matrix too large: rows=" << rows << " cols=" << cols;
    fail(fn, m.str());
  }
}

void check_codes(const char* fn, DType dtype, Activation act) {
  if (!valid_dtype(dtype)) fail(fn, "unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
  if (!valid_act(act)) fail(fn, "unsupported activation code " + std::to_string(static_cast<int>(act)));
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  if (a == nullptr || b == nullptr || an == 0 || bn == 0) return false;
  const auto ua = reinterpret_cast<std::uintptr_t>(a);
  const auto ub = reinterpret_cast<std::uintptr_t>(b);
  return ua < ub + bn && ub < ua + an;
}

// Element-for-element in-place use is safe (each thread reads its elements before writing
// them); any other overlap makes threads read what others already overwrote.
void require_same_or_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                              const void* b, std::size_t bbytes) {
  if (overlaps(a, abytes, b, bbytes) && !(a == b && abytes == bbytes)) {
    fail(fn, std::string(an) + " and " + bn + " partially overlap; they must be the same buffer or disjoint");
  }
}

void require_disjoint(const char* fn, const char* an, const void* a, std::size_t abytes, const char* bn,
                      const void* b, std::size_t bbytes) {
  if (overlaps(a, abytes, b, bbytes)) fail(fn, std::string(an) + " and " + bn + " must not overlap");
}

int sm_count() {
  constexpr int kMaxDevices = 256;
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  int dev = 0;
  FD_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices) {
    const int cached = cache[dev].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int n = 0;
  FD_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  n = std::max(n, 1);
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// total > 0, width > 0.
FlatPlan make_plan(int64_t total, int64_t width, unsigned& grid) {
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlocksPerSm * kMaxWaves;
  const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(total, int64_t{kThreads} * kUnroll), cap));
  grid = static_cast<unsigned>(std::min<int64_t>(blocks, INT_MAX));
  FlatPlan p;
  p.total = total;
  p.width = width;
  p.stride1 = static_cast<int64_t>(grid) * kThreads;
  p.srow1 = p.stride1 / width;
  p.scol1 = p.stride1 % width;
  p.strideU = p.stride1 * kUnroll;
  p.srowU = p.strideU / width;
  p.scolU = p.strideU % width;
  return p;
}

// Chunk count the heuristic prefers; rows > 0, cols > 0.
int64_t preferred_chunks(int64_t rows, int64_t cols) {
  const int64_t tiles = ceil_div(cols, kReduceNominalTileCols);
  const int64_t by_occupancy = ceil_div(kReduceTargetBlocks, tiles);
  const int64_t by_rows = ceil_div(rows, kMinRowsPerChunk);
  return std::max<int64_t>(1, std::min(by_occupancy, by_rows));
}

int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

template <typename T>
void launch_partial_sums_finalize(const float* partial, int64_t stride, int64_t nparts, int64_t cols, T* out,
                                  cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>(ceil_div(cols, int64_t{kFinalizeCols}), 65535);
  partial_sums_finalize_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(partial, stride, nparts,
                                                                                        cols, out);
  FD_CHECK_LAUNCH();
}

template <typename T, Activation A, int V, bool kAct>
void launch_backward_colsum(const T* grad, const void* pre_act, T* grad_in, T* act_out, T* bias_grad, int64_t rows,
                            int64_t cols, float* partial, int64_t nchunks, cudaStream_t stream) {
  // Column-vector threads per block: up to 256 columns per tile, fewer for narrow matrices so
  // that the remaining threads work on more rows instead of idling.
  const int max_tx = V == 8 ? 32 : 64;  // tiles of 256 columns (vector paths) or 64 (scalar)
  const int tx = std::min(max_tx, pow2_ceil(cols / V));
  const int ty = kThreads / tx;
  const int64_t tile_w = static_cast<int64_t>(tx) * V;
  const int64_t ntiles = ceil_div(cols, tile_w);
  const int64_t rows_per_chunk = ceil_div(rows, nchunks);
  // Recompute so that no chunk is empty (an empty chunk would still be summed, as zeros).
  nchunks = ceil_div(rows, rows_per_chunk);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ntiles, INT_MAX)),
                  static_cast<unsigned>(std::min<int64_t>(nchunks, 65535)));
  const dim3 block(tx, ty);
  act_backward_colsum_kernel<T, A, V, kAct><<<grid, block, 0, stream>>>(grad, pre_act, grad_in, act_out, partial,
                                                                         rows, cols, relu_mask_row_bytes(cols),
                                                                         rows_per_chunk, nchunks, ntiles);
  FD_CHECK_LAUNCH();
  launch_partial_sums_finalize<T>(partial, cols, nchunks, cols, bias_grad, stream);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void bias_act_forward(DType dtype, Activation act, const void* x, const void* bias, void* out, void* pre_act,
                      int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr const char* fn = "bias_act_forward";
  check_codes(fn, dtype, act);
  check_shape(fn, rows, cols);
  if (rows == 0 || cols == 0) return;
  if (x == nullptr || out == nullptr) fail(fn, "x and out must be non-null");

  const std::size_t esize = dtype_size(dtype);
  const std::size_t mat_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * esize;
  const bool mask_mode = act == Activation::kRelu && pre_act != nullptr;
  const std::size_t pre_bytes =
      mask_mode ? static_cast<std::size_t>(rows) * static_cast<std::size_t>(relu_mask_row_bytes(cols)) : mat_bytes;
  const std::size_t bias_bytes = static_cast<std::size_t>(cols) * esize;

  require_same_or_disjoint(fn, "x", x, mat_bytes, "out", out, mat_bytes);
  require_disjoint(fn, "bias", bias, bias_bytes, "out", out, mat_bytes);
  if (pre_act != nullptr) {
    require_disjoint(fn, "bias", bias, bias_bytes, "pre_act", pre_act, pre_bytes);
    if (mask_mode) {
      require_disjoint(fn, "x", x, mat_bytes, "the ReLU mask (pre_act)", pre_act, pre_bytes);
      require_disjoint(fn, "out", out, mat_bytes, "the ReLU mask (pre_act)", pre_act, pre_bytes);
    } else {
      require_same_or_disjoint(fn, "x", x, mat_bytes, "pre_act", pre_act, pre_bytes);
      // Same buffer for out and pre_act only makes sense when they hold the same values.
      if (act == Activation::kNone)
        require_same_or_disjoint(fn, "out", out, mat_bytes, "pre_act", pre_act, pre_bytes);
      else
        require_disjoint(fn, "out", out, mat_bytes, "pre_act", pre_act, pre_bytes);
    }
  }

  // Nothing to compute or move: identity in place.
  if (act == Activation::kNone && bias == nullptr && x == out && (pre_act == nullptr || pre_act == out)) return;

  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    constexpr int VW = 16 / static_cast<int>(sizeof(T));
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    const bool ptrs_aligned = aligned16(x) && aligned16(out) && (bias == nullptr || aligned16(bias));

    if (mask_mode) {
      auto* mask = static_cast<uint8_t*>(pre_act);
      const int64_t rb = relu_mask_row_bytes(cols);
      const bool vec = cols % 8 == 0 && ptrs_aligned;
      unsigned grid = 0;
      if (vec) {
        if constexpr (std::is_same_v<T, float>) {
          const FlatPlan plan = make_plan(rows * (cols / 4), cols / 4, grid);
          bias_relu_mask_f32_kernel<<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, plan);
        } else {
          const FlatPlan plan = make_plan(rows * rb, rb, grid);
          bias_relu_mask_kernel<T, true><<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, cols, plan);
        }
      } else {
        const FlatPlan plan = make_plan(rows * rb, rb, grid);
        bias_relu_mask_kernel<T, false><<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, cols, plan);
      }
      FD_CHECK_LAUNCH();
      return;
    }

    T* pt = static_cast<T*>(pre_act);
    const bool vec = cols % VW == 0 && ptrs_aligned && (pre_act == nullptr || aligned16(pre_act));
    dispatch_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      unsigned grid = 0;
      if (vec) {
        const FlatPlan plan = make_plan(rows * (cols / VW), cols / VW, grid);
        bias_act_kernel<T, A, VW><<<grid, kThreads, 0, stream>>>(xt, bt, ot, pt, plan);
      } else {
        const FlatPlan plan = make_plan(rows * cols, cols, grid);
        bias_act_kernel<T, A, 1><<<grid, kThreads, 0, stream>>>(xt, bt, ot, pt, plan);
      }
      FD_CHECK_LAUNCH();
    });
  });
}

std::size_t reduction_workspace_bytes(int64_t rows, int64_t cols) {
  check_shape("reduction_workspace_bytes", rows, cols);
  if (rows == 0 || cols == 0) return 0;
  return static_cast<std::size_t>(preferred_chunks(rows, cols)) * static_cast<std::size_t>(cols) * sizeof(float);
}

void act_backward_bias_grad(DType dtype, Activation act, const void* grad, const void* pre_act, void* grad_in,
                            void* bias_grad, int64_t rows, int64_t cols, void* workspace,
                            std::size_t workspace_bytes, cudaStream_t stream, void* act_out) {
  constexpr const char* fn = "act_backward_bias_grad";
  check_codes(fn, dtype, act);
  check_shape(fn, rows, cols);
  if (cols == 0) return;
  const std::size_t esize = dtype_size(dtype);
  if (rows == 0) {
    // Sum over no rows: the bias gradient is defined and zero (all-zero bits in every dtype).
    if (bias_grad != nullptr) FD_CUDA_CHECK(cudaMemsetAsync(bias_grad, 0, static_cast<std::size_t>(cols) * esize, stream));
    return;
  }
  if (grad == nullptr) fail(fn, "grad must be non-null");
  if (act != Activation::kNone && pre_act == nullptr)
    fail(fn, std::string("pre_act must be non-null for activation ") + activation_name(act));
  // grad_in may be omitted only when it would be a copy of grad anyway.
  if (act != Activation::kNone && grad_in == nullptr)
    fail(fn, std::string("grad_in must be non-null for activation ") + activation_name(act));
  if (act_out != nullptr && act != Activation::kGeluTanh && act != Activation::kSquaredRelu)
    fail(fn, std::string("act_out needs a dtype pre-activation (gelu_approx or sqrelu), got activation ") +
                 activation_name(act));

  const std::size_t mat_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * esize;
  const bool uses_pre = act != Activation::kNone;
  const bool mask_mode = act == Activation::kRelu;
  const std::size_t pre_bytes =
      !uses_pre ? 0
                : (mask_mode ? static_cast<std::size_t>(rows) * static_cast<std::size_t>(relu_mask_row_bytes(cols))
                             : mat_bytes);
  const std::size_t bias_bytes = static_cast<std::size_t>(cols) * esize;
  require_same_or_disjoint(fn, "grad", grad, mat_bytes, "grad_in", grad_in, mat_bytes);
  if (uses_pre) {
    if (mask_mode)
      require_disjoint(fn, "the ReLU mask (pre_act)", pre_act, pre_bytes, "grad_in", grad_in, mat_bytes);
    else
      require_same_or_disjoint(fn, "pre_act", pre_act, pre_bytes, "grad_in", grad_in, mat_bytes);
  }

  if (act_out != nullptr) {
    require_disjoint(fn, "act_out", act_out, mat_bytes, "grad", grad, mat_bytes);
    require_disjoint(fn, "act_out", act_out, mat_bytes, "grad_in", grad_in, mat_bytes);
    require_disjoint(fn, "act_out", act_out, mat_bytes, "pre_act", pre_act, pre_bytes);
  }
  const bool write_grad_in = grad_in != nullptr && !(act == Activation::kNone && grad_in == grad);
  // Instantiates the kernel with the act_out store only for the activations that can have one.
  auto with_act_flag = [&](auto atag, auto&& f) {
    constexpr Activation A = decltype(atag)::value;
    if constexpr (A == Activation::kGeluTanh || A == Activation::kSquaredRelu) {
      if (act_out != nullptr) {
        f(std::true_type{});
        return;
      }
    }
    f(std::false_type{});
  };

  if (bias_grad == nullptr) {
    if (act == Activation::kNone) {
      if (write_grad_in)
        FD_CUDA_CHECK(cudaMemcpyAsync(grad_in, grad, mat_bytes, cudaMemcpyDeviceToDevice, stream));
      return;
    }
    dispatch_dtype(dtype, [&](auto ttag) {
      using T = typename decltype(ttag)::type;
      constexpr int VW = 16 / static_cast<int>(sizeof(T));
      const bool vec = cols % VW == 0 && aligned16(grad) && aligned16(grad_in) && (mask_mode || aligned16(pre_act)) &&
                       (act_out == nullptr || aligned16(act_out));
      dispatch_act(act, [&](auto atag) {
        constexpr Activation A = decltype(atag)::value;
        if constexpr (A != Activation::kNone) {
          with_act_flag(atag, [&](auto act_flag) {
            constexpr bool kAct = decltype(act_flag)::value;
            const T* gt = static_cast<const T*>(grad);
            T* git = static_cast<T*>(grad_in);
            T* aot = static_cast<T*>(act_out);
            const int64_t rb = relu_mask_row_bytes(cols);
            unsigned grid = 0;
            if (vec) {
              const FlatPlan plan = make_plan(rows * (cols / VW), cols / VW, grid);
              act_backward_kernel<T, A, VW, kAct><<<grid, kThreads, 0, stream>>>(gt, pre_act, git, aot, rb, plan);
            } else {
              const FlatPlan plan = make_plan(rows * cols, cols, grid);
              act_backward_kernel<T, A, 1, kAct><<<grid, kThreads, 0, stream>>>(gt, pre_act, git, aot, rb, plan);
            }
            FD_CHECK_LAUNCH();
          });
        }
      });
    });
    return;
  }

  // Bias gradient requested.
  const std::size_t min_ws = static_cast<std::size_t>(cols) * sizeof(float);
  if (workspace == nullptr || workspace_bytes < min_ws) {
    std::ostringstream m;
    m << "workspace too small for the bias gradient: need at least " << min_ws << " bytes (cols=" << cols
      << " fp32 partial sums; " << reduction_workspace_bytes(rows, cols) << " preferred), got " << workspace_bytes
      << (workspace == nullptr ? " (null pointer)" : "");
    fail(fn, m.str());
  }
  if ((reinterpret_cast<std::uintptr_t>(workspace) & 3u) != 0) fail(fn, "workspace must be 4-byte aligned");
  const int64_t ws_chunks = static_cast<int64_t>(std::min<std::size_t>(workspace_bytes / min_ws, INT64_MAX));
  const int64_t nchunks = std::max<int64_t>(1, std::min(preferred_chunks(rows, cols), ws_chunks));
  const std::size_t used_ws = static_cast<std::size_t>(nchunks) * min_ws;

  require_disjoint(fn, "bias_grad", bias_grad, bias_bytes, "grad_in", grad_in, mat_bytes);
  require_disjoint(fn, "bias_grad", bias_grad, bias_bytes, "grad", grad, mat_bytes);
  require_disjoint(fn, "workspace", workspace, used_ws, "grad", grad, mat_bytes);
  require_disjoint(fn, "workspace", workspace, used_ws, "grad_in", grad_in, mat_bytes);
  require_disjoint(fn, "workspace", workspace, used_ws, "bias_grad", bias_grad, bias_bytes);
  if (uses_pre) {
    require_disjoint(fn, "workspace", workspace, used_ws, "pre_act", pre_act, pre_bytes);
    require_disjoint(fn, "bias_grad", bias_grad, bias_bytes, "pre_act", pre_act, pre_bytes);
  }
  if (act_out != nullptr) {
    require_disjoint(fn, "workspace", workspace, used_ws, "act_out", act_out, mat_bytes);
    require_disjoint(fn, "bias_grad", bias_grad, bias_bytes, "act_out", act_out, mat_bytes);
  }

  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    constexpr int VW = 16 / static_cast<int>(sizeof(T));
    const T* gt = static_cast<const T*>(grad);
    T* git = write_grad_in ? static_cast<T*>(grad_in) : nullptr;
    T* bgt = static_cast<T*>(bias_grad);
    auto* ws = static_cast<float*>(workspace);
    T* aot = static_cast<T*>(act_out);
    const bool vec = cols % VW == 0 && aligned16(grad) && (git == nullptr || aligned16(git)) &&
                     (!uses_pre || mask_mode || aligned16(pre_act)) && (aot == nullptr || aligned16(aot));
    dispatch_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      with_act_flag(atag, [&](auto act_flag) {
        constexpr bool kAct = decltype(act_flag)::value;
        if (vec)
          launch_backward_colsum<T, A, VW, kAct>(gt, pre_act, git, aot, bgt, rows, cols, ws, nchunks, stream);
        else
          launch_backward_colsum<T, A, 1, kAct>(gt, pre_act, git, aot, bgt, rows, cols, ws, nchunks, stream);
      });
    });
  });
}

void sum_partials(DType dtype, const float* partial, int64_t stride, int64_t nparts, int64_t cols, void* out,
                  cudaStream_t stream) {
  constexpr const char* fn = "sum_partials";
  check_codes(fn, dtype, Activation::kNone);
  check_shape(fn, nparts, cols);
  if (cols == 0) return;
  if (out == nullptr || (nparts > 0 && partial == nullptr)) fail(fn, "partial and out must be non-null");
  if (stride < cols) {
    std::ostringstream m;
    m << "stride must be >= cols (" << cols << "), got " << stride;
    fail(fn, m.str());
  }
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    launch_partial_sums_finalize<T>(partial, stride, nparts, cols, static_cast<T*>(out), stream);
  });
}

}  // namespace fused_dense::core
