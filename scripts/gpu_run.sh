#!/usr/bin/env bash
# One call on the GPU machine: install (or reuse a prebuilt extension), run the CUDA tests, the
# native elementwise test, and optionally the benchmark. Logs and JSON land in $OUT.
#
#   bash scripts/gpu_run.sh [tests] [native] [bench] [ab] [probes] [parallel] [sanitize]   (default: tests native)
#
# ab: the same benchmark sections twice in one call, first with this tree's extension, then with
# .prebuilt_branch/_C*.so (another branch's build of the extension, made here and carried), each
# run tuning afresh with its choices printed (AB_TUNING_VERBOSE=2: every candidate's time too);
# AB_BENCH_ARGS replaces the default sections.
#
# parallel (needs >= 2 GPUs): the tensor-parallel tests with NCCL, bench/parallel_mlp.py and the
# torchrun GPT example, on every visible GPU. sanitize: compute-sanitizer memcheck / racecheck /
# initcheck / synccheck over the native kernel test, the selected CUDA op tests and a short
# training run, each under a time limit (see the step below); memcheck and initcheck run with
# PyTorch's caching allocator off so every allocation has its exact size (the tests that need the
# allocator run in one more process with it on).
#
# A prebuilt fused_dense/_C*.so may be carried in .prebuilt/ (built here with the same torch);
# when it fails to load, the extension is built: MAX_JOBS=16 pip install -e . --no-build-isolation
# for sm_80 and sm_90. Env: PYTEST_ARGS (extra pytest args), BENCH_ARGS (bench/run.py args),
# GPU_RUN_LIMIT_S (the call's time limit, default 570: the benchmark's budget is cut to fit it).
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
# The GPU machine has no network: CUTLASS's headers for the own GEMM come carried in .cutlass/
# (cp -r "$(python -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')/source" .cutlass)
[ -f .cutlass/include/cutlass/cutlass.h ] && export CUTLASS_PATH="$PWD/.cutlass"
if ! python -c "import fused_dense, sys; sys.exit(0 if fused_dense.has_cuda_kernels() else 1)" 2>/dev/null; then
  stamp "building the extension (sm_80, sm_90)"
  rm -f fused_dense/_C*.so
  MAX_JOBS=16 FUSED_DENSE_CUDA_ARCHS="8.0;9.0a" python -m pip install -e . --no-build-isolation >"$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
fi
python -c "import fused_dense; print('fused_dense CUDA kernels:', fused_dense.has_cuda_kernels())"
rc=0

if want tests; then
  stamp "CUDA tests: pytest -m cuda"
  python -m pytest -m cuda -q -rfEs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/cuda_tests.log" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want native; then
  stamp "native elementwise test"
  nvcc -std=c++17 -O2 -Icsrc/core -gencode arch=compute_90,code=sm_90 tests/native/test_elementwise.cu \
    csrc/core/elementwise.cu csrc/core/types.cpp -o /tmp/test_elementwise && /tmp/test_elementwise --quick 2>&1 \
    | tail -5 | tee "$OUT/native.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  # effective bandwidth of each elementwise kernel at 16384 x 8192, as a share of a device copy's
  stamp "native elementwise bandwidth (--bench-only)"
  /tmp/test_elementwise --bench-only 2>&1 | tee "$OUT/native_bench.log" | grep "^bench"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want ab; then
  if ! ls .prebuilt_branch/_C*.so >/dev/null 2>&1; then
    echo "ab: no .prebuilt_branch/_C*.so (build the other branch's extension here and carry .prebuilt_branch)"
    rc=1
  else
    mkdir -p /tmp/ab_main_ext && cp fused_dense/_C*.so /tmp/ab_main_ext/
    for variant in main branch; do
      if [ "$variant" = branch ]; then rm -f fused_dense/_C*.so && cp .prebuilt_branch/_C*.so fused_dense/; fi
      stamp "A/B benchmark, $variant extension"
      FUSED_DENSE_TUNING_VERBOSE="${AB_TUNING_VERBOSE:-1}" python bench/run.py --out "$OUT/ab_$variant" \
        ${AB_BENCH_ARGS:---sections mlp,ops --no-compile --no-accuracy} >"$OUT/ab_$variant.log" 2>&1 || rc=1
      grep -A20 "^## Targets" "$OUT/ab_$variant/bench.md"
    done
    rm -f fused_dense/_C*.so && cp /tmp/ab_main_ext/_C*.so fused_dense/
  fi
fi

