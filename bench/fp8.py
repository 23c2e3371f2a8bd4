"""The fp8 section of bench/run.py (``--sections fp8``): the GELU MLP d -> 4d -> d, a FusedDense
block, the gated (SwiGLU) MLP and the Llama-style stack of bench/gated.py with FP8 GEMMs and bf16
master weights, forward + backward, against torchao's float8 training and the FP8 GEMM floor, every
variant side by side in interleaved rounds (bench/README.md lists them)."""
import copy
import inspect

import torch
import torch.nn as nn

from bench.gated import STACK, STACK_CPU, EagerGatedMLP, Stack
from bench.sections import (FD_IMPORT_ERROR, DTYPES, EagerMLP, Unavailable, VariantSpec, baseline_module, errstr,
                            float32_pass, floor_steps, log, reference, run_variants)

try:
    import fused_dense
    from fused_dense import FusedDense, FusedMLP
    Float8Recipe = getattr(fused_dense, "Float8Recipe", None)
    FusedGatedMLP = getattr(fused_dense, "FusedGatedMLP", None)
    replace_llama_mlps = getattr(fused_dense, "replace_llama_mlps", None)
except Exception:  # noqa: BLE001  (sections.FD_IMPORT_ERROR records why; the baselines still run)
    FusedDense = FusedMLP = Float8Recipe = FusedGatedMLP = replace_llama_mlps = None

# M x d of the MLP: the targets first, then the smaller widths where FP8 is forced (min_features=0)
TARGET_SHAPES = [(8192, 4096), (16384, 8192)]
FORCED_SHAPES = [(8192, 1024), (8192, 2048)]
DENSE_SHAPE = (16384, 8192, 8192)  # M x K -> N
BIG = 16384 * 8192  # M * d from which a shape gets BIG_ROUNDS interleaved rounds at most
BIG_ROUNDS = 3
CPU_SHAPE, CPU_DENSE = (64, 32), (64, 32, 32)
MLP_VARIANTS = ["fp8_floor", "bf16_floor", "eager", "fused_bf16", "fused_fp8_current", "fused_fp8_delayed",
                "fused_fp8_current_cached", "fused_fp8_delayed_cached", "torchao_tensorwise", "torchao_rowwise",
                "compile_bf16"]
DENSE_VARIANTS = ["fp8_floor", "bf16_floor", "eager", "fused_bf16", "fused_fp8_current", "torchao_tensorwise"]
# the gated MLP, SwiGLU, M x d -> h: the target (a Llama-3 8B MLP) first, then Llama-2 7B's
GATED_SHAPES = [(16384, 4096, 14336), (8192, 4096, 11008)]
CPU_GATED = (64, 32, 48)
GATED_VARIANTS = ["fp8_floor", "bf16_floor", "eager", "fused_bf16", "fused_fp8_current", "fused_fp8_delayed",
                  "fused_fp8_current_cached", "fused_fp8_delayed_cached", "torchao_tensorwise", "compile_bf16"]
# the Llama-style stack (bench/gated.py's): bf16 eager and compiled, torchao float8 of every nn.Linear
# compiled, and this library's FP8 (FusedGatedMLP MLPs, FusedDense attention projections) eager and compiled
STACK_VARIANTS = ["eager", "compile_bf16", "torchao_tensorwise", "fused_fp8_eager", "fused_fp8_compile",
                  "fused_fp8_delayed_compile"]
# what --fp8-items picks: the GELU MLP shapes, the Linear block, the gated MLP shapes, the stack
ITEMS = ("mlp", "dense", "gated", "stack")
# torch._scaled_mm's use_fast_accum per GEMM kind: as torchao's Float8LinearConfig has it
FAST_ACCUM = {"fwd": True, "dgrad": False, "wgrad": False}
E4M3_MAX = 448.0

_TORCHAO = {}


