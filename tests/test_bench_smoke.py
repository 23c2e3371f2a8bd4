"""The benchmarks still run and report (CPU, tiny sizes: the figures mean nothing, the plumbing does):
every section reports a status, the interleaved rounds and the sustained section are recorded, a
crashing variant is survived, clock sampling degrades to "not sampled" without NVML, the gated and
fp8 sections write runs of record of their own, and the committed runs of record are what the
report code writes from their JSON."""
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import environment, power, report, timing  # noqa: E402

CPU_QUICK = ["bench/run.py", "--device", "cpu", "--quick", "--sustained-warmup-ms", "20"]


def _run(cmd, timeout, env=None):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def _only(pattern):
    found = glob.glob(pattern)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One CPU quick run into a directory that already holds an older run of record and a file of
    another kind: (its JSON, its markdown, its console output, the directory)."""
    out = tmp_path_factory.mktemp("bench")
    for name in ("mlp-2000-01-01.json", "mlp-2000-01-01.md", "notes.txt"):
        (out / name).write_text("{}")
    res = _run([sys.executable, *CPU_QUICK, "--out", str(out)], timeout=900)
    path = _only(str(out / "mlp-*.json"))
    return json.loads(open(path).read()), open(path[:-5] + ".md").read(), res.stdout, out


def test_bench_run_cpu_quick(quick_run):
    data, md, stdout, out = quick_run
    day = data["env"]["date_utc"][:10]
    kinds = ("json", "md", "png") if importlib.util.find_spec("matplotlib") else ("json", "md")
    # the older run of record is gone, the other file stays
    assert sorted(os.listdir(out)) == sorted([f"mlp-{day}.{e}" for e in kinds] + ["notes.txt"]), os.listdir(out)
    assert data["complete"] and data["mlp"] and not data.get("errors")
    for item in data["mlp"]:
        for name, v in item["variants"].items():
            assert v["status"] in ("ok", "skipped"), (item["id"], name, v)
            if v["status"] == "ok":  # timed in each of the 5 interleaved rounds
                assert v["ms"] > 0 and v["rounds"] == 5 and len(v["round_ms"]) == 5 and v["reps"] >= 10, (name, v)
    assert data["method"]["rounds"] == 5 and data["method"]["budget_s"] == 420.0
    env = data["env"]
    for key in ("torch", "torch_cuda", "cublasLt_version_str", "git_tree", "python", "date_utc"):
        assert key in env, key
    assert md.startswith("# fused_dense benchmark") and "## Targets, from this run" in md
    assert f"[1/{len(data['plan'])}] ceiling" in stdout  # progress, item by item
    # the sustained section: the bf16 gelu shape again, its four variants after their own warm-up
    assert [r["id"] for r in data["sustained"]] == ["sustained:bf16:gelu_approx:256x64"]
    assert data["plan"].index("sustained:bf16:gelu_approx:256x64") == data["plan"].index("ceiling_end") - 1
    sus = data["sustained"][0]["variants"]
    assert sorted(sus) == sorted(["floor", "eager", "compile", "auto_l0"]), sorted(sus)
    for name, v in sus.items():
        assert v["status"] == "ok" and v["ms"] > 0 and len(v["round_ms"]) == 5, (name, v)
        assert "clocks" not in v and "rel_err" not in v and "memory" not in v, (name, v)
    assert sus["floor"]["x_floor"] == 1.0 and sus["eager"]["speedup_vs_eager"] == 1.0
    assert all(sus["auto_l0"][k] > 0 for k in ("x_floor", "speedup_vs_eager", "speedup_vs_compile"))
    assert data["method"]["sustained_warmup_ms"] == 20.0 and "20 ms" in data["method"]["sustained"]
    row = [ln for ln in md.split("## Sustained load (each block after 20 ms of its own steps)")[1].splitlines()
           if ln.startswith("| 256 × 64 |")]
    assert len(row) == 1 and row[0].count("|") == 10, row
    assert "sustained " in next(ln for ln in md.splitlines() if "auto / six GEMMs" in ln)
    assert report.markdown(data) == md


def test_report_names_figures_taken_with_allocator_calls(quick_run):
    """A figure whose timing included cudaMalloc / cudaFree (counted on CUDA runs) is named, a CUDA
    run without any says "none"; a CPU run, which cannot count them, says nothing."""
    res = json.loads(json.dumps(quick_run[0]))
    assert "cudaMalloc" not in report.markdown(res)
    item = res["mlp"][0]
    timed = [k for k, v in item["variants"].items() if v["status"] == "ok"]
    for k in timed:
        item["variants"][k]["allocator_calls"] = 0
    assert "the allocator): none." in report.markdown(res)
    item["variants"][timed[-1]]["allocator_calls"] = 6
    line = [ln for ln in report.markdown(res).splitlines() if "cudaMalloc" in ln]
    assert len(line) == 1 and line[0].endswith("(6).") and f"{item['M']} × {item['d']}" in line[0], line


def test_bench_recovers_from_a_crash_in_a_variant(tmp_path):
    """A worker that dies preparing one variant (FD_BENCH_TEST_CRASH segfaults on purpose) is
    restarted: that variant is 'crashed', the shape's others are timed in the new worker's rounds,
    except those of the same fused path."""
    env = dict(os.environ, FD_BENCH_TEST_CRASH="mlp:bf16:gelu_approx:256x64:auto_l1")
    _run([sys.executable, *CPU_QUICK, "--sections", "mlp", "--no-compile", "--out", str(tmp_path)], 900, env)
    data = json.loads(open(_only(str(tmp_path / "mlp-*.json"))).read())
    assert data.get("restarts") == 1, data.get("restarts")
    item = next(i for i in data["mlp"] if i["id"] == "mlp:bf16:gelu_approx:256x64")
    assert item["variants"]["auto_l1"]["status"] == "crashed", item["variants"]["auto_l1"]
    for key in ("floor", "eager", "h-1_l0", "h0_l0"):
        v = item["variants"][key]
        assert v["status"] == "ok" and v["rounds"] == 5 and len(v["round_ms"]) == 5, (key, v)
    for key in ("auto_l0", "auto_l2"):  # the crashed path, also at levels prepared before the crash
        v = item["variants"][key]
        assert v["status"] == "skipped" and "'FusedMLP heuristic=auto' crashed" in v["error"], (key, v)


def test_bench_gated_section_cpu(tmp_path):
    """--sections gated: the gated MLP's variants and the Llama-style stack, in a run of record of
    its own (gated-<date>.*) that leaves the MLP one beside it alone; Liger recorded unavailable with
    its reason where liger_kernel does not import."""
    (tmp_path / "mlp-2000-01-01.json").write_text("{}")
    res = _run([sys.executable, *CPU_QUICK, "--sections", "gated", "--no-compile", "--rounds", "2",
                "--out", str(tmp_path)], timeout=900)
    data = json.loads(open(_only(str(tmp_path / "gated-*.json"))).read())
    assert (tmp_path / "mlp-2000-01-01.json").exists()
    assert data["complete"] and not data.get("errors"), data.get("errors")
    assert data["plan"] == ["gated:bf16:swiglu:64x32x40", "gated_stack:bf16:swiglu"]
    assert "[1/2] gated:bf16:swiglu:64x32x40" in res.stdout  # progress
    (rec,) = data["gated"]
    vs = rec["variants"]
    assert sorted(vs) == sorted(["floor", "eager", "compile", "liger", "fused_l0", "fused_l1", "fused_l2"])
    assert vs["compile"]["status"] == "skipped"
    if importlib.util.find_spec("liger_kernel") is None:
        assert vs["liger"]["status"] == "unavailable" and "liger_kernel" in vs["liger"]["error"]
    for key in ("floor", "eager", "fused_l0", "fused_l1", "fused_l2"):
        assert vs[key]["status"] == "ok" and vs[key]["ms"] > 0 and len(vs[key]["round_ms"]) == 2, (key, vs[key])
    assert sorted(vs["floor"]["parts_ms"]) == ["dgrad1", "dgrad2", "fwd1", "fwd2", "wgrad1", "wgrad2"]
    saved = {k: vs[k]["memory"]["saved_bytes"] for k in ("fused_l0", "fused_l1", "fused_l2")}
    assert saved["fused_l2"] == 64 * 32 * 2 < saved["fused_l1"] < saved["fused_l0"], saved  # level 2 keeps x only
    for key in ("eager", "fused_l0"):
        assert vs[key]["rel_err"]["out"] <= 2e-2 and vs[key]["rel_err"]["dx"] <= 2e-2, vs[key]["rel_err"]
    (stack,) = data["gated_stack"]
    assert {k: v["status"] for k, v in stack["variants"].items()} == {
        "eager": "ok", "compile": "skipped", "fused_eager": "ok", "fused_compile": "skipped"}
    md = open(_only(str(tmp_path / "gated-*.md"))).read()
    assert "## Gated MLP forward + backward" in md and "## Llama-style stack" in md
    assert "ckpt 2 ≤ 1.30× ckpt 0, keeps at most x" in md


def test_bench_fp8_section_cpu(tmp_path):
    """--sections fp8: the FP8 MLP shape, the Linear block, the gated MLP and the Llama-style stack
    in a run of record of its own (fp8-<date>.*) that replaces an older one and leaves the MLP one
    alone; on the CPU the torch._scaled_mm, torchao and torch.compile variants are recorded
    unavailable with the reason, and the fused FP8 ones too where fused_dense has no Float8Recipe
    (or FusedGatedMLP / replace_llama_mlps take no fp8 argument)."""
    from bench import fp8
    for name in ("mlp-2000-01-01.json", "fp8-2000-01-01.json"):
        (tmp_path / name).write_text("{}")
    res = _run([sys.executable, *CPU_QUICK, "--sections", "fp8", "--rounds", "2", "--out", str(tmp_path)],
               timeout=900)
    path = _only(str(tmp_path / "fp8-*.json"))
    data = json.loads(open(path).read())
    assert (tmp_path / "mlp-2000-01-01.json").exists() and not (tmp_path / "fp8-2000-01-01.json").exists()
    assert data["complete"] and not data.get("errors"), data.get("errors")
    assert data["plan"] == ["fp8:bf16:gelu_approx:64x32", "fp8_dense:bf16:64x32x32",
                            "fp8_gated:bf16:swiglu:64x32x48", "fp8_stack:bf16:swiglu"]
    assert "[2/4] fp8_dense:bf16:64x32x32" in res.stdout  # progress
    (mlp,), (dense,) = data["fp8"], data["fp8_dense"]
    assert list(mlp["variants"]) == fp8.MLP_VARIANTS and list(dense["variants"]) == fp8.DENSE_VARIANTS
    six, three = ["fwd1", "fwd2", "dgrad2", "wgrad2", "dgrad1", "wgrad1"], ["fwd", "dgrad", "wgrad"]
    for rec, names in ((mlp, six), (dense, three)):
        vs = rec["variants"]
        for key in ("bf16_floor", "eager", "fused_bf16"):
            assert vs[key]["status"] == "ok" and vs[key]["ms"] > 0 and len(vs[key]["round_ms"]) == 2, (key, vs[key])
            assert vs[key]["x_bf16_floor"] == vs[key]["ms"] / vs["bf16_floor"]["ms"] and "x_fp8_floor" not in vs[key]
        assert list(vs["bf16_floor"]["parts_ms"]) == names
        assert vs["fused_bf16"]["speedup_vs_eager"] == vs["eager"]["ms"] / vs["fused_bf16"]["ms"]
        for key in ("eager", "fused_bf16"):
            assert max(vs[key]["rel_err"].values()) <= 2e-2 and "dw1" in vs[key]["rel_err"], vs[key]["rel_err"]
        for key in [k for k in vs if k == "fp8_floor" or k.startswith("torchao") or k == "compile_bf16"]:
            assert vs[key]["status"] == "unavailable" and vs[key]["error"].startswith("CPU run: "), (key, vs[key])
        for key in [k for k in vs if k.startswith("fused_fp8")]:
            if fp8.Float8Recipe is None:
                assert vs[key] == {"status": "unavailable",
                                   "error": "fused_dense has no Float8Recipe (no FP8 API in this build)"}, vs[key]
            else:
                assert vs[key]["status"] in ("ok", "unavailable"), (key, vs[key])
    (gated,), (stack,) = data["fp8_gated"], data["fp8_stack"]
    vs = gated["variants"]
    assert list(vs) == fp8.GATED_VARIANTS and gated["flops"] == 18 * 64 * 32 * 48
    for key in ("bf16_floor", "eager", "fused_bf16"):
        assert vs[key]["status"] == "ok" and len(vs[key]["round_ms"]) == 2, (key, vs[key])
    assert list(vs["bf16_floor"]["parts_ms"]) == six
    for key in ("eager", "fused_bf16"):
        assert sorted(vs[key]["rel_err"]) == ["dx", "out"] and max(vs[key]["rel_err"].values()) <= 2e-2, vs[key]
    for key in ("fp8_floor", "torchao_tensorwise", "compile_bf16"):
        assert vs[key]["status"] == "unavailable" and vs[key]["error"].startswith("CPU run: "), (key, vs[key])
    for key in [k for k in vs if k.startswith("fused_fp8")]:  # ok once FusedGatedMLP takes fp8=
        assert vs[key]["status"] in ("ok", "unavailable"), (key, vs[key])
        if vs[key]["status"] == "unavailable" and fp8.Float8Recipe is not None:
            assert "fp8" in vs[key]["error"], vs[key]
    vs = stack["variants"]
    assert list(vs) == fp8.STACK_VARIANTS
    assert vs["eager"]["status"] == "ok" and sorted(vs["eager"]["rel_err"]) == ["dx", "out"], vs["eager"]
    for key in ("compile_bf16", "torchao_tensorwise", "fused_fp8_compile"):
        assert vs[key]["status"] == "unavailable" and vs[key]["error"].startswith("CPU run: "), (key, vs[key])
    assert vs["fused_fp8_eager"]["status"] in ("ok", "unavailable"), vs["fused_fp8_eager"]
    md = open(path[:-5] + ".md").read()
    assert report.markdown(data) == md
    assert "## FP8 MLP forward + backward" in md and "## FP8 Linear forward + backward" in md
    assert "## FP8 gated MLP forward + backward" in md and "## FP8 Llama-style stack forward + backward" in md
    assert "| 64 × 32 → 48 | 2 | unavailable | " in md
    assert "| 64 × 32 | 2 | unavailable | " in md and "| 64 × 32 → 32 | 2 | unavailable | " in md
    if importlib.util.find_spec("matplotlib"):
        assert os.path.exists(path[:-5] + ".png")


def test_report_fp8_targets_against_torchao(tmp_path):
    """The fp8 targets: torchao tensorwise's time / the fused FP8 variant's, with its per-round
    range, at the target shapes only; an unmeasured fused variant fails its target."""
    def ok(ms):
        return {"status": "ok", "ms": ms, "tflops": 100.0, "round_ms": [ms] * 3, "rounds": 3}
    shape = {"dtype": "bf16", "activation": "gelu_approx"}
    res = {"fp8": [dict(shape, id="fp8:bf16:gelu_approx:8192x4096", M=8192, d=4096, h=16384, variants={
               "fp8_floor": ok(5.0), "fused_fp8_current": ok(5.0), "torchao_tensorwise": ok(6.0),
               "fused_fp8_delayed": {"status": "unavailable", "error": "no FP8 API"}}),
                   dict(shape, id="fp8:bf16:gelu_approx:8192x1024", M=8192, d=1024, h=4096, variants={
                       "fused_fp8_current": ok(1.0), "torchao_tensorwise": ok(1.0)})],
           "fp8_dense": [{"id": "fp8_dense:bf16:16384x8192x8192", "dtype": "bf16", "M": 16384, "K": 8192, "N": 8192,
                          "d": 8192, "variants": {"fused_fp8_current": ok(9.8), "torchao_tensorwise": ok(10.0)}}]}
    rows = {t: (fig, met) for t, fig, met in report.fp8_targets(res)}
    assert rows == {
        "FP8 MLP 8192 × 4096: FusedMLP FP8 current ≥ 1.15× torchao tensorwise (torchao / fused)":
            ("1.200 (rounds 1.200–1.200): 6.000 vs 5.000 ms", True),
        "FP8 MLP 8192 × 4096: FusedMLP FP8 delayed ≥ 1.20× torchao tensorwise (torchao / fused)":
            ("unavailable", False),
        "FP8 Linear 16384 × 8192 → 8192: FusedDense FP8 current ≥ 1.05× torchao Float8Linear tensorwise (torchao / "
        "fused)": ("1.020 (rounds 1.020–1.020): 10.000 vs 9.800 ms", False)}, rows
    md = report.markdown(res)
    assert "| 8192 × 4096 | 3 | 5.000 (–×) |" in md
    assert "| MLP 8192 × 4096 | fused FP8 delayed | unavailable: no FP8 API |" in md
    assert "[NO] FP8 Linear 16384 × 8192 → 8192" in report.summary(res)
    if importlib.util.find_spec("matplotlib"):
        assert os.path.exists(report.make_png(res, str(tmp_path / "fp8.png")))


def test_bench_fp8_items_pick_the_plan():
    """--fp8-items keeps some of the fp8 section's kinds, in the plan's order; the gated MLP's target
    shape, the stack and the other gated shape come after the existing items."""
    from bench import run
    plan = run.build_plan(run.parse_args(["--out", "x", "--sections", "fp8"])[1])
    assert [p[0] for p in plan] == [
        "fp8:bf16:gelu_approx:8192x4096", "fp8:bf16:gelu_approx:16384x8192", "fp8_dense:bf16:16384x8192x8192",
        "fp8:bf16:gelu_approx:8192x1024", "fp8:bf16:gelu_approx:8192x2048", "fp8_gated:bf16:swiglu:16384x4096x14336",
        "fp8_stack:bf16:swiglu", "fp8_gated:bf16:swiglu:8192x4096x11008"]
    args = run.parse_args(["--out", "x", "--sections", "fp8", "--fp8-items", "stack,gated"])[1]
    assert run.build_plan(args) == plan[-3:] and [p[1] for p in plan[-3:]] == ["fp8_gated", "fp8_stack", "fp8_gated"]
    with pytest.raises(SystemExit):
        run.parse_args(["--out", "x", "--sections", "fp8", "--fp8-items", "gated,nope"])


FP8_VS_FP32 = 0.15


def test_bench_fp8_gated_and_stack_run_the_fp8_api(tmp_path, monkeypatch):
    """The gated and stack items run FusedGatedMLP(fp8=...): the FP8 variants are built, called as
    their keys say (is_first_microbatch True every step; the cached ones False) and timed; the
    stack's MLPs are swapped through replace_llama_mlps(fp8=recipe), its attention projections are
    FusedDense FP8. (A subclass records the calls; a replace_llama_mlps stand-in builds it.)"""
    from bench import fp8, run
    fd = pytest.importorskip("fused_dense")
    if fp8.Float8Recipe is None:
        pytest.skip("fused_dense has no Float8Recipe")
    seen, recipes = [], []

    class Gated(fd.FusedGatedMLP):
        def forward(self, x, is_first_microbatch=None):
            seen.append(is_first_microbatch)
            return super().forward(x, is_first_microbatch)

    def replace(model, checkpoint_lvl=0, heuristic="auto", fp8=None):
        recipes.append(fp8)
        blocks = [m for m in model.modules() if hasattr(m, "mlp")]
        for b in blocks:
            w = b.mlp.gate_proj.weight
            g = Gated(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
            g.load_state_dict(b.mlp.state_dict())
            g.fp8 = fp8
            b.mlp = g
        return len(blocks)
    monkeypatch.setattr(fp8, "FusedGatedMLP", Gated)
    monkeypatch.setattr(fp8, "replace_llama_mlps", replace)
    monkeypatch.chdir(ROOT)
    assert run.main([*CPU_QUICK[1:], "--no-supervise", "--sections", "fp8", "--fp8-items", "gated,stack",
                     "--rounds", "1", "--rep-ms", "5", "--warmup-ms", "2", "--out", str(tmp_path)]) == 0
    data = json.loads(open(_only(str(tmp_path / "fp8-*.json"))).read())
    assert data["plan"] == ["fp8_gated:bf16:swiglu:64x32x48", "fp8_stack:bf16:swiglu"]
    vs = data["fp8_gated"][0]["variants"]
    for key in ("fused_fp8_current", "fused_fp8_delayed", "fused_fp8_current_cached", "fused_fp8_delayed_cached"):
        assert vs[key]["status"] == "ok" and vs[key]["scaling"] in key, (key, vs[key])
        assert vs[key]["is_first_microbatch"] is (not key.endswith("_cached")), vs[key]
        # FP8 against the unquantized float32 step: e4m3 rounds each value by up to 2^-4 relative
        # (measured 6.5e-2 on the output at this tiny shape)
        assert vs[key]["rel_err"]["out"] <= FP8_VS_FP32 and "speedup_vs_eager" in vs[key], vs[key]
    assert {True, False} <= set(seen) and None in seen  # the stack's MLPs are called as model(x)
    stack = data["fp8_stack"][0]["variants"]["fused_fp8_eager"]
    assert stack["status"] == "ok" and stack["scaling"] == "current" and stack["rel_err"]["out"] <= FP8_VS_FP32, stack
    assert recipes == [fp8.Float8Recipe(scaling="current", min_features=0)]  # fused_fp8_eager's (compile: CPU)
    model = fp8.fp8_stack(fp8.Stack(2, 32, 48, 4, "swiglu", torch.device("cpu"), torch.bfloat16), 2)
    assert all(type(b.qkv) is fd.FusedDense and b.qkv.fp8 == recipes[0] and b.o_proj.fp8 == recipes[0]
               for b in model.blocks)


def test_report_fp8_gated_and_stack_targets():
    """The gated MLP's target at 16384 × 4096 → 14336 (current and delayed against torchao
    tensorwise), none at the other shape; the stack's: fused FP8 eager ≥ 1.10× torchao compiled,
    the compiled one shown against the same figure, without a verdict where it did not run."""
    def ok(ms):
        return {"status": "ok", "ms": ms, "tflops": 100.0, "round_ms": [ms] * 5, "rounds": 5}
    g = {"dtype": "bf16", "activation": "swiglu", "d": 4096}
    res = {"fp8_gated": [dict(g, id="fp8_gated:bf16:swiglu:16384x4096x14336", M=16384, h=14336, variants={
               "fp8_floor": ok(12.0), "fused_fp8_current": ok(14.0), "fused_fp8_delayed": ok(13.5),
               "torchao_tensorwise": ok(16.5)}),
                         dict(g, id="fp8_gated:bf16:swiglu:8192x4096x11008", M=8192, h=11008, variants={
                             "fused_fp8_current": ok(5.0), "torchao_tensorwise": ok(5.0)})],
           "fp8_stack": [{"id": "fp8_stack:bf16:swiglu", "dtype": "bf16", "activation": "swiglu", "M": 4096,
                          "blocks": 2, "batch": 2, "seq": 2048, "d": 4096, "h": 11008, "heads": 32, "variants": {
                              "eager": ok(20.0), "torchao_tensorwise": ok(14.0), "fused_fp8_eager": ok(12.5),
                              "fused_fp8_compile": {"status": "unavailable", "error": "Unsupported: x"}}}]}
    rows = {t: (fig, met) for t, fig, met in report.fp8_targets(res)}
    stack = "FP8 Llama-style stack (2 blocks, B 2, T 2048, d 4096, h 11008): fused_dense FP8"
    assert rows == {
        "FP8 gated MLP swiglu 16384 × 4096 → 14336: FusedGatedMLP FP8 current ≥ 1.15× torchao tensorwise "
        "(torchao / fused)": ("1.179 (rounds 1.179–1.179): 16.500 vs 14.000 ms", True),
        "FP8 gated MLP swiglu 16384 × 4096 → 14336: FusedGatedMLP FP8 delayed ≥ 1.15× torchao tensorwise "
        "(torchao / fused)": ("1.222 (rounds 1.222–1.222): 16.500 vs 13.500 ms", True),
        f"{stack} eager ≥ 1.10× torchao tensorwise + torch.compile of the whole stack (torchao / fused)":
            ("1.120 (rounds 1.120–1.120): 14.000 vs 12.500 ms", True),
        f"{stack} torch.compile'd ≥ 1.10× torchao tensorwise + torch.compile (torchao / fused)":
            ("unavailable", None)}, rows
    md = report.markdown(res)
    assert "| 16384 × 4096 → 14336 | 5 | 12.000 (–×) |" in md
    assert "| fused FP8, eager | 12.500 | ––– | 100 | 1.600 | – | 1.120 |" in md, md
    assert "| stack B 2 × T 2048, d 4096 → h 11008 | fused FP8, torch.compile | unavailable: Unsupported: x |" in md
    assert "[ok] FP8 gated MLP swiglu 16384 × 4096 → 14336" in report.summary(res)
    if importlib.util.find_spec("matplotlib"):
        assert os.path.exists(report.make_png(res, os.path.join(os.environ.get("TMPDIR", "/tmp"), "fp8g.png")))


def test_parallel_mlp_bench_cpu_two_ranks(tmp_path):
    (tmp_path / "parallel-mlp-2000-01-01.json").write_text("{}")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          "bench/parallel_mlp.py", "--device", "cpu", "--dims", "64", "--tokens", "32", "--reps", "2",
          "--warmup", "1", "--out", str(tmp_path)], timeout=300)
    path = _only(str(tmp_path / "parallel-mlp-*.json"))  # the older run was removed
    data = json.loads(open(path).read())
    assert data["env"]["world_size"] == 2 and data["env"]["reps"] == 2
    assert [(r["d"], r["sequence_parallel"]) for r in data["results"]] == [(64, True), (64, False)]
    for r in data["results"]:
        assert max(r["check_rel_err"].values()) <= 1e-4, r["check_rel_err"]
        for k in ("fused_ms", "plain_ms", "fused_local_ms", "plain_local_ms", "comm_ms"):
            assert r[k] > 0, (k, r)
        assert sorted(r["overlap_chunks"]) == ["2", "4"] and all(v["fused_ms"] > 0 for v in r["overlap_chunks"].values())
    md = open(path[:-5] + ".md").read()
    assert "| 64 | 32 | on |" in md
    assert "| 64 | on | 4 |" in md and "| 64 | off | 2 |" in md
    os.remove(path[:-5] + ".md")
    _run([sys.executable, "bench/parallel_mlp.py", "--report", path], timeout=120)
    assert open(path[:-5] + ".md").read() == md


def test_parallel_bench_interval_arithmetic():
    from bench import parallel_mlp as pm
    a = pm.merge_intervals([(5, 7), (0, 2), (1, 3), (10, 12)])
    assert a == [(0, 3), (5, 7), (10, 12)]
    assert pm.total_length(a) == 7
    b = pm.merge_intervals([(2, 6), (11, 20)])
    assert pm.intersection_length(a, b) == 1 + 1 + 1  # [2,3] + [5,6] + [11,12]
    assert pm.intersection_length(a, []) == 0


def test_runs_of_record_are_what_the_report_writes():
    """docs/results holds one run of record per benchmark, and its markdown is what the report code
    makes of its JSON (so no hand edits and no stale report)."""
    from bench import parallel_mlp as pm
    mlp = _only(os.path.join(ROOT, "docs", "results", "mlp-*.json"))
    res = json.loads(open(mlp).read())
    assert report.markdown(res) == open(mlp[:-5] + ".md").read()
    assert os.path.exists(mlp[:-5] + ".png")
    assert os.path.basename(mlp) == f"mlp-{res['env']['date_utc'][:10]}.json"
    par = _only(os.path.join(ROOT, "docs", "results", "parallel-mlp-*.json"))
    data = json.loads(open(par).read())
    assert pm.markdown(data["env"], data["results"]) == open(par[:-5] + ".md").read()
    gated = _only(os.path.join(ROOT, "docs", "results", "gated-*.json"))
    assert report.markdown(json.loads(open(gated).read())) == open(gated[:-5] + ".md").read()
    assert os.path.exists(gated[:-5] + ".png")
    fp8_runs = glob.glob(os.path.join(ROOT, "docs", "results", "fp8-*.json"))
    assert len(fp8_runs) <= 1, fp8_runs
    for path in fp8_runs:
        assert report.markdown(json.loads(open(path).read())) == open(path[:-5] + ".md").read()
        assert os.path.exists(path[:-5] + ".png")
    from bench import dynamic
    dyn = _only(os.path.join(ROOT, "docs", "results", "dynamic-*.json"))
    assert dynamic.markdown(json.loads(open(dyn).read())) == open(dyn[:-5] + ".md").read()
    assert os.path.exists(dyn[:-5] + ".png")
    from bench import lm_head, memory, model
    for name, mod in (("lm_head", lm_head), ("model", model), ("memory", memory)):
        path = _only(os.path.join(ROOT, "docs", "results", f"{name}-*.json"))
        assert mod.markdown(json.loads(open(path).read())) == open(path[:-5] + ".md").read(), path
        assert os.path.exists(path[:-5] + ".png"), path
    from bench import mainloop
    path = _only(os.path.join(ROOT, "docs", "results", "mainloop-*.json"))
    res = json.loads(open(path).read())
    date = os.path.basename(path)[len("mainloop-"):-len(".json")]
    assert mainloop.markdown(res, res["resources"], res["commit"], date) == open(path[:-5] + ".md").read()
    assert os.path.exists(path[:-5] + ".png")


def test_mainloop_record_shows_stages_and_energy():
    """The mainloop search's newer fields (stage count, epilogue sub-tile, the shortlist's re-timing,
    the energy phase) reach its markdown, each finalist's energy and cycles against cuBLASLt's
    fastest."""
    from bench import mainloop

    def fin(name, config, ms, mj, mhz):
        return {"name": name, "config": config, "raster": 0, "swizzle": 1, "full_ms": ms, "sustained_ms": ms * 1.01,
                "energy": {"ms": ms, "mj": mj, "watts": mj / ms, "sm_mhz": mhz, "mcycles": ms * mhz * 1e-3,
                           "gemms": 100}}
    res = {"gpu": "GPU", "sm_count": 132, "driver": 1, "cuda_runtime": 1, "cublaslt": 1, "rounds": 7,
           "sustain_s": 10, "energy_s": 0.5,
           "configs": [{"name": "co_128x256_c2x1_s3", "tile": [128, 256, 64], "cluster": [2, 1],
                        "schedule": "cooperative", "scheduler": "persistent", "smem_bytes": 160 * 1024, "stages": 3,
                        "epilogue_tile": [128, 32]},
                       {"name": "co_192x192_c2x1_sn", "tile": [192, 192, 64], "cluster": [2, 1],
                        "schedule": "cooperative", "scheduler": "persistent", "smem_bytes": 192 * 1024, "stages": 4,
                        "epilogue_tile": [0, 0]}],
           "problems": [{"role": "gated_fc1", "m": 8192, "n": 22016, "k": 4096,
                         "screen": [{"name": "cublaslt#0", "ms": 2.0},
                                    {"name": "co_128x256_c2x1_s3 M/2", "config": 0, "ms": 2.1, "ok": True,
                                     "error": 1e-3, "shortlist_ms": 2.15}],
                         "final": [fin("cublaslt_first", -1, 2.0, 1200.0, 1700.0),
                                   fin("cublaslt_fastest", -1, 2.0, 1200.0, 1700.0),
                                   fin("co_128x256_c2x1_s3 M/2", 0, 2.1, 1320.0, 1600.0)]}]}
    md = mainloop.markdown(res, {"co_128x256_c2x1_s3": [{"registers": 168, "spill_stores": 0, "spill_loads": 0}]},
                           "abc1234", "2026-12-05")
    assert "| co_128x256_c2x1_s3 | cooperative | persistent | 128 × 256 × 64 | 3 | 128 × 32 | 160.0 | 168 |" in md
    # the split-N names are explained where the run has them (the run of record has none)
    assert "`_sn` the two consumer warp groups side by side along N" in md
    # the register-store epilogue (split-N, nosmem) has no sub-tile: said so, not "0 × 0"
    assert "| co_192x192_c2x1_sn | cooperative | persistent | 192 × 192 × 64 | 4 | none (register stores) | 192.0 | – |" \
        in md
    assert "## Energy and clock cycles under the power cap (0.5 s" in md
    # ours: 1.1x the energy, 2.1 ms at 1600 MHz = 3.36 Mcycles against 2.0 ms at 1700 = 3.4
    assert "| gated_fc1 | 8192 × 22016 × 4096 | co_128x256_c2x1_s3 M/2 | 2.1000 | 1320.00 | 629 | 1600 | 3.360 | " \
           "1.100 | 0.988 |" in md
    assert "| gated_fc1 | 8192 × 22016 × 4096 | co_128x256_c2x1_s3 M/2 2.100 → 2.150 |" in md
    del res["energy_s"]
    assert "Energy and clock cycles" not in mainloop.markdown(res, {}, "abc1234", "2026-12-05")


def test_mainloop_reads_an_ncu_profile(tmp_path):
    """bench.mainloop --ncu: the counters of an ncu details CSV of `mainloop_search --profile`, the
    harness's own lines mixed in, labelled by launch order (cuBLASLt's first algorithm, then each
    named configuration's 3 launches; the last of each shown)."""
    from bench import mainloop
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def row(i, kernel, metric, unit, value):
        return (f'"{i}","1","mainloop_search","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
                f'"GPU Speed Of Light Throughput","{metric}","{unit}","{value}"')
    lines = ["==PROF== Connected to process 1", head,
             "gated_fc1 M 8192 N 22016 K 4096: cuBLASLt's first algorithm launched 3 times"]
    for i in range(3):
        lines.append(row(i, "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", "Duration", "ms", f"2.0{i}"))
        lines.append(row(i, "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", "SM Frequency", "GHz", "1.76"))
    for j, name in enumerate(["co_128x256_c2x1_sk/M/2", "pp_128x128_c1x1/M/8"]):
        lines.append(f"{name}: launched 3 times, relative error 1.000e-03")
        for i in range(3):
            kid = 3 + 3 * j + i
            lines.append(row(kid, f"void cutlass::device_kernel<K{j}>(K{j}::Params)", "Duration", "ms",
                             f"2.{j + 1}{i}"))
            lines.append(row(kid, f"void cutlass::device_kernel<K{j}>(K{j}::Params)", "SM Frequency", "GHz", "1.70"))
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    got = mainloop.parse_ncu(str(path))
    assert (got["role"], got["m"], got["n"], got["k"]) == ("gated_fc1", 8192, 22016, 4096)
    assert [(k["label"], k["metrics"]["Duration"]) for k in got["kernels"]] == [
        ("cuBLASLt first", "2.02 ms"), ("co_128x256_c2x1_sk/M/2", "2.12 ms"), ("pp_128x128_c1x1/M/8", "2.22 ms")]
    md = "\n".join(mainloop.counter_lines({"counters": [got]}))
    assert "| kernel | Duration | SM Frequency |" in md
    assert "| co_128x256_c2x1_sk/M/2 | 2.12 ms | 1.70 GHz |" in md
    assert mainloop.counter_lines({}) == []