if want bench; then
  # figures taken beside another process on the GPU are not the card's; refuse rather than record them
  others=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
  if [ -n "$others" ]; then
    echo "benchmark: not run, other processes hold the GPU:"; echo "$others"; exit 1
  fi
  # One call on the GPU machine may run 600 s. With the tests before it (about 270 s) the full
  # benchmark (about 340 s) would not fit, so its budget shrinks to what the call has left
  # (GPU_RUN_LIMIT_S, default 570, less 60 s for the item running at the budget's end and the
  # report): the sections at the end of its plan are then recorded as skipped, never lost silently.
  budget_arg=()
  case " ${BENCH_ARGS:-} " in
    *" --budget"*) ;;
    *)
      left=$(( ${GPU_RUN_LIMIT_S:-570} - SECONDS - 60 ))
      if [ "$left" -lt 420 ]; then
        [ "$left" -lt 60 ] && left=60
        budget_arg=(--budget "$left")
        echo "benchmark: ${SECONDS} s of this call used, budget cut to ${left} s (GPU_RUN_LIMIT_S=${GPU_RUN_LIMIT_S:-570})"
      fi
      ;;
  esac
  stamp "benchmark: python bench/run.py --out $OUT ${BENCH_ARGS:-} ${budget_arg[*]+${budget_arg[*]}}"
  python bench/run.py --out "$OUT" ${BENCH_ARGS:-} ${budget_arg[@]+"${budget_arg[@]}"} 2>&1 | tee "$OUT/bench.log" | tail -80
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want probes; then
  # the one-idea probes of bench/ (bench/README.md), each under PROBE_LIMIT seconds, logs in $OUT;
  # PROBES picks some of them, PROBE_ARGS_<probe> adds arguments (e.g. PROBE_ARGS_interleaved_probe=--compile)
  for probe in ${PROBES:-interleaved_probe l2_chunk_probe overlap_probe dgrad_split_probe}; do
    a_var="PROBE_ARGS_$probe"; read -r -a probe_args <<<"${!a_var:-}"
    stamp "probe: bench/$probe.py ${probe_args[*]}"
    timeout "${PROBE_LIMIT:-150}" python "bench/$probe.py" "${probe_args[@]}" 2>&1 | tee "$OUT/$probe.log" | grep -v "^round "
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done
fi

