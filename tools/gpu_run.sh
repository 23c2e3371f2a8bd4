#!/usr/bin/env bash
# One call on a GPU machine: build the extension unless it imports with its CUDA kernels, then run
# the steps asked for, each step's log in the log directory.
#
#   bash tools/gpu_run.sh [--log-dir DIR] [--results-dir DIR] [--limit S] [--jobs N] [STEP...]
#
# Steps (default: tests native):
#   tests     pytest -m cuda (PYTEST_ARGS: more pytest arguments)
#   native    tests/native/test_elementwise.cu built with nvcc, --quick, then --bench-only
#   bench     bench/run.py --out RESULTS_DIR (BENCH_ARGS: more arguments); refused while another
#             process holds the GPU
#   parallel  on every visible GPU (>= 2): tests/test_parallel.py with NCCL, bench/parallel_mlp.py
#             (PARALLEL_BENCH_ARGS), examples/train_gpt_tp.py (GPT_TP_ARGS)
#   sanitize  compute-sanitizer over the native test, the CUDA tests, a short training run and
#             tools/sanitizer_probe.py; reports sorted by kernel (tools/sanitize_summary.py)
#
# Options, each also an environment variable:
#   --log-dir DIR      LOG_DIR      logs; default $OUT when set, else ./gpu_run_logs
#   --results-dir DIR  RESULTS_DIR  where the benchmarks write; default docs/results
#   --limit S          GPU_RUN_LIMIT_S  the call's wall-clock limit: the benchmark's budget and the
#                      sanitizer processes' limit are cut to what is left of it; default none
#   --jobs N           MAX_JOBS     build jobs; default the number of CPUs
# Also: PREBUILT_DIR (a fused_dense/_C*.so built for this torch, copied in first; default .prebuilt),
# CUTLASS_PATH (CUTLASS headers for the cutlass_sm90 kernels; default .cutlass when it has them),
# FUSED_DENSE_CUDA_ARCHS (default "8.0;9.0a"), and the SANITIZE_* variables of the sanitize step.
set -uo pipefail
LOG_DIR=${LOG_DIR:-${OUT:-$PWD/gpu_run_logs}}
RESULTS_DIR=${RESULTS_DIR:-docs/results}
LIMIT=${GPU_RUN_LIMIT_S:-}
JOBS=${MAX_JOBS:-$(nproc)}
steps=()
while [ $# -gt 0 ]; do
  case $1 in
    --log-dir) LOG_DIR=$2; shift 2;;
    --results-dir) RESULTS_DIR=$2; shift 2;;
    --limit) LIMIT=$2; shift 2;;
    --jobs) JOBS=$2; shift 2;;
    tests|native|bench|parallel|sanitize) steps+=("$1"); shift;;
    *) echo "gpu_run.sh: unknown argument '$1' (see the comment at the top)"; exit 2;;
  esac
