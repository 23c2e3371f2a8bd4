"""The test tooling itself: FUSED_DENSE_TEST_SHARD splits a suite between processes (the
sanitizer runs use it), so shards must be disjoint and together hold every test; and
tools/sanitize_summary.py must attribute the tool's reports to the right kernels."""
import glob
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OP_TESTS = sorted(glob.glob(os.path.join(HERE, "test_op_*.py")))  # the op suite, many parametrizations


def collected(shard=None, target=None, per_function=None, reverse=None, deselect_file=None, marker=None):
    env = dict(os.environ)
    for name in ("SHARD", "PER_FUNCTION", "REVERSE", "DESELECT_FILE"):
        env.pop(f"FUSED_DENSE_TEST_{name}", None)
    if deselect_file is not None:
        env["FUSED_DENSE_TEST_DESELECT_FILE"] = deselect_file
    if reverse is not None:
        env["FUSED_DENSE_TEST_REVERSE"] = reverse
    if shard is not None:
        env["FUSED_DENSE_TEST_SHARD"] = shard
    if per_function is not None:
        env["FUSED_DENSE_TEST_PER_FUNCTION"] = per_function
    marker_args = ["-m", marker] if marker else []
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *marker_args, *([os.path.join(HERE, target)] if target else OP_TESTS)],
                         cwd=os.path.dirname(HERE), env=env,
                         capture_output=True, text=True, timeout=300)
    return res, [line for line in res.stdout.splitlines() if "::" in line]


def test_shards_partition_the_suite():
    res, full = collected()
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(full) > 100
    parts = [collected(f"{i}/3")[1] for i in range(3)]
    assert all(parts), "a shard collected nothing"
    assert sorted(sum(parts, [])) == sorted(full)
    assert len(set(parts[0]) & set(parts[1])) == 0


def test_per_function_keeps_every_test_body():
    _, full = collected()
    functions = {line.split("[")[0] for line in full}
    for per in ("1", "3"):
        res, part = collected(per_function=per)
        assert res.returncode == 0, res.stdout + res.stderr
        assert set(part) <= set(full)
        assert {line.split("[")[0] for line in part} == functions  # every function still runs
        for fn in functions:
            n_all = sum(1 for line in full if line.split("[")[0] == fn)
            n_kept = sum(1 for line in part if line.split("[")[0] == fn)
            assert n_kept == min(int(per), n_all), fn
    # sharding applies after the selection: the shards partition the reduced list
    _, reduced = collected(per_function="3")
    shards = [collected("0/2", per_function="3")[1], collected("1/2", per_function="3")[1]]
    assert sorted(shards[0] + shards[1]) == sorted(reduced)
    res, _ = collected(per_function="0")
    assert res.returncode != 0 and "FUSED_DENSE_TEST_PER_FUNCTION" in res.stdout + res.stderr


def test_shards_split_only_what_the_marker_selects():
    """Sharding comes after pytest's -m deselection: n shards of n selected tests hold one each
    (no shard is left empty by tests the marker leaves out)."""
    _, selected = collected(per_function="1", marker="cuda")
    assert 5 < len(selected) < 60
    n = len(selected)
    shards = [collected(f"{i}/{n}", per_function="1", marker="cuda")[1] for i in range(n)]
    assert [len(s) for s in shards] == [1] * n
    assert sorted(sum(shards, [])) == sorted(selected)