def torchao():
    """(convert_to_float8_training, Float8LinearConfig), imported on first use; Unavailable with
    the import error where torchao does not import."""
    if not _TORCHAO:
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            _TORCHAO["ok"] = (convert_to_float8_training, Float8LinearConfig)
        except Exception as exc:  # noqa: BLE001
            _TORCHAO["error"] = f"torchao not importable: {errstr(exc, 200)}"
    if "error" in _TORCHAO:
        raise Unavailable(_TORCHAO["error"])
    return _TORCHAO["ok"]


def not_run(ctx, key):
    """The record of a variant that cannot run in this run ({status, error}), or None."""
    if not ctx.cuda and (compiled(key) or key == "fp8_floor"):
        what = ("torch._scaled_mm" if key == "fp8_floor" else "torchao float8" if key.startswith("torchao")
                else "torch.compile")
        return {"status": "unavailable", "error": f"CPU run: {what} is measured on a GPU only"}
    if compiled(key) and ctx.args.no_compile:
        return {"status": "skipped", "error": "--no-compile"}
    if key.startswith("torchao"):
        try:
            torchao()
        except Unavailable as exc:
            return {"status": "unavailable", "error": str(exc)}
    if key.startswith("fused_"):
        if FD_IMPORT_ERROR:
            return {"status": "unavailable", "error": FD_IMPORT_ERROR}
        if "fp8" in key and Float8Recipe is None:
            return {"status": "unavailable", "error": "fused_dense has no Float8Recipe (no FP8 API in this build)"}
    return None


def quantize(t):
    """t in float8 e4m3 with a per-tensor scale: (t8, the float32 scale that dequantizes it)."""
    scale = t.abs().amax().float().clamp_min(1e-12) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def fp8_floor_steps(ctx, gemms):
    """gemms: {name: (m, k, n)}, each a[m,k] @ b[k,n] as torch._scaled_mm e4m3 x e4m3 -> bf16 with
    per-tensor scales, on operands quantized here (out of the timing), both K-major: a row-major,
    b column-major (the transpose of a row-major [n,k]). The step and each GEMM alone by name."""
    parts = {}
    for name, (m, k, n) in gemms.items():
        a, sa = quantize(ctx.randn(m, k, dtype=torch.float32))
        b, sb = quantize(ctx.randn(n, k, dtype=torch.float32))
        fast = FAST_ACCUM[name.rstrip("12")]
        parts[name] = (lambda a=a, b=b, sa=sa, sb=sb, fast=fast:
                       torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast))

    def step():
        for gemm in parts.values():
            gemm()
    return step, parts


def mlp_gemms(M, d, h, n1=None):
    """The six GEMMs of the MLP's step, (m, k, n) as fp8_floor_steps takes them. n1: fc1's output
    width when it is not h (2h: a gated MLP's gate and up as one GEMM)."""
    n1 = h if n1 is None else n1
    return {"fwd1": (M, d, n1), "fwd2": (M, h, d), "dgrad2": (M, d, h), "wgrad2": (d, M, h), "dgrad1": (M, n1, d),
            "wgrad1": (n1, M, d)}


def dense_floor_steps(ctx, M, K, N, dtype):
    """The three plain GEMMs of a Linear's step: x@W^T, dY@W, dY^T@x."""
    x, w, dy = ctx.randn(M, K, dtype=dtype), ctx.randn(N, K, dtype=dtype, scale=K ** -0.5), ctx.randn(M, N, dtype=dtype)
    parts = {"fwd": lambda: torch.mm(x, w.t()), "dgrad": lambda: torch.mm(dy, w), "wgrad": lambda: torch.mm(dy.t(), x)}

    def step():
        for gemm in parts.values():
            gemm()
    return step, parts


class Microbatch(nn.Module):
    """mod(x, is_first_microbatch=first): True casts the weights to FP8 in every step (one optimizer
    step per step); False reuses the copies cast at the last True (a gradient-accumulation
    micro-batch after the first)."""

    def __init__(self, inner, first):
        super().__init__()
        self.inner, self.first = inner, first

    def forward(self, x):
        return self.inner(x, is_first_microbatch=self.first)


