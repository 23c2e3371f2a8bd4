// The mlp family (mlp.cpp): the MLP's argument checks and its checkpoint rules, one definition
// (MlpPlan), shared by the bf16 / fp16 autograd (autograd/mlp.cpp) and the FP8 autograd
// (autograd/mlp_fp8.cpp). The rules are stated in docs/contract.md ("Checkpoint levels").
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <optional>

#include "torch/checks.h"

namespace fused_dense {

inline constexpr int64_t kReluCode = static_cast<int64_t>(ActivationCode::kRelu);
// The checkpoint levels are 0 to kMaxCheckpointLevel (the rules below).
inline constexpr int64_t kMaxCheckpointLevel = 2;

// The shapes of fused_mlp's x [B, K], weight1 [h, K] (gated: the packed [2h, K], no bias1) and
// weight2 [N, h], in the op's own argument names; the general ops check the rest (dtypes,
// devices, contiguity, bias shapes) as they are called (mlp.cpp).
void check_mlp_shapes(const at::Tensor& x, const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                      const at::Tensor& weight2, int64_t activation, const char* op);

// Which inputs need a gradient: x, weight1, bias1, weight2, bias2 (an absent bias: false).
struct MlpNeeds {
  bool x = false, w1 = false, b1 = false, w2 = false, b2 = false;
};

inline MlpNeeds needs_from_list(const c10::List<bool>& needs, const char* op) {
  TORCH_CHECK_VALUE(needs.size() == 5, op,
                    ": needs_input_grad must hold 5 flags (x, weight1, bias1, weight2, bias2), got ", needs.size());
  return MlpNeeds{needs.get(0), needs.get(1), needs.get(2), needs.get(3), needs.get(4)};
}

// The MLPs take every activation but none.
inline void check_mlp_codes(int64_t activation, int64_t checkpoint_lvl, const char* op) {
  check_activation_in(op, activation, kNoActivation + 1, kLastActivation);
  TORCH_CHECK_VALUE(checkpoint_lvl >= 0 && checkpoint_lvl <= kMaxCheckpointLevel, op,
                    ": checkpoint_lvl must be 0, 1 or 2, got ", checkpoint_lvl);
}

// The checkpoint rules.
//   level 0: keep x, the pre-activation and act(fc1(x));
//   level 1: keep x and the pre-activation, rebuild act(fc1(x)) in backward; ReLU keeps its
//            bit-mask and its output, as at level 0 (the mask cannot rebuild the output);
//   level 2: keep x; re-run fc1 in backward.
// Only what some requested gradient reads is kept.
struct MlpPlan {
  MlpNeeds need;
  bool need_d_pre = false;     // a gradient flows back through the activation
  bool need_act_out = false;   // fc2's weight gradient reads act(fc1(x))
  bool keep_pre = false;       // the forward saves the pre-activation (ReLU: its bit-mask)
  bool keep_act_out = false;   // the forward saves act(fc1(x))
  bool recompute_fc1 = false;  // backward re-runs fc1 from x before anything else
  bool save_x = false, save_w1 = false, save_b1 = false, save_w2 = false;
};

inline MlpPlan make_plan(int64_t activation, int64_t checkpoint_lvl, MlpNeeds need, const char* op) {
  check_mlp_codes(activation, checkpoint_lvl, op);
  MlpPlan p;
  p.need = need;
  p.need_d_pre = need.x || need.w1 || need.b1;
  p.need_act_out = need.w2;
  const bool level0_outputs = checkpoint_lvl == 0 || (checkpoint_lvl == 1 && activation == kReluCode);
  if (checkpoint_lvl == 2) {
    p.keep_pre = false;
  } else if (level0_outputs) {
    p.keep_pre = p.need_d_pre;
  } else {  // level 1: the pre-activation also rebuilds the activation output
    p.keep_pre = p.need_d_pre || p.need_act_out;
  }
  p.keep_act_out = level0_outputs && p.need_act_out;
  p.recompute_fc1 = checkpoint_lvl == 2 && (p.need_d_pre || p.need_act_out);
  p.save_x = need.w1 || p.recompute_fc1;
  p.save_w1 = need.x || p.recompute_fc1;
  p.save_b1 = p.recompute_fc1;
  p.save_w2 = p.need_d_pre;
  return p;
}

}  // namespace fused_dense