if want parallel; then
  # NVLink multicast stays off on shared hosts (KINDS.md)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
  stamp "tensor-parallel tests with NCCL on $ngpu GPUs"
  python -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_parallel.py 2>&1 | tee "$OUT/nccl_tests.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stamp "ParallelFusedMLP benchmark on $ngpu GPUs"
  torchrun --standalone --nproc_per_node="$ngpu" bench/parallel_mlp.py --out "$OUT" ${PARALLEL_BENCH_ARGS:-} 2>&1 \
    | grep -v "^W1\|OMP_NUM_THREADS\|\*\*\*\*" | tee "$OUT/parallel_bench.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  stamp "GPT example with torchrun on $ngpu GPUs (loss checked against one process)"
  torchrun --standalone --nproc_per_node="$ngpu" examples/train_gpt_tp.py ${GPT_TP_ARGS:-} 2>&1 \
    | grep -v "^W1\|OMP_NUM_THREADS\|\*\*\*\*" | tee "$OUT/train_gpt_tp.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if want sanitize; then
  # compute-sanitizer memcheck / racecheck / initcheck / synccheck, all four at once, each over:
  #  (1) the native elementwise test binary in its --sanitize mode: 420 small cases (--quick's 15755
  #      did not finish in 360 s under the tools) that still launch every fused_dense kernel, for
  #      every dtype and activation, vector and scalar paths, in place, misaligned, edge widths,
  #      multi-block grids and the multi-chunk bias-gradient workspace; no cuBLASLt, no PyTorch;
  #  (2) the CUDA test suite (tests/ without test_large.py, whose 2^32-element problems would take
  #      hours instrumented, test_parallel.py, which needs its own processes per rank, and
  #      test_example.py, whose training subprocess (3) replaces), split into SANITIZE_SHARDS
  #      processes per tool (SANITIZE_SHARDS_<tool> overrides it per tool) with
  #      FUSED_DENSE_TEST_SHARD, optionally narrowed by pytest -k SANITIZE_SELECT_<tool> and to
  #      SANITIZE_PER_FUNCTION parametrizations per test function (FUSED_DENSE_TEST_REVERSE=1 runs
  #      each shard last test first, so a second run with the same shards covers what a first run
  #      cut by the limit did not reach); the fuzz test at
  #      SANITIZE_FUZZ_EXAMPLES examples;
  #  (3) a 3-step GPT training run (FusedMLP and nn.Linear models), attention on its math backend so
  #      the reports are not about cuDNN / flash attention kernels;
  #  (4) scripts/sanitizer_probe.py cases under initcheck and racecheck: plain torch.mm against a
  #      prefilled output and a positive control, to tell reports about NVIDIA's GEMMs apart.
  # Tools are spread over the visible GPUs in the order of SANITIZE_TOOLS, suite shards round them. Host backtraces are off
  # (a report still names its kernel, which is what the summary sorts by). memcheck and initcheck run with PyTorch's caching allocator off so
  # every allocation has its exact size. Every process has the same wall-clock limit,
  # SANITIZE_LIMIT (default 420 s); scripts/sanitize_summary.py sorts the reports by kernel.
  # SANITIZE_PARTS picks among native, suite, caching (the allocator-on process of memcheck and
  # initcheck), train and probes (default: all), so a follow-up run spends its CPU cores only on
  # what earlier runs did not reach.
  limit=${SANITIZE_LIMIT:-420}
  read -r -a parts <<<"${SANITIZE_PARTS:-native suite caching train probes}"
  for p in "${parts[@]}"; do
    case $p in native|suite|caching|train|probes) ;; *) echo "SANITIZE_PARTS: unknown part '$p' (expected native, suite, caching, train, probes)"; exit 2;; esac
  done
  part() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
  shards=${SANITIZE_SHARDS:-5}
  read -r -a tools <<<"${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
  read -r -a suite <<<"${SANITIZE_TESTS:-tests --ignore=tests/test_large.py --ignore=tests/test_parallel.py --ignore=tests/test_example.py}"
  export FUSED_DENSE_FUZZ_CUDA_EXAMPLES=${SANITIZE_FUZZ_EXAMPLES:-25}
  # 'auto' measures its candidates the first time it meets a problem shape: up to ~170 GEMM
  # launches (a warm-up of up to 100 runs, then 3 rounds over up to 12 candidates) where a fixed
  # heuristic makes one, and under the tools every launch is instrumented. Sanitized runs take the
  # rule's choice instead (the same cuBLASLt kernels the fixed-heuristic tests run); sessions 3
  # and 4 ran memcheck with measuring on (0 reports). SANITIZE_TUNING=1 turns it back on.
  export FUSED_DENSE_TUNING=${SANITIZE_TUNING:-0}
  # the tests' float64 reference matmuls run on the CPU (tests/fp64_reference_on_cpu.py: under the
  # tools PyTorch's float64 GEMMs, not fused_dense's kernels, look like what holds the tests up);
  # SANITIZE_FP64_REFERENCE_ON_CPU=0 keeps them on the GPU. Few CPU threads per process, as up to
  # ~30 sanitized processes share the cores.
  export FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU=${SANITIZE_FP64_REFERENCE_ON_CPU:-1}
  export OMP_NUM_THREADS=${SANITIZE_CPU_THREADS:-2}
  # SANITIZE_PER_FUNCTION=N: N parametrizations of each test function (every test body, far fewer runs)
  [ -n "${SANITIZE_PER_FUNCTION:-}" ] && export FUSED_DENSE_TEST_PER_FUNCTION=$SANITIZE_PER_FUNCTION
  ngpu=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
  common=(--error-exitcode 99)
  help=$(compute-sanitizer --help 2>&1)
  grep -q -- "--show-backtrace" <<<"$help" && common+=(--show-backtrace no)
  grep -q -- "--print-limit" <<<"$help" && common+=(--print-limit 100000)
  # SANITIZE_EXTRA_ARGS: more compute-sanitizer options, e.g. "--kernel-name-exclude kns=nvjet" to run
  # NVIDIA's cuBLAS GEMMs uninstrumented (the tool then checks only the other kernels, ours)
  if [ -n "${SANITIZE_EXTRA_ARGS:-}" ]; then
    read -r -a extra <<<"$SANITIZE_EXTRA_ARGS"
    grep -q -- "${extra[0]}" <<<"$help" || { echo "SANITIZE_EXTRA_ARGS: compute-sanitizer has no option ${extra[0]}"; exit 2; }
    common+=("${extra[@]}")
  fi
  part native && nvcc -std=c++17 -O2 -lineinfo -Icsrc/core -gencode arch=compute_90,code=sm_90 \
    tests/native/test_elementwise.cu csrc/core/elementwise.cu csrc/core/types.cpp -o /tmp/test_elementwise_sanitize
  mkdir -p "$OUT/sanitize"
  # sanitized TOOL GPU NAME -- CMD...: CMD under the tool in the background, its output (after an
  # "exit status N" line) in $OUT/sanitize/TOOL_NAME.log.
  sanitized() {
    local tool=$1 gpu=$2 name=$3; shift 4
    local caching=0; case $tool in memcheck|initcheck) caching=1;; esac
    [ -n "${KEEP_CACHING:-}" ] && caching=0
    (
      CUDA_VISIBLE_DEVICES=$gpu PYTORCH_NO_CUDA_MEMORY_CACHING=$caching timeout -s INT "$limit" \
        compute-sanitizer --tool "$tool" "${common[@]}" "$@" >"$OUT/sanitize/${tool}_$name.body" 2>&1
      st=$?
      { echo "exit status $st"; cat "$OUT/sanitize/${tool}_$name.body"; } >"$OUT/sanitize/${tool}_$name.log"
      rm -f "$OUT/sanitize/${tool}_$name.body"
    ) &
  }
  stamp "compute-sanitizer ${common[*]}: ${tools[*]} over ${parts[*]} (${shards} suite shards by default); ${limit}s each, $ngpu GPU(s)"
  for i in "${!tools[@]}"; do
    tool=${tools[$i]}; gpu=$((i % ngpu))
    part native && sanitized "$tool" "$gpu" native -- /tmp/test_elementwise_sanitize --sanitize
    n_var="SANITIZE_SHARDS_$tool"; n=${!n_var:-$shards}; part suite || n=0
    k_var="SANITIZE_SELECT_$tool"; select=(); [ -n "${!k_var:-}" ] && select=(-k "${!k_var}")
    # SANITIZE_DESELECT_<tool>=FILE: leave out the tests FILE lists (what earlier runs of this tool
    # passed, from sanitize_summary.py --passed-lists); the shards split what is left
    d_var="SANITIZE_DESELECT_$tool"; deselect=${!d_var:-}
    for ((s = 0; s < n; s++)); do
      # shards go round the GPUs (each tool starting at its own), so no GPU carries one tool's whole suite
      FUSED_DENSE_TEST_DESELECT_FILE="$deselect" FUSED_DENSE_TEST_SHARD="$s/$n" sanitized "$tool" "$(((i + s) % ngpu))" "suite$s" -- \
        python -m pytest -m cuda -v --durations=15 -p no:cacheprovider "${select[@]}" ${SANITIZE_PYTEST_ARGS:-} \
        "${suite[@]}"
    done
    # the tests that need PyTorch's caching allocator skip in the shards above under memcheck and
    # initcheck (allocator off); here they run in one more process with it on
    part caching && case $tool in memcheck|initcheck)
      KEEP_CACHING=1 sanitized "$tool" "$gpu" suite_caching -- python -m pytest -m "cuda and caching_allocator" \
        -v --durations=15 -p no:cacheprovider ${SANITIZE_PYTEST_ARGS:-} "${suite[@]}";;
    esac
    part train && sanitized "$tool" "$gpu" train -- python examples/train_gpt.py --steps 3 --layers 1 --tol 1 --attention math
    part probes || continue
    case $tool in
      initcheck) probes=(mm_fresh mm_prefilled fd_fresh act_fresh_mm act_prefilled_mm empty_read);;
      racecheck) probes=(mm_fresh fd_fresh);;
      *) probes=();;
    esac
    for p in "${probes[@]}"; do sanitized "$tool" "$gpu" "probe_$p" -- python scripts/sanitizer_probe.py "$p"; done
  done
  wait
  # A target can outlive its tool's time limit: in session 10 the instrumented pytest processes
  # kept running after compute-sanitizer returned, and the benchmark started next measured the
  # 8192^3 ceiling at 285 TF/s instead of 680. Nothing of this script holds the GPU now, so every
  # process still on it is such a leftover.
  sleep 5
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "sanitize: killing leftover GPU process $pid ($(ps -o args= -p "$pid" 2>/dev/null | cut -c1-120))"
    kill -9 "$pid" 2>/dev/null
  done
  stamp "sanitizer summaries"
  python scripts/sanitize_summary.py "$OUT"/sanitize/*.log --json "$OUT/sanitize_summary.json" \
    --union --passed-lists "$OUT/sanitize_passed" | tee "$OUT/sanitize_summary.txt"
  python - "$OUT/sanitize_summary.json" <<'PY' || rc=1
import json, sys
res = json.load(open(sys.argv[1]))
# 99 is the tool's --error-exitcode (reports, possibly only in NVIDIA's kernels); 124 the limit.
bad = {k: v for k, v in res.items() if v["errors_in_fused_dense"] or v["tests"].get("FAILED")
       or v["tests"].get("ERROR") or (v["status"] not in (0, 99, 124) and not v.get("empty"))}
cut = [k for k, v in res.items() if v["status"] == 124]
print(f"logs: {len(res)}; cut by the time limit: {len(cut)}; with a report in a fused_dense kernel, "
      f"a failed test or another exit status: {len(bad)}")
for k, v in bad.items():
    print("  ", k, "exit", v["status"], v["tests"], "reports in fused_dense kernels:", v["errors_in_fused_dense"])
sys.exit(1 if bad else 0)
PY
fi

stamp "done, rc=$rc"
exit $rc