def load_weights(mod, source):
    """source's parameters into mod, whose state may hold more (FP8 scaling state)."""
    missing, unexpected = mod.load_state_dict(source.state_dict(), strict=False)
    params = dict(mod.named_parameters())
    lost = [k for k in missing if k in params]
    if unexpected or lost:
        raise Unavailable(f"weights do not load: unexpected {unexpected}, missing parameters {lost}")
    return mod


def scaling(key):
    return "delayed" if "delayed" in key else "current"


def fused_module(key, make, source, x, dy, microbatch=True):
    """The fused_dense module of key: make(fp8=recipe or None) with source's weights. With
    microbatch, an FP8 variant is called with is_first_microbatch=True, a cached one with False
    after one step with True; without, as mod(x)."""
    try:
        fp8 = Float8Recipe(scaling=scaling(key), min_features=0) if "fp8" in key else None
        mod = load_weights(make(**({"fp8": fp8} if fp8 is not None else {})), source)
        if fp8 is None or not microbatch:
            return mod
        if key.endswith("_cached"):
            Microbatch(mod, True)(x).backward(dy)
            for t in [x, *mod.parameters()]:
                t.grad = None
            return Microbatch(mod, False)
        return Microbatch(mod, True)
    except Unavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(errstr(exc)) from exc


def torchao_module(key, source):
    """A copy of source with its nn.Linear turned into torchao's Float8Linear (recipe from the key),
    torch.compile'd."""
    convert, config = torchao()
    model = convert(copy.deepcopy(source), config=config.from_recipe_name(key.split("_", 1)[1]))
    n_lin = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    n_f8 = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    if n_f8 != n_lin:
        raise RuntimeError(f"torchao converted {n_f8} of {n_lin} linear layers")
    return torch.compile(model, dynamic=False)


def build(key, eager, fused_make, x, dy, microbatch=True):
    """A module variant: eager, compile_bf16 (no dynamo reset: the shape's other compiled variants
    stay compiled), torchao_*, fused_*."""
    if key == "compile_bf16":
        return torch.compile(eager, dynamic=False)
    if key.startswith("torchao"):
        return torchao_module(key, eager)
    if key == "eager":
        return baseline_module(key, eager)
    return fused_module(key, fused_make, eager, x, dy, microbatch)


def fused_path(kind):
    """The code path of a variant, for the crash bookkeeping: 'FusedMLP fp8 delayed', ..."""
    def path(key):
        if not key.startswith("fused_"):
            return None
        return f"{kind} fp8 {scaling(key)}" if "fp8" in key else f"{kind} bf16"
    return path


def compiled(key):
    return key == "compile_bf16" or key.startswith("torchao") or key.endswith("_compile")


def settings(key, microbatch=True):
    """Fields recorded with a variant: an FP8 one's scaling and is_first_microbatch (None: not passed)."""
    v = {}
    if "fp8" in key and key.startswith("fused_"):
        v = {"scaling": scaling(key), "is_first_microbatch": not key.endswith("_cached") if microbatch else None}
    if key.startswith("torchao"):
        v["recipe"] = key.split("_", 1)[1]
    return v


def fp8_ratios(variants):
    """x_fp8_floor / x_bf16_floor = time / the floor's; speedup_vs_torchao = torchao tensorwise's
    time / time (speedup_vs_eager: sections.ratios)."""
    ms = {k: v["ms"] for k, v in variants.items() if v.get("status") == "ok"}
    for k, v in variants.items():
        if k not in ms:
            continue
        for name, base in (("x_fp8_floor", "fp8_floor"), ("x_bf16_floor", "bf16_floor")):
            if base in ms:
                v[name] = ms[k] / ms[base]
        if "torchao_tensorwise" in ms:
            v["speedup_vs_torchao"] = ms["torchao_tensorwise"] / ms[k]


def _run(ctx, item_id, section, rec, tag, variants, spec, x, dy, eager, parts):
    for key in variants:
        if rec["variants"].get(key, {}).get("status") is None:
            pre = not_run(ctx, key)
            if pre is not None:
                rec["variants"][key] = pre
                log(f"{tag} {key}: {pre['status']} ({pre['error']})")
    rounds = min(ctx.args.rounds, BIG_ROUNDS) if rec["M"] * rec["d"] >= BIG else None
    run_variants(ctx, item_id, section, rec, tag, variants, spec, x, dy, eager, floor_parts=parts, rounds=rounds)
    rec["variants"] = {k: rec["variants"][k] for k in variants if k in rec["variants"]}  # in the plan's order
    fp8_ratios(rec["variants"])
    ctx.save()


