"""The gated section of bench/run.py (``--sections gated``): the gated MLP of Llama-family models,
down(act(gate(x)) * up(x)), forward + backward, every variant side by side in interleaved rounds,
and a Llama-style stack with its MLPs fused or not (bench/README.md lists the variants)."""
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.sections import (BASELINES, DTYPES, Unavailable, VariantSpec, baseline_module, errstr, float32_pass,
                            floor_steps, log, run_variants)

try:
    from fused_dense import FusedGatedMLP, replace_llama_mlps
except Exception:  # noqa: BLE001  (sections.FD_IMPORT_ERROR records why; the baselines still run)
    FusedGatedMLP = replace_llama_mlps = None
try:
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    LIGER_ERROR = None
except Exception as exc:  # noqa: BLE001
    LigerSwiGLUMLP = LigerGEGLUMLP = None
    LIGER_ERROR = f"liger_kernel not importable: {errstr(exc, 200)}"

# (M tokens, d, h) of Llama-family MLPs: a 1B-class, Llama-2 7B and Llama-3 8B
GATED_SHAPES = [(8192, 2048, 5632), (8192, 4096, 11008), (16384, 4096, 14336)]
GATED_ACTIVATIONS = ("swiglu", "geglu")
GATED_VARIANTS = ["floor", "eager", "compile", "liger", "fused_l0", "fused_l1", "fused_l2"]
# the Llama-style stack: blocks, batch, sequence, d, h, heads
STACK = dict(blocks=2, batch=2, seq=2048, d=4096, h=11008, heads=32)
STACK_CPU = dict(blocks=2, batch=1, seq=16, d=32, h=48, heads=4)
STACK_VARIANTS = ["eager", "compile", "fused_eager", "fused_compile"]
HF_ACT = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


