"""'auto' whose numerics do not depend on timing (csrc/core/tuning/tuner.h, docs/contract.md
"Heuristic codes"): deterministic mode takes no choice timed in the process, so two processes give
the same bits and a process that measured gives the bits of one that did not; choices exported by
one process and imported by another; the caches bounded over 10,000 distinct token counts.

Each bitwise comparison also checks the results against a float64 reference, so equal bits are
equal right answers."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fused_dense
from conftest import TOL, rel_err
from fused_dense import FusedMLP, ops, tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_or_skip():
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a GPU")


# One forward + backward of FusedMLP(d, h) at several token counts on seeded inputs, checked against
# float64, printing a digest of every output and gradient. Widths no other test uses.
STEP = r"""
import hashlib, json, sys, torch
import torch.nn.functional as F
from fused_dense import FusedMLP, tuning
d, h = 392, 1416
torch.manual_seed(1234)
mlp = FusedMLP(d, h, device='cuda', dtype=torch.bfloat16)
digest = hashlib.sha256()
errors = []
for m in (1000, 2048, 3000):
    x = torch.randn(m, d, device='cuda', dtype=torch.bfloat16).requires_grad_()
    g = torch.randn(m, d, device='cuda', dtype=torch.bfloat16)
    out = mlp(x)
    out.backward(g)
    x64 = x.detach().double().requires_grad_()
    w1, b1, w2, b2 = (p.detach().double().requires_grad_() for p in mlp.parameters())
    ref = F.linear(F.gelu(F.linear(x64, w1, b1), approximate='tanh'), w2, b2)
    ref.backward(g.double())
    for got, want in ((out, ref), (x.grad, x64.grad), (mlp.fc1.weight.grad, w1.grad), (mlp.fc2.weight.grad, w2.grad)):
        errors.append(float((got.double() - want).norm() / want.norm()))
        digest.update(got.detach().float().cpu().numpy().tobytes())
    mlp.zero_grad(set_to_none=True)
print('RESULT', json.dumps({'digest': digest.hexdigest(), 'errors': errors, 'stats': tuning.stats()}))
"""


def run_step(env_extra, code=STEP):
    # torch's own cuBLAS calls (the float64 reference) need this under use_deterministic_algorithms
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", **env_extra)
    env.pop("FUSED_DENSE_TUNING_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    # two GEMMs and the activation chained: twice the one-rounding tolerance (docs/contract.md)
    assert max(res["errors"]) <= 2 * TOL[torch.bfloat16], res["errors"]
    return res


@pytest.mark.cuda
def test_deterministic_mode_gives_the_same_bits_in_two_processes_whatever_they_measured():
    """Two processes in deterministic mode give identical bits and time nothing; a third process,
    which first measured the same problems (and so holds timed choices), gives the same bits
    once switched to deterministic mode: timed choices never reach its results."""
    cuda_or_skip()
    det = {"FUSED_DENSE_TUNING_DETERMINISTIC": "1", "FUSED_DENSE_TUNING_TABLE": "0"}
    a, b = run_step(det), run_step(det)
    assert a["digest"] == b["digest"], "two processes in deterministic mode gave different bits"
    assert a["stats"]["problems_measured"] == 0 and b["stats"]["problems_measured"] == 0, (a["stats"], b["stats"])
    measured_then_det = STEP.replace(
        "digest = hashlib.sha256()",
        "tuning.configure(enabled=True, budget_s=1e6, pace=1.0)\n"
        "for m in (1000, 2048, 3000):\n"
        "    xx = torch.randn(m, d, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "    mlp(xx).sum().backward()\n"
        "mlp.zero_grad(set_to_none=True)\n"
        "assert tuning.stats()['problems_measured'] > 0\n"
        "torch.manual_seed(1234); _ = FusedMLP(d, h, device='cuda', dtype=torch.bfloat16)\n"
        "torch.use_deterministic_algorithms(True)\n"
        "digest = hashlib.sha256()")
    c = run_step({"FUSED_DENSE_TUNING_TABLE": "0"}, measured_then_det)
    assert c["stats"]["problems_measured"] > 0, c["stats"]
    assert c["digest"] == a["digest"], "a process that had timed choices gave other bits in deterministic mode"


@pytest.mark.cuda
def test_deterministic_setting_measures_nothing_in_process():
    cuda_or_skip()
    previous = tuning.configure(deterministic=True, enabled=True, budget_s=1e6, pace=1.0, table="", cache="")
    try:
        before = tuning.stats()
        mlp = FusedMLP(408, 1432, device="cuda", dtype=torch.float16)
        x = torch.randn(777, 408, device="cuda", dtype=torch.float16, requires_grad=True)
        out = mlp(x)
        out.float().sum().backward()
        torch.cuda.synchronize()
        after = tuning.stats()
        assert after["problems_measured"] == before["problems_measured"], (before, after)
        ref = F.linear(F.gelu(F.linear(x.detach().double(), mlp.fc1.weight.double(), mlp.fc1.bias.double()),
                              approximate="tanh"), mlp.fc2.weight.double(), mlp.fc2.bias.double())
        assert rel_err(out, ref) <= 2 * TOL[torch.float16]
    finally:
        tuning.configure(**previous)


@pytest.mark.cuda
def test_exported_choices_import_and_serve_deterministic_mode(tmp_path):
    """Choices measured in one process, exported and imported by another, are what the other runs
    in deterministic mode: its bits equal the measuring process's."""
    cuda_or_skip()
    lines_file = tmp_path / "lines.json"
    exporter = STEP.replace("digest = hashlib.sha256()",
                            "tuning.configure(enabled=True, budget_s=1e6, pace=1.0)\n"
                            "digest = hashlib.sha256()").replace(
        "print('RESULT'", f"json.dump(tuning.export_choices(), open({str(lines_file)!r}, 'w'))\nprint('RESULT'")
    a = run_step({"FUSED_DENSE_TUNING_TABLE": "0"}, exporter)
    lines = json.loads(lines_file.read_text())
    assert a["stats"]["problems_measured"] > 0 and len(lines) >= a["stats"]["problems_measured"], (a["stats"], len(lines))
    importer = STEP.replace("digest = hashlib.sha256()",
                            f"n = tuning.import_choices(__import__('json').load(open({str(lines_file)!r})))\n"
                            f"assert n == {len(lines)}, n\n"
                            "digest = hashlib.sha256()")
    b = run_step({"FUSED_DENSE_TUNING_TABLE": "0", "FUSED_DENSE_TUNING_DETERMINISTIC": "1"}, importer)
    assert b["stats"]["imported_choices"] == len(lines) and b["stats"]["problems_measured"] == 0, b["stats"]
    assert b["digest"] == a["digest"], "the imported choices did not give the exporter's bits"


