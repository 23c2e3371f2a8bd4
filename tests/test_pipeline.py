"""The pipelined tensor-parallel MLP (fused_dense/pipeline.py): the order in which it issues its
collectives against its blocks' GEMMs, recorded with stand-in collectives in one process, and
its results against the unpipelined layer. The multi-process results (gloo, every world size)
are in test_parallel.py."""
import pytest
import torch

from fused_dense import ops, pipeline
from fused_dense.functional import FusedMLPFunc


class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


@pytest.fixture
def recorded(monkeypatch):
    """Stand-in collectives of a world of one rank that log when they are issued and waited,
    and op wrappers that log each block's GEMM halves."""
    log = []
    counts = {"gather": 0, "reduce": 0}

    def collective(kind):
        def run(t, group, async_op=False):
            assert async_op, "the pipeline issues every collective asynchronously"
            name = f"{kind}{counts[kind]}"
            counts[kind] += 1
            log.append(name)
            return t.clone(), _Handle(log, name)
        return run

    monkeypatch.setattr(pipeline, "all_gather_raw", collective("gather"))
    monkeypatch.setattr(pipeline, "reduce_scatter_raw", collective("reduce"))
    monkeypatch.setattr(pipeline, "all_reduce_raw", collective("reduce"))
    for name in ("fused_mlp_train_forward", "fused_mlp_backward"):
        op = ops._OVERLOADS[name]

        def logged(*args, _op=op, _name=name):
            log.append("forward" if _name.endswith("forward") else "backward")
            return _op(*args)
        monkeypatch.setitem(ops._OVERLOADS, name, logged)
    return log


def _params(d=8, h=24, dtype=torch.float64):
    torch.manual_seed(0)
    w1 = (torch.randn(h, d, dtype=dtype) * d ** -0.5).requires_grad_()
    b1 = torch.randn(h, dtype=dtype).requires_grad_()
    w2 = (torch.randn(d, h, dtype=dtype) * h ** -0.5).requires_grad_()
    b2 = torch.randn(d, dtype=dtype).requires_grad_()
    return w1, b1, w2, b2


def test_sequence_parallel_schedule(recorded):
    """Forward: block c + 1's gather is issued before block c computes, block c's reduction right
    after it, and every reduction is waited only after the last block. Backward likewise, with
    the input gradient's reduction issued before weight1's gradient GEMM of the same block."""
    w1, b1, w2, b2 = _params()
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    y = pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2, process_group=object(), chunks=3)
    assert recorded == ["gather0", "wait gather0", "gather1", "forward", "reduce0",
                        "wait gather1", "gather2", "forward", "reduce1",
                        "wait gather2", "forward", "reduce2",
                        "wait reduce0", "wait reduce1", "wait reduce2"]
    recorded.clear()
    y.backward(torch.randn_like(y))
    # per block: the output gradient's gather and the input's (not kept gathered), then the
    # next block's gathers, the backward half, the input gradient's reduction
    assert recorded == ["gather3", "gather4", "wait gather3",
                        "gather5", "gather6", "backward", "reduce3", "wait gather4",
                        "wait gather5", "gather7", "gather8", "backward", "reduce4", "wait gather6",
                        "wait gather7", "backward", "reduce5", "wait gather8",
                        "wait reduce3", "wait reduce4", "wait reduce5"]


def test_level_2_waits_for_the_input_before_recomputing(recorded):
    w1, b1, w2, b2 = _params()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    y = pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2, checkpoint_lvl=2, process_group=object(), chunks=2)
    recorded.clear()
    y.sum().backward()
    first = recorded[:recorded.index("backward")]
    # block 0's output gradient (gather2) and input (gather3) are both waited before fc1 is
    # recomputed, and block 1's gathers are issued before block 0 computes
    assert first == ["gather2", "gather3", "wait gather2", "wait gather3", "gather4", "gather5"]


