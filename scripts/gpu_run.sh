#!/usr/bin/env bash
# One call on the GPU machine: install (or reuse a prebuilt extension), run the CUDA tests, the
# native elementwise test, and optionally the benchmark. Logs and JSON land in $OUT.
#
#   bash scripts/gpu_run.sh [tests] [native] [bench] [sanitize]     (default: tests native)
#
# A prebuilt fused_dense/_C*.so may be carried in .prebuilt/ (built here with the same torch);
# when it fails to load, the extension is built: MAX_JOBS=16 pip install -e . --no-build-isolation
# for sm_80 and sm_90. Env: PYTEST_ARGS (extra pytest args), BENCH_ARGS (bench/run.py args).
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests native)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
stamp() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

stamp "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"

if ls .prebuilt/_C*.so >/dev/null 2>&1; then
  cp .prebuilt/_C*.so fused_dense/
fi
if ! python -c "import fused_dense, sys; sys.exit(0 if fused_dense.has_cuda_kernels() else 1)" 2>/dev/null; then
  stamp "building the extension (sm_80, sm_90)"
  rm -f fused_dense/_C*.so
  MAX_JOBS=16 FUSED_DENSE_CUDA_ARCHS="8.0;9.0" pip install -e . --no-build-isolation >"$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
fi
python -c "import fused_dense; print('fused_dense CUDA kernels:', fused_dense.has_cuda_kernels())"
rc=0

if want tests; then
  stamp "CUDA tests: pytest -m cuda"
  python -m pytest -m cuda -q -rfEs -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/cuda_tests.log" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want native; then
  stamp "native elementwise test"
  nvcc -std=c++17 -O2 -Icsrc/core -gencode arch=compute_90,code=sm_90 tests/native/test_elementwise.cu \
    csrc/core/elementwise.cu csrc/core/types.cpp -o /tmp/test_elementwise && /tmp/test_elementwise --quick 2>&1 \
    | tail -5 | tee "$OUT/native.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want bench; then
  stamp "benchmark: python bench/run.py --out $OUT ${BENCH_ARGS:-}"
  python bench/run.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want sanitize; then
  for tool in memcheck racecheck initcheck synccheck; do
    stamp "compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 99 python -m pytest -m cuda -q -x -p no:cacheprovider \
      ${SANITIZE_TESTS:-tests/test_ops.py} 2>&1 | tail -15 | tee "$OUT/sanitize_$tool.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done
fi
stamp "done, rc=$rc"
exit $rc
