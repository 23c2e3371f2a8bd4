#!/usr/bin/env bash
# Builds the native elementwise test (test_elementwise.cu) with the core folders it exercises.
#   bash tests/native/build.sh OUTPUT [NVCC_ARG...]      (run from the repository root)
# NVCC_ARCH (default: -gencode arch=compute_90,code=sm_90) picks the GPU architecture.
set -euo pipefail
out=${1:?usage: bash tests/native/build.sh OUTPUT [NVCC_ARG...]}
shift
read -r -a arch <<<"${NVCC_ARCH:--gencode arch=compute_90,code=sm_90}"
# The sources by folder: csrc/core/common and csrc/core/elementwise, the layers the test exercises.
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O2 --expt-relaxed-constexpr -Icsrc "${arch[@]}" "$@" tests/native/test_elementwise.cu \
  csrc/core/common/*.cpp csrc/core/elementwise/*.cu csrc/core/elementwise/*.cpp \
  -lcublasLt -o "$out"
