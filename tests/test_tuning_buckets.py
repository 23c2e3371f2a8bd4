"""heuristic='auto' across token counts (csrc/core/tuning/tuner.h, fused_dense/tuning.py): M buckets, one
measurement per bucket reused at every M in it without a heuristic query, the tuning budget, the
table of choices (python -m fused_dense.tune writes it; a process reads it and measures nothing),
and the settings' argument checks.

Results are checked against float64 references from plain PyTorch on fresh random inputs; the
widths are ones no other test uses, so the buckets start untuned in a shared pytest process."""
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


def mlp_step_checked(mlp, m, gen):
    """One forward + backward of mlp at m tokens on fresh random data, checked against float64."""
    dev, dt = mlp.fc1.weight.device, mlp.fc1.weight.dtype
    x = torch.randn(m, mlp.fc1.in_features, device=dev, dtype=dt, generator=gen).requires_grad_()
    g = torch.randn(m, mlp.fc2.out_features, device=dev, dtype=dt, generator=gen)
    out = mlp(x)
    out.backward(g)
    x64 = x.detach().double().requires_grad_()
    w1, b1, w2, b2 = (p.detach().double().requires_grad_() for p in
                      (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias))
    ref = F.linear(F.gelu(F.linear(x64, w1, b1), approximate="tanh"), w2, b2)
    ref.backward(g.double())
    # two GEMMs and the activation chained: twice the one-rounding tolerance (docs/contract.md)
    tol = 2 * TOL[dt]
    for name, got, want in (("out", out, ref), ("grad x", x.grad, x64.grad), ("grad w1", mlp.fc1.weight.grad, w1.grad),
                            ("grad w2", mlp.fc2.weight.grad, w2.grad), ("grad b1", mlp.fc1.bias.grad, b1.grad)):
        err = rel_err(got, want)
        assert err <= tol, f"{name} at M={m}: relative error {err:.3e} > {tol:.1e}"
    mlp.zero_grad(set_to_none=True)


@pytest.fixture
def unpaced_without_table():
    """Measuring unpaced and unbounded, without the shipped table or a cache file; restored after."""
    cuda_or_skip()
    previous = tuning.configure(enabled=True, budget_s=1e6, pace=1.0, buckets=4, table="", cache="",
                                deterministic=False)
    yield
    tuning.configure(**previous)


def nearest_round_count(m, b):
    """The bucket rule of docs/contract.md written out: counts below 16 are their own; above, the
    representatives are 2^k (1 + j / b) and m takes the nearest by ratio (the lower on a tie)."""
    if m < 16 or b == 0:
        return m
    octave = 1 << (m.bit_length() - 1)
    step = octave // b
    lo = octave + (m - octave) // step * step
    hi = lo + step
    return lo if m * m <= lo * hi else hi


@pytest.mark.cuda
def test_bucket_rule():
    cuda_or_skip()
    previous = tuning.configure(buckets=4)
    try:
        counts = list(range(1, 600)) + list(range(600, 70000, 97)) + [2048, 3072, 4096, 6144, 8192, 12288, 16384,
                                                                     24576, 32768, 10240, 14336, 8191, 8193, 9216]
        for b in (1, 2, 4, 8, 0):
            tuning.configure(buckets=b)
            reps = set(tuning.representatives(1, 140000))
            for m in counts:
                index, rep = tuning.m_bucket(m)
                assert rep == index == nearest_round_count(m, b), (b, m, rep)
                assert rep in reps and tuning.m_bucket(rep)[1] == rep, f"b={b}: representative {rep} of M={m}"
            if b >= 2:  # the token counts people use are measured at their exact M
                for m in (2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768):
                    assert tuning.m_bucket(m)[1] == m, (b, m)
        tuning.configure(buckets=4)
        assert tuning.representatives(8000, 17000) == [8192, 10240, 12288, 14336, 16384]
        assert tuning.m_bucket(9000)[1] == 8192 and tuning.m_bucket(9300)[1] == 10240
        with pytest.raises(ValueError, match="lo"):
            tuning.representatives(10, 5)
    finally:
        tuning.configure(**previous)


