// The activation backward, grad_in = grad * act'(pre_act), with the bias gradient on request:
// the elementwise half of the unfused data gradient (and the column sums of the weight gradient's
// bias). This file checks the arguments and runs the pass without the bias gradient; the pass
// with it is bias_grad_reduction.cu's.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <sstream>
#include <string>

#include "core/elementwise/act_backward_step.cuh"
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

}  // namespace

void act_backward_bias_grad(DType dtype, Activation act, const void* grad, const void* pre_act, void* grad_in,
                            void* bias_grad, int64_t rows, int64_t cols, void* workspace,
                            std::size_t workspace_bytes, int device, cudaStream_t stream, void* act_out) {
  constexpr const char* fn = "act_backward_bias_grad";
  check_codes(fn, dtype, act);
  check_shape(fn, rows, cols);
  if (cols == 0) return;
  const std::size_t esize = dtype_size(dtype);
  if (rows == 0) {
    // Sum over no rows: the bias gradient is defined and zero (all-zero bits in every dtype).
    if (bias_grad != nullptr)
      FD_CUDA_CHECK(cudaMemsetAsync(bias_grad, 0, static_cast<std::size_t>(cols) * esize, stream));
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
          with_act_out_flag<A>(act_out != nullptr, [&](auto act_flag) {
            constexpr bool kAct = decltype(act_flag)::value;
            const T* gt = static_cast<const T*>(grad);
            T* git = static_cast<T*>(grad_in);
            T* aot = static_cast<T*>(act_out);
            const int64_t rb = relu_mask_row_bytes(cols);
            unsigned grid = 0;
            if (vec) {
              const FlatPlan plan = make_flat_plan(device, rows * (cols / VW), cols / VW, grid);
              act_backward_kernel<T, A, VW, kAct><<<grid, kThreads, 0, stream>>>(gt, pre_act, git, aot, rb, plan);
            } else {
              const FlatPlan plan = make_flat_plan(device, rows * cols, cols, grid);
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
  const int64_t nchunks = std::max<int64_t>(1, std::min(preferred_reduction_chunks(rows, cols), ws_chunks));
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

  void* written_grad_in = write_grad_in ? grad_in : nullptr;
  const bool ptrs_aligned = aligned16(grad) && (written_grad_in == nullptr || aligned16(written_grad_in)) &&
                            (!uses_pre || mask_mode || aligned16(pre_act)) &&
                            (act_out == nullptr || aligned16(act_out));
  launch_act_backward_bias_grad(dtype, act, grad, pre_act, written_grad_in, act_out, bias_grad, rows, cols,
                                static_cast<float*>(workspace), nchunks, ptrs_aligned, stream);
}

}  // namespace fused_dense::core
