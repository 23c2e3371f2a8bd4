#!/usr/bin/env bash
# Builds the native elementwise test (test_elementwise.cu) with the core sources it exercises.
#   bash tests/native/build.sh OUTPUT [NVCC_ARG...]      (run from the repository root)
# NVCC_ARCH (default: -gencode arch=compute_90,code=sm_90) picks the GPU architecture.
set -euo pipefail
out=${1:?usage: bash tests/native/build.sh OUTPUT [NVCC_ARG...]}
shift
read -r -a arch <<<"${NVCC_ARCH:--gencode arch=compute_90,code=sm_90}"
core=csrc/core
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O2 -I"$core" "${arch[@]}" "$@" tests/native/test_elementwise.cu \
  "$core"/bias_act_forward.cu "$core"/relu_mask_forward.cu "$core"/act_backward.cu \
  "$core"/bias_grad_reduction.cu "$core"/sum_partials.cu "$core"/gated_act.cu \
  "$core"/elementwise_checks.cpp "$core"/device_info.cpp "$core"/cuda_check.cpp "$core"/types.cpp \
  -lcublasLt -o "$out"
