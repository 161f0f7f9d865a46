"""The public entry against hostile but valid calls: 64-bit index math, grids for any length,
the inputs' device, torch.compile and CUDA graphs, NaN locality, non-strided tensors, chunk sizes
far beyond the length. Each test failed on the code before the fix (commit fb0af3f)."""
import contextlib

import pytest
import torch

import mamba3_mimo
from conftest import (DEVICE, ON_GPU, assert_close_to_golden, assert_outputs_equal,
                      check_outputs, op_args, problem, record_launches, requires_gpu, seed_for)
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo.phases import bwd_fwd
from mamba3_mimo.reference import bwd_fwd_reference
from mamba3_mimo.runtime import device as runtime_device

FP32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------------------- 64-bit offsets


def _far_batches(x: torch.Tensor) -> torch.Tensor:
    """x with its batch stride set to 2**32 elements (a view of a buffer of 2**32 + one batch;
    virtual memory, barely touched)."""
    buf = torch.empty(2 ** 32 + x[0].numel(), dtype=x.dtype, device=x.device)
    far = buf.as_strided(x.shape, (2 ** 32,) + x.stride()[1:])
    far.copy_(x)
    return far


@pytest.mark.parametrize("name", ["q", "v"])
def test_batch_stride_beyond_2_32(name):
    """A q (or v, with dout and z) whose batch stride is 2**32 elements gives what the
    contiguous call gives: batch 1 is read from batch 1, not wrapped onto batch 0."""
    shape = Shape(2, 16, 1, 1, 16, 16, 1, 16)
    args = op_args(make_inputs(shape, BF16, True, True, device=DEVICE, seed=seed_for(name)))
    want = mamba3_mimo.mamba3_mimo_bwd_fwd(**args)
    names = ["v", "dout", "z"] if name == "v" else [name]
    far = dict(args, **{n: _far_batches(args[n]) for n in names})
    assert_outputs_equal(mamba3_mimo.mamba3_mimo_bwd_fwd(**far), want, "far batches: ")


# ---------------------------------------------------------------------------- grids


@pytest.mark.parametrize("N, R, S", [(16, 1, 70_000), (16, 8, 530_000)],
                         ids=["many_chunks", "many_output_tiles"])
def test_grids_within_hardware_limits(monkeypatch, N, R, S):
    """One-step chunks over a long sequence: every launch's grid keeps axes 1 and 2 within
    65,535 and axis 0 within 2**31 - 1 (chunk_increment's 69,999 chunks, chunk_output's 66,250
    tiles of eight one-step chunks at R = 8). Recorded without running."""
    shape = Shape(1, S, 1, 1, N, 16, R, 1)
    args = op_args(make_inputs(shape, FP32, True, True, device=DEVICE, seed=1))
    log = record_launches(monkeypatch, forward=False)
    mamba3_mimo.mamba3_mimo_bwd_fwd(**args)
    assert log, "nothing launched"
    for fn, grid, _, _ in log:
        assert grid[0] <= 2 ** 31 - 1 and all(g <= 65_535 for g in grid[1:]), (fn.__name__, grid)


def test_length_beyond_the_grids():
    """B * H * S beyond what grid axis 0 takes is refused up front, naming the sizes."""
    S = 2 ** 31
    z = torch.zeros((), device=DEVICE)
    seq, hs = (1, S, 1, 2), (1, 1, S)
    args = dict(dout=z.expand(seq), q=z.expand(1, S, 1, 1, 2), k=z.expand(1, S, 1, 1, 2),
                v=z.expand(seq), q_bias=torch.zeros(1, 1, 2), k_bias=torch.zeros(1, 1, 2),
                mimo_v=torch.zeros(1, 1, 2), mimo_o=torch.zeros(1, 1, 2),
                angles=z.expand(1, S, 1, 1), da_cs=z.expand(hs), da_cs_rev=z.expand(hs),
                dt=z.expand(hs), trap=z.expand(hs), segsum=z.expand(1, 1, S, 1, 1),
                chunk_size=1, rotary_dim_divisor=2)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=r"B \* H \* S"):
        mamba3_mimo.mamba3_mimo_bwd_fwd(**args)


# ---------------------------------------------------------------------------- device guard


