"""Where the README main job's eager step goes: its GPT (examples/train_gpt.py, GPU config: d 768,
12 layers, 8 x 1024 tokens, bf16, fused AdamW) with nn.Linear MLPs against FusedMLP, from the same
weights on the same random tokens.

    python -m bench.main_job_profile --out DIR            # the GPU figures (~1 min on the H200)
    python -m bench.main_job_profile --out DIR --device cpu  # a functional check (tiny model)

Per variant: wall ms a step (synchronised around each round of 10 steps), host issue ms a step (the
time until the round's last step is issued, before the synchronisation) and host CPU ms, in
interleaved rounds (the order reversed every other round), their medians and the median of the
per-round ratios fused / plain; then torch.profiler over 5 steps of each: kernel ms a step, the CUDA
runtime calls a step (count, host ms) and the CPU ops by self time. Results: DIR/main_job_profile.json.
"""
import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS_PER_ROUND = 10


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    tg = load_example()
    d, layers, heads, seq = (768, 12, 12, 1024) if cuda else (64, 2, 4, 64)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    models, opts, init = {}, {}, None
    for kind in ("plain", "fused"):
        torch.manual_seed(0)
        m = tg.GPT(tg.VOCAB, seq, d, layers, heads, kind)
        init = init if init is not None else m.state_dict()
        m.load_state_dict(init)
        models[kind] = m.to(dev, torch.bfloat16)
        opts[kind] = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=cuda)
    tokens = torch.randint(0, tg.VOCAB, (8, seq + 1), device=dev)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]

    def step(kind):
        logits = models[kind](inp)
        loss = F.cross_entropy(logits.float().view(-1, tg.VOCAB), tgt.reshape(-1))
        loss.backward()
        opts[kind].step()
        opts[kind].zero_grad(set_to_none=True)

    for kind in models:  # first calls: cuBLAS, the attention, the fused layers' tuning
        for _ in range(15):
            step(kind)
    sync()
    rounds = {k: {"wall_ms": [], "issue_ms": [], "cpu_ms": []} for k in models}
    for r in range(args.rounds):
        for kind in (list(models) if r % 2 == 0 else list(models)[::-1]):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(STEPS_PER_ROUND):
                step(kind)
            t1, c1 = time.perf_counter(), time.process_time()
            sync()
            t2 = time.perf_counter()
            per = 1e3 / STEPS_PER_ROUND
            rounds[kind]["issue_ms"].append((t1 - t0) * per)
            rounds[kind]["wall_ms"].append((t2 - t0) * per)
            rounds[kind]["cpu_ms"].append((c1 - c0) * per)
    ratios = [f / p for f, p in zip(rounds["fused"]["wall_ms"], rounds["plain"]["wall_ms"])]
    summary = {k: {f: statistics.median(v) for f, v in d_.items()} for k, d_ in rounds.items()}
    summary["wall_fused_over_plain"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(summary, indent=1), flush=True)

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = {}
    n = 5
    for kind in models:
        sync()
        with profile(activities=acts) as p:
            for _ in range(n):
                step(kind)
            sync()
        ka = p.key_averages()
        runtime = lambda name: name.startswith(("cuda", "cu"))  # noqa: E731
        kernels = sorted(((e.key, e.device_time_total / 1e3 / n, e.count // n) for e in ka
                          if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0),
                         key=lambda t: -t[1])
        calls = sorted(((e.key, e.count // n, e.self_cpu_time_total / 1e3 / n) for e in ka if runtime(e.key)),
                       key=lambda t: -t[2])
        ops = sorted(((e.key, e.count // n, e.self_cpu_time_total / 1e3 / n, e.cpu_time_total / 1e3 / n) for e in ka
                      if not runtime(e.key)), key=lambda t: -t[2])
        prof[kind] = {"kernel_ms": sum(t[1] for t in kernels), "kernels": kernels[:25], "runtime_calls": calls[:20],
                      "cpu_ops": ops[:40]}
        print(f"{kind}: kernel ms a step {prof[kind]['kernel_ms']:.3f}", flush=True)
        for name, count, ms in calls[:12]:
            print(f"  runtime {name[:60]}: {count} a step, {ms:.3f} ms")
        for name, count, self_ms, total_ms in ops[:25]:
            print(f"  op {name[:60]}: {count} a step, self {self_ms:.3f} ms, total {total_ms:.3f} ms")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "main_job_profile.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                   "summary": summary, "rounds": rounds, "profile": prof}, f, indent=1)


if __name__ == "__main__":
    main()
