#!/usr/bin/env python
"""Train the GPT of train_gpt.py with tensor (and sequence) parallelism, then check the result
against the same model trained in one process.

Launch one process per rank with torchrun:

    torchrun --standalone --nproc_per_node=2 examples/train_gpt_tp.py            # GPUs if enough, else CPU
    torchrun --standalone --nproc_per_node=2 examples/train_gpt_tp.py --device cpu --steps 50
    python examples/train_gpt_tp.py --steps 20                                   # one process, TP=1

Every rank holds a shard of each Transformer block:

* attention: ``qkv`` is a ``ColumnParallelLinear`` (whole heads per rank, through
  ``multiple_of=3 * head_dim``), ``proj`` a ``RowParallelLinear`` (``multiple_of=head_dim``);
* MLP: a ``ParallelFusedMLP`` (fc1 column-parallel, fused GELU, fc2 row-parallel);
* embeddings, layer norms and the output head are replicated: marked ``_shared_params`` (synced
  from rank 0 by ``sync_shared_params``) and, with sequence parallelism, ``_sequence_parallel``
  (their gradients are summed by ``allreduce_sequence_parallel_grad`` after each backward).

With ``--sequence-parallel`` (the default) the residual stream is split by rows: the batch is
flattened to ``batch * seq`` token rows and each rank embeds, normalises and scores its own
``batch * seq / world_size`` rows; the column-parallel layers all-gather them before their GEMM
and the row-parallel layers reduce-scatter their output back. Without it every rank holds all
rows and the row-parallel outputs are all-reduced.

The data is generated here, no downloads: every sequence is an arithmetic progression modulo the
vocabulary size, ``t_i = (start + i * step) mod vocab`` with a random start and step per sequence,
which a causal model learns to continue. The shards are cut from a single-process model of
train_gpt.py (plain nn.Linear MLP) built from the same seed, so after training rank 0 trains that
model alone on the same batches and compares the two loss curves over the first
``--check-steps`` steps (``--no-check`` skips it). Later steps are printed but not judged: the
partial sums add up in another order across ranks, and training amplifies such last-bit
differences into visible ones after a hundred steps or so, exactly as it amplifies a 1e-7 change
of the initial weights in a single process.
Backend: NCCL with one GPU per rank when enough GPUs are visible, else gloo on the CPU.
Exit status 1 when the curves do not agree.
"""
import argparse
import gc
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_gpt  # noqa: E402  (the model and the progress bar; also makes the checkout's fused_dense
#                                  importable)

from fused_dense.distributed import allreduce_sequence_parallel_grad, sync_shared_params  # noqa: E402
from fused_dense.parallel import ColumnParallelLinear, ParallelFusedMLP, RowParallelLinear  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Data


