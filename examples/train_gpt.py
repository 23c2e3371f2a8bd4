#!/usr/bin/env python
"""Train a GPT on the Python standard library's source code with fused_dense.FusedMLP as every
block's MLP, and again with nn.Linear -> GELU(tanh) -> nn.Linear, from the same initial weights on
the same batches, eagerly and under torch.compile; compare speed, memory and loss curves.

    python examples/train_gpt.py                  # GPU: GPT-2-small-class model, bf16, 200 steps
    python examples/train_gpt.py --no-compile     # eager runs only
    python examples/train_gpt.py --device cpu     # small float32 model: a functional check
    python examples/train_gpt.py --variable-length  # a new sequence length every step

GPU: d_model 768, 12 layers x 12 heads, sequence 1024, batch 8, byte vocabulary (86M parameters),
bf16 parameters, fused AdamW. On the H200 this is both faster and a fairer test of the MLPs than
bf16 autocast over float32 weights, whose per-call weight casts both variants pay; over 200 steps
the loss curves of the two precisions match (--precision bf16-autocast for long runs). CPU:
d_model 128, 2 layers, sequence 128, float32, torch.compile only with --compile. Data: every *.py
under sysconfig.get_paths()['stdlib'] (site-packages excluded), sorted, as bytes; every 20th file
is validation. Nothing is downloaded.

Per run: tokens/s (synchronised, over the steps after the untimed warm-up, which holds compilation
and the fused layers' first-call tuning), peak memory, final train / validation loss. The MLPs
agree when the last-20-step mean losses differ by at most --tol (relative; 2e-2 in bf16, where
rounding makes any two runs drift apart slowly, 1e-3 in float32). Results: --out/train_gpt.json
and the loss curves --out/train_gpt.png (with matplotlib). Exit status 1 when the curves differ.

--variable-length: every step draws its sequence length from [seq / 8, seq] (the same lengths for
every run), so the MLPs meet a new token count almost every step, as packed or variable-length
batches do. No step is left untimed, each run trains in a process of its own (each pays its own
first calls: cuBLAS's, the attention's and the fused layers' tuning), eagerly only unless
--compile, and the cumulative tokens/s after each step is reported: the run pays every first call
inside that figure.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import fused_dense
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import fused_dense
from fused_dense import FusedMLP

VOCAB = 256  # bytes
GPU_CONFIG = dict(d_model=768, layers=12, seq=1024, batch=8, steps=200)
CPU_CONFIG = dict(d_model=128, layers=2, seq=128, batch=8, steps=60)
VARIANTS = {"nn.Linear": "plain", "FusedMLP": "fused"}
TARGETS = {"eager": 1.02, "compile": 0.99}  # FusedMLP / nn.Linear tokens/s, H200, default configuration


# ---- model


class PlainMLP(nn.Module):
    """The unfused MLP, parameter-compatible with FusedMLP (fc1, fc2)."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, mlp_kind):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = (FusedMLP(d_model, 4 * d_model, activation="gelu_approx") if mlp_kind == "fused"
                    else PlainMLP(d_model, 4 * d_model))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, d_model, n_layers, n_heads, mlp_kind):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_kind) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- data and progress


