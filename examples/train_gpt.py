#!/usr/bin/env python
"""Train a small GPT-style Transformer whose MLPs are fused_dense.FusedMLP, then train the same
model with a plain nn.Linear MLP from the same initial weights on the same data, and check that
the two loss curves agree.

The data is generated here, no downloads: every sequence is an arithmetic progression modulo the
vocabulary size, ``t_i = (start + i * step) mod vocab`` with a random start and step per
sequence. The first token is unpredictable, the second reveals the step only together with the
first, and every later token is determined, so a causal model that learns to read the step from
the previous two tokens drives the loss well below log(vocab).

    python examples/train_gpt.py                      # GPU if present (bf16 autocast), else CPU
    python examples/train_gpt.py --device cpu --steps 300 --d-model 128 --layers 4

On the CPU both runs use float32 and must agree tightly; on the GPU they run under bf16 autocast
(``--precision`` overrides either) and must agree within bf16 noise, compared on a moving average
of the loss. Exit status 1 when they do not.
"""
import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from fused_dense import FusedMLP
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from fused_dense import FusedMLP


# ----------------------------------------------------------------------------------------------
# Model


class PlainMLP(nn.Module):
    """The unfused MLP, parameter-compatible with FusedMLP (fc1, fc2)."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def make_mlp(kind, d_model):
    if kind == "fused":
        return FusedMLP(d_model, 4 * d_model, activation="gelu_approx")
    return PlainMLP(d_model, 4 * d_model)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, mlp_kind):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = make_mlp(mlp_kind, d_model)

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


# ----------------------------------------------------------------------------------------------
# Data, progress, training


def batches(steps, batch, seq_len, vocab, seed, device):
    """Yields (inputs, targets) [batch, seq_len]: arithmetic progressions mod vocab."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len + 1)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        step = torch.randint(1, vocab, (batch, 1), generator=gen)
        seq = (start + step * pos) % vocab
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


class Progress:
    """A dependency-free progress bar: redrawn in place on a terminal, a line every ~10% otherwise."""

    def __init__(self, total, label, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.tty = stream.isatty()
        self.every = max(1, total // 10)

    def update(self, step, loss, tok_per_s):
        done = step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        width = 24
        filled = int(width * done / self.total)
        line = (f"{self.label:>6} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"loss {loss:.4f}  {tok_per_s:,.0f} tok/s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def train(model, args, device, label, use_autocast):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    losses = []
    progress = Progress(args.steps, label)
    tokens = 0
    start = time.perf_counter()
    for step, (inp, tgt) in enumerate(batches(args.steps, args.batch, args.seq, args.vocab, args.seed, device)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            logits = model(inp)
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # .item() synchronizes, so the timing below is honest
        tokens += inp.numel()
        progress.update(step, losses[-1], tokens / (time.perf_counter() - start))
    elapsed = time.perf_counter() - start
    return losses, tokens / elapsed


def moving_average(xs, window):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def relative_gaps(a, b, window):
    """|a - b| / |b| per step, after a moving average over `window` steps."""
    sa, sb = moving_average(a, window), moving_average(b, window)
    return [abs(x - y) / max(abs(y), 1e-8) for x, y in zip(sa, sb)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="'auto': bf16 autocast on GPU, float32 on CPU")
    parser.add_argument("--attention", choices=["sdpa", "math"], default="sdpa",
                        help="'math': PyTorch's plain-kernel attention instead of the fused SDPA kernels "
                             "(cuDNN, flash); the sanitizer runs use it so their reports are not about those")
    parser.add_argument("--tol", type=float, default=None,
                        help="float32: largest allowed relative gap between the curves, step by step "
                             "(default 1e-3); bf16: the smallest allowed mean relative gap (default 2e-2)")
    args = parser.parse_args(argv)
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    print(f"device {device} ({'bf16 autocast' if bf16 else 'float32'}), torch {torch.__version__}; "
          f"d_model {args.d_model}, layers {args.layers}, heads {args.heads}, batch {args.batch}, seq {args.seq}, "
          f"vocab {args.vocab}, steps {args.steps}, lr {args.lr}", flush=True)

    torch.manual_seed(args.seed)
    fused_model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, "fused").to(device)
    init = {k: v.detach().clone() for k, v in fused_model.state_dict().items()}  # a copy: training mutates
    n_params = sum(p.numel() for p in fused_model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters; chance loss log({args.vocab}) = {math.log(args.vocab):.3f}", flush=True)

    def plain_model():
        model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, "plain").to(device)
        model.load_state_dict(init)  # same init, same parameter names
        return model

    plain = plain_model()
    with sdpa_kernel(SDPBackend.MATH) if args.attention == "math" else contextlib.nullcontext():
        return train_and_compare(args, fused_model, plain, plain_model, device, bf16)


def train_and_compare(args, fused_model, plain, plain_model, device, bf16):
    fused_losses, fused_tps = train(fused_model, args, device, "fused", bf16)
    plain_losses, plain_tps = train(plain, args, device, "plain", bf16)
    curves = {"FusedMLP": fused_losses, "nn.Linear": plain_losses}
    if bf16:
        # bf16 training drifts chaotically away from any other run, so "agree" is measured against
        # bf16's own noise: how far the plain model in bf16 drifts from the plain model in fp32.
        curves["nn.Linear fp32"], _ = train(plain_model(), args, device, "fp32", False)

    marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    print(f"{'step':>6} " + " ".join(f"{name:>15}" for name in curves))
    for s in marks:
        print(f"{s + 1:>6} " + " ".join(f"{losses[s]:>15.4f}" for losses in curves.values()))
    print(f"tokens/s: FusedMLP {fused_tps:,.0f}, nn.Linear MLP {plain_tps:,.0f}")
    fell = fused_losses[-1] < 0.5 * fused_losses[0]
    print(f"loss {'fell' if fell else 'did not fall by half'}: {fused_losses[0]:.3f} -> {fused_losses[-1]:.3f}")

    if bf16:
        window = 10
        gap = sum(relative_gaps(fused_losses, plain_losses, window)) / args.steps
        noise = sum(relative_gaps(plain_losses, curves["nn.Linear fp32"], window)) / args.steps
        limit = max(args.tol if args.tol is not None else 2e-2, 3 * noise)
        what = (f"mean relative gap of {window}-step moving averages {gap:.2e}; bf16 noise (nn.Linear bf16 vs "
                f"fp32) {noise:.2e}; limit max(floor, 3 x noise) = {limit:.2e}")
    else:
        gap = max(relative_gaps(fused_losses, plain_losses, 1))
        limit = args.tol if args.tol is not None else 1e-3
        what = f"largest relative gap, step by step, {gap:.2e}; limit {limit:.0e}"
    if gap <= limit:
        print(f"OK: loss curves agree ({what})")
        return 0
    print(f"FAIL: loss curves differ ({what})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
