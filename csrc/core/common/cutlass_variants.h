// How the cutlass_sm90 kernels number the variants the tuner times (tuner.h): variant =
// configuration * kCutlassOrders + order, one of a kernel's tile configurations run with one of
// kCutlassOrders tile-scheduler orders (cutlass_sm90_common.cuh lists them).
#pragma once

namespace fused_dense::core {

inline constexpr int kCutlassOrders = 3;

}  // namespace fused_dense::core