def test_reverse_runs_the_same_shard_backwards():
    res, forward = collected("1/3", per_function="3")
    assert res.returncode == 0, res.stdout + res.stderr
    res, backward = collected("1/3", per_function="3", reverse="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(forward) > 10 and backward == forward[::-1]
    assert collected("1/3", per_function="3", reverse="0")[1] == forward
    res, _ = collected(reverse="yes")
    assert res.returncode != 0 and "FUSED_DENSE_TEST_REVERSE" in res.stdout + res.stderr


def test_deselect_file_leaves_out_listed_tests_before_sharding(tmp_path):
    _, reduced = collected(per_function="3")
    done = reduced[::2]
    listing = tmp_path / "passed.txt"
    listing.write_text("# passed earlier\n" + "\n".join(f"{t}  # memcheck" for t in done) + "\n\n")
    res, rest = collected(per_function="3", deselect_file=str(listing))
    assert res.returncode == 0, res.stdout + res.stderr
    assert rest == [t for t in reduced if t not in set(done)] and rest
    shards = [collected(f"{i}/2", per_function="3", deselect_file=str(listing))[1] for i in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(rest)
    res, _ = collected(deselect_file=str(tmp_path / "missing.txt"))
    assert res.returncode != 0 and "FUSED_DENSE_TEST_DESELECT_FILE" in res.stdout + res.stderr


@pytest.mark.parametrize("spec", ["3/3", "x", "1/0", "-1/2"])
def test_bad_shard_spec_is_a_usage_error(spec):
    res, _ = collected(spec)
    assert res.returncode != 0
    assert "FUSED_DENSE_TEST_SHARD" in res.stdout + res.stderr


def test_sanitize_summary_attributes_reports_to_kernels():
    """The summarizer counts pytest outcomes even where the tool's lines split pytest's, and puts
    each report under the kernel it names: fused_dense's or someone else's."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import sanitize_summary

    log = "\n".join([
        "exit status 124",
        "========= COMPUTE-SANITIZER",
        "tests/test_op_linear_act.py::test_a[x] PASSED [  2%]",
        "tests/test_op_linear_act.py::test_b[y] ========= Error: Race reported between Read access at nvjet_sm90_x_TNN+0xa50",
        "=========     and Write access at nvjet_sm90_x_TNN+0x9180 [512 hazards]",
        "PASSED [  4%]",
        "========= Invalid __global__ read of size 4 bytes",
        "=========     at void fused_dense::core::(anonymous namespace)::bias_kernel<float>(int, float*)+0x1d0",
        "=========     by thread (0,0,0) in block (0,0,0)",
        '========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to x.',
        "tests/test_op_linear_act.py::test_c FAILED",
        "========= 18 passed, 1830 deselected, 14 warnings in 141.90s (0:02:21) =========",
        "========= ERROR SUMMARY: 3 errors",
    ])
    res = sanitize_summary.parse(log)
    assert res["status"] == 124
    assert res["tests"] == {"PASSED": 2, "FAILED": 1}
    assert res["items"] == {"tests/test_op_linear_act.py::test_a[x]": "PASSED", "tests/test_op_linear_act.py::test_b[y]": "PASSED",
                            "tests/test_op_linear_act.py::test_c": "FAILED"}
    assert res["error_summary"] == 3
    mine = [e for e in res["errors"] if e[2]]
    other = [e for e in res["errors"] if not e[2]]
    assert [(k, sanitize_summary.short(n)) for k, n, _ in mine] == [
        ("Invalid __global__ read", "void fused_dense::core::(anonymous namespace)::bias_kernel<float>")]
    assert sorted(k for k, _, _ in other) == ["Error: Race reported between Read access",
                                              "Program hit cudaErrorInvalidValue"]
    assert [n for k, n, _ in other if k.startswith("Error: Race")] == ["nvjet_sm90_x_TNN"]


def test_profile_tools_kernel_names_keep_the_template_arguments():
    """The profile tools' kernel lines (short at TEMPLATE_WIDTH) keep what tells two instances of
    one kernel apart, here fp8_quantize's mode and flag, and drop only the argument list."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import sanitize_summary

    ns = "fused_dense::core::(anonymous namespace)::"
    for mode, flag in ((6, "false"), (3, "true")):
        name = (f"void {ns}cast_kernel_capped<__nv_bfloat16, (fused_dense::core::Activation)5, {mode}, {flag}>"
                f"(__nv_bfloat16 const*, __nv_bfloat16 const*, {ns}CastParams)")
        for seen in (name, name[:160]):  # whole, and cut as bench.model's profile keeps it
            assert sanitize_summary.short(seen, sanitize_summary.TEMPLATE_WIDTH) == name[:name.index(">(") + 1]
    assert sanitize_summary.short("nvjet_sm90_qqtst_128x256_TNN", sanitize_summary.TEMPLATE_WIDTH) == \
        "nvjet_sm90_qqtst_128x256_TNN"


def test_sanitize_summary_union_counts_each_test_once_with_its_worst_outcome():
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import io
    import sanitize_summary

    first = sanitize_summary.parse("exit status 124\ntests/t.py::a PASSED\ntests/t.py::b PASSED\n")
    rerun = sanitize_summary.parse("exit status 0\ntests/t.py::b FAILED\ntests/t.py::c SKIPPED\n"
                                   "tests/t.py::d SKIPPED\n")
    with_allocator = sanitize_summary.parse("exit status 0\ntests/t.py::d PASSED\n")
    other_tool = sanitize_summary.parse("exit status 0\ntests/t.py::a PASSED\n")
    out = io.StringIO()
    sanitize_summary.print_union({"r1/memcheck_suite0.log": first, "r2/memcheck_suite0.log": rerun,
                                  "r2/memcheck_suite_caching.log": with_allocator,
                                  "r1/racecheck_suite0.log": other_tool}, out=out)
    assert out.getvalue().splitlines() == [
        "union memcheck: 4 distinct tests: failed 1, passed 2, skipped 1",
        "union racecheck: 1 distinct tests: passed 1",
    ]


def test_sanitize_summary_passed_lists_feed_the_deselect_file(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import sanitize_summary

    _, reduced = collected(per_function="3")
    log = "exit status 124\n" + "\n".join(f"{t} PASSED" for t in reduced[:5]) + f"\n{reduced[5]} FAILED\n"
    sanitize_summary.write_passed_lists({"run/racecheck_suite0.log": sanitize_summary.parse(log)}, tmp_path)
    listing = tmp_path / "racecheck_passed.txt"
    assert listing.read_text().splitlines()[1:] == sorted(reduced[:5])
    res, rest = collected(per_function="3", deselect_file=str(listing))
    assert res.returncode == 0, res.stdout + res.stderr
    assert rest == reduced[5:]  # the failed one runs again


def test_sanitize_summary_check_flags_only_real_findings(tmp_path):
    """--check fails on a report in a fused_dense kernel, a failed test or an unexpected exit
    status, and passes reports in NVIDIA's kernels (exit 99), time-limit cuts (124) and empty shards."""
    logs = {
        "memcheck_native.log": "exit status 0\n========= ERROR SUMMARY: 0 errors\n",
        "racecheck_suite0.log": "exit status 99\ntests/t.py::a PASSED\n"
                                "========= Error: Race reported between Read access at nvjet_sm90_x_TNN+0xa50\n",
        "initcheck_suite1.log": "exit status 124\ntests/t.py::b PASSED\n",
        "synccheck_suite2.log": "exit status 255\ncollected 9 items / 9 deselected / 0 selected\n",
    }
    for name, text in logs.items():
        (tmp_path / name).write_text(text)

    def check(*names):
        res = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "tools", "sanitize_summary.py"),
                              *(str(tmp_path / n) for n in names), "--check"], capture_output=True, text=True,
                             timeout=120)
        return res.returncode, res.stdout
    rc, out = check(*logs)
    assert rc == 0 and "with a report in a fused_dense kernel, a failed test or another exit status: 0" in out, out
    bad = {"memcheck_suite3.log": "exit status 99\n========= Invalid __global__ read of size 4 bytes\n"
                                  "=========     at void fused_dense::core::bias_kernel<float>(int, float*)+0x1d0\n",
           "racecheck_suite4.log": "exit status 1\ntests/t.py::c FAILED\n",
           "initcheck_suite5.log": "exit status 134\ntests/t.py::d \n"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        rc, out = check(*logs, name)
        assert rc == 1 and f"{name} exit" in out, (name, out)


def test_fp64_reference_mode_moves_only_float64_matmuls():
    """The sanitize step's FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU mode, checked here with the CPU as
    both ends (no GPU in CI): which calls it takes, that results and gradients come through it
    unchanged, and that it leaves other dtypes and functions alone."""
    import torch
    import torch.nn.functional as F
    from fp64_reference_on_cpu import Float64MatmulsOn

    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, dtype=torch.float64)
    plain = F.linear(x, w, b) + (x @ w.t())
    grads = torch.autograd.grad((plain * g).sum(), (x, w, b))
    with Float64MatmulsOn("cpu", "cpu") as mode:
        routed = F.linear(x, w, b) + (x @ w.t())
        assert mode.moved == 2
        torch.relu(x)  # not a matmul
        F.linear(x.float(), w.float())  # not float64
        with pytest.raises(RuntimeError):  # mixed: left alone, so it fails as it would without the mode
            F.linear(x, w.float())
    assert mode.moved == 2
    torch.testing.assert_close(routed, plain, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad((routed * g).sum(), (x, w, b)), grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp64_reference_env_is_validated():
    env = dict(os.environ, FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU="yes")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(HERE, "test_functional.py"), "-k", "test_dense_cpu", "-x"],
                         cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU must be 0 or 1" in res.stdout + res.stderr
    env["FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU"] = "1"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(HERE, "test_functional.py"), "-k", "test_dense_cpu", "-x"],
                         cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout + res.stderr