@pytest.mark.cuda
def test_new_token_count_in_a_tuned_bucket_measures_nothing_and_queries_nothing(unpaced_without_table):
    """With refine off, a count that is no representative takes its bucket's choice as it is."""
    gen = torch.Generator(device="cuda")
    gen.seed()
    mlp = FusedMLP(328, 712, device="cuda", dtype=torch.bfloat16)
    tuning.configure(refine=False)
    before = tuning.stats()
    mlp_step_checked(mlp, 1500, gen)
    tuned = tuning.stats()
    assert tuned["problems_measured"] > before["problems_measured"], "the first M of a bucket measured nothing"
    for m in (1460, 1536, 1601, 1650):
        assert tuning.m_bucket(m)[0] == tuning.m_bucket(1500)[0]
        mlp_step_checked(mlp, m, gen)
    after = tuning.stats()
    assert after["problems_measured"] == tuned["problems_measured"], "a new M of a tuned bucket was measured"
    assert after["heuristic_queries"] == tuned["heuristic_queries"], \
        f"new M of a tuned bucket asked cuBLASLt's heuristic {after['heuristic_queries'] - tuned['heuristic_queries']} times"


@pytest.mark.cuda
def test_count_that_is_no_representative_is_measured_at_its_exact_m(unpaced_without_table):
    """refine (the default): a count between representatives takes its bucket's choice while
    measuring is not allowed, and is measured at its exact M, once, when it is."""
    gen = torch.Generator(device="cuda")
    gen.seed()
    mlp = FusedMLP(336, 728, device="cuda", dtype=torch.bfloat16)
    assert tuning.settings()["refine"] is True
    before = tuning.stats()
    mlp_step_checked(mlp, 1536, gen)  # the representative: measured at 1536
    tuned = tuning.stats()
    assert tuned["problems_measured"] > before["problems_measured"], "the representative was not measured"
    assert tuning.m_bucket(1553)[1] == 1536
    tuning.configure(enabled=False)  # not allowed: the bucket's choice, nothing measured
    mlp_step_checked(mlp, 1553, gen)
    assert tuning.stats()["problems_measured"] == tuned["problems_measured"], "measured while not allowed"
    tuning.configure(enabled=True)
    mlp_step_checked(mlp, 1553, gen)  # allowed: measured at 1553 (the MLP step's three GEMM problems)
    refined = tuning.stats()
    assert refined["problems_measured"] >= tuned["problems_measured"] + 3, (tuned, refined)
    for _ in range(2):  # and kept: nothing measured again
        mlp_step_checked(mlp, 1553, gen)
    assert tuning.stats()["problems_measured"] == refined["problems_measured"], "the exact M was measured twice"
    tuning.configure(deterministic=True)  # deterministic mode never keys by the exact M
    mlp_step_checked(mlp, 1601, gen)
    assert tuning.stats()["problems_measured"] == refined["problems_measured"], "measured in deterministic mode"


@pytest.mark.cuda
def test_spent_budget_keeps_the_rule_and_measures_later(unpaced_without_table):
    gen = torch.Generator(device="cuda")
    gen.seed()
    mlp = FusedMLP(344, 720, device="cuda", dtype=torch.float16)
    tuning.configure(budget_s=0.0)
    before = tuning.stats()
    mlp_step_checked(mlp, 700, gen)
    ruled = tuning.stats()
    assert ruled["problems_measured"] == before["problems_measured"], "measured with no budget left"
    assert ruled["rule_choices"] > before["rule_choices"]
    tuning.configure(budget_s=1e6)
    mlp_step_checked(mlp, 700, gen)
    assert tuning.stats()["problems_measured"] > ruled["problems_measured"], \
        "the rule's choice, kept while the budget was spent, was never measured once budget was given"