def test_bench_remeasures_a_disturbed_median(monkeypatch):
    """A CUDA figure whose p80 / p20 exceeds RETRY_SPREAD is taken again and the steadier kept, the
    other recorded (the timing itself is replaced: no GPU in CI)."""
    bench = timing.Bench(torch.device("cpu"))
    results = iter([{"ms": 10.7, "p20": 10.2, "p80": 11.5, "reps": 19},
                    {"ms": 10.0, "p20": 9.95, "p80": 10.05, "reps": 19}])
    monkeypatch.setattr(bench, "_cuda_once", lambda fn, g, est: dict(next(results)))
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: 1.0)
    monkeypatch.setattr(bench, "allocator_calls", lambda: 0)
    bench.cuda = True
    res = bench(lambda: None)
    assert res["ms"] == 10.0 and res["remeasured"]["dropped"]["ms"] == 10.7
    steady = iter([{"ms": 10.0, "p20": 9.95, "p80": 10.05, "reps": 19}])
    monkeypatch.setattr(bench, "_cuda_once", lambda fn, g, est: dict(next(steady)))
    res = bench(lambda: None)  # a second call of _cuda_once would raise StopIteration
    assert res["ms"] == 10.0 and "remeasured" not in res


def test_bench_interleaves_the_variants(monkeypatch):
    """interleaved() visits every key once per round, the order rotated by one place per round,
    gives each block the whole warm-up, pools each key's repetitions, and a key that raises is
    recorded with its exception and leaves the later rounds (timing replaced: no GPU)."""
    bench = timing.Bench(torch.device("cpu"), warmup_ms=10.0, rep_ms=40.0)
    visits, rounds_seen = [], []
    fake_ms = {"a": 1.0, "b": 2.0, "c": 4.0}

    def timed(fn, grad_to_none, warm, n):
        key = fn()
        visits.append((key, warm, n))
        return [fake_ms[key] + 0.01 * i for i in range(n)]
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: fake_ms[fn()])
    fns = {k: ((lambda k=k: k), None) for k in "abc"}
    windows = {}
    res = bench.interleaved(fns, rounds=4, windows=windows, progress=lambda r, n: rounds_seen.append((r, n)))
    assert [k for k, _, _ in visits] == list("abc" "bca" "cab" "abc")
    assert rounds_seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    # each round's share of max(rep_ms, min_reps * est) = 40 ms, after the whole 10 ms warm-up
    assert {k: n for k, _, n in visits} == {"a": 10, "b": 5, "c": 3}
    assert {k: w for k, w, _ in visits} == {"a": 10, "b": 5, "c": 2}
    for k in "abc":
        assert res[k]["rounds"] == 4 and len(res[k]["round_ms"]) == 4 and len(windows[k]) == 4
        assert res[k]["reps"] == 4 * {"a": 10, "b": 5, "c": 3}[k]
        assert fake_ms[k] <= res[k]["ms"] <= fake_ms[k] + 0.1
        assert all(a < b for a, b in windows[k])
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
    assert [k for k, _, _ in visits] == list("abc" "ca" "ac")  # round 1: b raises; round 2 rotates the rest
    assert len(res["a"]["round_ms"]) == 3 and len(res["c"]["round_ms"]) == 3