def stdlib_text(val_every=20):
    """(train, val) uint8 tensors: the standard library's *.py files, sorted by relative path and
    joined by newlines; every `val_every`-th file goes to val."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p.relative_to(root).as_posix() for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)))
    parts = ([], [])
    for i, name in enumerate(files):
        with contextlib.suppress(OSError):
            parts[i % val_every == 0].append((root / name).read_bytes())
    return tuple(torch.frombuffer(bytearray(b"\n".join(p)), dtype=torch.uint8) for p in parts)


def get_batch(data, offsets, seq):
    """(inputs, targets) [len(offsets), seq] from the windows of data starting at offsets."""
    window = data[offsets[:, None] + torch.arange(int(seq) + 1, device=data.device)].long()
    return window[:, :-1], window[:, 1:]


class Progress:
    """A dependency-free progress bar: redrawn in place on a terminal, a line every ~10% otherwise."""

    def __init__(self, total, label, stream=None):
        self.total, self.label, self.stream = total, label, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // (50 if self.tty else 10))

    def due(self, step):
        return (step + 1) % self.every == 0 or step + 1 == self.total

    def update(self, step, loss, tok_per_s=None):
        if not self.due(step):
            return
        done, width = step + 1, 24
        filled = int(width * done / self.total)
        speed = "warming up" if tok_per_s is None else f"{tok_per_s:,.0f} tok/s"
        line = f"{self.label:>18} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} loss {loss:.4f}  {speed}"
        self.stream.write(("\r" + line + " " * 4) if self.tty else (line + "\n"))
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


# ---- training


def train_run(kind, compiled, init, data, args, device, label):
    """Trains one model from `init`; returns the run's figures and its loss per step."""
    train, val, offsets, val_offsets, lengths = data
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = GPT(VOCAB, args.seq, args.d_model, args.layers, args.heads, kind)
    model.load_state_dict(init)
    model.to(device=device, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-autocast")
    warmup_lr = max(1, args.steps // 10)
    losses = torch.zeros(args.steps, device=device)
    progress = Progress(args.steps, label)
    start = None
    cumulative = []  # --variable-length: tokens/s over steps 1..s, after each step s
    tokens = 0
    for step in range(args.steps):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        # linear warm-up, then cosine decay to a tenth of --lr
        frac = max(0.0, (step - warmup_lr) / max(1, args.steps - warmup_lr))
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup_lr) * (0.55 + 0.45 * math.cos(math.pi * frac))
        inp, tgt = get_batch(train, offsets[step], lengths[step])
        with autocast:
            logits = forward(inp)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        if args.variable_length:
            sync()
            tokens += inp.numel()
            cumulative.append(tokens / (time.perf_counter() - start))
        if progress.due(step):  # .item() synchronises: only when the bar is redrawn
            now = losses[step].item()
            tps = None if start is None else (cumulative[-1] if cumulative else
                                              (step + 1 - args.warmup) * inp.numel() / (time.perf_counter() - start))
            progress.update(step, now, tps)
    sync()
    elapsed = time.perf_counter() - start
    model.eval()  # validation on the eager module (same weights): no recompilation for eval mode
    with torch.no_grad(), autocast:
        val_loss = sum(F.cross_entropy(model(x).float().view(-1, VOCAB), y.reshape(-1)).item()
                       for x, y in (get_batch(val, o, args.seq) for o in val_offsets)) / len(val_offsets)
    curve = losses.tolist()
    timed_tokens = args.batch * int(sum(int(n) for n in lengths[args.warmup:]))
    return {
        "tokens_per_s": timed_tokens / elapsed,
        "cumulative_tokens_per_s": cumulative or None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "final_train_loss": curve[-1],
        "train_loss_last20": sum(curve[-20:]) / len(curve[-20:]),
        "val_loss": val_loss,
    }, curve


def run_in_own_process(argv, mode, name, args):
    """One run of --variable-length in a fresh process (its own CUDA context and caches)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv),
               "--run", f"{mode} {name}", "--out", tmp]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            sys.exit(f"error: the run '{mode} {name}' failed (exit status {proc.returncode})")
        with open(os.path.join(tmp, "run.json")) as f:
            got = json.load(f)
    return got["run"], got["curve"]


def plot(curves, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no loss-curve PNG")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, "--" if name.endswith("nn.Linear") else "-", label=name, lw=1)
    ax.set(xlabel="step", ylabel="train loss (nats / byte)", title="GPT on the Python standard library")
    ax.grid(alpha=0.3), ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    for flag in ("steps", "batch", "seq", "d-model", "layers"):
        p.add_argument(f"--{flag}", type=int, default=None, help="default: by device (see above)")
    p.add_argument("--heads", type=int, default=None, help="default: d_model / 64")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per run (at most a quarter of them)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 GPU, 3e-3 CPU)")
    p.add_argument("--precision", choices=["auto", "bf16", "bf16-autocast", "fp32"], default="auto",
                   help="'auto': bf16 (bf16 weights) on GPU, fp32 on CPU; 'bf16-autocast': float32 weights")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also run under torch.compile (default: on GPU only)")
    p.add_argument("--attention", choices=["sdpa", "math"], default="sdpa",
                   help="'math': PyTorch's plain-kernel attention instead of the fused SDPA kernels")
    p.add_argument("--tol", type=float, default=None, help="loss agreement tolerance (default 2e-2 bf16, 1e-3 fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="train_gpt_out", help="folder for train_gpt.json and train_gpt.png")
    p.add_argument("--variable-length", action="store_true",
                   help="a sequence length from [seq / 8, seq] per step, each run in its own process (see above)")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # "<mode> <variant>": this run only
    args = p.parse_args(argv)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not fused_dense.has_cuda_kernels():
        sys.exit("error: a GPU is present, but this fused_dense extension was built without its CUDA kernels "
                 "(no CUDA toolkit was found at build time), so FusedMLP would run its CPU code. Rebuild with "
                 "CUDA's compiler visible (nvcc on PATH or CUDA_HOME set, FUSED_DENSE_CPU_ONLY unset): "
                 "`pip install --no-build-isolation -e .`; or pass --device cpu for the CPU check.")
    for key, value in (GPU_CONFIG if device.type == "cuda" else CPU_CONFIG).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.heads = args.heads or max(1, args.d_model // 64)
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    args.warmup = 0 if args.variable_length else min(args.warmup, args.steps // 4)
    args.lr = args.lr or (1e-3 if device.type == "cuda" else 3e-3)
    args.precision = args.precision if args.precision != "auto" else "bf16" if device.type == "cuda" else "fp32"
    args.compile = (device.type == "cuda" and not args.variable_length) if args.compile is None else args.compile
    tol = args.tol if args.tol is not None else (1e-3 if args.precision == "fp32" else 2e-2)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the same for both MLPs
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)

    train, val = stdlib_text()
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.randint(0, len(train) - args.seq - 1, (args.steps, args.batch), generator=gen)
    val_offsets = torch.randint(0, len(val) - args.seq - 1, (8, args.batch), generator=gen)
    lengths = (torch.randint(max(1, args.seq // 8), args.seq + 1, (args.steps,), generator=gen).tolist()
               if args.variable_length else [args.seq] * args.steps)
    data = (train.to(device), val.to(device), offsets.to(device), val_offsets.to(device), lengths)
    torch.manual_seed(args.seed)
    init = GPT(VOCAB, args.seq, args.d_model, args.layers, args.heads, "plain").state_dict()
    n_params = sum(t.numel() for t in init.values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if args.run is not None:  # one run of --variable-length, in its own process: figures to --out
        mode, name = args.run.split(" ", 1)
        with sdpa_kernel(SDPBackend.MATH) if args.attention == "math" else contextlib.nullcontext():
            run, curve = train_run(VARIANTS[name], mode == "compile", init, data, args, device, args.run)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump({"run": run, "curve": curve}, f)
        return 0
    print(f"{device} ({where}), torch {torch.__version__}, {args.precision}; {n_params / 1e6:.1f}M parameters: "
          f"d_model {args.d_model}, {args.layers} layers x {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"{args.steps} steps ({args.warmup} untimed), lr {args.lr}"
          f"{', variable sequence lengths' if args.variable_length else ''}; data: {len(train) / 1e6:.1f} MB train, "
          f"{len(val) / 1e6:.1f} MB val of Python {sys.version.split()[0]}'s standard library", flush=True)
    if device.type == "cpu":
        print("note: on the CPU this is a functional check of FusedMLP in training, not a speed figure")

    runs, curves = {}, {}
    modes = ["eager"] + (["compile"] if args.compile else [])
    with sdpa_kernel(SDPBackend.MATH) if args.attention == "math" else contextlib.nullcontext():
        for mode in modes:
            for name, kind in VARIANTS.items():
                if args.variable_length:
                    runs[f"{mode} {name}"], curves[f"{mode} {name}"] = run_in_own_process(argv, mode, name, args)
                else:
                    runs[f"{mode} {name}"], curves[f"{mode} {name}"] = train_run(
                        kind, mode == "compile", init, data, args, device, f"{mode} {name}")

    print(f"\n{'run':<18} {'tokens/s':>10} {'peak GiB':>9} {'final loss':>11} {'last-20 mean':>13} {'val loss':>9}")
    for name, r in runs.items():
        mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{name:<18} {r['tokens_per_s']:>10,.0f} {mem:>9} {r['final_train_loss']:>11.4f} "
              f"{r['train_loss_last20']:>13.4f} {r['val_loss']:>9.4f}")
    ratios, agreement = {}, {}
    for mode in modes:
        fused, plain = runs[f"{mode} FusedMLP"], runs[f"{mode} nn.Linear"]
        ratios[mode] = fused["tokens_per_s"] / plain["tokens_per_s"]
        gap = abs(fused["train_loss_last20"] - plain["train_loss_last20"]) / plain["train_loss_last20"]
        steps = [abs(a - b) / b for a, b in zip(curves[f"{mode} FusedMLP"], curves[f"{mode} nn.Linear"])]
        a = agreement[mode] = {"relative_gap_last20": gap, "tol": tol, "agree": gap <= tol,
                               "max_relative_step_gap": max(steps)}
        if args.variable_length:
            cf, cp = fused["cumulative_tokens_per_s"], plain["cumulative_tokens_per_s"]
            behind = [i + 1 for i, (f_, p_) in enumerate(zip(cf, cp)) if f_ < p_]
            a["cumulative_ratio_after_step"] = {str(k): cf[k - 1] / cp[k - 1] for k in (1, 2, 5, 10, 20, 50, 100, 200)
                                                if k <= len(cf)}
            a["steps_where_fused_cumulative_is_behind"] = behind
            print(f"{mode:>7}: cumulative tokens/s FusedMLP / nn.Linear after step "
                  + ", ".join(f"{k}: {v:.3f}x" for k, v in a["cumulative_ratio_after_step"].items())
                  + (f"; behind at {len(behind)} steps (first {behind[:5]})" if behind else "; never behind"))
        target = f" (H200 target >= {TARGETS[mode]:.2f}x)" if device.type == "cuda" else ""
        print(f"{mode:>7}: FusedMLP / nn.Linear tokens/s {ratios[mode]:.3f}x{target}; loss curves "
              f"{'agree' if a['agree'] else 'DIFFER'}: last-20-step means {a['relative_gap_last20']:.2e} apart "
              f"(tol {tol:.0e}), largest single-step gap {a['max_relative_step_gap']:.2e}")
    fell = all(c[-1] < c[0] for c in curves.values())
    print(f"loss {'fell' if fell else 'did NOT fall'} in every run: "
          + ", ".join(f"{c[0]:.3f} -> {c[-1]:.3f}" for c in curves.values()))

    os.makedirs(args.out, exist_ok=True)
    png = plot(curves, os.path.join(args.out, "train_gpt.png"))
    report = {"device": where, "torch": torch.__version__, "fused_dense": fused_dense.__version__,
              "config": {k: getattr(args, k) for k in ("d_model", "layers", "heads", "seq", "batch", "steps",
                                                       "warmup", "lr", "precision", "compile", "seed",
                                                       "variable_length")},
              "parameters": n_params, "runs": runs, "ratio_fused_over_linear": ratios, "agreement": agreement,
              "targets": TARGETS if device.type == "cuda" else None, "loss_curves": curves}
    with open(os.path.join(args.out, "train_gpt.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'train_gpt.json')}" + (f" and {png}" if png else ""))
    ok = fell and all(a["agree"] for a in agreement.values())
    print("OK: FusedMLP and nn.Linear train alike" if ok else "FAIL: the loss curves differ or did not fall")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