@pytest.mark.cuda
def test_per_problem_budget_bounds_the_measuring(unpaced_without_table):
    """With a 0 ms budget per problem only the first two candidates are timed, once: a problem's
    measuring takes a few runs, not rounds of every candidate."""
    gen = torch.Generator(device="cuda")
    gen.seed()
    mlp = FusedMLP(352, 736, device="cuda", dtype=torch.bfloat16)
    tuning.configure(problem_budget_ms=0.0)
    before = tuning.stats()
    mlp_step_checked(mlp, 3000, gen)
    after = tuning.stats()
    measured = after["problems_measured"] - before["problems_measured"]
    assert measured >= 4, f"only {measured} problems measured"
    per_problem_ms = (after["measuring_s"] - before["measuring_s"]) * 1e3 / measured
    assert per_problem_ms < 60, f"{per_problem_ms:.1f} ms per problem with a 0 ms budget"


# A forward of about 3 ms on the H200 (2.2 TFLOP) and one of about 0.1 ms; widths no other test uses.
LONG_FORWARD = (8192, 8192, 16392)
SHORT_FORWARD = (1000, 1016, 2040)


@pytest.mark.cuda
def test_long_problems_are_timed_after_a_lead_in_of_their_own_runs(unpaced_without_table, capfd, monkeypatch):
    """A problem whose run takes 2 ms or more after the warm-up times each candidate after 60 ms of its own
    runs (the clock settles to what the kernel draws under the power cap); a short one does not.
    The tuner's verbose line says which, and the result is the op's either way."""
    monkeypatch.setenv("FUSED_DENSE_TUNING_VERBOSE", "1")
    tuning.configure(problem_budget_ms=0.0, buckets=0)  # the first two candidates, once
    gen = torch.Generator(device="cuda")
    gen.seed()
    lines = {}
    for name, (m, k, n) in (("long", LONG_FORWARD), ("short", SHORT_FORWARD)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        capfd.readouterr()
        out = ops.linear_act(x, w, b, "gelu_approx", True, "auto")
        torch.cuda.synchronize()
        err = capfd.readouterr().err
        tuned = [l for l in err.splitlines() if f"B={m} K={k} N={n}" in l and "tuned forward" in l]
        assert len(tuned) == 1, f"{name}: expected one tuned line for B={m} K={k} N={n}, stderr:\n{err}"
        lines[name] = tuned[0]
        ref = F.gelu(F.linear(x[:64].double(), w.double(), b.double()), approximate="tanh")
        e = rel_err(out[0][:64], ref)
        assert e <= 2 * TOL[torch.bfloat16], f"{name}: relative error {e:.3e}"
    assert "each run after" in lines["long"], lines["long"]
    assert "each run after" not in lines["short"], lines["short"]


def run_python(args, env_extra, timeout=600):
    env = dict(os.environ, **env_extra)
    env.pop("FUSED_DENSE_TUNING_CACHE", None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:3]}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


# Reads the table named by FUSED_DENSE_TUNING_TABLE with measuring off, runs FusedMLP(256, 1024)
# at token counts of the tabled buckets, checks against float64 and prints the tuner's counters.
READER = r"""
import sys, torch
sys.path.insert(0, 'tests')
import fused_dense
from fused_dense import FusedMLP, tuning
from test_tuning_buckets import mlp_step_checked
gen = torch.Generator(device='cuda'); gen.seed()
mlp = FusedMLP(256, 1024, device='cuda', dtype=torch.bfloat16)
for m in (612, 700, 859):
    mlp_step_checked(mlp, m, gen)
import json
print('STATS', json.dumps(tuning.stats()))
"""


def reader_stats(table):
    proc = run_python(["-c", READER], {"FUSED_DENSE_TUNING": "0", "FUSED_DENSE_TUNING_TABLE": str(table)})
    line = [l for l in proc.stdout.splitlines() if l.startswith("STATS ")][-1]
    return json.loads(line[len("STATS "):])