class FakeTuner:
    """bench.timing.tuner_seconds replaced: the library's measuring_s, grown by measure()."""
    def __init__(self):
        self.seconds = 0.0

    def measure(self):
        self.seconds += 0.1

    def __call__(self, device):
        return self.seconds


def test_bench_retimes_reps_that_held_a_tuner_measurement(monkeypatch):
    """untuned runs a block again while the tuner measured during it (at most RETIME_TUNED times
    more) and keeps the clean run; _timed watches the timed calls, not the warm-up; the interleaved
    rounds and a figure taken by __call__ count the blocks timed again in `retimed` (timing
    replaced: no GPU)."""
    tuner = FakeTuner()
    monkeypatch.setattr(timing, "tuner_seconds", tuner)
    runs = []

    def run():
        runs.append(None)
        if len(runs) == 1:
            tuner.measure()
        return len(runs)
    assert timing.untuned(run, torch.device("cpu")) == (2, 1)
    runs.clear()
    assert timing.untuned(lambda: (tuner.measure(), run())[1], torch.device("cpu")) == (
        timing.RETIME_TUNED + 1, timing.RETIME_TUNED)
    bench = timing.Bench(torch.device("cpu"))
    calls = []

    def fn_measuring_on(call):
        def fn():
            calls.append(None)
            if len(calls) == call:
                tuner.measure()
        return fn
    bench._timed(fn_measuring_on(1), None, 1, 3)  # in the warm-up: the timed calls are clean
    assert bench.retimed == 0 and len(calls) == 4
    calls.clear()
    bench._timed(fn_measuring_on(2), None, 1, 3)  # the first timed call: the 3 calls again
    assert bench.retimed == 1 and len(calls) == 7
    # interleaved: key a's first block was timed again
    bench = timing.Bench(torch.device("cpu"), warmup_ms=10.0, rep_ms=40.0)
    visits = []

    def timed(fn, grad_to_none, warm, n):
        key = fn()
        visits.append(key)
        if key == "a" and visits.count("a") == 1:
            bench.retimed += 1
        return [1.0] * n
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: 1.0)
    res = bench.interleaved({k: ((lambda k=k: k), None) for k in "ab"}, rounds=2)
    assert visits == list("ab" "ba")
    assert res["a"]["retimed"] == 1 and res["b"]["retimed"] == 0
    # __call__: the span of do_bench (its warm-up with it) watched; at most RETIME_TUNED more
    bench = timing.Bench(torch.device("cpu"))
    monkeypatch.setattr(bench, "_estimate_ms", lambda fn, g: 1.0)
    monkeypatch.setattr(bench, "allocator_calls", lambda: 0)
    bench.cuda = True
    taken = []

    def once(fn, warmup, rep, grad_to_none, quantiles):
        taken.append(None)
        if len(taken) == 1:
            tuner.measure()
        return [10.0 * len(taken), 10.0, 10.0]
    bench.do_bench = once
    res = bench(lambda: None)
    assert res["ms"] == 20.0 and res["retimed"] == 1 and len(taken) == 2
    taken.clear()
    bench.do_bench = lambda fn, **kw: (tuner.measure(), once(fn, **kw))[1]
    res = bench(lambda: None)
    assert res["retimed"] == timing.RETIME_TUNED and len(taken) == timing.RETIME_TUNED + 1