def batches(steps, batch, seq_len, vocab, seed, device):
    """Yields (inputs, targets) [batch, seq_len]: arithmetic progressions mod vocab."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len + 1)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        step = torch.randint(1, vocab, (batch, 1), generator=gen)
        seq = (start + step * pos) % vocab
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


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


# ----------------------------------------------------------------------------------------------
# Model


class ParallelBlock(nn.Module):
    """train_gpt.Block with its linear layers split over `group`. Input and output are token
    rows ``[rows, d_model]``: this rank's rows with sequence parallelism, all rows without."""

    def __init__(self, d_model, n_heads, group, sequence_parallel):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        # qkv output features are [3, heads, head_dim] in the full model; a rank holds
        # [3, its heads, head_dim] (load_shards picks those rows).
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, group, sequence_parallel=sequence_parallel,
                                        multiple_of=3 * self.head_dim)
        self.proj = RowParallelLinear(d_model, d_model, group, sequence_parallel=sequence_parallel,
                                      multiple_of=self.head_dim)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = ParallelFusedMLP(d_model, 4 * d_model, activation="gelu_approx", process_group=group,
                                    sequence_parallel=sequence_parallel)
        self.local_heads = self.qkv.out_features // (3 * self.head_dim)

    def forward(self, x, batch):
        qkv = self.qkv(self.ln1(x))  # all rows: [batch * seq, 3 * local_heads * head_dim]
        q, k, v = qkv.view(batch, -1, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(-1, self.local_heads * self.head_dim))
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """train_gpt.GPT over a process group; same parameter names, sharded where parallel."""

    def __init__(self, vocab, seq_len, d_model, n_layers, n_heads, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel, self.seq_len = group, sequence_parallel, seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(ParallelBlock(d_model, n_heads, group, sequence_parallel)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        replicated = [self.tok, self.pos, self.ln_f, self.head]
        replicated += [ln for b in self.blocks for ln in (b.ln1, b.ln2)]
        for module in replicated:
            for p in module.parameters():
                p._shared_params = True
                if sequence_parallel:
                    p._sequence_parallel = True

    def local_rows(self, n_rows):
        """The token rows this rank embeds and scores."""
        if not self.sequence_parallel:
            return slice(0, n_rows)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        per_rank = n_rows // world
        return slice(rank * per_rank, (rank + 1) * per_rank)

    def forward(self, idx):
        """idx [batch, seq] (the same on every rank) -> logits for this rank's rows [rows, vocab]."""
        batch, seq = idx.shape
        rows = torch.arange(batch * seq, device=idx.device)[self.local_rows(batch * seq)]
        x = self.tok(idx.reshape(-1)[rows]) + self.pos(rows % seq)
        for block in self.blocks:
            x = block(x, batch)
        return self.head(self.ln_f(x))


@torch.no_grad()
def load_shards(tp_model, full_model):
    """Copies this rank's part of `full_model` (a train_gpt.GPT) into `tp_model`."""
    full = dict(full_model.named_modules())
    for name, m in tp_model.named_modules():
        src = full.get(name)
        if isinstance(m, ColumnParallelLinear) and name.endswith("qkv"):
            # Full rows are [3, heads, head_dim]: keep [3, this rank's heads, head_dim].
            hd3 = m.multiple_of
            heads = slice(m.shard.start // hd3, m.shard.stop // hd3)
            n_heads = m.total_out_features // hd3
            w = src.weight.view(3, n_heads, hd3 // 3, -1)[:, heads]
            m.weight.copy_(w.reshape(m.weight.shape))
            m.bias.copy_(src.bias.view(3, n_heads, hd3 // 3)[:, heads].reshape(-1))
        elif isinstance(m, ColumnParallelLinear):
            m.weight.copy_(src.weight[m.shard])
            if m.bias is not None:
                m.bias.copy_(src.bias[m.shard])
        elif isinstance(m, RowParallelLinear):
            m.weight.copy_(src.weight[:, m.shard])
            if m.bias is not None:
                m.bias.copy_(src.bias)
        elif isinstance(m, (nn.Embedding, nn.LayerNorm, nn.Linear)):
            for p, q in zip(m.parameters(), src.parameters()):
                p.copy_(q)


# ----------------------------------------------------------------------------------------------
# Process group


def init_distributed(device_arg):
    """Joins the torchrun group (or makes a one-process group); returns (device, backend)."""
    if "RANK" not in os.environ:  # plain `python train_gpt_tp.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
            os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        use_cuda = device_arg == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device, "nccl"
    dist.init_process_group("gloo")
    return torch.device("cpu"), "gloo"


# ----------------------------------------------------------------------------------------------
# Training


def train_parallel(model, args, device, group):
    """Trains the tensor-parallel model; returns (loss per step, tokens/s)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    use_autocast = device.type == "cuda"
    rank = dist.get_rank(group)
    progress = train_gpt.Progress(args.steps, f"TP={dist.get_world_size(group)}") if rank == 0 else None
    losses, tokens = [], 0
    start = time.perf_counter()
    for step, (inp, tgt) in enumerate(batches(args.steps, args.batch, args.seq, args.vocab, args.seed, device)):
        rows = model.local_rows(tgt.numel())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            logits = model(inp)
        # Mean over all batch * seq tokens: each rank adds its rows' share.
        loss = F.cross_entropy(logits.float(), tgt.reshape(-1)[rows], reduction="sum") / tgt.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        allreduce_sequence_parallel_grad(model, group)
        opt.step()
        total = loss.detach().clone()
        if model.sequence_parallel:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
        tokens += inp.numel()
        if progress is not None:
            progress.update(step, losses[-1], tokens / (time.perf_counter() - start))
    return losses, tokens / (time.perf_counter() - start)


def train_single(model, args, device):
    """The same training, in this process alone, on the unsharded train_gpt.GPT."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    use_autocast = device.type == "cuda"
    progress = train_gpt.Progress(args.steps, "TP=1")
    losses, tokens = [], 0
    start = time.perf_counter()
    for step, (inp, tgt) in enumerate(batches(args.steps, args.batch, args.seq, args.vocab, args.seed, device)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            logits = model(inp)
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        tokens += inp.numel()
        progress.update(step, losses[-1], tokens / (time.perf_counter() - start))
    return losses, tokens / (time.perf_counter() - start)


def largest_gap(a, b, window):
    """Largest relative gap between the two curves after a moving average over `window` steps."""
    return max(relative_gaps(a, b, window), default=0.0)


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
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="'auto': one GPU per rank when enough are visible, else the CPU (gloo)")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="train the single-process model on rank 0 afterwards and compare the curves")
    parser.add_argument("--check-steps", type=int, default=50,
                        help="steps over which the curves must agree (later, rounding differences grow)")
    parser.add_argument("--tol", type=float, default=None,
                        help="largest allowed relative gap between the loss curves "
                             "(default: 1e-3 in float32 on CPU, 5e-2 under bf16 autocast on GPU)")
    args = parser.parse_args(argv)
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")

    device, backend = init_distributed(args.device)
    try:
        status = run(parser, args, device, backend)
    finally:
        # Nothing may keep the process group alive past destroy_process_group(): a gloo group
        # destroyed later, during interpreter shutdown, can abort the process ("terminate called
        # without an active exception"). run() has returned, so only reference cycles are left.
        gc.collect()
        dist.destroy_process_group()
    return status


def run(parser, args, device, backend):
    """Builds, trains and checks; returns the exit status (the same on every rank)."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.sequence_parallel and (args.batch * args.seq) % world:
        parser.error(f"--sequence-parallel needs batch * seq ({args.batch * args.seq}) divisible by the "
                     f"number of processes ({world})")
    if args.heads < world:
        parser.error(f"--heads ({args.heads}) must be at least the number of processes ({world})")
    bf16 = device.type == "cuda"
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"{world} rank(s), {backend} on {device.type} ({'bf16 autocast' if bf16 else 'float32'}), "
        f"sequence_parallel={args.sequence_parallel}, torch {torch.__version__}; d_model {args.d_model}, "
        f"layers {args.layers}, heads {args.heads}, batch {args.batch}, seq {args.seq}, vocab {args.vocab}, "
        f"steps {args.steps}", flush=True)

    # Every rank builds the same full model from --seed (on the CPU, so it is bit-identical
    # everywhere) and keeps its shard of it.
    torch.manual_seed(args.seed)
    full = train_gpt.GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, "plain")
    tp_model = ParallelGPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, group,
                           args.sequence_parallel)
    load_shards(tp_model, full)
    tp_model.to(device)
    sync_shared_params(tp_model, group)  # a no-op here (same seed everywhere), needed in general
    n_local = sum(p.numel() for p in tp_model.parameters())
    log(f"{sum(p.numel() for p in full.parameters()) / 1e6:.2f}M parameters, {n_local / 1e6:.2f}M on rank 0; "
        f"chance loss log({args.vocab}) = {math.log(args.vocab):.3f}", flush=True)

    tp_losses, tp_tps = train_parallel(tp_model, args, device, group)

    status = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
        print(f"tokens/s with TP={world}: {tp_tps:,.0f}")
        fell = tp_losses[-1] < tp_losses[0]
        print(f"loss {'fell' if fell else 'did not fall'}: {tp_losses[0]:.3f} -> {tp_losses[-1]:.3f}")
        if args.check:
            ref_losses, ref_tps = train_single(full.to(device), args, device)
            print(f"tokens/s in one process: {ref_tps:,.0f}")
            tol = args.tol if args.tol is not None else (5e-2 if bf16 else 1e-3)
            window = 10 if bf16 else 1
            n = min(args.steps, args.check_steps)
            gap = largest_gap(tp_losses[:n], ref_losses[:n], window)
            print(f"{'step':>6} {'TP=' + str(world):>10} {'1 process':>10}")
            for s in marks:
                print(f"{s + 1:>6} {tp_losses[s]:>10.4f} {ref_losses[s]:>10.4f}")
            what = f"moving average over {window} steps" if window > 1 else "step by step"
            if gap <= tol:
                print(f"OK: TP={world} matches one process over the first {n} steps (largest relative gap "
                      f"{gap:.2e} <= {tol:.0e}, {what})")
            else:
                print(f"FAIL: TP={world} differs from one process within the first {n} steps (largest "
                      f"relative gap {gap:.2e} > {tol:.0e}, {what})")
                status.fill_(1)
            if args.steps > n:
                print(f"(over all {args.steps} steps the gap is {largest_gap(tp_losses, ref_losses, window):.2e}: "
                      f"the sums are split differently across ranks, and training amplifies those rounding "
                      f"differences the same way it amplifies a 1e-7 change of the initial weights)")
    dist.broadcast(status, src=0)
    return int(status.item())


if __name__ == "__main__":
    sys.exit(main())
