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
import time

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


# the sustained section's warm-up on the CPU: its length matters on the GPU only (the power cap)
CPU_SUSTAINED_WARMUP = ["--sustained-warmup-ms", "20"]


def test_bench_run_cpu_quick(tmp_path):
    _run([sys.executable, "bench/run.py", "--device", "cpu", "--quick", "--out", str(tmp_path)]
         + CPU_SUSTAINED_WARMUP, timeout=600)
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
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("# fused_dense benchmark")
    # the sustained section: the bf16 gelu shape again, its four variants timed after their own warm-up
    assert [r["id"] for r in data["sustained"]] == ["sustained:bf16:gelu_approx:256x64"]
    assert data["plan"].index("sustained:bf16:gelu_approx:256x64") == data["plan"].index("ceiling_end") - 1
    sus = data["sustained"][0]["variants"]
    assert sorted(sus) == sorted(["floor", "eager", "compile", "auto_l0"]), sorted(sus)
    for name, v in sus.items():
        assert v["status"] == "ok" and v["ms"] > 0, (name, v)
        assert v["rounds"] == 5 and len(v["round_ms"]) == 5, (name, v)
        assert "clocks" not in v and "rel_err" not in v and "memory" not in v, (name, v)  # CPU: no nvidia-smi
    assert sus["floor"]["x_floor"] == 1.0 and sus["eager"]["speedup_vs_eager"] == 1.0
    for k in ("x_floor", "speedup_vs_eager", "speedup_vs_compile"):
        assert sus["auto_l0"][k] > 0, (k, sus["auto_l0"])
    assert data["method"]["sustained_warmup_ms"] == 20.0 and "20 ms" in data["method"]["sustained"]
    assert "## Sustained load (each block after 20 ms of its own steps)" in md
    row = [ln for ln in md.split("## Sustained load")[1].splitlines() if ln.startswith("| 256 × 64 |")]
    assert len(row) == 1 and row[0].count("|") == 10, row
    assert "sustained " in next(ln for ln in md.splitlines() if "auto / six GEMMs" in ln)


def test_report_names_figures_taken_with_allocator_calls(tmp_path):
    """A figure whose timing included cudaMalloc / cudaFree (counted on CUDA runs) is named in the
    report, and a CUDA run without any says "none"; a CPU run, which cannot count them, says nothing."""
    _run([sys.executable, "bench/run.py", "--device", "cpu", "--quick", "--out", str(tmp_path)]
         + CPU_SUSTAINED_WARMUP, timeout=600)
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


def _smi_line(t, sm, watts, reasons="0x0000000000000004"):
    """One line as nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,<reasons> --format=csv,noheader,nounits
    writes it: the timestamp in local time, milliseconds."""
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + f".{int(round(t % 1 * 1000)) % 1000:03d}"
    return f"{stamp}, {sm}, {watts}, {reasons}"


def test_clock_samples_parse_and_fall_into_timed_blocks():
    """nvidia-smi's lines parse to epoch seconds on time.time()'s clock; each variant gets the medians
    of the samples inside its timed blocks only, a sample outside every block is ignored, a variant
    without samples gets nothing, and lines that do not parse are left out."""
    run = _load("run")
    t0 = float(int(time.time())) + 0.25  # whole milliseconds, so the round trip is exact
    lines = [_smi_line(t0 + 0.0, 1980, 350.5, "0x0000000000000000"),  # warm-up of floor's block: ignored
             _smi_line(t0 + 1.0, 1410, 699.0), _smi_line(t0 + 1.1, 1395, 700.2),  # floor, round 0
             _smi_line(t0 + 2.5, 1500, 650.0),                                     # between blocks: ignored
             _smi_line(t0 + 3.0, 1455, 698.0), _smi_line(t0 + 3.1, "[N/A]", "[N/A]"),  # auto_l0
             _smi_line(t0 + 5.05, 1380, 701.0),                                    # floor, round 1
             "", "garbage, 1, 2", "2026/13/45 99:00:00.000, 1400, 700, 0x0"]
    samples = run.parse_smi_samples(lines)
    assert len(samples) == 7
    assert samples[0]["t"] == pytest.approx(t0, abs=1e-6) and samples[0]["sm_mhz"] == 1980.0
    assert samples[0]["power_w"] == 350.5 and samples[0]["reasons"] == "0x0000000000000000"
    assert samples[5]["sm_mhz"] is None and samples[5]["power_w"] is None
    windows = {"floor": [(t0 + 0.95, t0 + 1.15), (t0 + 5.0, t0 + 5.1)], "auto_l0": [(t0 + 2.95, t0 + 3.15)],
               "eager": [(t0 + 4.0, t0 + 4.04)]}
    clocks = run.clocks_in_windows(samples, windows)
    assert set(clocks) == {"floor", "auto_l0"}
    assert clocks["floor"] == {"samples": 3, "sm_mhz": 1395.0, "power_w": 700.2,
                               "clock_limit_reasons": ["0x0000000000000004"]}
    assert clocks["auto_l0"] == {"samples": 2, "sm_mhz": 1455.0, "power_w": 698.0,
                                 "clock_limit_reasons": ["0x0000000000000004"]}
    assert run.clocks_in_windows([], windows) == {}


def test_clock_sampler_without_nvidia_smi(tmp_path, monkeypatch):
    """No nvidia-smi on PATH (CPU machines, CI): the sampler starts nothing, says why, returns no
    samples, and so no variant gets clock fields; no error."""
    run = _load("run")
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = run.ClockSampler().start()
    assert not sampler.running and sampler.fields is None and "no nvidia-smi" in sampler.note
    assert sampler.stop() == [] and sampler.stop() == []
    rec, variants = {"id": "sustained:bf16:gelu_approx:256x64"}, {"floor": {"status": "ok"}, "auto_l0": {"status": "ok"}}
    run.record_clocks(rec, variants, sampler, {"floor": [(0.0, time.time())], "auto_l0": [(0.0, time.time())]})
    assert rec == {"id": "sustained:bf16:gelu_approx:256x64"}
    assert variants == {"floor": {"status": "ok"}, "auto_l0": {"status": "ok"}}