class EagerGatedMLP(nn.Module):
    """nn.Linear gate / up / down and SiLU or GELU (tanh): a LlamaMLP, its submodule names."""

    def __init__(self, d, h, activation, device, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(h, d, bias=False, device=device, dtype=dtype)
        self.act_fn = nn.SiLU() if activation == "swiglu" else nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _liger(activation, d, h, device, dtype):
    cls = LigerSwiGLUMLP if activation == "swiglu" else LigerGEGLUMLP
    if cls is None:
        raise Unavailable(LIGER_ERROR)
    config = types.SimpleNamespace(hidden_size=d, intermediate_size=h, hidden_act=HF_ACT[activation], mlp_bias=False)
    return cls(config).to(device=device, dtype=dtype)


def make_gated_module(key, eager, activation, d, h, device, dtype):
    base = baseline_module(key, eager)
    if base is not None:
        return base
    try:
        if key == "liger":
            mod = _liger(activation, d, h, device, dtype)
        else:
            if FusedGatedMLP is None:
                raise Unavailable("fused_dense not importable")
            mod = FusedGatedMLP(d, h, activation=activation, checkpoint_lvl=int(key[-1]), device=device, dtype=dtype)
        mod.load_state_dict(eager.state_dict())
    except Unavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(errstr(exc)) from exc
    return mod


def gated_path(key):
    if key in BASELINES:
        return None
    return "Liger gated MLP" if key == "liger" else "FusedGatedMLP"


def run_gated(ctx, item_id, dtype_name, activation, M, d, h, variants):
    """One gated MLP shape: floor, eager, compile, Liger, FusedGatedMLP at checkpoint levels 0, 1, 2
    (their saved bytes in each variant's memory record), forward + backward."""
    dtype = DTYPES[dtype_name]
    rec = ctx.record("gated", item_id, dtype=dtype_name, activation=activation, M=M, d=d, h=h, flops=18 * M * d * h,
                     variants={})
    ctx.seed(item_id)
    eager = EagerGatedMLP(d, h, activation, ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)

    spec = VariantSpec(build=lambda key: make_gated_module(key, eager, activation, d, h, ctx.device, dtype),
                       floor=lambda: floor_steps(ctx, M, d, h, dtype, fc1_width=2 * h), fused_path=gated_path,
                       settings=lambda key: {"checkpoint_lvl": int(key[-1])} if key.startswith("fused_l") else {},
                       reference=lambda: float32_pass(EagerGatedMLP(d, h, activation, ctx.device, torch.float32),
                                                      eager, x, dy))
    run_variants(ctx, item_id, "gated", rec, f"gated {dtype_name} {activation} M={M} d={d} h={h}", variants, spec,
                 x, dy, eager, floor_parts=True)


# ---- the Llama-style stack


class RMSNorm(nn.Module):
    def __init__(self, d, device, dtype, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """Pre-norm block: causal attention (F.scaled_dot_product_attention, no rotary embedding) and
    a gated MLP whose submodules are named as Hugging Face's (self_attn, mlp with gate_proj / up_proj /
    down_proj and act_fn), so replace_llama_mlps swaps it."""

    def __init__(self, d, h, heads, activation, device, dtype):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(d, device, dtype), RMSNorm(d, device, dtype)
        self.qkv, self.o_proj = nn.Linear(d, 3 * d, **kw), nn.Linear(d, d, **kw)
        self.mlp = EagerGatedMLP(d, h, activation, device, dtype)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.o_proj(a)
        return x + self.mlp(self.mlp_norm(x))


class Stack(nn.Module):
    def __init__(self, blocks, d, h, heads, activation, device, dtype):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, heads, activation, device, dtype) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def run_stack(ctx, item_id, dtype_name, activation, variants):
    """The Llama-style stack forward + backward with nn.Linear MLPs (eager, compiled) and with its
    MLPs swapped for FusedGatedMLP by replace_llama_mlps (eager, compiled)."""
    dtype = DTYPES[dtype_name]
    s = STACK if ctx.cuda else STACK_CPU
    B, T, d, h = s["batch"], s["seq"], s["d"], s["h"]
    # the projections' GEMMs, forward + backward (the attention's own flops not counted)
    flops = s["blocks"] * 6 * B * T * (4 * d * d + 3 * d * h)
    rec = ctx.record("gated_stack", item_id, dtype=dtype_name, activation=activation, M=B * T, flops=flops,
                     variants={}, **s)
    ctx.seed(item_id)
    eager = Stack(s["blocks"], d, h, s["heads"], activation, ctx.device, dtype)
    x = ctx.randn(B, T, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(B, T, d, dtype=dtype)

    def build(key):
        if key == "eager":
            return eager
        model = eager
        if key.startswith("fused"):
            if replace_llama_mlps is None:
                raise Unavailable("fused_dense not importable")
            model = Stack(s["blocks"], d, h, s["heads"], activation, ctx.device, dtype)
            model.load_state_dict(eager.state_dict())
            replaced = replace_llama_mlps(model)
            assert replaced == s["blocks"], replaced
        if key.endswith("compile"):
            torch._dynamo.reset()
            return torch.compile(model, dynamic=False)
        return model

    spec = VariantSpec(build=build, floor=None, fused_path=lambda k: "FusedGatedMLP" if k.startswith("fused") else None,
                       settings=lambda k: {}, reference=lambda: None)
    run_variants(ctx, item_id, "gated_stack", rec, f"gated stack {dtype_name} {activation} B={B} T={T} d={d} h={h}",
                 variants, spec, x, dy, eager)


def plan_items(args):
    """[(item_id, section, payload)] of the gated section."""
    if args.device == "cpu":
        shapes = [(64, 32, 40)]
    elif args.quick:
        shapes = GATED_SHAPES[:1]
    else:
        shapes = GATED_SHAPES
    acts = GATED_ACTIVATIONS[:1] if args.quick else GATED_ACTIVATIONS
    items = [(f"gated:bf16:{act}:{M}x{d}x{h}", "gated", ("bf16", act, M, d, h, GATED_VARIANTS))
             for act in acts for M, d, h in shapes]
    # the stack after the SwiGLU shapes, before GeGLU's: a budget cut loses GeGLU's figures first
    items.insert(len(shapes), ("gated_stack:bf16:swiglu", "gated_stack", ("bf16", "swiglu", STACK_VARIANTS)))
    return items


def note_liger():
    if LIGER_ERROR:
        log(f"gated: Liger variants unavailable ({LIGER_ERROR})")
