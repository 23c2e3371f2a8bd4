// The gating of a gated MLP over the packed pre-activation (elementwise.h): the elementwise half
// of the unfused gated forward (out = act(g) * u) and of the unfused gated data gradient
// (d_g = d_out * u * act'(g), d_u = d_out * act(g), and on request out again).
//
// An item is one unit (scalar path, any hidden width) or one whole interleave block of
// kGatedInterleave units (vector path: hidden a multiple of it and 16-byte aligned pointers), whose
// gate and up values are two neighbouring vectors of the packed row.
#include <cstdint>

#include "core/common/activation_math.cuh"
#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/elementwise_checks.h"
#include "core/elementwise/flat_grid.cuh"
#include "core/elementwise/type_dispatch.cuh"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core {

using namespace elementwise_detail;

namespace {

constexpr int kBlock = static_cast<int>(kGatedInterleave);
static_assert(kBlock * 2 % 16 == 0, "a block of 16-bit gate values must fill whole 16-byte vectors");

// Gate and up values of an item: V == kBlock reads the item's block (item idx = row * (hidden /
// kBlock) + block, packed at idx * 2 kBlock); V == 1 the unit's two columns of its row.
template <int V>
struct GatedItem {
  int64_t g_at, u_at;  // element offsets of the gate / up values in gu
  __device__ __forceinline__ GatedItem(const Cursor& c, int64_t hidden) {
    if constexpr (V == 1) {
      const int64_t row_start = c.row * 2 * hidden;
      g_at = row_start + gated_gate_column(c.col);
      u_at = row_start + gated_up_column(c.col, hidden);
    } else {
      g_at = c.idx * 2 * V;
      u_at = g_at + V;
    }
  }
};

template <typename T, Activation A, int V>
__global__ void __launch_bounds__(kThreads)
    gated_forward_kernel(const T* gu, T* out, int64_t hidden, FlatPlan plan) {
  Cursor c[kUnroll];
  init_cursors(c, plan);
  while (c[0].idx < plan.total) {
    Pack<T, V> gv[kUnroll], uv[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        const GatedItem<V> item(c[k], hidden);
        gv[k] = load_pack<T, V>(gu + item.g_at);
        uv[k] = load_pack<T, V>(gu + item.u_at);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        float g[V], u[V];
        pack_to_floats(g, gv[k]);
        pack_to_floats(u, uv[k]);
#pragma unroll
        for (int j = 0; j < V; ++j) g[j] = gate_act<A, kPaired<T>>(g[j]) * u[j];
        Pack<T, V> ov;
        floats_to_pack(ov, g);
        store_pack<T, V>(out + c[k].idx * V, ov);
      }
    }
    advance_all(c, plan);
  }
}

template <typename T, Activation A, int V, bool kOut>
__global__ void __launch_bounds__(kThreads)
    gated_backward_kernel(const T* d_out, const T* gu, T* d_gu, T* out, int64_t hidden, FlatPlan plan) {
  Cursor c[kUnroll];
  init_cursors(c, plan);
  while (c[0].idx < plan.total) {
    Pack<T, V> dv[kUnroll], gv[kUnroll], uv[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        const GatedItem<V> item(c[k], hidden);
        dv[k] = load_pack<T, V>(d_out + c[k].idx * V);
        gv[k] = load_pack<T, V>(gu + item.g_at);
        uv[k] = load_pack<T, V>(gu + item.u_at);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (c[k].idx < plan.total) {
        const GatedItem<V> item(c[k], hidden);
        float d[V], g[V], u[V], dg[V], du[V], h[V];
        pack_to_floats(d, dv[k]);
        pack_to_floats(g, gv[k]);
        pack_to_floats(u, uv[k]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float slope;
          const float a = gate_act<A, kPaired<T>>(g[j], &slope);
          dg[j] = d[j] * u[j] * slope;
          du[j] = d[j] * a;
          h[j] = a * u[j];
        }
        Pack<T, V> dgv, duv;
        floats_to_pack(dgv, dg);
        floats_to_pack(duv, du);
        store_pack<T, V>(d_gu + item.g_at, dgv);
        store_pack<T, V>(d_gu + item.u_at, duv);
        if constexpr (kOut) {
          Pack<T, V> hv;
          floats_to_pack(hv, h);
          store_pack<T, V>(out + c[k].idx * V, hv);
        }
      }
    }
    advance_all(c, plan);
  }
}