@pytest.mark.cuda
def test_table_written_by_the_tool_serves_without_measuring(tmp_path):
    cuda_or_skip()
    table = tmp_path / "choices.txt"
    tool = run_python(["-m", "fused_dense.tune", "--out", str(table), "--dims", "256", "--dtypes", "bfloat16",
                       "--activations", "gelu_approx", "--min-tokens", "600", "--max-tokens", "900", "--fresh"], {})
    assert "choices measured" in tool.stdout, tool.stdout[-2000:]
    lines = [l for l in table.read_text().splitlines() if l and not l.startswith("#")]
    assert lines and all(l.startswith("sm") and "/cublasLt" in l for l in lines), lines[:3]
    stats = reader_stats(table)
    assert stats["table_choices"] == len(lines), stats
    assert stats["problems_measured"] == 0 and stats["rule_choices"] == 0, \
        f"a process with the table measured or fell back to the rule: {stats}"

    # lines of another compute capability are not read (the process falls back to the rule)
    other = tmp_path / "other.txt"
    other.write_text("\n".join("sm10" + l[l.index("/"):] for l in lines) + "\n")
    stats = reader_stats(other)
    assert stats["table_choices"] == 0 and stats["rule_choices"] > 0, stats

    # an algorithm the problem never had (its 8 words zeroed) is checked before use: results stay
    # correct (the reader checks them) whatever cuBLASLt makes of it
    zeroed = tmp_path / "zeroed.txt"
    zeroed.write_text("\n".join(" ".join(l.split()[:-8] + ["0" * 16] * 8) for l in lines) + "\n")
    stats = reader_stats(zeroed)
    assert stats["table_choices"] == len(lines), stats


# An FP8 MLP step at a representative token count (640) with the table named by
# FUSED_DENSE_TUNING_TABLE and measuring off; prints the tuner's counters.
FP8_READER = r"""
import json, torch
from fused_dense import Float8Recipe, FusedMLP, tuning
torch.manual_seed(0)
mlp = FusedMLP(2048, 8192, fp8=Float8Recipe(), device='cuda', dtype=torch.bfloat16)
x = torch.randn(640, 2048, device='cuda', dtype=torch.bfloat16, requires_grad=True)
mlp(x).float().sum().backward()
torch.cuda.synchronize()
print('STATS', json.dumps(tuning.stats()))
"""


@pytest.mark.cuda
def test_tool_measures_fp8_choices_that_serve_an_fp8_mlp(tmp_path):
    """--fp8-only adds the FP8 GEMMs' choices (op kinds 5 and 6: the forward, and a gradient times
    a weight or an input; 7 at most besides) to a table and leaves its bf16 lines byte for byte; an
    FP8 MLP at a tabled count then measures nothing and takes no rule's choice."""
    cuda_or_skip()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a GPU of compute capability 8.9+")
    table = tmp_path / "choices.txt"
    common = ["-m", "fused_dense.tune", "--out", str(table), "--dims", "2048", "--dtypes", "bfloat16",
              "--activations", "gelu_approx", "--min-tokens", "600", "--max-tokens", "700",
              "--problem-budget-ms", "50"]

    def lines():
        return [l for l in table.read_text().splitlines() if l and not l.startswith("#")]

    run_python(common + ["--fresh"], {})
    bf16 = lines()
    assert bf16 and {int(l.split()[1]) for l in bf16}.isdisjoint({5, 6, 7}), bf16[:3]
    run_python(common + ["--fp8-only"], {})
    added = [l for l in lines() if l not in bf16]
    assert set(bf16) <= set(lines()), "--fp8-only changed or dropped a bf16 line"
    kinds = {int(l.split()[1]) for l in added}
    assert {5, 6} <= kinds <= {5, 6, 7}, kinds
    proc = run_python(["-c", FP8_READER], {"FUSED_DENSE_TUNING": "0", "FUSED_DENSE_TUNING_TABLE": str(table)})
    line = [l for l in proc.stdout.splitlines() if l.startswith("STATS ")][-1]
    stats = json.loads(line[len("STATS "):])
    assert stats["table_choices"] > 0 and stats["problems_measured"] == 0 and stats["rule_choices"] == 0, stats