def test_model_rounds_retime_a_block_that_held_a_tuner_measurement(monkeypatch):
    """bench.model's interleaved_ms times a block again when the tuner measured during it: the
    first block after the 3 warm-up calls measures here, so it runs twice and its first time is
    dropped."""
    from bench import model as bm
    tuner = FakeTuner()
    monkeypatch.setattr(timing, "tuner_seconds", tuner)
    calls = {"a": 0, "b": 0}

    def step(k):
        def fn():
            calls[k] += 1
            if k == "a" and calls[k] == 4:
                tuner.measure()
        return fn
    times = bm.interleaved_ms({k: step(k) for k in "ab"}, torch.device("cpu"), rounds=2, reps=5)
    assert calls == {"a": 3 + 5 + 5 + 5, "b": 3 + 5 + 5}
    assert len(times["a"]) == 2 and len(times["b"]) == 2


def test_model_profiles_are_taken_again_when_the_tuner_measured_in_them(monkeypatch):
    """bench.model's profiles (op_device_time here, on the CPU; profile_calls shares the rule) are
    taken again while the tuner measured during them: the first profile's calls measure, so the
    calls run twice and the table is the second profile's."""
    from bench import model as bm
    tuner = FakeTuner()
    monkeypatch.setattr(timing, "tuner_seconds", tuner)
    calls = []
    a = torch.randn(64, 64)

    def fn():
        calls.append(None)
        if len(calls) == 1:
            tuner.measure()
        return a @ a
    rows = bm.op_device_time(fn, 2, torch.device("cpu"))
    assert len(calls) == 4
    assert any(r[0] in ("aten::mm", "aten::matmul") and r[3] == 1 for r in rows), rows


