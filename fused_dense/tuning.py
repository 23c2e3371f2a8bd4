"""The tuner behind ``heuristic='auto'``: its settings, counters and buckets, read and set here.

How it chooses (buckets of the token count, where a choice comes from, the budget, the fixed rule)
and the environment variables that :func:`configure` overrides are written once, in
docs/contract.md ("Heuristic codes"); the C++ core (csrc/core/tuning/tuner.h) implements them.
"""
import math
import os

import torch

from ._loader import has_cuda_kernels, load_library

SHIPPED_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning_tables", "choices.txt")

_FIELDS = ("enabled", "budget_s", "problem_budget_ms", "pace", "buckets", "cache", "table")


def _require_tuner(what):
    load_library()
    if not has_cuda_kernels():
        raise RuntimeError(f"fused_dense.tuning.{what}: this build has no CUDA kernels, so nothing is tuned "
                           "(a CPU-only build runs the reference kernels)")


def settings() -> dict:
    """The tuner's current settings: enabled, budget_s, problem_budget_ms, buckets, cache, table
    (empty strings: no file)."""
    _require_tuner("settings")
    return dict(zip(_FIELDS, torch.ops.fused_dense.tuning_settings()))


def configure(*, enabled=None, budget_s=None, problem_budget_ms=None, pace=None, buckets=None, cache=None,
              table=None) -> dict:
    """Changes the given settings for this process and returns the previous ones (so a caller can
    restore them with ``configure(**previous)``).

    enabled: measure new problems at all (False: shipped table, cache and fixed rule only).
    budget_s: seconds of measuring per process (default 30).
    problem_budget_ms: per problem (default 100); once spent, what has been measured decides.
    pace: the share of wall time measuring may take (default 0.05: at most 0.1 s plus 5% of the
        time since the first measurement, so early steps stay fast and later ones measure the
        rest); 1 or more: unpaced.
    buckets: buckets per octave of M, 1, 2 (default; the shipped table's grid), 4 or 8; 0 keys
        choices by the exact M.
    cache: path of the file that keeps choices across processes (None keeps it, '' turns it off).
    table: path of a table of choices (None keeps it, '' leaves the shipped one out,
        :data:`SHIPPED_TABLE` restores it).
    """
    _require_tuner("configure")
    for name, value in (("budget_s", budget_s), ("problem_budget_ms", problem_budget_ms), ("pace", pace)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value >= 0):
            raise ValueError(f"fused_dense.tuning.configure: {name} must be a finite number >= 0, got {value!r}")
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"fused_dense.tuning.configure: enabled must be True or False, got {enabled!r}")
    if buckets is not None and (isinstance(buckets, bool) or buckets not in (0, 1, 2, 4, 8)):
        raise ValueError(f"fused_dense.tuning.configure: buckets must be 0, 1, 2, 4 or 8 (per octave of M; 0: "
                         f"exact M), got {buckets!r}")
    for name, value in (("cache", cache), ("table", table)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"fused_dense.tuning.configure: {name} must be a path or '', got {value!r}")
    previous = settings()
    new = dict(previous)
    given = dict(enabled=enabled, budget_s=budget_s, problem_budget_ms=problem_budget_ms, pace=pace,
                 buckets=buckets, cache=cache, table=table)
    new.update({k: (os.fspath(v) if k in ("cache", "table") else v) for k, v in given.items() if v is not None})
    torch.ops.fused_dense.set_tuning_settings(bool(new["enabled"]), float(new["budget_s"]),
                                              float(new["problem_budget_ms"]), float(new["pace"]),
                                              int(new["buckets"]),
                                              new["cache"], new["table"])
    return previous


def stats() -> dict:
    """Counters of this process: problems_measured, rule_choices (given the fixed rule, nothing
    measured), table_choices and cache_choices (entries read), measuring_s, heuristic_queries
    (cuBLASLt algorithm lists built; a new M of a known bucket adds none)."""
    _require_tuner("stats")
    names = ("problems_measured", "rule_choices", "table_choices", "cache_choices", "measuring_s",
             "heuristic_queries")
    return dict(zip(names, torch.ops.fused_dense.tuning_stats()))


def m_bucket(m: int):
    """(bucket index, representative M) of token count m under the current settings."""
    _require_tuner("m_bucket")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"fused_dense.tuning.m_bucket: m must be an int >= 1, got {m!r}")
    return tuple(torch.ops.fused_dense.tuning_m_bucket(m))


def _install_shipped_table():
    """Points the tuner at the package's table (FUSED_DENSE_TUNING_TABLE still overrides it)."""
    if has_cuda_kernels():
        torch.ops.fused_dense.set_default_tuning_table(SHIPPED_TABLE if os.path.isfile(SHIPPED_TABLE) else "")


_install_shipped_table()  # once, when the package is imported