done
[ ${#steps[@]} -eq 0 ] && steps=(tests native)
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
stamp() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# seconds left of --limit less a margin, or the default when there is no limit
left() { if [ -n "$LIMIT" ]; then echo $(( LIMIT - SECONDS - $1 )); else echo "$2"; fi; }

stamp "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG_DIR/env.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG_DIR/env.txt"
prebuilt=${PREBUILT_DIR:-.prebuilt}
ls "$prebuilt"/_C*.so >/dev/null 2>&1 && cp "$prebuilt"/_C*.so fused_dense/
[ -z "${CUTLASS_PATH:-}" ] && [ -f .cutlass/include/cutlass/cutlass.h ] && export CUTLASS_PATH="$PWD/.cutlass"
# An extension with libstdc++ linked in statically (a CXX whose library path holds only
# libstdc++.a) beside PyTorch's shared one crashes at its first iostream use (the tuner's file
# tags): build such a one again with the system compilers.
shared_libstdcxx() { readelf -d fused_dense/_C*.so 2>/dev/null | grep -q 'NEEDED.*libstdc++'; }
build() {
  stamp "building the extension (${FUSED_DENSE_CUDA_ARCHS:-8.0;9.0a}, $JOBS jobs, CXX=${CXX:-default})"
  rm -f fused_dense/_C*.so
  MAX_JOBS=$JOBS python -m pip install -e . --no-build-isolation >"$LOG_DIR/build.log" 2>&1 \
    || { tail -50 "$LOG_DIR/build.log"; exit 1; }
}
if ! python -c "import fused_dense, sys; sys.exit(0 if fused_dense.has_cuda_kernels() else 1)" 2>/dev/null; then
  build
  if ! shared_libstdcxx && [ "${CXX:-}" != g++ ]; then
    echo "gpu_run.sh: the extension built with CXX=${CXX:-default} links libstdc++ statically; again with CC=gcc CXX=g++"
    CC=gcc CXX=g++ build
  fi
fi
shared_libstdcxx || { echo "gpu_run.sh: fused_dense/_C*.so does not load libstdc++.so.6 (linked statically?): it would crash; stopping"; exit 1; }
python -c "import fused_dense; print('fused_dense CUDA kernels:', fused_dense.has_cuda_kernels())"
rc=0
cap=$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
bin_dir=$(mktemp -d)

if want tests; then
  stamp "CUDA tests: pytest -m cuda"
  python -m pytest -m cuda -q -rfEs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$LOG_DIR/cuda_tests.log" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want native; then
  stamp "native elementwise test (sm_$cap)"
  NVCC_ARCH="-gencode arch=compute_$cap,code=sm_$cap" bash tests/native/build.sh "$bin_dir/test_elementwise" \
    && "$bin_dir/test_elementwise" --quick 2>&1 | tail -5 | tee "$LOG_DIR/native.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stamp "native elementwise bandwidth (--bench-only)"
  "$bin_dir/test_elementwise" --bench-only 2>&1 | tee "$LOG_DIR/native_bench.log" | grep "^bench"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want bench; then
  others=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
  if [ -n "$others" ]; then
    echo "benchmark: not run, other processes hold the GPU (their figures would not be the card's):"
    echo "$others"; exit 1
  fi
  budget=()
  case " ${BENCH_ARGS:-} " in
    *" --budget"*) ;;
    *) if [ -n "$LIMIT" ]; then  # 60 s for the item running at the budget's end and the report
         b=$(left 60 0); [ "$b" -lt 60 ] && b=60; budget=(--budget "$b"); fi;;
  esac
  stamp "benchmark: python bench/run.py --out $RESULTS_DIR ${BENCH_ARGS:-} ${budget[*]+${budget[*]}}"
  python bench/run.py --out "$RESULTS_DIR" ${BENCH_ARGS:-} ${budget[@]+"${budget[@]}"} 2>&1 \
    | tee "$LOG_DIR/bench.log" | tail -80
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want parallel; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
  quiet() { grep -v "^W1\|OMP_NUM_THREADS\|\*\*\*\*"; }
  stamp "tensor-parallel tests with NCCL on $ngpu GPUs"
  python -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_parallel.py 2>&1 | tee "$LOG_DIR/nccl_tests.log" \
    | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stamp "ParallelFusedMLP benchmark on $ngpu GPUs"
  torchrun --standalone --nproc_per_node="$ngpu" bench/parallel_mlp.py --out "$RESULTS_DIR" ${PARALLEL_BENCH_ARGS:-} \
    2>&1 | quiet | tee "$LOG_DIR/parallel_bench.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stamp "GPT example with torchrun on $ngpu GPUs (loss checked against one process)"
  torchrun --standalone --nproc_per_node="$ngpu" examples/train_gpt_tp.py ${GPT_TP_ARGS:-} 2>&1 | quiet \
    | tee "$LOG_DIR/train_gpt_tp.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want sanitize; then
  # compute-sanitizer, each tool of SANITIZE_TOOLS (default all four) over each part of
  # SANITIZE_PARTS (default all):
  #   native   the native test's --sanitize mode: every elementwise kernel, no cuBLASLt, no PyTorch
  #   suite    the CUDA tests (SANITIZE_TESTS; default tests/ without test_large.py, test_parallel.py
  #            and test_example.py) in SANITIZE_SHARDS processes per tool (default 5;
  #            SANITIZE_SHARDS_<tool> per tool), optionally narrowed by pytest -k SANITIZE_SELECT_<tool>,
  #            to SANITIZE_PER_FUNCTION parametrizations per test function, without the tests listed
  #            in SANITIZE_DESELECT_<tool> (a file from sanitize_summary.py --passed-lists)
  #   caching  memcheck / initcheck once more with PyTorch's caching allocator on, for the tests that
  #            need it (the shards run with it off, so every allocation has its exact size)
  #   train    examples/train_gpt.py for 3 steps, attention on its math backend
  #   probes   tools/sanitizer_probe.py cases under initcheck and racecheck (NVIDIA's GEMMs alone)
  # Tools go round the visible GPUs, shards round them too. Each process runs at most SANITIZE_LIMIT
  # seconds (default: what --limit leaves less 120 s, else 3600). 'auto' tuning is off
  # (SANITIZE_TUNING=1 turns it on), float64 test references run on the CPU
  # (SANITIZE_FP64_REFERENCE_ON_CPU=0: on the GPU), the fuzz test takes SANITIZE_FUZZ_EXAMPLES (25)
  # examples, each process SANITIZE_CPU_THREADS threads (default: the CPUs shared among the
  # processes), SANITIZE_EXTRA_ARGS more compute-sanitizer options.
  limit=${SANITIZE_LIMIT:-$(left 120 3600)}
  read -r -a parts <<<"${SANITIZE_PARTS:-native suite caching train probes}"
  part() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
  shards=${SANITIZE_SHARDS:-5}
  read -r -a tools <<<"${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
  default_suite="tests --ignore=tests/test_large.py --ignore=tests/test_parallel.py --ignore=tests/test_example.py"
  read -r -a suite <<<"${SANITIZE_TESTS:-$default_suite}"
  export FUSED_DENSE_FUZZ_CUDA_EXAMPLES=${SANITIZE_FUZZ_EXAMPLES:-25}
  export FUSED_DENSE_TUNING=${SANITIZE_TUNING:-0}
  export FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU=${SANITIZE_FP64_REFERENCE_ON_CPU:-1}
  n_proc=$(( ${#tools[@]} * (shards + 4) ))
  threads=$(( $(nproc) / n_proc )); [ "$threads" -lt 1 ] && threads=1
  export OMP_NUM_THREADS=${SANITIZE_CPU_THREADS:-$threads}
  [ -n "${SANITIZE_PER_FUNCTION:-}" ] && export FUSED_DENSE_TEST_PER_FUNCTION=$SANITIZE_PER_FUNCTION
  ngpu=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
  common=(--error-exitcode 99)
  help=$(compute-sanitizer --help 2>&1)
  grep -q -- "--show-backtrace" <<<"$help" && common+=(--show-backtrace no)
  grep -q -- "--print-limit" <<<"$help" && common+=(--print-limit 100000)
  if [ -n "${SANITIZE_EXTRA_ARGS:-}" ]; then read -r -a extra <<<"$SANITIZE_EXTRA_ARGS"; common+=("${extra[@]}"); fi
  part native && NVCC_ARCH="-gencode arch=compute_$cap,code=sm_$cap" \
    bash tests/native/build.sh "$bin_dir/test_elementwise_sanitize" -lineinfo
  sdir="$LOG_DIR/sanitize"
  mkdir -p "$sdir"
  : >"$sdir/.groups"
  # sanitized TOOL GPU NAME -- CMD...: CMD under the tool in the background, in a process group of
  # its own (ended after the step, so no instrumented target outlives it); its output, after an
  # "exit status N" line, in $sdir/TOOL_NAME.log
  sanitized() {
    local tool=$1 gpu=$2 name=$3 caching=0; shift 4
    case $tool in memcheck|initcheck) caching=1;; esac
    [ -n "${KEEP_CACHING:-}" ] && caching=0
    (
      CUDA_VISIBLE_DEVICES=$gpu PYTORCH_NO_CUDA_MEMORY_CACHING=$caching setsid timeout -s INT "$limit" \
        compute-sanitizer --tool "$tool" "${common[@]}" "$@" >"$sdir/${tool}_$name.body" 2>&1 &
      echo $! >>"$sdir/.groups"
      wait $!
      st=$?
      { echo "exit status $st"; cat "$sdir/${tool}_$name.body"; } >"$sdir/${tool}_$name.log"
      rm -f "$sdir/${tool}_$name.body"
    ) &
  }
  stamp "compute-sanitizer ${common[*]}: ${tools[*]} over ${parts[*]}; ${limit} s each, $ngpu GPU(s)"
  for i in "${!tools[@]}"; do
    tool=${tools[$i]}; gpu=$((i % ngpu))
    part native && sanitized "$tool" "$gpu" native -- "$bin_dir/test_elementwise_sanitize" --sanitize
    n_var="SANITIZE_SHARDS_$tool"; n=${!n_var:-$shards}; part suite || n=0
    k_var="SANITIZE_SELECT_$tool"; select=(); [ -n "${!k_var:-}" ] && select=(-k "${!k_var}")
    d_var="SANITIZE_DESELECT_$tool"
    for ((s = 0; s < n; s++)); do
      FUSED_DENSE_TEST_DESELECT_FILE="${!d_var:-}" FUSED_DENSE_TEST_SHARD="$s/$n" \
        sanitized "$tool" "$(((i + s) % ngpu))" "suite$s" -- python -m pytest -m cuda -v --durations=15 \
        -p no:cacheprovider "${select[@]}" ${SANITIZE_PYTEST_ARGS:-} "${suite[@]}"
    done
    part caching && case $tool in memcheck|initcheck)
      KEEP_CACHING=1 sanitized "$tool" "$gpu" suite_caching -- python -m pytest -m "cuda and caching_allocator" \
        -v --durations=15 -p no:cacheprovider ${SANITIZE_PYTEST_ARGS:-} "${suite[@]}";;
    esac
    part train && sanitized "$tool" "$gpu" train -- \
      python examples/train_gpt.py --steps 3 --layers 1 --d-model 128 --seq 128 --no-compile --tol 1 --attention math --out "$LOG_DIR/train_gpt_sanitize"
    part probes || continue
    case $tool in
      initcheck) probes=(mm_fresh mm_prefilled fd_fresh act_fresh_mm act_prefilled_mm empty_read);;
      racecheck) probes=(mm_fresh fd_fresh);;
      *) probes=();;
    esac
    for p in "${probes[@]}"; do sanitized "$tool" "$gpu" "probe_$p" -- python tools/sanitizer_probe.py "$p"; done
  done
  wait
  while read -r group; do kill -9 -- "-$group" 2>/dev/null; done <"$sdir/.groups"
  stamp "sanitizer summaries"
  python tools/sanitize_summary.py "$sdir"/*.log --json "$LOG_DIR/sanitize_summary.json" --union \
    --passed-lists "$LOG_DIR/sanitize_passed" --check | tee "$LOG_DIR/sanitize_summary.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

stamp "done, rc=$rc"
exit $rc