def run_fp8(ctx, item_id, M, d, variants):
    """One MLP shape, bf16 GELU (tanh) d -> 4d -> d: the FP8 and bf16 floors, eager, FusedMLP bf16,
    FusedMLP FP8 (current / delayed scaling, weights cast every step or cached), torchao float8
    (tensorwise / rowwise, compiled), torch.compile bf16; forward + backward."""
    dtype, h = DTYPES["bf16"], 4 * d
    rec = ctx.record("fp8", item_id, dtype="bf16", activation="gelu_approx", M=M, d=d, h=h, flops=12 * M * d * h,
                     variants={})
    ctx.seed(item_id)
    eager = EagerMLP(d, h, "gelu_approx", ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)

    def make(**fp8):
        return FusedMLP(d, h, d, activation="gelu_approx", heuristic="auto", device=ctx.device, dtype=dtype, **fp8)
    spec = VariantSpec(build=lambda key: build(key, eager, make, x, dy), floor=None, fused_path=fused_path("FusedMLP"),
                       settings=settings, reference=lambda: reference(ctx, eager, x, dy), compiled=compiled,
                       floors={"fp8_floor": lambda: fp8_floor_steps(ctx, mlp_gemms(M, d, h)),
                               "bf16_floor": lambda: floor_steps(ctx, M, d, h, dtype)})
    # the GEMMs one by one at the targets (and on the CPU, to check the plumbing), not at the forced shapes
    parts = (M, d) in TARGET_SHAPES or not ctx.cuda
    _run(ctx, item_id, "fp8", rec, f"fp8 bf16 gelu M={M} d={d}", variants, spec, x, dy, eager, parts)


def run_fp8_dense(ctx, item_id, M, K, N, variants):
    """One Linear M x K -> N with bias, forward + backward: the FP8 and bf16 floors (three GEMMs),
    nn.Linear, FusedDense bf16 and FP8 (current scaling), torchao Float8Linear (tensorwise, compiled)."""
    dtype = DTYPES["bf16"]
    rec = ctx.record("fp8_dense", item_id, dtype="bf16", M=M, K=K, N=N, d=K, flops=6 * M * K * N, variants={})
    ctx.seed(item_id)
    eager = nn.Linear(K, N, device=ctx.device, dtype=dtype)
    x = ctx.randn(M, K, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, N, dtype=dtype)

    def ref():
        lin = nn.Linear(K, N, device=ctx.device, dtype=torch.float32)
        return dict(float32_pass(lin, eager, x, dy), dw1=lin.weight.grad)

    def make(**fp8):
        return FusedDense(K, N, device=ctx.device, dtype=dtype, **fp8)
    # FusedDense FP8 is called as dense(x): its default, the weights cast in every call
    spec = VariantSpec(build=lambda key: build(key, eager, make, x, dy, microbatch=False), floor=None,
                       fused_path=fused_path("FusedDense"), settings=lambda key: settings(key, microbatch=False),
                       reference=ref, compiled=compiled,
                       floors={"fp8_floor": lambda: fp8_floor_steps(ctx, {"fwd": (M, K, N), "dgrad": (M, N, K),
                                                                          "wgrad": (N, M, K)}),
                               "bf16_floor": lambda: dense_floor_steps(ctx, M, K, N, dtype)})
    _run(ctx, item_id, "fp8_dense", rec, f"fp8 dense bf16 M={M} K={K} N={N}", variants, spec, x, dy, eager, True)


