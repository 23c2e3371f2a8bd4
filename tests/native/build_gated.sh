#!/usr/bin/env bash
# Builds the native test of the gated-MLP cutlass_sm90 kernels (test_gated_cutlass.cu) with the
# core sources it needs, for sm_90a.
#   bash tests/native/build_gated.sh OUTPUT [NVCC_ARG...]      (run from the repository root)
# CUTLASS_PATH: a CUTLASS tree (tools/cutlass_path.sh finds one when unset).
set -euo pipefail
out=${1:?usage: bash tests/native/build_gated.sh OUTPUT [NVCC_ARG...]}
shift
source tools/cutlass_path.sh
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DFUSED_DENSE_WITH_CUTLASS_SM90A \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ -Icsrc -I"$CUTLASS_PATH/include" -I"$CUTLASS_PATH/tools/util/include" "$@" \
  tests/native/test_gated_cutlass.cu csrc/core/cutlass_sm90/cutlass_sm90_gated.cu csrc/core/common/*.cpp \
  -lcublasLt -o "$out"
