#!/usr/bin/env python
"""Summarizes compute-sanitizer logs: per log, the exit status, the pytest outcome counts, the
tool's ERROR SUMMARY and every reported error attributed to the kernel it was found in, split
into fused_dense's kernels and everyone else's (cuBLASLt, cuDNN, PyTorch).

    python tools/sanitize_summary.py LOG... [--json out.json] [--union] [--passed-lists DIR] [--check]

A log's first line may be "exit status N" (gpu_run.sh writes it); 124 means the time limit cut
the run, and the tests listed before that point are what ran. --check exits 1 when a log has a
report in a fused_dense kernel, a failed test, or an exit status other than 0, 99 (the tool's
--error-exitcode: reports, maybe only in NVIDIA's kernels) and 124.
"""
import argparse
import collections
import json
import os
import re
import sys

PYTEST_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
PYTEST_ITEM = re.compile(r"^(tests/\S+::\S+)")
KERNEL_AT = re.compile(r"\bat (?:0x[0-9a-f]+ in )?(.+?)\+0x[0-9a-f]+")
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
PREFIX = "========= "
# pytest's closing line, centred between '=' runs, starts with exactly PREFIX when it is ~62 wide
PYTEST_CLOSING = re.compile(r"^\d+ (passed|failed|skipped|deselected|errors?|warnings?)\b.* in \d+(\.\d+)?s\b")
NOT_ERRORS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "Target application returned", "LEAK SUMMARY",
              "Process did not terminate", "Error: process didn't terminate successfully")


EMPTY_SELECTION = re.compile(r"collected \d+ items? / \d+ deselected / 0 selected|^=+ no tests ran", re.M)


def in_fused_dense(kernel):
    return "fused_dense" in kernel


# A width at which the library's kernels keep their template arguments (an op's mode and flags,
# e.g. cast_kernel_capped<__nv_bfloat16, (fused_dense::core::Activation)4, 6, false>) once short()
# has dropped the argument list: the profile tools' kernel lines.
TEMPLATE_WIDTH = 130