def test_sanitize_summary_marks_empty_shards():
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import sanitize_summary

    empty = sanitize_summary.parse(
        "exit status 255\n========= COMPUTE-SANITIZER\n"
        "collecting ... collected 1851 items / 1851 deselected / 0 selected\n\n"
        "===== 1851 deselected in 1.47s =====\n"
        "========= Error: Target application terminated before first instrumented API call\n")
    crashed = sanitize_summary.parse(
        "exit status 255\ncollecting ... collected 12 items / 11 deselected / 1 selected\ntests/t.py::a \n")
    assert empty["empty"] and not crashed["empty"]


def test_fp64_reference_mode_for_worker_threads(monkeypatch):
    """A TorchFunctionMode is per thread: a test's own threads enter theirs through from_env()."""
    import threading

    import torch
    import torch.nn.functional as F
    import fp64_reference_on_cpu as mod

    monkeypatch.setenv(mod.ENV, "1")
    assert isinstance(mod.from_env(), mod.Float64MatmulsOn)
    monkeypatch.setenv(mod.ENV, "0")
    assert not isinstance(mod.from_env(), mod.Float64MatmulsOn)
    monkeypatch.setenv(mod.ENV, "on")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        mod.from_env()
    x = torch.randn(3, 4, dtype=torch.float64)
    with mod.Float64MatmulsOn("cpu", "cpu") as outer:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(F.linear(x, x)))
        thread.start()
        thread.join()
    assert outer.moved == 0 and len(seen) == 1  # the main thread's mode did not reach the thread


