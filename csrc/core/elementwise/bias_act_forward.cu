// out = act(x + bias), and the pre-activation saved on request: the elementwise half of the
// unfused forward, and the op act_forward.
#include <cstdint>

#include "core/common/activation_math.cuh"
#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/elementwise_checks.h"
#include "core/elementwise/elementwise_launch.h"
#include "core/elementwise/flat_grid.cuh"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {

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
          // 16-bit GELU kernels are issue-bound (docs/performance.md, "Elementwise kernels and
          // host time").
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

}  // namespace

void bias_act_forward(DType dtype, Activation act, const void* x, const void* bias, void* out, void* pre_act,
                      int64_t rows, int64_t cols, int device, cudaStream_t stream) {
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

  const bool ptrs_aligned = aligned16(x) && aligned16(out) && (bias == nullptr || aligned16(bias));
  if (mask_mode) {
    launch_bias_relu_mask(dtype, x, bias, out, static_cast<uint8_t*>(pre_act), rows, cols, ptrs_aligned, device,
                          stream);
    return;
  }

  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    constexpr int VW = 16 / static_cast<int>(sizeof(T));
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    T* pt = static_cast<T*>(pre_act);
    const bool vec = cols % VW == 0 && ptrs_aligned && (pre_act == nullptr || aligned16(pre_act));
    dispatch_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      unsigned grid = 0;
      if (vec) {
        const FlatPlan plan = make_flat_plan(device, rows * (cols / VW), cols / VW, grid);
        bias_act_kernel<T, A, VW><<<grid, kThreads, 0, stream>>>(xt, bt, ot, pt, plan);
      } else {
        const FlatPlan plan = make_flat_plan(device, rows * cols, cols, grid);
        bias_act_kernel<T, A, 1><<<grid, kThreads, 0, stream>>>(xt, bt, ot, pt, plan);
      }
      FD_CHECK_LAUNCH();
    });
  });
}

void act_forward(DType dtype, Activation act, const void* pre_act, void* out, int64_t rows, int64_t cols, int device,
                 cudaStream_t stream) {
  bias_act_forward(dtype, act, pre_act, nullptr, out, nullptr, rows, cols, device, stream);
}

}  // namespace fused_dense::core