def test_host_step_wall_steps_retake_a_step_the_tuner_measured_in(monkeypatch):
    """tools/host_step.wall_steps (fp8_path_profile's walls too): a step during which the tuner
    measured is taken again, so each (host, wall) pair is of a clean step."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import host_step
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    tuner = FakeTuner()
    monkeypatch.setattr(timing, "tuner_seconds", tuner)
    steps = []

    class Runner:
        device = torch.device("cpu")

        def sync(self):
            pass

        def step(self, ids):
            steps.append(ids)
            if len(steps) == 2:  # the second step (ids "b") measures
                tuner.measure()
    walls = host_step.wall_steps(Runner(), ["a", "b", "c"])
    assert steps == ["a", "b", "b", "c"] and len(walls) == 3
    assert all(len(w) == 2 and 0 <= w[0] <= w[1] for w in walls), walls


def test_report_shows_each_ratio_per_round():
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


def test_bench_names_the_source_tree_that_ran():
    """The recorded tree id is git's id of the files as they are, not of HEAD: HEAD's tree on a clean
    checkout, another one with an untracked file (a copy can carry an old .git under newer files)."""
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD^{tree}"], capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout: there is no tree id to record")
    tree = environment.source_tree_id()
    assert tree is not None and len(tree) == 40 and all(c in "0123456789abcdef" for c in tree), tree
    if not subprocess.run(["git", "-C", ROOT, "status", "--porcelain"], capture_output=True, text=True).stdout.strip():
        assert tree == git.stdout.strip(), "a clean checkout's tree id differs from HEAD's"
    extra = os.path.join(ROOT, "bench", f"_tree_id_check_{os.getpid()}.txt")
    try:
        with open(extra, "w") as f:
            f.write("changes the tree\n")
        assert environment.source_tree_id() != tree
    finally:
        os.remove(extra)
    header = report.markdown({"env": {"git_commit": "c07a00b268b5", "git_dirty": True, "git_tree": tree}})
    assert f"source tree {tree[:12]}" in header.splitlines()[2], header[:400]


class FakeNVML(types.SimpleNamespace):
    """The pynvml calls the bench makes, answering from a script of SM clocks."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, clocks):
        super().__init__(clocks=iter(clocks), handle_index=None)

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handle_index = i
        return "gpu"

    def nvmlDeviceGetClockInfo(self, h, kind):
        return next(self.clocks, 1380) if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetPowerUsage(self, h):
        return 699500  # mW

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4

    nvmlSystemGetDriverVersion = staticmethod(lambda: "580.1")
    nvmlDeviceGetMaxClockInfo = staticmethod(lambda h, k: 1980)
    nvmlDeviceGetEnforcedPowerLimit = staticmethod(lambda h: 700000)
    nvmlDeviceGetTemperature = staticmethod(lambda h, s: 34)
    nvmlDeviceGetPerformanceState = staticmethod(lambda h: 0)


def test_power_sampler_reads_nvml_in_the_background():
    """The sampler's thread reads clock, power (W) and reasons until stop(); each variant gets the
    medians of the samples inside its blocks, a variant whose blocks caught none gets nothing."""
    nvml = FakeNVML([1980] + [1410] * 1000)
    sampler = power.PowerSampler(0, interval_ms=5, nvml=nvml).start()
    try:
        assert sampler.running and sampler.note is None
        t0 = time.time()
        time.sleep(0.2)
        t1 = time.time()
    finally:
        samples = sampler.stop()
    n = len(samples)
    time.sleep(0.05)
    assert not sampler.running and len(sampler.stop()) == n  # the thread has ended: no more samples
    assert len(samples) >= 5 and samples[0]["power_w"] == 699.5 and samples[0]["reasons"] == "0x4"
    rec, variants = {}, {"floor": {"status": "ok"}, "auto_l0": {"status": "ok"}}
    power.record_clocks(rec, variants, sampler, {"auto_l0": [(t0, t1)], "floor": [(t1 + 60, t1 + 61)]})
    assert rec["clock_sampling"] == {"tool": "nvml", "interval_ms": 5, "samples": len(samples)}
    clocks = variants["auto_l0"]["clocks"]
    assert clocks["samples"] >= 3 and clocks["sm_mhz"] == 1410 and clocks["power_w"] == 699.5
    assert clocks["clock_limit_reasons"] == ["0x4"] and "clocks" not in variants["floor"]
    state = power.gpu_state(0, nvml=FakeNVML([1980]))
    assert state == {"driver": "580.1", "clock_sm_mhz": 1980, "clock_max_sm_mhz": 1980, "clock_mem_mhz": 3201,
                     "power_limit_w": 700.0, "temp_c": 34, "pstate": "P0", "clock_limit_reasons": "0x4"}


