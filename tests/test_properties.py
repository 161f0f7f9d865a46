"""Contract properties (SPEC section 5): determinism, layout independence, inputs left untouched,
every output element written."""
import pytest
import torch

from conftest import (DEVICE, IMPLS, assert_outputs_equal, check_outputs, op_args, problem,
                      run_op, seed_for)
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo.reference import bwd_fwd_reference

# B = 2 and H = G = 2 so that transposing the first two dims really changes the layout;
# S = 40 with C = 16 so that the public entry pads a partial last chunk. N = 16 runs the split
# state pass and N = 64 the fused scan (configs.SCAN_MIN_N; test_both_state_forms).
# The scan shape runs through the public entry only: the other impls do not depend on N.
SHAPE = Shape(B=2, S=40, H=2, G=2, N=16, P=16, R=2, C=16)
SCAN_SHAPE = Shape(B=2, S=40, H=2, G=2, N=64, P=16, R=2, C=16)
CASES = pytest.mark.parametrize("shape, impl", [(SHAPE, i) for i in IMPLS] +
                                [(SCAN_SHAPE, "dispatch")],
                                ids=[f"split-{i}" for i in IMPLS] + ["scan-dispatch"])
GATES = [(True, True), (False, False)]


def test_both_state_forms():
    """The shapes of this file run both forms of the production state pass."""
    from mamba3_mimo import configs
    from mamba3_mimo.bench import problem_of
    forms = []
    for shape in (SHAPE, SCAN_SHAPE):
        args = op_args(make_inputs(shape, torch.float32, True, True, device=DEVICE, seed=0))
        forms.append(configs.preferred(problem_of(args)).state.scan)
    assert forms == [False, True]


def _gate_id(g):
    return f"z{int(g[0])}_d{int(g[1])}"


@CASES
def test_deterministic(impl, shape):
    args, _, _ = problem(shape, torch.bfloat16, True, True)
    first = run_op(args, impl)
    for _ in range(2):
        assert_outputs_equal(run_op(args, impl), first, "second run: ")


# ---------------------------------------------------------------------------- layouts

PARAMS = ("q_bias", "k_bias", "mimo_v", "mimo_o", "mimo_z", "d")


def _every_other(x):
    """Same values, stride 2 along the last dim."""
    buf = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype,
                     device=x.device)
    buf[..., ::2] = x
    return buf[..., ::2]


def _transposed(x):
    """Same values, first two dims swapped in memory (1-d tensors: every other element)."""
    if x.dim() < 2:
        return _every_other(x)
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def _offset(x):
    """Same values, contiguous, at a storage offset of one element (pointer not 16-byte aligned)."""
    buf = torch.full((x.numel() + 1,), float("nan"), dtype=x.dtype, device=x.device)
    buf[1:] = x.reshape(-1)
    return buf[1:].view(x.shape)


def _odd_leading_stride(x):
    """Same values, each slice of the first dim one element further than the last ends, so that
    the batch stride is odd (the kernels then cannot assume aligned (b, h) slices)."""
    if x.dim() < 2:
        return _every_other(x)
    inner = x[0].numel()
    buf = torch.full((x.shape[0], inner + 1), float("nan"), dtype=x.dtype, device=x.device)
    buf[:, :inner] = x.reshape(x.shape[0], inner)
    return buf[:, :inner].unflatten(1, x.shape[1:])


def _expanded(name, x):
    """Stride 0 along the head dim for per-head parameters, along the batch dim for dout;
    the values change (first slice repeated), the contiguous comparison uses the same values."""
    if name in PARAMS:
        return x[:1].expand(x.shape)
    if name == "dout":
        return x[:1].expand(x.shape)
    return x


LAYOUTS = {
    "every_other": lambda name, x: _every_other(x),
    "transposed": lambda name, x: _transposed(x),
    "offset": lambda name, x: _offset(x),
    "odd_leading_stride": lambda name, x: _odd_leading_stride(x),
    "expanded": _expanded,
}


@CASES
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_non_contiguous_inputs(layout, impl, shape):
    """Views with other strides, offsets or broadcast give bitwise the result of contiguous copies
    of the same values, and that result matches the golden."""
    dtype = torch.float16
    base = op_args(make_inputs(shape, dtype, True, True, device=DEVICE,
                               seed=seed_for(shape, layout)))
    views = {k: LAYOUTS[layout](k, v) if isinstance(v, torch.Tensor) else v
             for k, v in base.items()}
    changed = [k for k, v in views.items() if isinstance(v, torch.Tensor)
               and (not v.is_contiguous() or v.storage_offset() != 0)]
    assert len(changed) >= 6, f"the layout changed only {changed}"
    contiguous = {k: v.contiguous() if isinstance(v, torch.Tensor) else v
                  for k, v in views.items()}
    expected = run_op(contiguous, impl)
    assert_outputs_equal(run_op(views, impl), expected, f"{layout} views vs contiguous: ")
    golden = bwd_fwd_reference(**contiguous, dtype=torch.float64)
    bench = bwd_fwd_reference(**contiguous, dtype=torch.float32)
    check_outputs(expected, golden, bench, dtype)


# ---------------------------------------------------------------------------- inputs untouched


@CASES
@pytest.mark.parametrize("gates", GATES, ids=_gate_id)
def test_inputs_unmodified(gates, impl, shape):
    args = op_args(make_inputs(shape, torch.bfloat16, *gates, device=DEVICE,
                               seed=seed_for(shape, "unmodified", gates)))
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    before = {k: (v.clone(), v.shape, v.stride(), v.data_ptr()) for k, v in tensors.items()}
    run_op(args, impl)
    for name, x in tensors.items():
        value, shape, stride, ptr = before[name]
        assert (x.shape, x.stride(), x.data_ptr()) == (shape, stride, ptr), f"{name} was resized"
        assert torch.equal(x, value), f"{name} was modified by the call"


# ---------------------------------------------------------------------------- every output written


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty and friends return NaN-filled float tensors for the whole test, so that any
    output element the implementation allocates but never writes shows as NaN."""
    def poisoned(fn):
        def wrapper(*args, **kwargs):
            t = fn(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t
        return wrapper

    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, poisoned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
    assert torch.empty(4).isnan().all()


@CASES
@pytest.mark.parametrize("gates", GATES, ids=_gate_id)
def test_every_output_written(poisoned_empty, gates, impl, shape):
    """Under poisoned allocation, two problems in a row: every element finite and close to its
    golden (stale values from the first run would fail the second)."""
    for seed in ("first", "second"):
        dtype = torch.float32
        inputs = make_inputs(shape, dtype, *gates, device=DEVICE,
                             seed=seed_for(shape, "poison", gates, seed))
        args = op_args(inputs)
        golden = bwd_fwd_reference(**args, dtype=torch.float64)
        bench = bwd_fwd_reference(**args, dtype=torch.float32)
        check_outputs(run_op(args, impl), golden, bench, dtype)
