"""examples/train_gpt.py: its CPU configuration trains both MLP variants to agreeing, falling loss
curves and writes its figures; a disagreeing MLP is reported; a GPU with a CPU-only build of the
extension is refused before any training; --model hf-gpt2 trains transformers' GPT-2 as built and
converted alike, and a converted MLP 1% off fails. --fp8: a tiny CPU run writes a verdict that follows from
its own curves, with every dense layer in FP8; the verdict's rule (the floor, 3 x the bf16-vs-fp32
gap, a NaN) decides the exit status."""
import json
import math
import os
import statistics
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_gpt  # noqa: E402

TINY = ["--device", "cpu", "--steps", "16", "--d-model", "64", "--layers", "1", "--seq", "64", "--batch", "4"]
FP8_TINY = ["--device", "cpu", "--steps", "24", "--d-model", "64", "--layers", "1", "--seq", "32", "--batch", "4"]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models gain nothing from threads, and OpenMP threads waiting on one another make a
    loaded 2-core CI machine many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _report(out):
    with open(os.path.join(out, "train_gpt.json")) as f:
        return json.load(f)


def test_cpu_run_trains_both_variants_alike(tmp_path, capsys):
    assert train_gpt.main([*TINY, "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {"eager nn.Linear", "eager FusedMLP"}  # no torch.compile on the CPU
    for name, run in report["runs"].items():
        assert run["tokens_per_s"] > 0, name
        assert math.isfinite(run["val_loss"]), name
        curve = report["loss_curves"][name]
        assert len(curve) == 16
        # the loss falls well below log(256) = 5.55 within 16 steps
        assert sum(curve[-4:]) / 4 < curve[0] - 0.5, (name, curve)
        assert len(run["chunk_tokens_per_s"]) == 2, name  # 12 timed steps: rounds of 10 and 2
        assert [len(c) for c in run["chunk_step_ms"]] == [10, 2], name  # each step's time
        assert all(ms > 0 for c in run["chunk_step_ms"] for ms in c), name
        assert run["gc_pause_ms"] >= 0, name
    fused, plain = report["loss_curves"]["eager FusedMLP"], report["loss_curves"]["eager nn.Linear"]
    # float32 on the CPU: the same math up to summation order, step by step
    assert max(abs(a - b) / b for a, b in zip(fused, plain)) < 1e-4
    assert report["agreement"]["eager"]["agree"] and report["config"]["precision"] == "fp32"
    # the speed ratio: the median of the rounds' tokens/s ratios; beside it the rounds' median steps'
    f_run, p_run = (report["runs"][n] for n in ("eager FusedMLP", "eager nn.Linear"))
    per_round = [f / p for f, p in zip(f_run["chunk_tokens_per_s"], p_run["chunk_tokens_per_s"])]
    assert report["ratio_fused_over_linear"]["eager"] == statistics.median(per_round)
    steps = [statistics.median(p) / statistics.median(f) for f, p in zip(f_run["chunk_step_ms"], p_run["chunk_step_ms"])]
    assert report["agreement"]["eager"]["ratio_median_steps"] == statistics.median(steps)
    assert set(report["agreement"]["eager"]["slow_steps"]) == {"FusedMLP", "nn.Linear"}
    assert (tmp_path / "train_gpt.png").stat().st_size > 0  # matplotlib is in the test environment
    captured = capsys.readouterr()
    assert "16/16" in captured.err and "tok/s" in captured.err  # the progress bar
    assert "functional check" in captured.out and "OK: FusedMLP and nn.Linear train alike" in captured.out


def test_cpu_defaults_are_the_small_configuration(tmp_path, monkeypatch):
    """Without a GPU the defaults pick the small float32 configuration and skip torch.compile; the
    training itself is replaced here (the configuration is what is checked)."""
    seen = []

    def fake_interleaved(kinds, compiled, init, data, args, device, mode):
        seen.append((tuple(kinds.values()), compiled, device.type))
        curve = [5.0 - 0.01 * i for i in range(args.steps)]
        return {name: ({"tokens_per_s": 1.0, "peak_memory_gib": None, "final_train_loss": curve[-1],
                        "train_loss_last20": sum(curve[-20:]) / 20, "val_loss": 4.0}, curve) for name in kinds}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train_gpt, "train_interleaved", fake_interleaved)
    assert train_gpt.main(["--out", str(tmp_path)]) == 0
    cfg = _report(tmp_path)["config"]
    assert {k: cfg[k] for k in ("d_model", "layers", "seq", "batch", "steps")} == train_gpt.CPU_CONFIG
    assert cfg["precision"] == "fp32" and cfg["compile"] is False and cfg["heads"] == 2
    assert seen == [(("plain", "fused"), False, "cpu")]


def test_variants_alternate_in_rounds(monkeypatch):
    """train_interleaved: both variants' warm-ups, then rounds of CHUNK_STEPS steps, the order
    reversed every other round; every step of each run is taken exactly once, in order."""
    calls = []

    class FakeRun:
        def __init__(self, kind, compiled, init, data, args, device, label):
            self.label = label

        def advance(self, first, last):
            calls.append((self.label, first, last))

        def finish(self):
            return {"label": self.label}, []

    monkeypatch.setattr(train_gpt, "Run", FakeRun)
    args = types.SimpleNamespace(warmup=4, steps=27)
    got = train_gpt.train_interleaved({"a": "plain", "b": "fused"}, False, None, None, args, None, "eager")
    assert got == {"a": ({"label": "eager a"}, []), "b": ({"label": "eager b"}, [])}
    assert calls == [("eager a", 0, 4), ("eager b", 0, 4), ("eager a", 4, 14), ("eager b", 4, 14),
                     ("eager b", 14, 24), ("eager a", 14, 24), ("eager a", 24, 27), ("eager b", 24, 27)]


def test_disagreeing_mlp_fails_the_check(tmp_path, monkeypatch, capsys):
    """A 'fused' variant with another activation (ReLU) must be reported as differing, exit 1."""
    real = train_gpt.FusedMLP
    monkeypatch.setattr(train_gpt, "FusedMLP", lambda d, h, activation: real(d, h, activation="relu"))
    assert train_gpt.main([*TINY, "--out", str(tmp_path)]) == 1
    assert not _report(tmp_path)["agreement"]["eager"]["agree"]
    assert "FAIL" in capsys.readouterr().out


def test_gpu_with_cpu_only_build_is_refused(tmp_path, monkeypatch):
    """A GPU is present but the extension has no CUDA kernels: a clear error at once, no CPU run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train_gpt.fused_dense, "has_cuda_kernels", lambda: False)
    monkeypatch.setattr(train_gpt, "stdlib_text", lambda *a: pytest.fail("data was read before the check"))
    with pytest.raises(SystemExit) as exc:
        train_gpt.main(["--out", str(tmp_path)])
    message = str(exc.value.code)
    assert "without its CUDA kernels" in message and "nvcc" in message and "--device cpu" in message
    assert not (tmp_path / "train_gpt.json").exists()


def test_stdlib_text_is_deterministic_and_split():
    train, val = train_gpt.stdlib_text()
    again_train, again_val = train_gpt.stdlib_text()
    assert torch.equal(train, again_train) and torch.equal(val, again_val)
    assert len(train) > 1_000_000 and 0 < len(val) < len(train) / 5
    assert b"def " in bytes(train[:200_000].tolist())


def test_script_runs_as_a_program(tmp_path):
    """`python examples/train_gpt.py` from another folder: --out is relative to the caller."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *TINY[:4],
                           "--d-model", "32", "--layers", "1", "--seq", "16", "--batch", "2", "--out", "o"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(_report(tmp_path / "o")["runs"]) == {"eager nn.Linear", "eager FusedMLP"}


def _largest_ma_gap(curve, ref, window):
    """The test's own moving averages: (largest relative gap, 1-based step ending that window)."""
    ma = [sum(curve[i:i + window]) / window for i in range(len(curve) - window + 1)]
    mr = [sum(ref[i:i + window]) / window for i in range(len(ref) - window + 1)]
    gaps = [abs(a - b) / b for a, b in zip(ma, mr)]
    return max(gaps), gaps.index(max(gaps)) + window


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_cpu_fp8_run_writes_a_verdict_its_curves_give(tmp_path, capfd, scaling):
    """Three runs (FP8 at every size, bf16, fp32), each in its own process; the verdict's figures
    follow from the curves in the JSON and the exit status from the verdict. Whether FP8 is within
    the limit after 24 CPU steps of a tiny model is not asserted."""
    code = train_gpt.main([*FP8_TINY, "--fp8", scaling, "--out", str(tmp_path)])
    report = _report(tmp_path)
    fp8, bf16, fp32 = f"eager fp8 {scaling}", "eager bf16", "eager fp32"
    assert set(report["runs"]) == {fp8, bf16, fp32}
    assert report["config"]["fp8"] == scaling and report["config"]["precision"] == "bf16"
    assert report["config"]["compile"] is False
    curves = report["loss_curves"]
    for name in (fp8, bf16, fp32):
        assert len(curves[name]) == 24 and math.isfinite(report["runs"][name]["val_loss"]), name
        assert sum(curves[name][-4:]) / 4 < curves[name][0] - 0.5, (name, curves[name])
    # the bf16 run has the same layers without FP8 (deterministic on the CPU): FP8 took effect
    assert curves[fp8] != curves[bf16]
    assert "fp8_layers" not in report["runs"][bf16]
    v = report["fp8"]
    assert v["window"] == train_gpt.FP8_WINDOW == 20 and v["factor"] == 3 and v["floor"] == train_gpt.FP8_FLOOR
    gap, at = _largest_ma_gap(curves[fp8], curves[bf16], 20)
    ref, ref_at = _largest_ma_gap(curves[bf16], curves[fp32], 20)
    assert v["gap_fp8_vs_bf16"] == pytest.approx(gap, rel=1e-9) and v["gap_fp8_vs_bf16_step"] == at
    assert v["gap_bf16_vs_fp32"] == pytest.approx(ref, rel=1e-9) and v["gap_bf16_vs_fp32_step"] == ref_at
    assert v["limit"] == pytest.approx(max(v["floor"], 3 * ref), rel=1e-9)
    assert v["within_limit"] == (v["gap_fp8_vs_bf16"] <= v["limit"])
    # one block: its MLP (6 GEMMs) and qkv, proj and the head as FusedDense (3 GEMMs each)
    assert v["fp8_layers"] == {"FusedMLP": 1, "FusedDense": 3, "fp8_gemms": 15, "dense_layers_not_in_fp8": 0}
    assert v["every_dense_layer_fp8"] and v["loss_fell"]
    assert v["passed"] == v["within_limit"] and code == (0 if v["passed"] else 1)
    assert (tmp_path / "train_gpt.png").stat().st_size > 0
    out, err = capfd.readouterr()
    assert f"{fp8} [" in err and "24/24" in err  # each run's progress bar, from its own process
    assert f"{'OK' if v['passed'] else 'FAIL'}: FP8 ({scaling} scaling, every dense layer)" in out


def _fake_fp8_runs(bf16_offset, fp8_offset):
    """run_in_own_process for --fp8 without training: curves a fixed factor off a falling fp32 curve."""
    def fake(argv, mode, name, args):
        curve = [5.0 - 0.03 * i for i in range(args.steps)]
        factor = {"fp32": 1.0, "bf16": 1.0 + bf16_offset}.get(name, 1.0 + fp8_offset)
        curve = [c * factor for c in curve]
        run = {"tokens_per_s": 1.0, "peak_memory_gib": None, "final_train_loss": curve[-1],
               "train_loss_last20": sum(curve[-20:]) / 20, "val_loss": 4.0}
        if name.startswith("fp8"):
            run["fp8_layers"] = {"FusedMLP": 1, "FusedDense": 3, "fp8_gemms": 15, "dense_layers_not_in_fp8": 0}
        return run, curve
    return fake


@pytest.mark.parametrize("bf16_offset, fp8_offset, limit, passed", [
    (4e-3, 1e-2, 1.2e-2, True),    # 3 x the bf16-vs-fp32 gap (1.2e-2) admits a 6e-3 gap
    (4e-3, 5e-2, 1.2e-2, False),   # a 4.6e-2 gap is outside it
    (1e-3, 9e-3, 1e-2, True),      # the floor (1e-2 > 3 x 1e-3) admits an 8e-3 gap
    (1e-3, 1.5e-2, 1e-2, False),   # but not a 1.4e-2 one
])
def test_fp8_verdict_decides_the_exit_status(tmp_path, monkeypatch, capsys, bf16_offset, fp8_offset, limit, passed):
    """The runs are replaced; the CPU defaults of --fp8 (FP8_CPU_CONFIG, eager) are checked on the way."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train_gpt, "run_in_own_process", _fake_fp8_runs(bf16_offset, fp8_offset))
    assert train_gpt.main(["--fp8", "delayed", "--out", str(tmp_path)]) == (0 if passed else 1)
    report = _report(tmp_path)
    cfg = report["config"]
    assert {k: cfg[k] for k in ("d_model", "layers", "seq", "batch", "steps")} == train_gpt.FP8_CPU_CONFIG
    assert cfg["compile"] is False and cfg["precision"] == "bf16"
    v = report["fp8"]
    expected = abs((1 + fp8_offset) / (1 + bf16_offset) - 1)
    assert v["gap_fp8_vs_bf16"] == pytest.approx(expected, rel=1e-6)
    assert v["gap_bf16_vs_fp32"] == pytest.approx(bf16_offset, rel=1e-6)
    assert v["limit"] == pytest.approx(limit, rel=1e-6)
    assert v["within_limit"] is passed and v["passed"] is passed
    assert ("OK: FP8 (delayed scaling" if passed else "FAIL: FP8 (delayed scaling") in capsys.readouterr().out


def test_fp8_nan_loss_is_outside_any_limit():
    fp32 = [5.0 - 0.03 * i for i in range(40)]
    fp8 = list(fp32)
    fp8[30] = math.nan
    verdict, gaps = train_gpt.fp8_verdict(fp8, fp32, fp32)
    assert verdict["gap_fp8_vs_bf16"] == math.inf and not verdict["within_limit"]
    assert verdict["limit"] == train_gpt.FP8_FLOOR and len(gaps["fp8_vs_bf16"]) == 21


@pytest.mark.parametrize("extra", [["--precision", "fp32"], ["--variable-length"]])
def test_fp8_refuses_what_it_does_not_compare(tmp_path, extra):
    with pytest.raises(SystemExit) as exc:
        train_gpt.main(["--device", "cpu", "--fp8", "current", *extra, "--out", str(tmp_path)])
    assert exc.value.code == 2 and not (tmp_path / "train_gpt.json").exists()


@pytest.mark.cuda
def test_gpu_run_short(tmp_path):
    """A short run of the GPU configuration (2 layers, 30 steps, eager and compiled)."""
    assert train_gpt.main(["--device", "cuda", "--steps", "30", "--layers", "2", "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {f"{m} {v}" for m in ("eager", "compile") for v in ("nn.Linear", "FusedMLP")}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in report["runs"].values())


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["hf-gpt2", "hf-llama"])
def test_gpu_hf_run_short(tmp_path, model):
    """--model hf-gpt2 / hf-llama on the GPU configuration cut to 2 layers and 30 steps, eager and
    compiled."""
    pytest.importorskip("transformers")
    assert train_gpt.main(["--device", "cuda", "--model", model, "--steps", "30", "--layers", "2",
                           "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {f"{m} {v}" for m in ("eager", "compile") for v in ("Hugging Face", "convert_model")}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in report["runs"].values())


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="FP8 needs a GPU of compute capability 8.9+")
def test_gpu_fp8_run_short(tmp_path):
    """--fp8 current on the GPU configuration cut to 2 layers and 40 steps: the three runs, every
    dense layer in FP8, and an exit status that follows the verdict (not asserted to pass)."""
    code = train_gpt.main(["--device", "cuda", "--fp8", "current", "--steps", "40", "--layers", "2",
                           "--out", str(tmp_path)])
    report = _report(tmp_path)
    assert set(report["runs"]) == {"eager fp8 current", "eager bf16", "eager fp32"}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in report["runs"].values())
    v = report["fp8"]
    assert v["fp8_layers"] == {"FusedMLP": 2, "FusedDense": 5, "fp8_gemms": 27, "dense_layers_not_in_fp8": 0}
    assert code == (0 if v["passed"] else 1)


def test_cpu_hf_gpt2_converted_trains_like_the_model_as_built(tmp_path, capsys):
    """--model hf-gpt2: transformers' GPT-2 as built against convert_model's, from the same weights on
    the same batches; the converter's report is printed and the curves agree step by step."""
    pytest.importorskip("transformers")
    assert train_gpt.main([*TINY, "--model", "hf-gpt2", "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {"eager Hugging Face", "eager convert_model"}
    assert report["config"]["model"] == "hf-gpt2"
    ours, theirs = report["loss_curves"]["eager convert_model"], report["loss_curves"]["eager Hugging Face"]
    assert max(abs(a - b) / b for a, b in zip(ours[:8], theirs[:8])) < 1e-5  # float32: rounding apart only
    assert sum(ours[-4:]) / 4 < ours[0] - 0.5
    out = capsys.readouterr().out
    assert "converted transformer.h.0.mlp: GPT2MLP -> ConvertedMLP" in out and "left      lm_head" in out
    assert "OK: convert_model and Hugging Face train alike" in out


def _convert_then_scale(monkeypatch, layer_type, names):
    """convert_model, then the named parameters of every `layer_type` layer scaled by 1.01 (after
    the converter's own probe, so only the training comparison can notice)."""
    real = train_gpt.fused_dense.convert_model

    def convert_then_scale(model, **kw):
        report = real(model, **kw)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, layer_type):
                    for name in names:
                        m.get_parameter(name).mul_(1.01)
        return report
    monkeypatch.setattr(train_gpt.fused_dense, "convert_model", convert_then_scale)


def test_cpu_hf_gpt2_wrong_converted_mlp_fails(tmp_path, monkeypatch, capsys):
    """Converted MLPs whose output is 1% off (fc2 scaled after the converter's own probe) must fail
    the check: the first steps' agreement catches it."""
    pytest.importorskip("transformers")
    _convert_then_scale(monkeypatch, train_gpt.fused_dense.convert.ConvertedMLP, ("fc2.weight", "fc2.bias"))
    assert train_gpt.main([*TINY, "--model", "hf-gpt2", "--out", str(tmp_path)]) == 1
    agreement = _report(tmp_path)["agreement"]["eager"]
    assert not agreement["agree"] and agreement["max_relative_gap_first_steps"] > 1e-4, agreement
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["hf-gpt2", "hf-llama"])
@pytest.mark.parametrize("extra", [["--fp8", "current"], ["--variable-length"]])
def test_hf_models_refuse_what_they_do_not_compare(tmp_path, extra, model):
    with pytest.raises(SystemExit):
        train_gpt.main([*TINY, "--model", model, *extra, "--out", str(tmp_path)])


def test_cpu_hf_llama_converted_trains_like_the_model_as_built(tmp_path, capsys):
    """--model hf-llama: transformers' Llama as built against convert_model's (its MLPs as
    FusedGatedMLP), from the same weights on the same batches; the curves agree step by step."""
    pytest.importorskip("transformers")
    assert train_gpt.main([*TINY, "--model", "hf-llama", "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {"eager Hugging Face", "eager convert_model"}
    ours, theirs = report["loss_curves"]["eager convert_model"], report["loss_curves"]["eager Hugging Face"]
    assert max(abs(a - b) / b for a, b in zip(ours[:8], theirs[:8])) < 1e-5  # float32: rounding apart only
    out = capsys.readouterr().out
    assert "converted model.layers.0.mlp: LlamaMLP -> FusedGatedMLP(swiglu)" in out
    assert "OK: convert_model and Hugging Face train alike" in out


def test_cpu_hf_llama_wrong_converted_mlp_fails(tmp_path, monkeypatch, capsys):
    """Converted gated MLPs whose output is 1% off (the down weight scaled after conversion) fail."""
    pytest.importorskip("transformers")
    _convert_then_scale(monkeypatch, train_gpt.fused_dense.FusedGatedMLP, ("down_proj.weight",))
    assert train_gpt.main([*TINY, "--model", "hf-llama", "--out", str(tmp_path)]) == 1
    agreement = _report(tmp_path)["agreement"]["eager"]
    assert not agreement["agree"] and agreement["max_relative_gap_first_steps"] > 1e-4, agreement


def test_slow_steps_counts_steps_over_the_limit_of_their_median():
    """slow_steps: steps over SLOW_STEP x the median of all the run's steps, across its rounds."""
    assert train_gpt.slow_steps([[10.0, 10.0, 11.4], [11.6, 20.0]]) == 1  # median 11.4: limit 13.11
    assert train_gpt.slow_steps([[10.0, 10.0, 10.0], [11.6, 20.0]]) == 2  # median 10.0: limit 11.5
    assert train_gpt.slow_steps([[10.0] * 5]) == 0
    assert train_gpt.slow_steps([]) == 0
