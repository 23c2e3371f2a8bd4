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

_FIELDS = ("enabled", "budget_s", "problem_budget_ms", "pace", "buckets", "cache", "table", "deterministic", "refine")


def _require_tuner(what):
    load_library()
    if not has_cuda_kernels():
        raise RuntimeError(f"fused_dense.tuning.{what}: this build has no CUDA kernels, so nothing is tuned "
                           "(a CPU-only build runs the reference kernels)")


def settings() -> dict:
    """The tuner's current settings: enabled, budget_s, problem_budget_ms, pace, buckets, cache, table
    (empty strings: no file), deterministic, refine."""
    _require_tuner("settings")
    return dict(zip(_FIELDS, torch.ops.fused_dense.tuning_settings()))


def configure(*, enabled=None, budget_s=None, problem_budget_ms=None, pace=None, buckets=None, cache=None,
              table=None, deterministic=None, refine=None) -> dict:
    """Changes the given settings for this process and returns the previous ones (so a caller can
    restore them with ``configure(**previous)``).

    enabled: measure new problems at all (False: shipped table, cache and fixed rule only).
    budget_s: seconds of measuring per process (default 30).
    problem_budget_ms: per problem (default 100); once spent, what has been measured decides.
    pace: the share of wall time measuring may take (default 0.05: at most 0.1 s plus 5% of the
        time since the first measurement, so early steps stay fast and later ones measure the
        rest); 1 or more: unpaced.
    buckets: representatives per octave of M, 1, 2, 4 (default; the shipped table's grid) or 8; 0
        keys choices by the exact M.
    cache: path of the file that keeps choices across processes (None keeps it, '' turns it off).
    table: path of a table of choices (None keeps it, '' leaves the shipped one out,
        :data:`SHIPPED_TABLE` restores it).
    deterministic: choices never timed in this process (the table, the cache file, imported
        choices, else the fixed rule), as under ``torch.use_deterministic_algorithms(True)``; use it
        in a process group unless the ranks share their choices (:func:`share_choices`).
    refine: a token count that is no representative of its bucket is measured at its exact M where
        measuring is allowed (default True), and takes its bucket's choice until then; False: it
        always takes its bucket's choice.
    """
    _require_tuner("configure")
    for name, value in (("budget_s", budget_s), ("problem_budget_ms", problem_budget_ms), ("pace", pace)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value >= 0):
            raise ValueError(f"fused_dense.tuning.configure: {name} must be a finite number >= 0, got {value!r}")
    for name, value in (("enabled", enabled), ("deterministic", deterministic), ("refine", refine)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"fused_dense.tuning.configure: {name} must be True or False, got {value!r}")
    if buckets is not None and (isinstance(buckets, bool) or buckets not in (0, 1, 2, 4, 8)):
        raise ValueError(f"fused_dense.tuning.configure: buckets must be 0, 1, 2, 4 or 8 (per octave of M; 0: "
                         f"exact M), got {buckets!r}")
    for name, value in (("cache", cache), ("table", table)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"fused_dense.tuning.configure: {name} must be a path or '', got {value!r}")
    previous = settings()
    new = dict(previous)
    given = dict(enabled=enabled, budget_s=budget_s, problem_budget_ms=problem_budget_ms, pace=pace,
                 buckets=buckets, cache=cache, table=table, deterministic=deterministic, refine=refine)
    new.update({k: (os.fspath(v) if k in ("cache", "table") else v) for k, v in given.items() if v is not None})
    torch.ops.fused_dense.set_tuning_settings(bool(new["enabled"]), float(new["budget_s"]),
                                              float(new["problem_budget_ms"]), float(new["pace"]),
                                              int(new["buckets"]),
                                              new["cache"], new["table"], bool(new["deterministic"]),
                                              bool(new["refine"]))
    return previous


def stats() -> dict:
    """Counters of this process: problems_measured, rule_choices (given the fixed rule, nothing
    measured), table_choices and cache_choices (entries read), measuring_s, heuristic_queries
    (cuBLASLt algorithm lists built; a new M of a known bucket adds none), imported_choices (taken
    by :func:`import_choices`), and what the bounded caches hold now: process_choices (choices
    made in this process) and plans_cached (GEMM plans)."""
    _require_tuner("stats")
    names = ("problems_measured", "rule_choices", "table_choices", "cache_choices", "measuring_s",
             "heuristic_queries", "imported_choices", "process_choices", "plans_cached")
    return dict(zip(names, torch.ops.fused_dense.tuning_stats()))