@pytest.mark.parametrize("shape", [(11, 8), (7, 3, 8)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "sqrelu"])
def test_blocks_sum_to_the_unpipelined_layer(recorded, shape, sequence_parallel, chunks, lvl, activation):
    """On one rank the pipelined layer equals FusedMLPFunc (same C++ halves) within float64
    rounding: the blocks only cut the rows, and the weight gradients are sums over them."""
    w1, b1, w2, b2 = _params()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y = pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=lvl,
                                        process_group=object(), sequence_parallel=sequence_parallel,
                                        chunks=chunks)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w1, b1, w2, b2], g)
    ref = FusedMLPFunc.apply(x, w1, b1, w2, b2, activation, True, False, lvl, "auto")
    ref_grads = torch.autograd.grad(ref, [x, w1, b1, w2, b2], g)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_16_bit_weight_gradients_are_summed_in_float32(recorded):
    w1, b1, w2, b2 = (t.detach().to(torch.bfloat16).requires_grad_() for t in _params())
    x = torch.randn(64, 8, dtype=torch.bfloat16, requires_grad=True)
    y = pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2, process_group=object(), chunks=8)
    y.float().sum().backward()
    assert w1.grad.dtype == torch.bfloat16
    x64, w164, b164, w264, b264 = (t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2))
    ref = torch.nn.functional.gelu(x64 @ w164.T + b164, approximate="tanh") @ w264.T + b264
    ref.sum().backward()
    for t, r in ((w1, w164), (w2, w264), (b1, b164)):
        err = (t.grad.double() - r.grad).norm() / r.grad.norm()
        assert err < 1e-2, err


def test_bad_chunks_and_group():
    w1, b1, w2, b2 = _params()
    x = torch.randn(4, 8, dtype=torch.float64)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
            pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2, process_group=object(), chunks=bad)
    with pytest.raises(ValueError, match="needs a process_group"):
        pipeline.pipelined_parallel_mlp(x, w1, w2, b1, b2)


@pytest.fixture
def recorded_linear(recorded, monkeypatch):
    """As `recorded`, for the linear layers: a world of one rank, and their GEMM ops logged."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    names = {"linear_act": "gemm", "act_linear_dgrad": "dgrad", "linear_bias_wgrad": "wgrad"}
    for name, label in names.items():
        op = ops._OVERLOADS[name]

        def logged(*args, _op=op, _label=label):
            recorded.append(_label)
            return _op(*args)
        monkeypatch.setitem(ops._OVERLOADS, name, logged)
    return recorded


def test_column_linear_schedule(recorded_linear):
    """Forward: block c + 1's gather before block c's GEMM. Backward: block c + 1's re-gather of
    x and block c's input-gradient reduction are issued before block c's weight gradient."""
    w, b = _params()[:2]
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    y = pipeline.PipelinedColumnLinearFunc.apply(x, w, b, object(), 2)
    assert recorded_linear == ["gather0", "wait gather0", "gather1", "gemm", "wait gather1", "gemm"]
    recorded_linear.clear()
    y.backward(torch.randn_like(y))
    assert recorded_linear == ["gather2", "gather3", "dgrad", "reduce0", "wait gather2", "wgrad",
                               "dgrad", "reduce1", "wait gather3", "wgrad", "wait reduce0", "wait reduce1"]
    ref_x = x.detach().clone().requires_grad_()
    torch.testing.assert_close(y, ref_x @ w.T + b, rtol=1e-12, atol=1e-12)


def test_row_linear_schedule(recorded_linear):
    """Forward: block c's reduction right after its GEMM, all waited after the last block.
    Backward: block c + 1's gather of the output gradient before block c's GEMMs."""
    w, b = _params()[:2]
    x = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)  # w: [24, 8] -> x @ w is [6, 8]
    w = w.detach().T.contiguous().requires_grad_()
    y = pipeline.PipelinedRowLinearFunc.apply(x, w, None, object(), True, 3)
    assert recorded_linear == ["gemm", "reduce0", "gemm", "reduce1", "gemm", "reduce2",
                               "wait reduce0", "wait reduce1", "wait reduce2"]
    recorded_linear.clear()
    g = torch.randn_like(y)
    y.backward(g)
    assert recorded_linear == ["gather0", "wait gather0", "gather1", "dgrad", "wgrad",
                               "wait gather1", "gather2", "dgrad", "wgrad", "wait gather2", "dgrad", "wgrad"]
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    (x2 @ w2.T).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)
