"""The benchmark scripts still run (CPU, tiny sizes: the figures mean nothing, the plumbing does).

The GPU runs that produce the committed figures happen on the GPU machine; these keep the scripts
from rotting between them: every section reports a status, the tensor-parallel benchmark's two
MLPs agree, and the outputs (JSON, markdown) are written.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(cmd, timeout):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_bench_run_cpu_quick(tmp_path):
    _run([sys.executable, "bench/run.py", "--device", "cpu", "--quick", "--out", str(tmp_path)], timeout=600)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["mlp"], "no MLP figures"
    for item in data["mlp"]:
        for name, v in item["variants"].items():
            assert v["status"] in ("ok", "skipped", "unavailable"), (item["id"], name, v)
    ok = [v for item in data["mlp"] for v in item["variants"].values() if v["status"] == "ok"]
    assert ok and all(v["ms"] > 0 for v in ok)
    for item in data["mlp"]:  # every variant of a shape timed in each of the 5 interleaved rounds
        for name, v in item["variants"].items():
            if v["status"] == "ok":
                assert v["rounds"] == 5 and len(v["round_ms"]) == 5 and v["reps"] >= 10, (item["id"], name, v)
    assert "interleaved rounds" in data["method"]["mlp_timer"]
    assert (tmp_path / "bench.md").read_text().startswith("# fused_dense benchmark")


def test_report_names_figures_taken_with_allocator_calls(tmp_path):
    """A figure whose timing included cudaMalloc / cudaFree (counted on CUDA runs) is named in the
    report, and a CUDA run without any says "none"; a CPU run, which cannot count them, says nothing."""
    _run([sys.executable, "bench/run.py", "--device", "cpu", "--quick", "--out", str(tmp_path)], timeout=600)
    report = _load("report")
    res = json.loads((tmp_path / "bench.json").read_text())
    assert "cudaMalloc" not in report.markdown(res)
    item = res["mlp"][0]
    timed = [k for k, v in item["variants"].items() if v["status"] == "ok"]
    for k in timed:
        item["variants"][k]["allocator_calls"] = 0
    assert "the allocator): none." in report.markdown(res)
    item["variants"][timed[-1]]["allocator_calls"] = 6
    line = [ln for ln in report.markdown(res).splitlines() if "cudaMalloc" in ln]
    assert len(line) == 1 and line[0].endswith("(6).") and f"{item['M']} × {item['d']}" in line[0], line


def test_parallel_mlp_bench_cpu_two_ranks(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          "bench/parallel_mlp.py", "--device", "cpu", "--dims", "64", "--tokens", "32", "--reps", "2",
          "--warmup", "1", "--out", str(tmp_path)], timeout=300)
    data = json.loads((tmp_path / "parallel_mlp.json").read_text())
    assert data["env"]["world_size"] == 2
    assert [(r["d"], r["sequence_parallel"]) for r in data["results"]] == [(64, True), (64, False)]
    for r in data["results"]:
        assert max(r["check_rel_err"].values()) <= 1e-4, r["check_rel_err"]
        for k in ("fused_ms", "plain_ms", "fused_local_ms", "plain_local_ms", "comm_ms"):
            assert r[k] > 0, (k, r)
    assert "| 64 | 32 | on |" in (tmp_path / "parallel_mlp.md").read_text()


def test_parallel_bench_interval_arithmetic():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import parallel_mlp as pm
    finally:
        sys.path.pop(0)
    a = pm.merge_intervals([(5, 7), (0, 2), (1, 3), (10, 12)])
    assert a == [(0, 3), (5, 7), (10, 12)]
    assert pm.total_length(a) == 7
    b = pm.merge_intervals([(2, 6), (11, 20)])
    assert pm.intersection_length(a, b) == 1 + 1 + 1  # [2,3] + [5,6] + [11,12]
    assert pm.intersection_length(a, []) == 0


def test_bench_remeasures_a_disturbed_median(monkeypatch):
    """A CUDA measurement whose p80 / p20 exceeds Bench.RETRY_SPREAD is taken again and the steadier
    one kept, the other recorded (the timing itself is replaced here: no GPU in CI)."""
    run = _load("run")
    bench = run.Bench(torch.device("cpu"))
    results = iter([{"ms": 10.7, "p20": 10.2, "p80": 11.5, "reps": 19},
                    {"ms": 10.0, "p20": 9.95, "p80": 10.05, "reps": 19}])
    monkeypatch.setattr(bench, "_cuda_once", lambda fn, g, est: dict(next(results)))
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: 1.0)
    bench.cuda = True
    res = bench(lambda: None)
    assert res["ms"] == 10.0 and res["remeasured"]["dropped"]["ms"] == 10.7
    steady = iter([{"ms": 10.0, "p20": 9.95, "p80": 10.05, "reps": 19}])
    monkeypatch.setattr(bench, "_cuda_once", lambda fn, g, est: dict(next(steady)))
    res = bench(lambda: None)  # a second call of _cuda_once would raise StopIteration
    assert res["ms"] == 10.0 and "remeasured" not in res


def test_bench_interleaves_the_variants(monkeypatch):
    """Bench.interleaved visits every variant once per round, in an order rotated by one place per
    round, pools each variant's repetitions over the rounds, and a variant that raises is recorded
    with its exception and leaves the later rounds while the others go on (timing replaced: no GPU)."""
    run = _load("run")
    bench = run.Bench(torch.device("cpu"), warmup_ms=10.0, rep_ms=40.0)
    visits = []
    fake_ms = {"a": 1.0, "b": 2.0, "c": 4.0}

    def timed(fn, grad_to_none, warm, n):
        key = fn()
        visits.append((key, warm, n))
        return [fake_ms[key] + 0.01 * i for i in range(n)]
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: fake_ms[fn()])
    fns = {k: ((lambda k=k: k), None) for k in "abc"}
    res = bench.interleaved(fns, rounds=4)
    assert [k for k, _, _ in visits] == list("abc" "bca" "cab" "abc")
    # each round's share of max(rep_ms, min_reps * est) = 40 ms: ceil(10 / est) reps, after the
    # whole 10 ms warm-up
    assert {k: n for k, _, n in visits} == {"a": 10, "b": 5, "c": 3}
    assert {k: w for k, w, _ in visits} == {"a": 10, "b": 5, "c": 2}
    for k in "abc":
        assert res[k]["rounds"] == 4 and len(res[k]["round_ms"]) == 4
        assert res[k]["reps"] == 4 * {"a": 10, "b": 5, "c": 3}[k]
        assert fake_ms[k] <= res[k]["ms"] <= fake_ms[k] + 0.1
    visits.clear()
    calls = {"b": 0}

    def flaky_b():
        calls["b"] += 1
        if calls["b"] > 1:  # the estimate passes, the second round's block raises
            raise RuntimeError("b broke")
        return "b"
    fns["b"] = (flaky_b, None)
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: 1.0)
    res = bench.interleaved(fns, rounds=3)
    assert isinstance(res["b"]["error"], RuntimeError) and str(res["b"]["error"]) == "b broke"
    # round 0: a b c; round 1: b raises, then c a; round 2 rotates what is left: a c
    assert [k for k, _, _ in visits] == list("abc" "ca" "ac")
    assert len(res["a"]["round_ms"]) == 3 and len(res["c"]["round_ms"]) == 3


def test_bench_recovers_from_a_crash_in_a_variant(tmp_path):
    """A worker that dies while preparing one MLP variant (FD_BENCH_TEST_CRASH segfaults on purpose)
    is restarted: that variant is recorded 'crashed', and the shape's other variants are prepared and
    timed in the new worker's interleaved rounds, except those of the same fused path."""
    env = dict(os.environ, FD_BENCH_TEST_CRASH="mlp:bf16:gelu_approx:256x64:auto_l1")
    res = subprocess.run([sys.executable, "bench/run.py", "--device", "cpu", "--quick", "--sections", "mlp",
                          "--no-compile", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data.get("restarts") == 1, data.get("restarts")
    item = next(i for i in data["mlp"] if i["id"] == "mlp:bf16:gelu_approx:256x64")
    assert item["variants"]["auto_l1"]["status"] == "crashed", item["variants"]["auto_l1"]
    for key in ("floor", "eager", "h-1_l0", "h0_l0"):
        v = item["variants"][key]
        assert v["status"] == "ok" and v["rounds"] == 5 and len(v["round_ms"]) == 5, (key, v)
    # the path that crashed ('auto') is skipped for the rest of the run, also at the levels that
    # were prepared but not yet timed when the worker died
    for key in ("auto_l0", "auto_l2"):
        v = item["variants"][key]
        assert v["status"] == "skipped" and "'FusedMLP heuristic=auto' crashed" in v["error"], (key, v)


def test_report_shows_each_ratio_per_round():
    """A target's figure carries the least and greatest per-round ratio of the two variants it
    compares (blocks of one round are timed close together), and nothing for runs without rounds."""
    report = _load("report")
    auto = {"status": "ok", "ms": 10.0, "round_ms": [10.0, 9.0, 11.0]}
    eager = {"status": "ok", "ms": 10.5, "round_ms": [10.5, 9.9, 10.45]}
    assert report.round_range(eager, auto) == " (rounds 0.950–1.100)"
    assert report.round_range(eager, {"status": "ok", "ms": 10.0}) == ""
    assert report.round_range(eager, {"round_ms": [10.0, 9.0]}) == ""  # rounds that do not pair up
    res = {"mlp": [{"dtype": "bf16", "activation": "gelu_approx", "M": 8192, "d": 4096, "h": 16384,
                    "variants": {"eager": dict(eager, speedup_vs_eager=1.0),
                                 "auto_l0": dict(auto, speedup_vs_eager=1.05)}}]}
    row = [r for r in report.targets(res) if "not slower than eager" in r[0]]
    assert row == [("bf16 gelu 8192×4096: auto not slower than eager (eager / auto ≥ 1)",
                    "1.050 (rounds 0.950–1.100)", True)], row


def test_bench_names_the_source_tree_that_ran(tmp_path):
    """The recorded tree id is git's id of the files as they are, not of HEAD: it equals HEAD's tree
    on a clean checkout and changes with an uncommitted edit (the GPU machine's copy can carry an
    old .git under newer files)."""
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD^{tree}"], capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout: there is no tree id to record (the report then leaves it out)")
    bench = _load("run")
    tree = bench.source_tree_id()
    assert tree is not None and len(tree) == 40 and all(c in "0123456789abcdef" for c in tree), tree
    clean = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"], capture_output=True, text=True).stdout
    if not clean.strip():
        assert tree == git.stdout.strip(), "a clean checkout's tree id differs from HEAD's"
    # an untracked, not ignored file is part of the files that run
    extra = os.path.join(ROOT, "bench", f"_tree_id_probe_{os.getpid()}.txt")
    try:
        with open(extra, "w") as f:
            f.write("changes the tree\n")
        assert bench.source_tree_id() != tree
    finally:
        os.remove(extra)
    report = _load("report")
    header = report.markdown({"env": {"git_commit": "c07a00b268b5", "git_dirty": True, "git_tree": tree}})
    assert f"source tree {tree[:12]}" in header.splitlines()[2], header[:400]