// Checks shared by both entry points; false when there is nothing to do.
bool check_gated_call(const char* fn, DType dtype, Activation act, int64_t rows, int64_t hidden) {
  check_gated_codes(fn, dtype, act);
  check_shape(fn, rows, hidden);
  check_shape(fn, rows, 2 * hidden);
  return rows > 0 && hidden > 0;
}

// Launches kernel<V> over the items: whole blocks when `vec`, else single units.
template <typename Launch>
void launch_items(int device, int64_t rows, int64_t hidden, bool vec, Launch&& launch) {
  unsigned grid = 0;
  if (vec) {
    const FlatPlan plan = make_flat_plan(device, rows * (hidden / kBlock), hidden / kBlock, grid);
    launch(std::integral_constant<int, kBlock>{}, grid, plan);
  } else {
    const FlatPlan plan = make_flat_plan(device, rows * hidden, hidden, grid);
    launch(std::integral_constant<int, 1>{}, grid, plan);
  }
  FD_CHECK_LAUNCH();
}

}  // namespace

void gated_act_forward(DType dtype, Activation act, const void* gu, void* out, int64_t rows, int64_t hidden,
                       int device, cudaStream_t stream) {
  constexpr const char* fn = "gated_act_forward";
  if (!check_gated_call(fn, dtype, act, rows, hidden)) return;
  if (gu == nullptr || out == nullptr) fail(fn, "gu and out must be non-null");
  const std::size_t esize = dtype_size(dtype);
  const std::size_t out_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(hidden) * esize;
  require_disjoint(fn, "gu", gu, 2 * out_bytes, "out", out, out_bytes);
  const bool vec = hidden % kBlock == 0 && aligned16(gu) && aligned16(out);
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    dispatch_gated_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      launch_items(device, rows, hidden, vec, [&](auto vtag, unsigned grid, const FlatPlan& plan) {
        constexpr int V = decltype(vtag)::value;
        gated_forward_kernel<T, A, V><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(gu), static_cast<T*>(out),
                                                                     hidden, plan);
      });
    });
  });
}

void gated_act_backward(DType dtype, Activation act, const void* d_out, const void* gu, void* d_gu, void* out,
                        int64_t rows, int64_t hidden, int device, cudaStream_t stream) {
  constexpr const char* fn = "gated_act_backward";
  if (!check_gated_call(fn, dtype, act, rows, hidden)) return;
  if (d_out == nullptr || gu == nullptr || d_gu == nullptr) fail(fn, "d_out, gu and d_gu must be non-null");
  const std::size_t esize = dtype_size(dtype);
  const std::size_t h_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(hidden) * esize;
  // d_gu is written at the positions its thread read gu from: in place is safe, other overlaps not
  require_same_or_disjoint(fn, "gu", gu, 2 * h_bytes, "d_gu", d_gu, 2 * h_bytes);
  require_disjoint(fn, "d_out", d_out, h_bytes, "gu", gu, 2 * h_bytes);
  require_disjoint(fn, "d_out", d_out, h_bytes, "d_gu", d_gu, 2 * h_bytes);
  require_disjoint(fn, "out", out, h_bytes, "gu", gu, 2 * h_bytes);
  require_disjoint(fn, "out", out, h_bytes, "d_gu", d_gu, 2 * h_bytes);
  require_same_or_disjoint(fn, "d_out", d_out, h_bytes, "out", out, h_bytes);
  const bool vec = hidden % kBlock == 0 && aligned16(d_out) && aligned16(gu) && aligned16(d_gu) &&
                   (out == nullptr || aligned16(out));
  dispatch_dtype(dtype, [&](auto ttag) {
    using T = typename decltype(ttag)::type;
    const T* dt = static_cast<const T*>(d_out);
    const T* gt = static_cast<const T*>(gu);
    T* dgt = static_cast<T*>(d_gu);
    T* ot = static_cast<T*>(out);
    dispatch_gated_act(act, [&](auto atag) {
      constexpr Activation A = decltype(atag)::value;
      launch_items(device, rows, hidden, vec, [&](auto vtag, unsigned grid, const FlatPlan& plan) {
        constexpr int V = decltype(vtag)::value;
        if (out != nullptr)
          gated_backward_kernel<T, A, V, true><<<grid, kThreads, 0, stream>>>(dt, gt, dgt, ot, hidden, plan);
        else
          gated_backward_kernel<T, A, V, false><<<grid, kThreads, 0, stream>>>(dt, gt, dgt, ot, hidden, plan);
      });
    });
  });
}

}  // namespace fused_dense::core
