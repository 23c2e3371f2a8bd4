"""examples/train_gpt.py: its CPU configuration trains both MLP variants to agreeing, falling loss
curves and writes its figures; a disagreeing MLP is reported; a GPU with a CPU-only build of the
extension is refused before any training."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_gpt  # noqa: E402

TINY = ["--device", "cpu", "--steps", "16", "--d-model", "64", "--layers", "1", "--seq", "64", "--batch", "4"]


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
    fused, plain = report["loss_curves"]["eager FusedMLP"], report["loss_curves"]["eager nn.Linear"]
    # float32 on the CPU: the same math up to summation order, step by step
    assert max(abs(a - b) / b for a, b in zip(fused, plain)) < 1e-4
    assert report["agreement"]["eager"]["agree"] and report["config"]["precision"] == "fp32"
    assert (tmp_path / "train_gpt.png").stat().st_size > 0  # matplotlib is in the test environment
    captured = capsys.readouterr()
    assert "16/16" in captured.err and "tok/s" in captured.err  # the progress bar
    assert "functional check" in captured.out and "OK: FusedMLP and nn.Linear train alike" in captured.out


def test_cpu_defaults_are_the_small_configuration(tmp_path, monkeypatch):
    """Without a GPU the defaults pick the small float32 configuration and skip torch.compile; the
    training itself is replaced here (the configuration is what is checked)."""
    seen = []

    def fake_run(kind, compiled, init, data, args, device, label):
        seen.append((kind, compiled, device.type))
        curve = [5.0 - 0.01 * i for i in range(args.steps)]
        return {"tokens_per_s": 1.0, "peak_memory_gib": None, "final_train_loss": curve[-1],
                "train_loss_last20": sum(curve[-20:]) / 20, "val_loss": 4.0}, curve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train_gpt, "train_run", fake_run)
    assert train_gpt.main(["--out", str(tmp_path)]) == 0
    cfg = _report(tmp_path)["config"]
    assert {k: cfg[k] for k in ("d_model", "layers", "seq", "batch", "steps")} == train_gpt.CPU_CONFIG
    assert cfg["precision"] == "fp32" and cfg["compile"] is False and cfg["heads"] == 2
    assert seen == [("plain", False, "cpu"), ("fused", False, "cpu")]


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


@pytest.mark.cuda
def test_gpu_run_short(tmp_path):
    """A short run of the GPU configuration (2 layers, 30 steps, eager and compiled)."""
    assert train_gpt.main(["--device", "cuda", "--steps", "30", "--layers", "2", "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert set(report["runs"]) == {f"{m} {v}" for m in ("eager", "compile") for v in ("nn.Linear", "FusedMLP")}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in report["runs"].values())