def test_power_is_not_sampled_without_nvml(monkeypatch):
    """No pynvml (or no GPU for it): nothing starts, the reason is recorded as 'not sampled', no
    variant gets clock fields, and the environment says so instead of listing clocks."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = power.PowerSampler(0).start()
    assert not sampler.running and sampler.note == "not sampled: no pynvml (the nvidia-ml-py package)"
    assert sampler.stop() == []
    rec, variants = {"id": "x"}, {"auto_l0": {"status": "ok"}}
    power.record_clocks(rec, variants, sampler, {"auto_l0": [(0.0, time.time())]})
    assert rec["clock_sampling"].startswith("not sampled") and variants == {"auto_l0": {"status": "ok"}}
    state = power.gpu_state(0)
    assert list(state) == ["nvml"] and state["nvml"].startswith("not sampled")
    assert f"GPU clocks and power: {state['nvml']}." in report.markdown({"env": state})

    class NoGPU(FakeNVML):
        def nvmlDeviceGetHandleByIndex(self, i):
            raise RuntimeError("NVML: no GPU with this index")
    assert "no GPU with this index" in power.PowerSampler(0, nvml=NoGPU([])).start().note


def test_clocks_fall_into_timed_blocks():
    t0 = 1000.0
    samples = [{"t": t0 + dt, "sm_mhz": mhz, "power_w": w, "reasons": r} for dt, mhz, w, r in [
        (0.0, 1980, 350.5, "0x0"),                                 # before floor's block: ignored
        (1.0, 1410, 699.0, "0x4"), (1.1, 1395, 700.2, "0x4"),     # floor, round 0
        (2.5, 1500, 650.0, "0x4"),                                 # between blocks: ignored
        (3.0, 1455, 698.0, "0x4"), (3.1, None, None, None),       # auto_l0
        (5.05, 1380, 701.0, "0x4")]]                               # floor, round 1
    windows = {"floor": [(t0 + 0.95, t0 + 1.15), (t0 + 5.0, t0 + 5.1)], "auto_l0": [(t0 + 2.95, t0 + 3.15)],
               "eager": [(t0 + 4.0, t0 + 4.04)]}
    clocks = power.clocks_in_windows(samples, windows)
    assert clocks == {"floor": {"samples": 3, "sm_mhz": 1395, "power_w": 700.2, "clock_limit_reasons": ["0x4"]},
                      "auto_l0": {"samples": 2, "sm_mhz": 1455, "power_w": 698.0, "clock_limit_reasons": ["0x4"]}}
    assert power.clocks_in_windows([], windows) == {}


def test_report_puts_sustained_figures_beside_the_standard_ones():
    """The sustained table (clock columns where they were sampled) and its ratios in the targets,
    labelled 'sustained', next to the standard figures, whose verdict they do not change."""
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
                              clock_sampling={"tool": "nvml", "interval_ms": 100, "samples": 250},
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
    assert "medians of the nvml samples (every 100 ms)" in table and "8192 × 2048 3 / 3 / 3 / 3." in table
    assert md.index("## Sustained load") < md.index("## MLP detail")
    assert "sustained (each block after 1000 ms of its own steps):" in report.summary(res)


def test_exact_tuner_variant_switches_settings_and_keeps_the_default_budget(monkeypatch):
    """The mlp section's 'auto_exact_l0' runs under exact-M keys, unpaced, with a generous budget; the
    other variants under the process's settings, their budget not charged for the exact variant's
    measuring."""
    import fused_dense
    from bench import sections
    from fused_dense import tuning
    state = {"settings": dict(enabled=True, budget_s=30.0, problem_budget_ms=100.0, pace=0.05, buckets=4,
                              cache="", table="t", deterministic=False), "measuring_s": 0.0}

    def configure(**kw):
        prev = dict(state["settings"])
        state["settings"].update(kw)
        return prev
    monkeypatch.setattr(fused_dense, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(tuning, "settings", lambda: dict(state["settings"]))
    monkeypatch.setattr(tuning, "configure", configure)
    monkeypatch.setattr(tuning, "stats", lambda: {"measuring_s": state["measuring_s"]})
    modes = sections.TunerModes()
    modes.enter("eager")  # nothing switched before the first exact variant
    assert state["settings"]["buckets"] == 4
    modes.enter("auto_exact_l0")
    assert {k: state["settings"][k] for k in sections.EXACT_TUNER} == sections.EXACT_TUNER
    state["measuring_s"] = 7.5  # what the exact variant's first call measured
    modes.enter("auto_l0")
    assert state["settings"] == dict(enabled=True, budget_s=37.5, problem_budget_ms=100.0, pace=0.05, buckets=4,
                                     cache="", table="t", deterministic=False)
    assert sections.fused_spec("auto_exact_l0") == ("auto", 0)


def test_model_section_runs_on_cpu(tmp_path):
    """bench.model: a tiny Llama, Hugging Face's against convert_model's, interleaved, with loss curves
    that agree and a markdown that the report code rewrites the same from the JSON."""
    pytest.importorskip("transformers")
    _run([sys.executable, "-m", "bench.model", "--device", "cpu", "--quick", "--configs", "llama-tiny",
          "--out", str(tmp_path)], timeout=600)
    (path,) = glob.glob(str(tmp_path / "model-*.json"))
    with open(path) as f:
        res = json.load(f)
    vs = res["configs"]["llama-tiny"]["variants"]
    assert set(vs) == {"hf_eager", "fd_eager"}, sorted(vs)
    for v in vs.values():
        assert v["ms"] > 0 and len(v["losses"]) == 8 and len(v["round_ms"]) == 2
    assert "converted" in vs["fd_eager"]["note"] and not vs["fd_eager"]["note"].startswith("convert_model(fp8=None): 0")
    assert vs["fd_eager"]["loss_gap"] < 1e-2  # bf16 CPU: the same model, fused
    with open(path[:-5] + ".md") as f:
        md = f.read()
    from bench import model as bench_model
    assert md == bench_model.markdown(res)
    # a run split across calls: the second keeps the first's config, which names its own commit
    first = tmp_path / "first.json"
    os.replace(path, first)
    res["configs"]["llama-tiny"]["environment"]["git_commit"] = "0123456789abcdef"
    first.write_text(json.dumps(res))
    _run([sys.executable, "-m", "bench.model", "--device", "cpu", "--quick", "--configs", "gpt2-tiny",
          "--merge", str(first), "--out", str(tmp_path)], timeout=600)
    (path,) = glob.glob(str(tmp_path / "model-*.json"))
    with open(path) as f:
        merged = json.load(f)
    assert list(merged["configs"]) == ["gpt2-tiny", "llama-tiny"]
    assert merged["configs"]["llama-tiny"]["variants"] == res["configs"]["llama-tiny"]["variants"]
    assert "Measured in another call: commit 0123456789ab" in bench_model.markdown(merged)


def test_model_linears_alone_runs_every_call_on_cpu(monkeypatch):
    """bench.model.linears_isolated on a tiny Llama on the CPU (the FP8 ops' reference kernels,
    torch.compile included; the floor's torch._scaled_mm replaced, it needs a GPU): every call of
    LINEAR_CALLS timed, each against the floor of its q / k / v layout."""
    pytest.importorskip("transformers")
    from bench import model as bench_model
    monkeypatch.setattr(bench_model, "linear_floor_steps", lambda *a: [lambda: None])
    cfg = dict(family="llama", d=64, h=64, layers=1, heads=4, kv_heads=2, vocab=64, batch=1, seq=16)
    base = bench_model.build_hf(cfg, torch.device("cpu"), torch.bfloat16)
    res = bench_model.linears_isolated(cfg, base, torch.device("cpu"), rounds=1, reps=1)
    keys = [key for key, _, _, _ in bench_model.LINEAR_CALLS]
    assert "fp8_qkv_rw_compile" in keys and set(res["ms"]) == set(keys) | {"floor", "floor_qkv"}
    for key, fuse, _, _ in bench_model.LINEAR_CALLS:
        floor = res["ms"]["floor_qkv" if fuse else "floor"]
        assert res["ms"][key] > 0 and res["vs_floor"][key] == res["ms"][key] / floor


def test_model_profile_table_lists_the_classes_any_variant_has():
    """bench.model.profile_table: one row per variant, the classes any of them has in
    KERNEL_CLASSES order then other, absent classes as 0.00, the total last; no lines without a
    profile (CPU runs)."""
    from bench.model import profile_table
    assert profile_table(None) == [] and profile_table({}) == []
    lines = profile_table({"hf_compile": {"other": 2.5, "gemm": 10.0, "total": 12.5, "launches": 20},
                           "fd": {"gemm": 10.25, "fp8_cast": 1.0, "total": 11.25, "launches": 12}})
    assert lines[3:] == ["| | gemm | fp8_cast | other | total |", "|---|---|---|---|---|",
                         "| hf_compile | 10.00 | 0.00 | 2.50 | 12.50 |", "| fd | 10.25 | 1.00 | 0.00 | 11.25 |"]


def test_model_op_device_time_tells_gemms_apart_by_their_shapes():
    """bench.model.op_device_time on the CPU (self CPU time in place of device time): each op
    that did work, keyed by its operands' shapes, sorted by time, counted per call."""
    from bench.model import op_device_time
    torch.manual_seed(0)
    a, b = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=False)
    x = torch.randn(8, 32)

    def fn():
        b(a(x)).sum()

    rows = op_device_time(fn, 2, torch.device("cpu"))
    mms = {shapes: n for op, shapes, ms, n in rows if op == "aten::mm"}
    assert mms == {"[[8, 32], [32, 64]]": 1.0, "[[8, 64], [64, 16]]": 1.0}, rows
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    assert all(ms > 0 for _, _, ms, _ in rows)


def test_model_ops_table_lists_each_variants_largest_ops():
    """bench.model.ops_table: a table per variant that has ops, at most OPS_ROWS rows each."""
    from bench.model import OPS_ROWS, ops_table
    assert ops_table("a step", {}) == [] and ops_table("a step", {"hf_compile": None}) == []
    rows = [["aten::mm", "[[8, 32], [32, 64]]", 1.5 - 0.01 * i, 2] for i in range(OPS_ROWS + 3)]
    lines = ops_table("a step", {"hf_compile": rows, "fd_compile": rows[:2]})
    assert lines.count("|---|---|---|---|") == 2
    assert sum(line.startswith("| aten::mm |") for line in lines) == OPS_ROWS + 2
    assert "| aten::mm | [[8, 32], [32, 64]] | 1.500 | 2 |" in lines


def test_model_profile_classes_the_library_fp8_passes_as_casts():
    """The step profiles' fp8_cast class holds the library's quantize and transpose kernels (names
    as the H200's profiler gives them), not only torch's and torchao's."""
    from bench.model import kernel_class
    names = {
        "void fused_dense::core::(anonymous namespace)::cast_kernel<__nv_bfloat16, "
        "(fused_dense::core::Activation)4, 3, false>(__nv_bfloat16 const*)": "fp8_cast",
        "void fused_dense::core::(anonymous namespace)::cast_kernel_capped<__nv_bfloat16, "
        "(fused_dense::core::Activation)0, 5, false>(int)": "fp8_cast",
        "fused_dense::core::(anonymous namespace)::transpose_kernel(unsigned char const*, long, long)": "fp8_cast",
        "void fused_dense::core::(anonymous namespace)::amax_kernel<__nv_bfloat16, "
        "(fused_dense::core::Activation)0, 0, 1>(int)": "fp8_cast",
        "void fused_dense::core::(anonymous namespace)::norm_backward_kernel<__nv_bfloat16, 8>(int)": "norm",
        "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "gemm",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int)": "other",
        "triton_per_fused__to_copy_add_div_expand_mul_pow_sum_1": "other",
    }
    assert {n: kernel_class(n) for n in names} == names


def test_model_profile_classes_the_loss_apart_from_attention():
    """The LM head's loss kernels (Inductor's, ATen's, the library's) are the loss class, not
    attention (whose softmax pattern matches them); SDPA's kernels stay attention (names as the
    H100's profiler gives them)."""
    from bench.model import kernel_class
    names = {
        "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_clone_eq_expand_"
        "nll_loss_backward_nll_loss_forward_scalar_tensor_slice_view_where_0": "loss",
        "triton_red_fused__log_softmax__to_copy__unsafe_view_prepare_softmax_online_view_10": "loss",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float ": "loss",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss",
        "void fused_dense::core::(anonymous namespace)::cross_entropy_rows_kernel<__nv_bfloat16>"
        "(fused_dense::core::CrossEntropyRowsArgs, bool)": "loss",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0":
            "attention",
        "void cudnn::fusion::fmha_reduce_head<true>(void const*, void*, unsigned int)": "attention",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, c10::BFloat16, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>": "attention",  # eager attention's softmax
    }
    assert {n: kernel_class(n) for n in names} == names


def test_model_fp8_loss_gaps_are_judged_by_the_main_jobs_rule():
    """Each FP8 variant's loss gap to hf_eager against max(floor, factor x hf_compile's gap)."""
    from bench.model import LOSS_GAP_FACTOR, LOSS_GAP_FLOOR, targets
    ms = {"ms": 10.0, "round_ms": [10.0, 10.0]}
    variants = {"hf_eager": dict(ms, loss_gap=0.0), "hf_compile": dict(ms, loss_gap=0.05),
                "fd_fp8_current_compile": dict(ms, loss_gap=0.2), "torchao_compile": dict(ms, loss_gap=0.1),
                "fd_compile": dict(ms, loss_gap=0.9)}
    res = {"configs": {"llama-x": {"config": {"family": "llama", "layers": 2}, "variants": variants}}}
    rows = {t: (q, met) for t, q, _, met in targets(res) if "loss gap" in t}
    limit = max(LOSS_GAP_FLOOR, LOSS_GAP_FACTOR * 0.05)
    assert limit == pytest.approx(0.15)
    got = {t.split(": ")[1].split(" ")[0]: v for t, v in rows.items()}
    assert got == {"fd_fp8_current_compile": (0.2, False), "torchao_compile": (0.1, True)}  # bf16 variants not judged