def test_launches_on_the_inputs_device(monkeypatch):
    """on_device makes the inputs' CUDA device current when another one is (Triton launches on
    the current device), and leaves it alone otherwise; the public entry runs inside it."""
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    with runtime_device.on_device(torch.device("cuda", 1)):
        pass
    with runtime_device.on_device(torch.device("cuda", 0)):
        pass
    with runtime_device.on_device(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 1)]
    monkeypatch.undo()

    seen = []
    guard = bwd_fwd.on_device

    @contextlib.contextmanager
    def recording(d):
        seen.append(d)
        with guard(d):
            yield

    monkeypatch.setattr(bwd_fwd, "on_device", recording)
    args, golden, bench = problem(Shape(1, 20, 2, 1, 16, 16, 2, 8), FP32)
    for _ in range(2):  # checked, then cached
        check_outputs(mamba3_mimo.mamba3_mimo_bwd_fwd(**args), golden, bench, FP32)
    assert seen == [args["q"].device] * 2


@requires_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_gpu_while_the_first_is_current():
    """Inputs on cuda:1 while cuda:0 is current: the outputs are on cuda:1 and right."""
    shape = Shape(2, 40, 2, 1, 64, 32, 2, 16)
    args, golden, bench = problem(shape, BF16)
    torch.cuda.set_device(0)
    moved = {k: v.to("cuda:1") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for _ in range(2):
        outs = mamba3_mimo.mamba3_mimo_bwd_fwd(**moved)
        assert all(o is None or o.device == torch.device("cuda", 1) for o in outs)
        check_outputs(tuple(None if o is None else o.to("cuda:0") for o in outs), golden,
                      bench, BF16)
    assert torch.cuda.current_device() == 0


# ---------------------------------------------------------------------------- torch.compile


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) around the operator traces it as the custom op
    mamba3_mimo::bwd_fwd (no graph break) and gives the eager outputs bit for bit, Z on and
    off. The CPU run uses aot_eager (no C compiler needed); the GPU run Inductor."""
    backend = "inductor" if ON_GPU else "aot_eager"
    torch._dynamo.reset()
    for z_gate in (True, False):
        args, golden, bench = problem(Shape(1, 40, 2, 1, 16, 16, 2, 16), FP32, z_gate)
        compiled = torch.compile(mamba3_mimo.mamba3_mimo_bwd_fwd, fullgraph=True,
                                 backend=backend)
        outs = compiled(**args)
        check_outputs(outs, golden, bench, FP32)
        assert_outputs_equal(outs, mamba3_mimo.mamba3_mimo_bwd_fwd(**args), "compiled: ")


def test_custom_op_fake_matches_real():
    """The custom op's fake implementation gives the real outputs' shapes and dtypes
    (torch.library.opcheck: schema, fake tensor and dispatch checks)."""
    for z_gate, output_dtype in ((True, BF16), (False, FP32)):
        args, _, _ = problem(Shape(1, 20, 2, 1, 16, 16, 2, 8), FP32, z_gate)
        a = dict(args, output_dtype=output_dtype)
        order = bwd_fwd.ARG_NAMES + ("chunk_size", "rotary_dim_divisor", "output_dtype")
        torch.library.opcheck(bwd_fwd._bwd_fwd_op, tuple(a[n] for n in order),
                              test_utils=("test_schema", "test_faketensor"))


@requires_gpu
def test_cuda_graph_capture():
    """A call captured in a CUDA graph replays with new inputs copied into the captured ones
    and equals the eager call on those inputs."""
    shape = Shape(2, 48, 2, 1, 64, 32, 2, 16)
    first = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=1))
    second = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=2))
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mamba3_mimo.mamba3_mimo_bwd_fwd(**static)  # compiles and caches the plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mamba3_mimo.mamba3_mimo_bwd_fwd(**static)
    for k, v in second.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    assert_outputs_equal(captured, mamba3_mimo.mamba3_mimo_bwd_fwd(**second), "graph: ")


# ---------------------------------------------------------------------------- NaN locality


def _nonfinite_steps(x: torch.Tensor, axis: int) -> set:
    return set((~torch.isfinite(x)).nonzero()[:, axis].tolist())


@pytest.mark.parametrize("where", ["v", "k", "dt"])
def test_nan_reaches_only_its_step_and_later(where):
    """A NaN at step 20 (inside an output tile of two 16-step chunks) leaves every output of
    steps 0-19 as the clean call's and the states entering the chunks before it; it reaches
    the later steps: a NaN in v its own value column of its head, a NaN in k every head of its
    group, a NaN in dt every column of its head. qk_dot and the states are the clean call's bit
    for bit; dz of the earlier steps comes from chunk_output's rerun of the tile, another
    compiled kernel: bit for bit under the interpreter, on a GPU within fp32 rounding of the
    two kernels' summation orders (1e-5 of the largest value)."""
    shape = Shape(1, 40, 4, 2, 16, 16, 2, 16)
    args, _, _ = problem(shape, FP32)
    clean = mamba3_mimo.mamba3_mimo_bwd_fwd(**args)
    bad = dict(args)
    bad[where] = args[where].clone()
    if where == "v":
        bad["v"][0, 20, 1, 3] = float("nan")
    elif where == "k":
        bad["k"][0, 20, 1, 1, 5] = float("nan")
    else:
        bad["dt"][0, 1, 20] = float("nan")
    states, qk_dot, _, _, dz = mamba3_mimo.mamba3_mimo_bwd_fwd(**bad)
    if ON_GPU:
        diff = (dz[:, :20] - clean[4][:, :20]).abs().max().item()
        assert diff <= 1e-5 * clean[4][:, :20].abs().max().item(), diff
    else:
        assert torch.equal(dz[:, :20], clean[4][:, :20])
    assert torch.equal(qk_dot[:, :, :20], clean[1][:, :, :20])
    assert torch.equal(states[:, :, :2], clean[0][:, :, :2])  # entering chunks 0 and 1
    late = torch.zeros_like(dz, dtype=torch.bool)
    if where == "v":
        late[:, 20:, 1, 3] = True
    elif where == "k":
        late[:, 20:, 2:4] = True  # heads 2 and 3 read group 1
    else:
        late[:, 20:, 1] = True
    assert torch.equal(~torch.isfinite(dz), late)
    assert _nonfinite_steps(qk_dot, 2) == ({20} if where == "k" else set())


