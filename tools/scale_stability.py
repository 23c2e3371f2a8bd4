"""How often a power-of-two FP8 scale would change from one training step to the next: for each
tensor an FP8 Llama step quantizes with current scaling (every decoder linear's input and weight in
e4m3, its output gradient in e5m2), the scale fp8_max / amax rounded down to a power of two, step
after step of bench.model's training (transformers' LlamaForCausalLM, bf16, its data, learning rate
and clipping).

    python tools/scale_stability.py [--config llama-2048] [--steps 100] [--json FILE]
    python tools/scale_stability.py --device cpu --config tiny --steps 30   # a functional check

A quantize that took last step's power-of-two scale as a guess could cast in the pass that takes
the amax and re-cast only where the guess was wrong: the fraction of kept scales is the fraction of
amax passes such a kernel would save (docs/performance.md, "FP8 in a model"). The model is trained
in bf16 (no FP8 layers), whose amaxes an FP8 run follows closely over these steps.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import model as bm  # noqa: E402

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
TINY = dict(family="llama", d=256, h=1024, layers=2, heads=4, kv_heads=2, vocab=32000, batch=2, seq=256)


def pow2_exponent(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The float32 exponent field of fmax / amax (the scale's power-of-two floor), as int32."""
    scale = (fmax / amax.double().clamp_min(1e-12)).float()
    return (scale.view(torch.int32) >> 23) & 0xFF


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-2048", choices=[*bm.CONFIGS, "tiny"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = TINY if args.config == "tiny" else bm.CONFIGS[args.config]
    model = bm.build_hf(cfg, device, torch.bfloat16)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=bm.Runner.LR, weight_decay=0.0, fused=device.type == "cuda")

    names, pending = [], {}  # tensor name -> this step's amax (a device scalar)

    def record(name, t, fmt):
        if name not in pending and (name, fmt) not in names:
            names.append((name, fmt))
        pending[name] = t.detach().abs().amax().float()

    def hook(name):
        def fwd(mod, inputs, out):
            record(f"{name}.x", inputs[0], "e4m3")
            record(f"{name}.w", mod.weight, "e4m3")
            if out.requires_grad:
                out.register_hook(lambda g: record(f"{name}.grad", g, "e5m2"))
        return fwd

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            mod.register_forward_hook(hook(name))

    data = bm.text_tokens()
    history = []  # per step: {name: exponent}
    for step, ids in enumerate(bm.batches(data, cfg, args.steps, device)):
        for group in opt.param_groups:
            group["lr"] = bm.Runner.LR * min(1.0, (step + 1) / bm.Runner.WARMUP_STEPS)
        pending.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, bm.Runner.CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        exps = {n: int(pow2_exponent(pending[n], FMAX[f])) for n, f in names}
        history.append(exps)
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps}: loss {float(loss.detach()):.3f}", flush=True)

    def kept(steps):
        """{kind: [steps whose exponent equals the step before's, steps compared]} over `steps`."""
        counts = {}
        for n, _ in names:
            k = counts.setdefault(n.rsplit(".", 1)[1], [0, 0])
            for prev, cur in zip(steps[:-1], steps[1:]):
                k[0] += prev[n] == cur[n]
                k[1] += 1
        return counts

    # the first steps (warm-up) move fastest: the same counts over the second half alone
    kinds, half = kept(history), kept(history[len(history) // 2:])
    out = {"config": args.config, "steps": args.steps, "device": str(device),
           "kept": {k: v[0] / v[1] for k, v in kinds.items()},
           "kept_second_half": {k: v[0] / v[1] for k, v in half.items()},
           "tensors": len(names)}
    for label, table in (("all steps", kinds), ("second half", half)):
        print(f"{label}: " + ", ".join(f"{k} {v[0]}/{v[1]} kept ({v[0] / v[1]:.1%})" for k, v in table.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