def test_model_bf16_loss_curves_are_judged_by_the_main_jobs_bf16_rule():
    """Each bf16 conversion's last-20-step mean loss against hf_eager's, within the main job's bf16
    tolerance; the rule's numbers are the example's own."""
    from bench import main_job_profile
    from bench.model import LOSS_BF16_TOL, LOSS_GAP_FACTOR, LOSS_GAP_FLOOR, LOSS_LAST_STEPS, targets
    example = main_job_profile.load_example()
    assert (LOSS_BF16_TOL, LOSS_GAP_FACTOR, LOSS_GAP_FLOOR, LOSS_LAST_STEPS) == (
        example.BF16_TOL, example.FP8_FACTOR, example.FP8_FLOOR, 20)
    ref = [3.0 - 0.01 * i for i in range(40)]
    ms = {"ms": 10.0, "round_ms": [10.0, 10.0]}
    # the last 20 steps' mean of ref is 2.705: 1.5% and 2.5% above it
    variants = {"hf_eager": dict(ms, losses=ref), "fd_eager": dict(ms, losses=[x * 1.015 for x in ref]),
                "fd_compile": dict(ms, losses=[x * 1.025 for x in ref]),
                "fd_fp8_current_compile": dict(ms, losses=[x * 1.5 for x in ref])}
    for family in ("llama", "gpt2"):
        res = {"configs": {"c": {"config": {"family": family, "layers": 2}, "variants": variants}}}
        rows = {t.split(": ")[1].split(" ")[0]: (q, met) for t, q, _, met in targets(res) if "mean loss" in t}
        assert set(rows) == {"fd_eager", "fd_compile"}  # FP8 variants go by the FP8 rule
        assert rows["fd_eager"][0] == pytest.approx(0.015) and rows["fd_eager"][1] is True
        assert rows["fd_compile"][0] == pytest.approx(0.025) and rows["fd_compile"][1] is False
    # hf_compile, rounding alone, 0.5% from hf_eager: the limit stays 2e-2; 1.5% away, it is 2 x 1.5%
    from bench.model import LOSS_BF16_NOISE_FACTOR
    assert LOSS_BF16_NOISE_FACTOR == 2.0
    for noise, limit, verdicts in ((1.005, 0.02, (True, False)), (1.015, 0.03, (True, True))):
        v = dict(variants, hf_compile=dict(ms, losses=[x * noise for x in ref]))
        res = {"configs": {"c": {"config": {"family": "llama", "layers": 2}, "variants": v}}}
        rows = {t: met for t, _, _, met in targets(res) if "mean loss" in t}
        # sorted: fd_compile (2.5% away), then fd_eager (1.5%)
        assert [rows[t] for t in sorted(rows)] == [verdicts[1], verdicts[0]]
        assert all(f") = {limit:.3f} (relative)" in t for t in rows), rows


def test_model_step_gain_row_carries_the_rounds_range():
    """#38's step-gain row: the gain q - 1 of hf_compile / fd_compile, with its per-round range, judged
    against 0.75 x the MLP's share of the step x its isolated lead."""
    from bench.model import targets
    variants = {"hf_compile": {"ms": 10.0, "round_ms": [10.0, 10.2, 9.9]},
                "fd_compile": {"ms": 9.9, "round_ms": [9.9, 10.0, 10.0]}}
    mlp = {"ms": {"hf_compile": 1.0}, "lead": 0.02}  # 2 layers x 1 ms: a share of 0.2
    res = {"configs": {"c": {"config": {"family": "llama", "layers": 2}, "variants": variants, "mlp": mlp}}}
    (row,) = [r for r in targets(res) if "step gain" in r[0]]
    assert "MLP share (0.20) x isolated lead (+0.020)" in row[0]
    assert row[1] == pytest.approx(10.0 / 9.9 - 1)
    assert row[2] == pytest.approx((9.9 / 10.0 - 1, 10.2 / 10.0 - 1))
    assert row[3] is True  # 0.0101 >= 0.75 x 0.2 x 0.02 = 0.003
    mlp["lead"] = 0.08  # needs 0.012
    assert [r for r in targets(res) if "step gain" in r[0]][0][3] is False


def test_model_fp8_targets_of_the_norm_cast_issue():
    """#39's compiled FP8 targets (1.08x / 1.05x torchao at llama-2048 / llama-4096) are judged for
    every compiled current-scaling variant measured (q / k / v fused or not, the lighter recipes);
    delayed scaling only against 1x; eager FP8 not at all."""
    from bench.model import targets
    ms = lambda v: {"ms": v, "round_ms": [v, v]}  # noqa: E731
    variants = {"torchao_compile": ms(10.8), "fd_fp8_current_compile": ms(10.2), "fd_fp8_current_qkv_compile": ms(10.0),
                "fd_fp8_delayed_compile": ms(9.0), "fd_fp8_current_qkv_lce_compile": ms(10.9),
                "fd_fp8_current_eager": ms(12.0)}
    res = {"configs": {"llama-2048": {"config": {"family": "llama", "layers": 2}, "variants": variants}}}
    rows = {t: met for t, _, _, met in targets(res) if "torchao_compile /" in t}
    assert rows == {"llama-2048: torchao_compile / fd_fp8_current_compile >= 1": True,
                    "llama-2048: torchao_compile / fd_fp8_current_compile >= 1.08 (#39)": False,
                    "llama-2048: torchao_compile / fd_fp8_delayed_compile >= 1": True,
                    "llama-2048: torchao_compile / fd_fp8_current_qkv_compile >= 1": True,
                    "llama-2048: torchao_compile / fd_fp8_current_qkv_compile >= 1.08 (#39)": True,
                    "llama-2048: torchao_compile / fd_fp8_current_qkv_lce_compile >= 1": False,
                    "llama-2048: torchao_compile / fd_fp8_current_qkv_lce_compile >= 1.08 (#39)": False}