def test_tool_refuses_fp8_only_without_fp8_items():
    proc = subprocess.run([sys.executable, "-m", "fused_dense.tune", "--out", os.devnull, "--dims", "768",
                           "--fp8-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        assert "needs a CUDA build" in proc.stderr, proc.stderr[-2000:]
    elif torch.cuda.get_device_capability() < (8, 9):
        assert "compute capability 8.9" in proc.stderr, proc.stderr[-2000:]
    else:
        assert "--fp8-only measures bfloat16 widths" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.cuda
def test_configure_checks_its_arguments():
    cuda_or_skip()
    for bad in (dict(budget_s=-1.0), dict(problem_budget_ms=float("nan")), dict(pace="fast"), dict(enabled=1),
                dict(buckets="yes"), dict(buckets=3), dict(buckets=True), dict(cache=3), dict(deterministic=1),
                dict(refine="on")):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            tuning.configure(**bad)
    previous = tuning.configure(budget_s=12.5)
    try:
        assert tuning.settings()["budget_s"] == 12.5
    finally:
        tuning.configure(**previous)
    assert tuning.settings() == previous
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        tuning.m_bucket(0)


def test_tuning_module_in_this_build():
    """A CUDA build reports its settings; a CPU-only build says it has no tuner."""
    if fused_dense.has_cuda_kernels():
        assert set(tuning.settings()) == {"enabled", "budget_s", "problem_budget_ms", "pace", "buckets", "cache",
                                          "table", "deterministic", "refine"}
    else:
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            tuning.settings()


def test_tune_tool_rejects_bad_arguments():
    from fused_dense import tune
    for argv, message in ((["--out", "t.txt", "--min-tokens", "0"], "--min-tokens must be >= 1"),
                          (["--out", "t.txt", "--min-tokens", "900", "--max-tokens", "10"], "must be <= --max-tokens"),
                          (["--out", "t.txt", "--dims", "0"], "--dims must be positive"),
                          (["--out", "t.txt", "--dtypes", "float64"], "invalid choice")):
        proc = subprocess.run([sys.executable, "-m", "fused_dense.tune", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr[-1000:])
    key = "sm90/cublasLt13.0/choices3 0 1 20 1024 4096 1 1 1 0 1"
    assert tune.merge([key + " 1 0 -1 1 first", key + " 0 2 -1 1 second"]) == [key + " 0 2 -1 1 second"]


def test_shipped_table_holds_no_cutlass_choice_for_a_long_problem():
    """docs/contract.md: the shipped table leaves out the problems of 1.3 TFLOP or more whose choice
    was a cutlass_sm90 kernel measured without the lead-in. The work is the GEMM's own, written out
    here from the key (op, dtype, M, K, N, ...): 2 M K N, and a gated forward's gate and up as one
    GEMM of twice N."""
    path = os.path.join(ROOT, "fused_dense", "tuning_tables", "choices.txt")
    long_cutlass, lines = [], 0
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            lines += 1
            w = line.split()
            op, m, k, n = int(w[1]), int(w[3]), int(w[4]), int(w[5])
            cutlass = int(w[13])
            tflop = 2.0 * m * k * n * (2 if op == 3 else 1) / 1e12
            if cutlass >= 0 and tflop >= 1.3:
                long_cutlass.append((round(tflop, 2), " ".join(w[:14])))
    assert lines > 1000, f"the shipped table has {lines} lines"
    assert not long_cutlass, f"cutlass choices for problems of >= 1.3 TFLOP: {sorted(long_cutlass)[:5]}"