def run_fp8_gated(ctx, item_id, activation, M, d, h, variants):
    """One gated MLP shape, bf16 down(act(gate(x)) * up(x)) without biases: the FP8 and bf16 floors
    (gate and up as one GEMM of width 2h), eager (bench/gated.py's LlamaMLP-like module),
    FusedGatedMLP bf16 and FP8 (current / delayed scaling, weights cast every step or cached),
    torchao float8 tensorwise (compiled), torch.compile bf16; forward + backward."""
    dtype = DTYPES["bf16"]
    rec = ctx.record("fp8_gated", item_id, dtype="bf16", activation=activation, M=M, d=d, h=h, flops=18 * M * d * h,
                     variants={})
    ctx.seed(item_id)
    eager = EagerGatedMLP(d, h, activation, ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)

    def make(**fp8):
        if FusedGatedMLP is None:
            raise Unavailable("fused_dense has no FusedGatedMLP")
        return FusedGatedMLP(d, h, activation=activation, heuristic="auto", device=ctx.device, dtype=dtype, **fp8)

    def ref():  # out and dx: the fused module's parameters (gate and up packed) do not pair with eager's
        return float32_pass(EagerGatedMLP(d, h, activation, ctx.device, torch.float32), eager, x, dy)
    spec = VariantSpec(build=lambda key: build(key, eager, make, x, dy), floor=None,
                       fused_path=fused_path("FusedGatedMLP"), settings=settings, reference=ref, compiled=compiled,
                       floors={"fp8_floor": lambda: fp8_floor_steps(ctx, mlp_gemms(M, d, h, 2 * h)),
                               "bf16_floor": lambda: floor_steps(ctx, M, d, h, dtype, fc1_width=2 * h)})
    parts = (M, d, h) == GATED_SHAPES[0] or not ctx.cuda
    _run(ctx, item_id, "fp8_gated", rec, f"fp8 gated bf16 {activation} M={M} d={d} h={h}", variants, spec, x, dy,
         eager, parts)


def fused_dense_of(lin, recipe):
    """A FusedDense(fp8=recipe) holding lin's weights (and bias)."""
    w = lin.weight
    return load_weights(FusedDense(lin.in_features, lin.out_features, bias=lin.bias is not None, device=w.device,
                                   dtype=w.dtype, fp8=recipe), lin)


def stack_scaling(key):
    """The FP8 stack variant's scaling: fused_fp8_delayed_compile's delayed, the others' current."""
    return "delayed" if "delayed" in key else "current"


def fp8_stack(source, blocks, scaling="current"):
    """A copy of the stack source in this library's FP8 (Float8Recipe(scaling, min_features=0)): its
    MLPs swapped for FusedGatedMLP by replace_llama_mlps(fp8=recipe), its attention projections (qkv,
    o_proj) for FusedDense(fp8=recipe). Unavailable where fused_dense cannot build it."""
    if replace_llama_mlps is None or FusedDense is None or Float8Recipe is None:
        raise Unavailable("fused_dense has no replace_llama_mlps / FusedDense / Float8Recipe")
    try:
        recipe = Float8Recipe(scaling=scaling, min_features=0)
        model = copy.deepcopy(source)
        replaced = replace_llama_mlps(model, fp8=recipe)
        if replaced != blocks:
            raise Unavailable(f"replace_llama_mlps replaced {replaced} of {blocks} MLPs")
        wrong = [f"{type(b.mlp).__name__}(fp8={getattr(b.mlp, 'fp8', None)!r})" for b in model.blocks
                 if not isinstance(b.mlp, FusedGatedMLP) or getattr(b.mlp, "fp8", recipe) != recipe]
        if wrong:
            raise Unavailable(f"replace_llama_mlps(fp8=recipe) made {wrong}")
        for b in model.blocks:
            b.qkv, b.o_proj = fused_dense_of(b.qkv, recipe), fused_dense_of(b.o_proj, recipe)
        return model
    except Unavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(errstr(exc)) from exc


def stack_settings(key):
    if key.startswith("fused_fp8"):
        return {"scaling": stack_scaling(key), "min_features": 0, "is_first_microbatch": None,
                "fp8_layers": "MLPs: FusedGatedMLP (replace_llama_mlps); qkv, o_proj: FusedDense"}
    return settings(key)


