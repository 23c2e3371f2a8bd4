"""The GPT example runs end to end (a few steps on the CPU), reports agreeing loss curves, and
fails when the fused model's curve departs from the plain one."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--device", "cpu", "--steps", "12", "--d-model", "32", "--layers", "2", "--batch", "8", "--seq", "16"]


def run_python(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_train_gpt_cpu_short():
    proc = run_python([SCRIPT, *SMALL])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: loss curves agree" in proc.stdout
    assert "tok/s" in proc.stderr and "12/12" in proc.stderr  # the progress bar


def test_train_gpt_math_attention():
    """--attention math (what the sanitizer's training run uses) trains alike; other values are refused."""
    proc = run_python([SCRIPT, *SMALL, "--attention", "math"])
    assert proc.returncode == 0 and "OK: loss curves agree" in proc.stdout, proc.stdout + proc.stderr
    proc = run_python([SCRIPT, *SMALL, "--attention", "flash"])
    assert proc.returncode == 2 and "--attention" in proc.stderr and "'flash'" in proc.stderr


def test_train_gpt_cpu_bf16_short():
    proc = run_python([SCRIPT, *SMALL, "--precision", "bf16"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: loss curves agree" in proc.stdout and "bf16 noise" in proc.stdout


# Runs the example with the fused MLP's activation gradient broken (GELU' evaluated at the wrong
# point): the float32 comparison must notice and exit 1.
BROKEN = """
import sys
sys.path.insert(0, {examples!r})
from fused_dense import functional
good = functional._act_dgrad
def broken(weight, d_output, pre_act, activation, *rest):
    if activation == "gelu_approx":
        pre_act = pre_act + 1
    return good(weight, d_output, pre_act, activation, *rest)
functional._act_dgrad = broken
functional._NATIVE_MLP = None  # the broken helper is FusedMLPFunc's; the C++ op would bypass it
import train_gpt
sys.exit(train_gpt.main(sys.argv[1:]))
"""


def test_train_gpt_detects_a_broken_gradient():
    proc = run_python(["-c", BROKEN.format(examples=os.path.join(ROOT, "examples")), *SMALL])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: loss curves differ" in proc.stdout


def test_train_gpt_rejects_bad_heads():
    proc = run_python([SCRIPT, "--device", "cpu", "--steps", "1", "--d-model", "30", "--heads", "4"])
    assert proc.returncode == 2 and "--heads" in proc.stderr


@pytest.mark.cuda
def test_train_gpt_cuda_bf16():
    proc = run_python([SCRIPT, "--device", "cuda", "--steps", "200"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: loss curves agree" in proc.stdout