def m_bucket(m: int):
    """(key, representative M) of token count m under the current settings: the tuning key holds
    the representative itself, so both are the nearest representative (m itself with buckets=0)."""
    _require_tuner("m_bucket")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"fused_dense.tuning.m_bucket: m must be an int >= 1, got {m!r}")
    return tuple(torch.ops.fused_dense.tuning_m_bucket(m))


def representatives(lo: int, hi: int) -> list:
    """The representative token counts of the current grid in [lo, hi], ascending: the counts a
    table is measured at (python -m fused_dense.tune)."""
    _require_tuner("representatives")
    for name, value in (("lo", lo), ("hi", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"fused_dense.tuning.representatives: {name} must be an int >= 1, got {value!r}")
    if lo > hi:
        raise ValueError(f"fused_dense.tuning.representatives: lo ({lo}) must be <= hi ({hi})")
    return list(torch.ops.fused_dense.tuning_representatives(lo, hi))


def _device_index(device, what):
    if device is None:
        return torch.cuda.current_device()
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is None:
        raise ValueError(f"fused_dense.tuning.{what}: device must name an index (e.g. 'cuda:0'), got {device!r}")
    return index


def export_choices(device=None) -> list:
    """The final choices of the device (default: the current one): measured in this process, read
    from the table or the cache file, imported; lines of the cache file's format."""
    _require_tuner("export_choices")
    return list(torch.ops.fused_dense.tuning_export_choices(_device_index(device, "export_choices")))


def import_choices(lines, device=None) -> int:
    """Takes another process's :func:`export_choices` lines for the device (lines of another GPU
    kind or cuBLASLt are skipped); they win over this process's own choices and serve
    deterministic mode. Returns how many were taken."""
    _require_tuner("import_choices")
    lines = list(lines)
    if not all(isinstance(line, str) for line in lines):
        raise ValueError("fused_dense.tuning.import_choices: lines must be strings (export_choices' lines)")
    return torch.ops.fused_dense.tuning_import_choices(_device_index(device, "import_choices"), lines)


def share_choices(group=None, src: int = 0, device=None) -> int:
    """Gives every rank of the process group the choices of rank `src` (global rank): rank src
    exports, the others import. Call it at the same point on every rank (it is a collective),
    outside any op, compiled region or CUDA graph; keep the ranks in deterministic mode (the
    default of a process with WORLD_SIZE > 1) so no rank times a problem of its own. Returns how
    many choices this rank took (on src: how many it sent)."""
    import torch.distributed as dist
    _require_tuner("share_choices")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fused_dense.tuning.share_choices: torch.distributed is not initialized")
    payload = [export_choices(device) if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    if dist.get_rank() == src:
        return len(payload[0])
    return import_choices(payload[0], device)


def measure_and_share(step, group=None, src: int = 0, device=None) -> int:
    """Runs ``step()`` (a training step, on every rank of the group) with measuring on at rank `src`
    alone, unpaced, then shares src's choices with every rank (:func:`share_choices`); each rank
    keeps its own deterministic setting for the steps after. The step's results may differ
    between ranks (src runs measured choices, the others the table or the rule): use a warm-up
    step whose results you can discard. Returns what share_choices returns."""
    import torch.distributed as dist
    _require_tuner("measure_and_share")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fused_dense.tuning.measure_and_share: torch.distributed is not initialized")
    previous = configure(deterministic=False, enabled=True, pace=1.0) if dist.get_rank() == src else None
    try:
        step()
    finally:
        if previous is not None:
            configure(**previous)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return share_choices(group, src, device)


def _install_shipped_table():
    """Points the tuner at the package's table (FUSED_DENSE_TUNING_TABLE still overrides it)."""
    if has_cuda_kernels():
        torch.ops.fused_dense.set_default_tuning_table(SHIPPED_TABLE if os.path.isfile(SHIPPED_TABLE) else "")


_install_shipped_table()  # once, when the package is imported