def run_fp8_stack(ctx, item_id, activation, variants):
    """bench/gated.py's Llama-style stack forward + backward: bf16 eager and compiled, torchao float8
    tensorwise of every nn.Linear compiled, and this library's FP8 (fp8_stack) eager and compiled
    (current scaling), and compiled with delayed scaling."""
    dtype = DTYPES["bf16"]
    s = STACK if ctx.cuda else STACK_CPU
    B, T, d, h = s["batch"], s["seq"], s["d"], s["h"]
    flops = s["blocks"] * 6 * B * T * (4 * d * d + 3 * d * h)  # the projections' GEMMs, as bench/gated.py
    rec = ctx.record("fp8_stack", item_id, dtype="bf16", activation=activation, M=B * T, flops=flops, variants={},
                     **s)
    ctx.seed(item_id)
    eager = Stack(s["blocks"], d, h, s["heads"], activation, ctx.device, dtype)
    x = ctx.randn(B, T, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(B, T, d, dtype=dtype)

    def build_stack(key):
        if key in ("eager", "compile_bf16") or key.startswith("torchao"):
            return build(key, eager, None, x, dy)
        model = fp8_stack(eager, s["blocks"], stack_scaling(key))
        return torch.compile(model, dynamic=False) if key.endswith("_compile") else model

    def ref():
        return float32_pass(Stack(s["blocks"], d, h, s["heads"], activation, ctx.device, torch.float32), eager, x, dy)
    spec = VariantSpec(build=build_stack, floor=None, fused_path=fused_path("FusedGatedMLP"), settings=stack_settings,
                       reference=ref, compiled=compiled, floors={})
    _run(ctx, item_id, "fp8_stack", rec, f"fp8 stack bf16 {activation} B={B} T={T} d={d} h={h}", variants, spec, x,
         dy, eager, False)


def plan_items(args):
    """[(item_id, section, payload)] of the fp8 section: the target shapes, the FusedDense block, the
    forced shapes, then the gated MLP's target shape, the stack and the other gated shape (a budget
    cut loses the last first); --fp8-items keeps some of the four kinds."""
    if args.shapes:
        shapes = args.shapes
    elif args.device == "cpu":
        shapes = [CPU_SHAPE]
    elif args.quick:
        shapes = TARGET_SHAPES[:1]
    else:
        shapes = TARGET_SHAPES + FORCED_SHAPES
    dense = CPU_DENSE if args.device == "cpu" else DENSE_SHAPE
    items = [(f"fp8:bf16:gelu_approx:{M}x{d}", "fp8", (M, d, MLP_VARIANTS)) for M, d in shapes]
    at = sum(1 for s in shapes if s in TARGET_SHAPES) or len(shapes)
    M, K, N = dense
    items.insert(at, (f"fp8_dense:bf16:{M}x{K}x{N}", "fp8_dense", (M, K, N, DENSE_VARIANTS)))
    if args.device == "cpu":
        gated = [CPU_GATED]
    elif args.quick:
        gated = GATED_SHAPES[:1]
    else:
        gated = GATED_SHAPES
    tail = [(f"fp8_gated:bf16:swiglu:{M}x{d}x{h}", "fp8_gated", ("swiglu", M, d, h, GATED_VARIANTS))
            for M, d, h in gated]
    if not args.quick or args.device == "cpu":
        tail.insert(1, ("fp8_stack:bf16:swiglu", "fp8_stack", ("swiglu", STACK_VARIANTS)))
    want = set(getattr(args, "fp8_items", None) or ITEMS)
    kind = {"fp8": "mlp", "fp8_dense": "dense", "fp8_gated": "gated", "fp8_stack": "stack"}
    return [it for it in items + tail if kind[it[1]] in want]


def note():
    if Float8Recipe is None:
        log("fp8: fused FP8 variants unavailable (fused_dense has no Float8Recipe)")
    elif FusedGatedMLP is not None and "fp8" not in inspect.signature(FusedGatedMLP.__init__).parameters:
        log("fp8: FusedGatedMLP has no fp8 argument in this build: its FP8 variants will be recorded unavailable")
    try:
        torchao()
    except Unavailable as exc:
        log(f"fp8: torchao variants unavailable ({exc})")
