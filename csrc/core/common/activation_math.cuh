// The activations' device math, one definition for every kernel that applies them: the
// elementwise kernels (elementwise.h) and the cutlass_sm90 kernels' epilogues
// (cutlass_sm90_common.cuh), so that each path computes the same function of the same fp32 inputs.
#pragma once

#include "core/common/types.h"

namespace fused_dense::core {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

__device__ __forceinline__ float relu_f(float p) {
  // Propagate NaN (fmaxf would turn it into 0 and hide a diverged activation); map -0 to +0.
  return (p > 0.f || p != p) ? p : 0.f;
}

// 0.5 * (1 + tanh(u)) == sigmoid(2u), u = sqrt(2/pi) * (p + 0.044715 p^3). The sigmoid form
// needs one exp and one reciprocal instead of tanhf's two branches, which matters because at
// 8 elements per 16 bytes the 16-bit GELU kernels are otherwise issue-bound, not memory-bound.
// The fast form (16-bit outputs) uses the hardware ex2/rcp approximations, whose error (a few fp32
// ulps) is far below half a 16-bit ulp; fp32 outputs keep the accurate expf and division.
// Returns s = sigmoid(2u) and sets *e = exp(-2u), so that 1 - s == e * s.
__device__ __forceinline__ float gelu_sigmoid_fast(float p, float* e) {
  // -2u * log2(e) = p * (c0 + c1 p^2), constants folded so the chain is mul, fma, mul.
  constexpr float c0 = -2.f * kSqrt2OverPi * 1.4426950408889634f;
  constexpr float c1 = c0 * kGeluCoeff;
  const float z = p * fmaf(c1, p * p, c0);
  float s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(*e) : "f"(z));
  // e == inf (very negative p) gives rcp(inf) == 0, the correct limit.
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + *e));
  return s;
}

template <bool kFast>
__device__ __forceinline__ float gelu_sigmoid(float p) {
  if constexpr (kFast) {
    float e;
    return gelu_sigmoid_fast(p, &e);
  } else {
    const float u = kSqrt2OverPi * fmaf(kGeluCoeff * p * p, p, p);
    return 1.f / (1.f + expf(-2.f * u));
  }
}

template <Activation A, bool kFast>
__device__ __forceinline__ float act_forward(float p) {
  if constexpr (A == Activation::kNone) {
    return p;
  } else if constexpr (A == Activation::kGeluTanh) {
    return p * gelu_sigmoid<kFast>(p);
  } else if constexpr (A == Activation::kRelu) {
    return relu_f(p);
  } else {
    const float r = relu_f(p);
    return r * r;
  }
}

// Derivative of act_forward<A> at p (not used for ReLU, whose backward reads the bit-mask). With
// `value` non-null, also act_forward<A>(p) itself, by the same expression, so bit-identical, from
// the same sigmoid: the compiler does not merge two ex2 / rcp inline-asm sequences by itself.
template <Activation A, bool kFast>
__device__ __forceinline__ float act_derivative(float p, float* value = nullptr) {
  if constexpr (A == Activation::kNone) {
    if (value != nullptr) *value = p;
    return 1.f;
  } else if constexpr (A == Activation::kGeluTanh) {
    // d/dp [p * s(p)] with s = sigmoid(2u): s + p * s' and s' = 2 s (1 - s) u'.
    if constexpr (kFast) {
      // In the data gradient's GEMM epilogue this math is on the critical path (at d = 1024 it
      // costs more than reading the pre-activation: docs/performance.md), so it is kept short:
      // 1 - s taken as e * s (no cancellation near s = 1 either), the constants of 2 p u' folded.
      float e;
      const float s = gelu_sigmoid_fast(p, &e);
      if (value != nullptr) *value = p * s;
      constexpr float c2 = 2.f * kSqrt2OverPi, c3 = 6.f * kSqrt2OverPi * kGeluCoeff;
      const float st = (s * (p * fmaf(c3, p * p, c2))) * e;  // 2 p u' s (1 - s)
      // NaN only where a factor saturates and the exact tail is 0 (e = inf and s = 0 for very
      // negative p, p u' = inf and e = 0 for huge p): the derivative is s (0 or 1) there. A NaN p
      // makes s NaN, so it still propagates.
      return isnan(st) ? s : fmaf(st, s, s);
    } else {
      const float s = gelu_sigmoid<kFast>(p);
      if (value != nullptr) *value = p * s;
      const float s1s = s * (1.f - s);
      // For huge |p| the factor p * u' overflows to inf while s (1 - s) is exactly 0; the
      // limit of the product is 0, not NaN.
      const float tail =
          s1s == 0.f ? 0.f : 2.f * p * s1s * (kSqrt2OverPi * fmaf(3.f * kGeluCoeff, p * p, 1.f));
      return s + tail;
    }
  } else if constexpr (A == Activation::kRelu) {
    if (value != nullptr) *value = relu_f(p);
    return p > 0.f ? 1.f : 0.f;
  } else {
    const float r = relu_f(p);
    if (value != nullptr) *value = r * r;
    return 2.f * r;
  }
}

// sigmoid(x) = 1 / (1 + exp(-x)); the fast form (16-bit outputs) on the hardware ex2 / rcp
// approximations, as gelu_sigmoid_fast.
template <bool kFast>
__device__ __forceinline__ float sigmoid_f(float x) {
  if constexpr (kFast) {
    float e, s;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));  // e == inf gives 0, the limit
    return s;
  } else {
    return 1.f / (1.f + expf(-x));
  }
}

// The gate's activation of a gated unit (kSwiGLU: SiLU, g sigmoid(g); kGeGLU: tanh GELU), and with
// `deriv` non-null its derivative, from the same sigmoid: the value is bit-identical either way,
// so a backward pass that rebuilds act(g) * u gives the forward's bits.
template <Activation A, bool kFast>
__device__ __forceinline__ float gate_act(float g, float* deriv = nullptr) {
  static_assert(A == Activation::kSwiGLU || A == Activation::kGeGLU, "gate_act takes a gated activation");
  if constexpr (A == Activation::kGeGLU) {
    if (deriv == nullptr) return act_forward<Activation::kGeluTanh, kFast>(g);
    float value;
    *deriv = act_derivative<Activation::kGeluTanh, kFast>(g, &value);
    return value;
  } else {
    const float s = sigmoid_f<kFast>(g);
    if (deriv != nullptr) {
      // d/dg [g s(g)] = s + g s (1 - s). NaN only where g is infinite (inf * 0): the limits 0 / 1
      // are s there; a NaN g keeps its NaN.
      const float d = s * fmaf(g, 1.f - s, 1.f);
      *deriv = (d != d && g == g) ? s : d;
    }
    return s == 0.f ? 0.f : g * s;  // g -> -inf: 0, not -inf * 0
  }
}

}  // namespace fused_dense::core