def test_clock_sampler_runs_and_stops_its_process(tmp_path):
    """The sampler's background process (a stand-in nvidia-smi here, the same output format) is
    started, writes samples while blocks run, and is ended by stop(); the samples of a block come back
    attributed to it. The stand-in refuses the older reasons field name, as newer drivers may."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"""#!{sys.executable}
import sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))
if "clocks_throttle_reasons" in query:
    print("Field clocks_throttle_reasons.active is not a valid field to query.")
    sys.exit(2)
def line():
    t = time.time()
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + ".%03d, 1410, 699.50, 0x0000000000000004" % (t % 1 * 1000)
if "-lms" not in sys.argv:
    print(line())
    sys.exit(0)
interval = int(sys.argv[sys.argv.index("-lms") + 1]) / 1000
while True:
    print(line(), flush=True)
    time.sleep(interval)
""")
    fake.chmod(0o755)
    run = _load("run")
    sampler = run.ClockSampler(exe=str(fake), interval_ms=20, max_s=60).start()
    try:
        assert sampler.running, sampler.note
        assert sampler.fields[-1] == "clocks_event_reasons.active", sampler.fields
        deadline = time.time() + 10
        while os.fstat(sampler._out.fileno()).st_size == 0 and time.time() < deadline:
            time.sleep(0.05)  # the stand-in's start: a Python interpreter
        t0 = time.time()
        time.sleep(0.3)
        t1 = time.time()
        proc = sampler._proc
    finally:
        samples = sampler.stop()
    assert proc.poll() is not None, "the sampling process is still running after stop()"
    rec, variants = {}, {"floor": {"status": "ok"}, "auto_l0": {"status": "ok"}}
    run.record_clocks(rec, variants, sampler, {"auto_l0": [(t0, t1)], "floor": [(t1 + 60, t1 + 61)]})
    assert rec["clock_sampling"]["samples"] == len(samples) and rec["clock_sampling"]["interval_ms"] == 20
    clocks = variants["auto_l0"]["clocks"]
    assert clocks["samples"] >= 3, (len(samples), clocks)
    assert clocks["sm_mhz"] == 1410.0 and clocks["power_w"] == 699.5
    assert clocks["clock_limit_reasons"] == ["0x0000000000000004"]
    assert "clocks" not in variants["floor"]  # its block had no sample


def test_report_puts_sustained_figures_beside_the_standard_ones():
    """The sustained section's table (clock columns where nvidia-smi was sampled) and its ratios in
    the targets, labelled 'sustained', next to the standard figures, whose verdict they do not change."""
    report = _load("report")

    def variants(floor, eager, compile_, auto, clocks=None):
        vs = {k: {"status": "ok", "ms": ms, "tflops": 12 * 8192 * 2048 * 8192 / ms / 1e9, "round_ms": [ms] * 5}
              for k, ms in (("floor", floor), ("eager", eager), ("compile", compile_), ("auto_l0", auto))}
        vs["auto_l0"].update(x_floor=auto / floor, speedup_vs_eager=eager / auto, speedup_vs_compile=compile_ / auto)
        vs["eager"]["x_floor"] = eager / floor
        for k, c in (clocks or {}).items():
            vs[k]["clocks"] = c
        return vs
    shape = {"dtype": "bf16", "activation": "gelu_approx", "M": 8192, "d": 2048, "h": 8192}
    clocks = {k: {"samples": 3, "sm_mhz": mhz, "power_w": 699.0}
              for k, mhz in (("floor", 1410.0), ("eager", 1440.0), ("compile", 1425.0), ("auto_l0", 1455.0))}
    res = {"method": {"sustained_warmup_ms": 1000.0},
           "mlp": [dict(shape, variants=variants(2.455, 2.697, 2.688, 2.585))],
           "sustained": [dict(shape, id="sustained:bf16:gelu_approx:8192x2048",
                              clock_sampling={"tool": "nvidia-smi", "interval_ms": 100, "samples": 250},
                              variants=variants(2.900, 3.100, 3.080, 2.923, clocks))]}
    rows = {t: (fig, met) for t, fig, met in report.targets(res)}
    fig, met = rows["bf16 gelu 8192×2048: auto / six GEMMs ≤ 1.03"]
    assert fig.startswith("1.053 (rounds 1.053–1.053) (eager 1.099); sustained 1.008 (rounds 1.008–1.008)"), fig
    assert met is False  # the verdict stays on the standard figure
    fig, _ = rows["bf16 gelu 8192×2048: eager / auto ≥ 1.08"]
    assert fig.startswith("1.043") and "; sustained 1.061" in fig, fig
    md = report.markdown(res)
    table = md.split("## Sustained load (each block after 1000 ms of its own steps)")[1]
    row = next(ln for ln in table.splitlines() if ln.startswith("| 8192 × 2048 |"))
    assert row == ("| 8192 × 2048 | 2.900 | 3.100 | 3.080 | 2.923 | 1.061 | 1.054 | 1.008 | 1.053 | "
                   "1410 / 1440 / 1425 / 1455 | 699 / 699 / 699 / 699 |"), row
    assert "samples per variant: 8192 × 2048 3 / 3 / 3 / 3." in table
    assert md.index("## Sustained load") < md.index("## MLP detail")
    assert "sustained (each block after 1000 ms of its own steps):" in report.summary(res)