@pytest.mark.cuda
def test_import_checks_its_arguments():
    cuda_or_skip()
    with pytest.raises(ValueError, match="lines must be strings"):
        tuning.import_choices([1, 2])
    assert tuning.import_choices(["sm10/cublasLt0.0/choices5 0 0 0 1 1 0 0 0 0 4 1 0 -1 0" + " 0" * 8,
                                  "not a line"]) == 0
    with pytest.raises(RuntimeError, match="not initialized"):
        tuning.share_choices()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.cuda
def test_caches_stay_bounded_over_10000_token_counts():
    """Exact-M keys (buckets=0) and a new token count at every call: the GEMM plans and the
    choices made in the process stay within their bounds, and the process's memory flat."""
    cuda_or_skip()
    previous = tuning.configure(buckets=0, enabled=False, table="", cache="", deterministic=False)
    try:
        K, N = 64, 72
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        x_all = torch.randn(10_000 + 16, K, device="cuda", dtype=torch.bfloat16)
        rss = {}
        for i, m in enumerate(range(17, 10_017)):
            out, _ = ops.linear_act(x_all[:m], w, b, "gelu_approx", True, "auto")
            if m in (17, 5_000, 10_000):
                ref = F.gelu(F.linear(x_all[:m].double(), w.double(), b.double()), approximate="tanh")
                assert rel_err(out, ref) <= TOL[torch.bfloat16], m
            if i in (5_000, 9_999):
                torch.cuda.synchronize()
                rss[i] = rss_bytes()
        stats = tuning.stats()
        assert stats["plans_cached"] <= 2048, stats
        assert stats["process_choices"] <= 4096, stats
        growth = rss[9_999] - rss[5_000]
        assert growth < 16 << 20, f"memory grew {growth / 2**20:.1f} MiB over the last 5,000 token counts"
    finally:
        tuning.configure(**previous)


@pytest.mark.cuda
def test_one_rank_of_several_starts_in_deterministic_mode():
    """WORLD_SIZE > 1 (torchrun's) makes deterministic mode the default; the explicit setting wins."""
    cuda_or_skip()
    code = "from fused_dense import tuning; print('DET', tuning.settings()['deterministic'])"

    def det(**env):
        e = dict(os.environ, **env)
        for k in ("WORLD_SIZE", "FUSED_DENSE_TUNING_DETERMINISTIC"):
            if k not in env:
                e.pop(k, None)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [l for l in out.stdout.splitlines() if l.startswith("DET ")][-1] == "DET True"

    assert not det()
    assert not det(WORLD_SIZE="1")
    assert det(WORLD_SIZE="2")
    assert not det(WORLD_SIZE="2", FUSED_DENSE_TUNING_DETERMINISTIC="0")
    assert det(FUSED_DENSE_TUNING_DETERMINISTIC="1")
