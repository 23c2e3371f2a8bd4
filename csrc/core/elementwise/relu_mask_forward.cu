// ReLU forward with its bit-mask: out = relu(x + bias) and bit (j % 8) of byte (j / 8) of mask
// row i set exactly when x[i, j] + bias[j] >= 0 (types.h's format; rounded to the dtype first).
#include <cstdint>
#include <type_traits>

#include "core/common/activation_math.cuh"
#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise_launch.h"
#include "core/elementwise/flat_grid.cuh"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core::elementwise_detail {
namespace {

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

}  // namespace

void launch_bias_relu_mask(DType dtype, const void* x, const void* bias, void* out, uint8_t* mask, int64_t rows,
                           int64_t cols, bool ptrs_aligned, int device, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    const int64_t rb = relu_mask_row_bytes(cols);
    const bool vec = cols % 8 == 0 && ptrs_aligned;
    unsigned grid = 0;
    if (vec) {
      if constexpr (std::is_same_v<T, float>) {
        const FlatPlan plan = make_flat_plan(device, rows * (cols / 4), cols / 4, grid);
        bias_relu_mask_f32_kernel<<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, plan);
      } else {
        const FlatPlan plan = make_flat_plan(device, rows * rb, rb, grid);
        bias_relu_mask_kernel<T, true><<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, cols, plan);
      }
    } else {
      const FlatPlan plan = make_flat_plan(device, rows * rb, rb, grid);
      bias_relu_mask_kernel<T, false><<<grid, kThreads, 0, stream>>>(xt, bt, ot, mask, cols, plan);
    }
    FD_CHECK_LAUNCH();
  });
}

}  // namespace fused_dense::core::elementwise_detail
