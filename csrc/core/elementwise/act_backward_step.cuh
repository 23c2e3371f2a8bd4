// One vector of the activation backward, shared by the elementwise backward kernels
// (act_backward.cu, bias_grad_reduction.cu; internal to them): what act'(.) needs for V
// consecutive elements (the dtype pre-activation, or the ReLU mask's bits unpacked from their
// byte), and grad_in = grad * act'(pre) with the values the bias gradient sums.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/common/activation_math.cuh"
#include "core/common/types.h"
#include "core/elementwise/vector_pack.cuh"

namespace fused_dense::core::elementwise_detail {

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

// Calls f(std::true_type{}) when act_out is to be written, else f(std::false_type{}), so that only
// the activations that can have an act_out (gelu_approx and sqrelu, whose pre_act holds values)
// instantiate the kernels with its store.
template <Activation A, typename F>
void with_act_out_flag(bool has_act_out, F&& f) {
  if constexpr (A == Activation::kGeluTanh || A == Activation::kSquaredRelu) {
    if (has_act_out) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

}  // namespace fused_dense::core::elementwise_detail