def short(kernel, width=90):
    """A demangled kernel name without its argument list, cut to `width`. A name whose argument
    list was cut short (bench.model's profile keeps 160 characters) loses it from the template's
    closing '>('."""
    kernel = kernel.strip()
    if kernel.endswith(")"):  # drop the argument list of a demangled name, nothing before it
        depth = 0
        for i in range(len(kernel) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(kernel[i], 0)
            if depth == 0:
                kernel = kernel[:i].strip()
                break
    elif ">(" in kernel:
        kernel = kernel[: kernel.index(">(") + 1]
    return kernel if len(kernel) <= width else kernel[: width - 3] + "..."


def parse(text):
    """Returns a dict: status, tests (outcome -> count), items (test id -> outcome), error_summary, errors: list of
    (kind, kernel or '', in fused_dense: bool)."""
    status = None
    first = text.split("\n", 1)[0]
    m = re.match(r"exit status (-?\d+)", first)
    if m:
        status = int(m.group(1))
    tests = collections.Counter()
    seen = set()
    items = {}  # test id -> outcome
    errors = []
    summary = None
    # The tool's lines can land in the middle of pytest's "item ... PASSED" line: split them off.
    lines = []
    for raw in text.splitlines():
        at = raw.find(PREFIX.strip())
        if at > 0:
            lines += [raw[:at], raw[at:]]
        else:
            lines.append(raw)
    pending = None  # a test item whose outcome is still to come
    for i, line in enumerate(lines):
        item = PYTEST_ITEM.match(line)
        rest = line[item.end():] if item else (line if pending and not line.startswith(PREFIX.strip()) else "")
        if item:
            pending = item.group(1)
        outcome = PYTEST_OUTCOME.search(rest) if pending else None
        if outcome:
            if pending not in seen:
                seen.add(pending)
                tests[outcome.group(1)] += 1
                items[pending] = outcome.group(1)
            pending = None
        s = SUMMARY.search(line)
        if s:
            summary = (summary or 0) + int(s.group(1))
        if not line.startswith(PREFIX) or line.startswith(PREFIX + " "):
            continue
        header = line[len(PREFIX):].strip()
        if not header or any(header.startswith(n) for n in NOT_ERRORS) or PYTEST_CLOSING.match(header):
            continue
        kind = re.sub(r"\s+at\s.*", "", header)
        kind = re.sub(r" of size \d+ bytes?", "", kind)
        kernel = ""
        k = KERNEL_AT.search(header)
        if k is None:
            for nxt in lines[i + 1:i + 4]:
                if not nxt.startswith(PREFIX + " "):
                    break
                k = KERNEL_AT.search(nxt)
                if k:
                    break
        if k is not None:
            kernel = k.group(1).strip()
        if header.startswith("Program hit"):
            kind, kernel = re.sub(r" \(error \d+\).*", "", header), ""
        errors.append((kind, kernel, in_fused_dense(kernel)))
    # a shard left with no test (every one deselected): the tool then exits 255 ("terminated before
    # first instrumented API call"), which is no failure
    empty = not tests and EMPTY_SELECTION.search(text) is not None
    return {"status": status, "tests": dict(tests), "items": items, "error_summary": summary, "errors": errors,
            "empty": empty}


def report(name, res, out=sys.stdout):
    t = res["tests"]
    tests = ", ".join(f"{k.lower()} {v}" for k, v in sorted(t.items())) or "no pytest items"
    status = res["status"]
    note = " (time limit)" if status == 124 else " (empty shard: no test selected)" if res.get("empty") else ""
    print(f"{name}: exit status {status}{note}; tests: {tests}; ERROR SUMMARY: {res['error_summary']}", file=out)
    mine = collections.Counter((k, short(n)) for k, n, o in res["errors"] if o)
    other = collections.Counter((k, short(n)) for k, n, o in res["errors"] if not o)
    print(f"  reports in fused_dense kernels: {sum(mine.values())}", file=out)
    for (kind, kernel), c in mine.most_common(10):
        print(f"    {c:6d}  {kind}  in  {kernel}", file=out)
    print(f"  reports elsewhere (NVIDIA / PyTorch kernels, host API): {sum(other.values())}", file=out)
    for (kind, kernel), c in other.most_common(8):
        print(f"    {c:6d}  {kind}  in  {kernel or '-'}", file=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--union", action="store_true",
                    help="also print, per tool (the log name's prefix up to '_'), the distinct tests "
                         "over all given logs, e.g. a run and its FUSED_DENSE_TEST_REVERSE=1 rerun")
    ap.add_argument("--passed-lists", metavar="DIR",
                    help="write DIR/TOOL_passed.txt per tool: the tests passed over all given logs")
    ap.add_argument("--check", action="store_true", help="exit 1 on a finding (see above)")
    args = ap.parse_args()
    results = {}
    for path in args.logs:
        with open(path, errors="replace") as f:
            res = parse(f.read())
        report(path, res)
        res["errors_in_fused_dense"] = sum(1 for e in res["errors"] if e[2])
        res["errors_elsewhere"] = sum(1 for e in res["errors"] if not e[2])
        res["error_kinds"] = collections.Counter(f"{k} | {short(n)}" for k, n, _ in res["errors"]).most_common(30)
        del res["errors"]
        results[path] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.union:
        print_union(results)
    if args.passed_lists:
        write_passed_lists(results, args.passed_lists)
    if args.check:
        bad = findings(results)
        cut = [k for k, v in results.items() if v["status"] == 124]
        print(f"logs: {len(results)}; cut by the time limit: {len(cut)}; with a report in a fused_dense kernel, "
              f"a failed test or another exit status: {len(bad)}")
        for k in bad:
            v = results[k]
            print("  ", k, "exit", v["status"], v["tests"], "reports in fused_dense kernels:",
                  v["errors_in_fused_dense"])
        return 1 if bad else 0
    return 0


def findings(results):
    """The logs that fail --check."""
    return [k for k, v in results.items() if v["errors_in_fused_dense"] or v["tests"].get("FAILED")
            or v["tests"].get("ERROR") or (v["status"] not in (0, 99, 124) and not v.get("empty"))]


def union(results):
    """tool (the log name's prefix up to '_') -> {test id: its worst outcome over the logs}: a test
    that failed in one run and passed in another counts as failed; one skipped in one run (e.g.
    without the caching allocator) and passed in another counts as passed."""
    rank = {"SKIPPED": -1, "PASSED": 0, "XFAIL": 1, "XPASS": 2, "FAILED": 3, "ERROR": 3}
    tools = collections.defaultdict(dict)
    for path, res in results.items():
        tool = os.path.basename(path).split("_", 1)[0]
        for test, outcome in res["items"].items():
            old = tools[tool].get(test)
            if old is None or rank.get(outcome, 3) > rank.get(old, 3):
                tools[tool][test] = outcome
    return tools


def print_union(results, out=sys.stdout):
    for tool, tests in sorted(union(results).items()):
        counts = collections.Counter(tests.values())
        print(f"union {tool}: {len(tests)} distinct tests: " +
              ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items())), file=out)


def write_passed_lists(results, directory):
    """DIR/TOOL_passed.txt: the tests that passed under TOOL in every given log that ran them, one
    id per line: FUSED_DENSE_TEST_DESELECT_FILE for the next run of that tool (SANITIZE_DESELECT_TOOL
    in tools/gpu_run.sh), so it spends its time on the rest."""
    os.makedirs(directory, exist_ok=True)
    for tool, tests in sorted(union(results).items()):
        passed = sorted(t for t, outcome in tests.items() if outcome == "PASSED")
        with open(os.path.join(directory, f"{tool}_passed.txt"), "w") as f:
            f.write(f"# {len(passed)} tests that passed under {tool}\n")
            f.writelines(t + "\n" for t in passed)


if __name__ == "__main__":
    sys.exit(main())