def test_nan_in_a_late_tile():
    """A NaN in v at step 250 of 300 (one-chunk tiles of 8 steps at R = 8: tile 31 of 38, in the
    fourth group of tiles that a program of the rerun checks): only its column from its step
    on, as above."""
    shape = Shape(1, 300, 2, 1, 16, 16, 8, 8)
    args, _, _ = problem(shape, FP32)
    clean = mamba3_mimo.mamba3_mimo_bwd_fwd(**args)
    bad = dict(args, v=args["v"].clone())
    bad["v"][0, 250, 0, 7] = float("nan")
    dz = mamba3_mimo.mamba3_mimo_bwd_fwd(**bad)[4]
    late = torch.zeros_like(dz, dtype=torch.bool)
    late[:, 250:, 0, 7] = True
    assert torch.equal(~torch.isfinite(dz), late)
    diff = (dz[:, :250] - clean[4][:, :250]).abs().max().item()
    assert diff <= (1e-5 * clean[4][:, :250].abs().max().item() if ON_GPU else 0.0), diff


# ---------------------------------------------------------------------------- argument kinds


@pytest.mark.parametrize("kind", ["sparse", "mkldnn"])
@pytest.mark.parametrize("name", ["q", "v", "segsum", "mimo_v"])
def test_non_strided_tensor(name, kind):
    """Sparse and mkldnn tensors are refused with a TypeError naming the argument, before any
    torch-internal error."""
    args, _, _ = problem(Shape(1, 20, 2, 1, 16, 16, 2, 8), FP32)
    x = args[name].cpu()
    if kind == "mkldnn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("this torch build has no mkldnn")
        x = x.to_mkldnn()
    else:
        x = x.to_sparse()
    with pytest.raises(TypeError, match=rf"\b{name}\b.*(strided|layout)"):
        mamba3_mimo.mamba3_mimo_bwd_fwd(**dict(args, **{name: x}))