def run_tuner_probe(*argv):
    return subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "tools", "tuner_probe.py"), *argv],
                          cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)


def test_tuner_probe_refuses_bad_arguments():
    res = run_tuner_probe("--shape", "0", "8", "8")
    assert res.returncode == 2
    assert "--shape, --rounds and --batch must be positive, got [0, 8, 8]" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_tuner_probe_without_a_gpu_says_so():
    res = run_tuner_probe()
    assert res.returncode == 1
    assert "needs a CUDA build of fused_dense and a GPU" in res.stderr


@pytest.mark.cuda
def test_tuner_probe_prints_the_tuners_reading_and_the_calls():
    res = run_tuner_probe("--shape", "512", "256", "384", "--rounds", "2", "--batch", "2", "--budget-ms", "50")
    assert res.returncode == 0, res.stderr
    assert "fused_dense: tuned forward" in res.stderr  # the tuner's verbose line for the problem
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "heuristic" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["auto", "-1", "0", "1"]


def test_lce_chunk_sweep_records_each_chunk_size_and_the_rule(tmp_path):
    out = tmp_path / "sweep.json"
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "tools", "lce_chunk_sweep.py"),
                          "--device", "cpu", "--shapes", "64x1000x300", "--chunks", "32,128,512", "--rounds", "1",
                          "--out", str(out)], cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    import json

    import fused_dense  # noqa: F401 - registers the op
    (shape,) = json.loads(out.read_text())["shapes"]
    rule = torch.ops.fused_dense.linear_cross_entropy_chunk_rows(300, 64, 1000, 2, 0)
    assert (shape["d"], shape["vocab"], shape["tokens"], shape["rule_rows"]) == (64, 1000, 300, rule)
    # chunk sizes at or over the token count (one chunk) are left out but for the first
    assert list(shape["variants"]) == ["rule", "chunk_32", "chunk_128"]
    for v in shape["variants"].values():
        assert v["status"] == "ok" and v["ms"] > 0 and v["peak_bytes"] is None  # no peak on the CPU
        # bf16 logits against float64 (measured: loss 1.2e-5, gradients 2.6e-3 to 4e-3): within bf16's
        # rounding, 2^-8, the loss averaged over the tokens well under it
        assert v["loss"] < 1e-3 and v["x_grad"] < 1e-2 and v["weight_grad"] < 1e-2
    # one chunk rounds the weight gradient once, 32-row chunks ten times
    assert shape["variants"]["rule"]["weight_grad"] < shape["variants"]["chunk_32"]["weight_grad"]
