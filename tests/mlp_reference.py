"""Float64 references of the MLP and the gated MLP, written in plain PyTorch from docs/contract.md,
with no fused_dense code in them: the activations ("Activation codes"), the gated layout ("Gated
layout") and the ReLU bit-mask layout. Tests compare the library with these; they never take a
layout or a value from the library they check.

    act(t, name)                  the activation of each name, float64 in, float64 out
    GATED_BLOCK                   G, the gated layout's interleave (8 units)
    gated_columns(h)              (gate columns, up columns) of the h units in a packed row
    pack_gate_up / unpack_gate_up the packed [2h, ...] weight from gate and up rows, and back
    relu_mask_bits(mask, n)       the bool [rows, n] a ReLU bit-mask [rows, ceil(n / 8)] holds
    mlp(...), gated_mlp(...)      fc2(act(fc1(x))) / down(act(g) * u), differentiable
"""
import torch
import torch.nn.functional as F

# docs/contract.md, "Gated layout": the gate and up rows interleaved in blocks of G = 8 units.
GATED_BLOCK = 8


def act(t, name):
    """docs/contract.md, "Activation codes": gelu_approx is the tanh GELU, relu(p) = p if p > 0
    else 0, sqrelu = relu(p)^2; the gated names give the gate's activation (silu / tanh GELU)."""
    if name in ("gelu_approx", "geglu"):
        return 0.5 * t * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3)))
    if name == "relu":
        return torch.where(t > 0, t, torch.zeros_like(t))
    if name == "sqrelu":
        return torch.where(t > 0, t, torch.zeros_like(t)).square()
    if name == "swiglu":
        return t * torch.sigmoid(t)
    raise ValueError(f"activation must be one of gelu_approx, relu, sqrelu, swiglu, geglu, got {name!r}")


def gated_columns(hidden, block=GATED_BLOCK):
    """Unit j's packed gate / up columns: blocks of `block` units, each block's gate columns, then
    its up columns; the last block may be short."""
    gate, up = [], []
    for start in range(0, hidden, block):
        width = min(block, hidden - start)
        gate += [2 * start + o for o in range(width)]
        up += [2 * start + width + o for o in range(width)]
    return gate, up


def pack_gate_up(gate, up, dim=0):
    """The packed tensor (size 2h along dim) holding gate and up (size h along dim) in the
    columns gated_columns(h) gives."""
    assert gate.shape == up.shape, f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}"
    hidden = gate.shape[dim]
    shape = list(gate.shape)
    shape[dim] = 2 * hidden
    packed = gate.new_empty(shape)
    gcols, ucols = gated_columns(hidden)
    packed.index_copy_(dim, torch.tensor(gcols, dtype=torch.long, device=gate.device), gate)
    packed.index_copy_(dim, torch.tensor(ucols, dtype=torch.long, device=gate.device), up)
    return packed


def unpack_gate_up(packed, dim=0):
    """(gate, up) of a packed tensor; differentiable (index_select)."""
    gcols, ucols = gated_columns(packed.shape[dim] // 2)
    index = lambda cols: torch.tensor(cols, dtype=torch.long, device=packed.device)  # noqa: E731
    return packed.index_select(dim, index(gcols)), packed.index_select(dim, index(ucols))


def relu_mask_bits(mask, n):
    """The bool [rows, n] of a ReLU bit-mask [rows, ceil(n / 8)] uint8: bit j % 8 (least
    significant first) of byte j // 8 of row i is set where pre_act[i, j] >= 0 (docs/contract.md,
    "Activation codes" and DESIGN.md)."""
    assert mask.dtype == torch.uint8 and mask.shape[-1] == (n + 7) // 8, (mask.dtype, tuple(mask.shape), n)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # [rows, bytes, 8], bits[i, b, k] = bit k of byte b
    return bits.reshape(mask.shape[0], -1)[:, :n].bool()


def leaves64(*ts):
    """float64 copies of ts (None kept) that require grad, for a reference's autograd."""
    return [None if t is None else t.detach().to(torch.float64).requires_grad_() for t in ts]


def mlp(x, w1, b1, w2, b2, activation, relu_active=None):
    """fc2(act(fc1(x))) from float64 tensors. For relu, `relu_active` (bool, pre-activation's
    shape) may give the units whose gradient passes, where the float64 sign alone cannot decide
    a near-tie (see relu_pattern)."""
    pre = F.linear(x, w1, b1)
    if activation == "relu" and relu_active is not None:
        a = pre * relu_active.to(pre.dtype)
    else:
        a = act(pre, activation)
    return F.linear(a, w2, b2)


def gated_mlp(x, w1, w2, b2, activation):
    """down(act(g) * u) from float64 tensors, w1 the packed [2h, K] gate / up weight."""
    wg, wu = unpack_gate_up(w1)
    return F.linear(act(F.linear(x, wg), activation) * F.linear(x, wu), w2, b2)


def relu_pattern(pre64, mask, rss, k, product64=None, dtype=torch.float32):
    """The units whose ReLU gradient passes, for a float64 reference of a rounded computation.

    The float64 pre-activation pre64 decides every unit whose |pre64| is above a band: 16 times the
    typical error of a float32-accumulated sum of k random-sign terms (16 u_fp32 sqrt(k) rss, rss
    the root-sum-square of the unit's k products), plus, for a 16-bit `dtype`, twice the rounding
    error of the fc1 product `product64` (x @ w1^T in float64) rounded to dtype before the bias is
    added (eps(dtype) |product64|); the library may take the sign after that rounding. The bits of
    the library's own forward `mask` are taken only for the near-ties inside the band. A mask bit
    that disagrees with a clear float64 sign fails here, so the mask cannot make the reference
    agree with a wrong result."""
    bits = relu_mask_bits(mask.to(pre64.device), pre64.shape[-1])
    band = rss * 2.0 ** -20 * max(k, 1) ** 0.5
    if product64 is not None and dtype in (torch.float16, torch.bfloat16):
        band = band + product64.abs() * torch.finfo(dtype).eps
    clear = pre64.abs() > band
    wrong = (bits != (pre64 >= 0)) & clear
    assert not wrong.any(), f"{int(wrong.sum())} ReLU mask bits disagree with a clear float64 sign"
    return torch.where(clear, pre64 >= 0, bits)