def test_chunk_size_far_beyond_the_length():
    """chunk_size = 2**17 over 10 steps runs as one chunk of the kernels' size: no padding to
    2**17 steps, no copy of the [2**17, 2**17] segsum (here a zero expanded over it, with a zero
    log-decay, so that it is exact), and the outputs match the golden."""
    C, shape = 2 ** 17, Shape(1, 10, 2, 1, 16, 16, 2, 16)
    args = op_args(make_inputs(shape, FP32, True, True, device=DEVICE, seed=3))
    for name in ("da_cs", "da_cs_rev"):
        args[name] = torch.zeros_like(args[name])
    # the reference reads segsum whole: its golden takes the one chunk as chunk_size = S,
    # the same outputs (states: one chunk, zero)
    one = dict(args, chunk_size=shape.S, segsum=torch.zeros(1, 2, 1, shape.S, shape.S,
                                                            device=DEVICE))
    golden = bwd_fwd_reference(**one, dtype=torch.float64)
    bench = bwd_fwd_reference(**one, dtype=torch.float32)
    args["segsum"] = torch.zeros((), device=DEVICE).expand(1, 2, 1, C, C)
    args["chunk_size"] = C
    check_outputs(mamba3_mimo.mamba3_mimo_bwd_fwd(**args), golden, bench, FP32)


# ---------------------------------------------------------------------------- long sequences


def _with_reset(args: dict, s0: int) -> dict:
    """args with the log-decay at step s0 so negative that exp() of it is exactly 0: the state
    restarts there, and the outputs of steps s0.. equal those of a call on steps s0.. alone."""
    from mamba3_mimo.reference import decay_pieces
    out = dict(args)
    adt = args["adt"].clone()
    adt[..., s0] = -1e4
    out["da_cs"], out["da_cs_rev"], out["segsum"] = decay_pieces(adt, args["chunk_size"])
    out.pop("adt")
    return out


def _window(args: dict, lo: int, hi: int) -> dict:
    """The inputs of steps lo..hi-1, with decay pieces rebuilt for them."""
    from mamba3_mimo.reference import decay_pieces
    out = {}
    for k, v in args.items():
        if k in ("dout", "q", "k", "v", "angles", "z") and v is not None:
            out[k] = v[:, lo:hi]
        elif k in ("dt", "trap", "adt"):
            out[k] = v[..., lo:hi]
        else:
            out[k] = v
    out["da_cs"], out["da_cs_rev"], out["segsum"] = decay_pieces(out.pop("adt"),
                                                                 args["chunk_size"])
    return out


@requires_gpu
@pytest.mark.parametrize("N, P, R, S", [(256, 128, 1, 70_000), (16, 16, 8, 530_000)],
                         ids=["scan_offsets_past_2_31", "split_many_tiles"])
def test_long_sequence_on_the_gpu(N, P, R, S):
    """One-step chunks over 70,000 steps (the fused scan's chunk offsets pass 2**31 elements)
    and 530,000 steps (66,250 output tiles, 529,999 chunk increments), with the state restarted
    2,048 steps before the end: the call's outputs on the first 2,048 steps and on the last
    2,048 match the float64 goldens of those windows alone."""
    shape = Shape(1, S, 1, 1, N, P, R, 1)
    inputs = make_inputs(shape, BF16, True, True, device="cuda", seed=seed_for(shape, "long"))
    s0 = S - 2048
    states, qk_dot, _, _, dz = mamba3_mimo.mamba3_mimo_bwd_fwd(**_with_reset(inputs, s0),
                                                               output_dtype=FP32)
    for lo, hi in ((0, 2048), (s0, S)):
        window = _window(inputs, lo, hi)
        golden = bwd_fwd_reference(**window, dtype=torch.float64)
        bench = bwd_fwd_reference(**window, dtype=torch.float32)
        first = 1 if lo else 0  # the state entering step s0 holds the steps before it
        for name, x, i in (("states", states[:, :, lo + first:hi], 0),
                           ("qk_dot", qk_dot[:, :, lo:hi], 1), ("dz", dz[:, lo:hi], 4)):
            g, b = golden[i], bench[i]
            if name == "states":
                g, b = g[:, :, first:], b[:, :, first:]
            assert_close_to_golden(name, x, g, b, BF16, FP32)