def test_model_causal_sdpa_leaves_the_mask_to_is_causal_under_compile(monkeypatch):
    """bench.model --causal-sdpa: a compiled Llama's SDPA call gets is_causal and no mask (with
    torch < 2.14 transformers builds the mask under torch.compile), the same logits as eager."""
    transformers = pytest.importorskip("transformers")
    import transformers.masking_utils as mu
    from bench import model as bench_model

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", mu._ignore_causal_mask_sdpa)  # restored after the test
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(conf).eval()
    ids = torch.randint(0, 128, (2, 32))

    def compiled_sdpa_calls():
        calls = []

        def backend(gm, example_inputs):
            calls.extend(dict(n.kwargs) for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
            return gm.forward

        torch._dynamo.reset()
        with torch.no_grad():
            logits = torch.compile(model, backend=backend)(ids).logits
        return calls, logits

    with torch.no_grad():
        eager = model(ids).logits
    before, _ = compiled_sdpa_calls()
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14):
        assert before and before[0].get("attn_mask") is not None, before
    assert "skipped" in bench_model.causal_sdpa_under_compile()
    assert bench_model.causal_sdpa_under_compile() == "already set"
    after, logits = compiled_sdpa_calls()
    torch._dynamo.reset()
    assert after and all(k.get("attn_mask") is None and k.get("is_causal") is True for k in after), after
    assert torch.allclose(logits, eager, rtol=1e-5, atol=1e-5)
    # the skip is taken only without padding or window and with as many queries as keys
    def rule(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return "transformers' rule"

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", rule)
    bench_model.causal_sdpa_under_compile()
    skip = mu._ignore_causal_mask_sdpa
    assert skip(None, 8, 8, 0, 0) is True and skip(None, 8, 8, 0, 0, None) is True
    assert skip(None, 8, 8, 0, 0, 4) == skip(None, 8, 8, 0, 0, local_attention_size=4) == "transformers' rule"
    assert skip(torch.ones(1, 8, dtype=torch.bool), 8, 8, 0, 0) == "transformers' rule"
    assert skip(None, 1, 8, 7, 0) == "transformers' rule"


def test_lm_head_section_runs_on_cpu(tmp_path):
    """bench.lm_head: Hugging Face's LM head + loss against the fused one at tiny shapes, interleaved,
    with errors against float64 and targets reported, and a markdown the report code rewrites the
    same from the JSON."""
    _run([sys.executable, "-m", "bench.lm_head", "--device", "cpu", "--quick", "--out", str(tmp_path)], timeout=600)
    (path,) = glob.glob(str(tmp_path / "lm_head-*.json"))
    with open(path) as f:
        res = json.load(f)
    (shape,) = res["shapes"]
    vs = shape["variants"]
    assert set(vs) == {"hf_eager", "hf_compile", "liger", "fused", "fused_fp8"}, sorted(vs)
    for name in ("hf_eager", "fused", "fused_fp8"):
        assert vs[name]["status"] == "ok" and vs[name]["ms"] > 0 and len(vs[name]["round_ms"]) == 2, vs[name]
    assert vs["hf_compile"]["status"] == "unavailable" and vs["liger"]["status"] == "unavailable"
    (acc,) = res["accuracy"]
    assert (acc["vocab"], acc["tokens"]) == (shape["vocab"], shape["tokens"])
    for name in ("hf_eager", "fused"):
        errs = acc["variants"][name]
        assert 0 < errs["loss"] < 1e-2 and 0 < errs["x_grad"] < 2e-2 and 0 < errs["weight_grad"] < 2e-2, errs
    verdicts = {k: v for per in res["targets_met"].values() for k, v in per.items()}
    assert verdicts["time_vs_liger"] == "n/a" and verdicts["error_vs_hf_eager"] in ("met", "not met")
    from bench import lm_head
    with open(path[:-5] + ".md") as f:
        assert f.read() == lm_head.markdown(res)
    os.remove(path[:-5] + ".md")
    lm_head.main(["--report", path])  # the markdown again, from the JSON alone
    with open(path[:-5] + ".md") as f:
        assert f.read() == lm_head.markdown(res)


def test_saved_storages_count_each_storage_once():
    """bench.timing.SavedStorages: a tensor saved twice (or two views of one storage) counts once,
    two copies of it twice, and the excluded storages (parameters) not at all."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with timing.SavedStorages(exclude=[w]) as once:
        (x * x).sum().backward()  # x saved twice (each operand), one storage
    assert (once.storages, once.bytes) == (1, 4 * 8 * 4)
    with timing.SavedStorages(exclude=[w]) as twice:
        (x.clone() * x.clone() + x @ w).sum().backward()  # two copies, and x beside the excluded w
    assert (twice.storages, twice.bytes) == (3, 3 * 4 * 8 * 4)
    mem = timing.step_memory(torch.device("cpu"), lambda: (x[:2] * x[2:]).sum().backward())
    assert mem == {"before_bytes": None, "peak_bytes": None, "saved_bytes": 4 * 8 * 4, "saved_storages": 1}


def test_memory_section_runs_on_cpu(tmp_path):
    """bench.memory: the MLPs (bf16 and FP8 fused, eager) and the Llama step at tiny shapes, each
    variant measured alone with what it saves for backward, timed interleaved, the CPU's missing
    variants recorded unavailable with the reason, the targets reported, and a markdown the report
    code rewrites the same from the JSON."""
    pytest.importorskip("transformers")
    (tmp_path / "memory-2000-01-01.json").write_text("{}")
    _run([sys.executable, "-m", "bench.memory", "--device", "cpu", "--quick", "--out", str(tmp_path)], timeout=600)
    (path,) = glob.glob(str(tmp_path / "memory-*.json"))
    with open(path) as f:
        res = json.load(f)
    from bench import memory
    assert [(s["label"], s["M"], s["d"], s["h"]) for s in res["shapes"]] == [(s[0], *s[2:]) for s in memory.CPU_SHAPES]
    for s in res["shapes"]:
        vs = s["variants"]
        assert list(vs) == memory.mlp_variants(memory.FP8_PATHS)
        assert vs["torchao_tensorwise"]["status"] == "unavailable" and vs["torchao_tensorwise"]["error"].startswith(
            "CPU run: "), vs["torchao_tensorwise"]
        for key in ("eager", "fused_bf16", "fused_fp8_current", "fused_fp8_delayed"):
            v = vs[key]
            assert v["status"] == "ok" and v["ms"] > 0 and len(v["round_ms"]) == 2, (key, v)
            assert v["saved_bytes"] > 0 and v["saved_storages"] > 0 and v["peak_bytes"] is None, (key, v)
        # x is counted: at least its storage beside what the layers save
        assert vs["fused_bf16"]["saved_bytes"] > s["M"] * s["d"] * 2
    llama = res["llama"]
    assert llama["config_name"] == "llama-tiny" and list(llama["variants"]) == memory.LLAMA_DEFAULT_VARIANTS
    hf = llama["variants"]["hf_eager"]
    assert hf["status"] == "ok" and hf["tokens_per_s"] > 0 and len(hf["round_ms"]) == 2 and hf["saved_bytes"] > 0, hf
    for key in memory.LLAMA_DEFAULT_VARIANTS[1:]:
        assert llama["variants"][key]["status"] == "unavailable", (key, llama["variants"][key])
    verdicts = {where: {k: t["verdict"] for k, t in per.items()} for where, per in res["targets_met"].items()}
    assert "GELU MLP 64 × 64: fused_fp8_current" not in verdicts  # the old path: what the others are measured by
    gelu = verdicts["GELU MLP 64 × 64: fused_fp8_current_pre_fp8"]
    assert gelu["saved_vs_fused_bf16"] in ("met", "not met") and gelu["peak_vs_fused_bf16"] == "n/a"
    assert gelu["time_vs_old_fp8_path"] in ("met", "not met", "tie")
    # the e4m3 pre-activation: half the bf16 MLP's bytes, plus the 4-byte scale
    saved = {k: res["shapes"][0]["variants"][k]["saved_bytes"] for k in ("fused_bf16", "fused_fp8_current_pre_fp8")}
    assert saved["fused_fp8_current_pre_fp8"] <= saved["fused_bf16"] // 2 + 64, saved
    assert verdicts["LlamaForCausalLM llama-tiny: fd_fp8_current_compile"]["llama_step_memory_vs_torchao"] == "n/a"
    assert not (tmp_path / "memory-2000-01-01.json").exists()
    with open(path[:-5] + ".md") as f:
        md = f.read()
    assert md == memory.markdown(res) and "## Targets (#41)" in md and "CUDA" in md and "commit" in md
    os.remove(path[:-5] + ".md")
    memory.main(["--report", path])  # the markdown again, from the JSON alone
    with open(path[:-5] + ".md") as f:
        assert f.read() == md


def test_memory_time_verdict_is_a_tie_only_within_the_rounds():
    """bench.memory's time targets: met by the medians' ratio, else a tie where some interleaved
    round's ratio meets the limit, else not met; the figure names the rounds' range."""
    from bench import memory

    def rec(num_rounds, den_rounds):
        import statistics
        return {"variants": {k: {"status": "ok", "ms": statistics.median(r), "round_ms": r}
                             for k, r in (("new", num_rounds), ("old", den_rounds))}}
    met = memory._target(rec([1.01, 1.0, 1.02], [1.0, 1.0, 1.0]), "new", "old", "ms", 1.02)
    assert met["verdict"] == "met" and met["rounds"] == [1.0, 1.02]
    tie = memory._target(rec([1.03, 1.01, 1.04], [1.0, 1.0, 1.0]), "new", "old", "ms", 1.02)
    assert tie["verdict"] == "tie" and tie["ratio"] == pytest.approx(1.03) and tie["rounds"][0] == pytest.approx(1.01)
    over = memory._target(rec([1.03, 1.025, 1.04], [1.0, 1.0, 1.0]), "new", "old", "ms", 1.02)
    assert over["verdict"] == "not met"
    mem = rec([1.0], [1.0])
    mem["variants"]["new"]["peak_bytes"], mem["variants"]["old"]["peak_bytes"] = 3, 2
    peak = memory._target(mem, "new", "old", "peak_bytes", 1.0)
    assert peak["verdict"] == "not met" and "rounds" not in peak  # only a time has rounds


def test_main_job_profile_runs_on_cpu(tmp_path):
    """bench.main_job_profile: both GPTs step in interleaved rounds, the ratio is the median of the
    per-round ratios, and the profile of each variant is written."""
    _run([sys.executable, "-m", "bench.main_job_profile", "--device", "cpu", "--rounds", "2", "--out", str(tmp_path)],
         timeout=600)
    with open(tmp_path / "main_job_profile.json") as f:
        res = json.load(f)
    rounds = res["rounds"]
    assert all(len(rounds[k][f]) == 2 for k in ("plain", "fused") for f in ("wall_ms", "issue_ms", "cpu_ms"))
    ratios = [f / p for f, p in zip(rounds["fused"]["wall_ms"], rounds["plain"]["wall_ms"])]
    assert res["summary"]["wall_fused_over_plain"]["median"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2)
    assert set(res["profile"]) == {"plain", "fused"} and all(res["profile"][k]["cpu_ops"] for k in res["profile"])


def test_dynamic_buckets_retime_outliers():
    """bench.dynamic's buckets part: a mode that loses more than the max-loss target at a count is
    timed again with exact-M, and the re-timing's loss replaces the first (kept as first_loss);
    modes within the target, and counts with no outlier, are not re-timed."""
    from bench import dynamic
    modes = (0,) + dynamic.GRIDS + (dynamic.REFINED,)
    bucket_of = lambda b, m: [m, m]  # noqa: E731  (the tuner's buckets need a CUDA build)
    ms = {b: [1.0, 1.0, 1.0] for b in modes}
    ms[2] = [1.10, 1.12, 1.10]  # 10%: an outlier
    ms[4] = [1.02, 1.02, 1.03]  # 2%: within the 3% target
    asked = []

    def retime(again):
        asked.append(again)
        return {0: [2.0] * dynamic.RETIME_ROUNDS, 2: [2.02] * dynamic.RETIME_ROUNDS}

    row = dynamic.count_row(1500, ms, retime, bucket_of)
    assert asked == [(0, 2)]
    assert row["retimed_exact_ms"] == 2.0
    assert row["2"]["retimed"] and row["2"]["first_loss"] == pytest.approx(0.10)
    assert row["2"]["loss"] == pytest.approx(0.01) and row["2"]["ms"] == 2.02
    assert "retimed" not in row["4"] and row["4"]["loss"] == pytest.approx(0.02)
    calm = dynamic.count_row(1500, {b: [1.0] * 3 for b in modes}, lambda again: pytest.fail(f"re-timed {again}"),
                             bucket_of)
    assert "retimed_exact_ms" not in calm and all(calm[str(b)]["loss"] == 0 for b in modes[1:])


def test_model_targets_compare_fp8_step_memory_with_torchao():
    """bench.model's targets: every compiled FP8 variant's step memory against torchao compiled's
    (#39: <= 1), from the figures measured, none where torchao's is missing."""
    from bench import model as bench_model

    def res(ao_bytes):
        vs = {"fd_fp8_current_qkv_compile": {"step_bytes": 3856}, "fd_fp8_current_qkv_ck1_nowc_compile":
              {"step_bytes": 3300}, "fd_fp8_current_eager": {"step_bytes": 5000}}
        if ao_bytes:
            vs["torchao_compile"] = {"step_bytes": ao_bytes}
        return {"configs": {"llama-2048": {"config": {"family": "llama", "layers": 4}, "variants": vs}}}

    rows = {t: (q, met) for t, q, _, met in bench_model.targets(res(3359)) if "step memory" in t}
    assert rows == {
        "llama-2048: fd_fp8_current_qkv_compile / torchao_compile step memory <= 1 (#39)": (3856 / 3359, False),
        "llama-2048: fd_fp8_current_qkv_ck1_nowc_compile / torchao_compile step memory <= 1 (#39)":
            (3300 / 3359, True)}
    assert not [t for t, *_ in bench_model.targets(res(None)) if "step memory" in t]


def test_quantize_passes_tool_times_every_case_and_compares_two_builds(tmp_path, capsys):
    """tools/quantize_passes.py on the CPU reference kernels: every pass with the scale given and
    with current scaling, one --jsonl line a run, --compare side by side with the later label's
    ratio to the first."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import quantize_passes
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    out = tmp_path / "runs.jsonl"
    small = ["--device", "cpu", "--rows", "32", "--d", "32", "--hidden", "48", "--rounds", "1", "--jsonl", str(out)]
    assert quantize_passes.main(small + ["--label", "old"]) == 0
    assert quantize_passes.main(small + ["--label", "new", "--cases", "bwd from e4m3"]) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in runs] == ["old", "new"]
    families = ("x", "plain gelu_approx", "gated swiglu")
    kinds = ("fwd", "fwd + pre's e4m3 copy", "bwd", "bwd from e4m3 pre", "bwd from e4m3 pre, in place")
    names = {"x"} | {f"{f} {k}" for f in families[1:] for k in kinds}
    assert set(runs[0]["ms"]) == {f"{n}: {s}" for n in names for s in ("cast", "current")}
    assert set(runs[1]["ms"]) == {f"{f} {k}: {s}" for f in families[1:] for k in kinds[3:] for s in ("cast", "current")}
    assert all(len(v) == 1 and v[0] > 0 for r in runs for v in r["ms"].values())
    capsys.readouterr()
    lines = quantize_passes.compare(str(out))
    assert "new/old" in lines[0]
    row = next(line for line in lines if line.startswith("gated swiglu bwd from e4m3 pre, in place: current"))
    assert len(row.split()[-3:]) == 3 and float(row.split()[-1]) > 0
    assert next(line for line in lines if line.startswith("x: cast")).rstrip().endswith("-")
