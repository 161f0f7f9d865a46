"""Every address a kernel touches lies inside a tensor it was given, each access inside one of
them (CPU interpreter only).

The interpreter does not fault on a stray address, so this wraps its load and store builders and
checks each active (unmasked) address against the byte ranges of the launch's tensor arguments.
On a GPU the same property is what compute-sanitizer checks.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import IMPLS, ON_GPU, op_args, run_op, seed_for
from mamba3_mimo.inputs import Shape, make_inputs

pytestmark = pytest.mark.skipif(ON_GPU, reason="checks the Triton interpreter's memory accesses")


@pytest.fixture
def bounds_checked(monkeypatch):
    """Record the argument ranges of each interpreted launch and check every access against them."""
    from triton.runtime import interpreter as interp

    ranges = []
    violations = []

    def call(self, *args, _orig=interp.GridExecutor.__call__, **kwargs):
        ranges.clear()
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes(), self.fn.__name__))
        return _orig(self, *args, **kwargs)

    def inside(ptrs, mask, what):
        """The mask with every stray active address switched off (recorded as a violation), so
        that the access itself stays harmless. One access comes from one base pointer, so its
        addresses must also lie in a single argument: an index that runs past the end of one
        tensor into the next argument's memory is a violation too."""
        addr = np.asarray(ptrs.data).astype(np.int64)
        width = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        active = np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        ok = np.zeros(addr.shape, dtype=bool)
        hit = 0
        for lo, hi in {(lo, hi) for lo, hi, _ in ranges}:  # views share their storage's range
            here = (addr >= lo) & (addr + width <= hi)
            hit += bool((active & here).any())
            ok |= here
        stray = active & ~ok
        name = ranges[0][2] if ranges else "?"
        if stray.any():
            violations.append(f"{name}: {what} outside every argument "
                              f"({int(stray.sum())} addresses)")
        if hit > 1:
            violations.append(f"{name}: one {what} spans {hit} arguments")
        return interp.TensorHandle(active & ok, mask.dtype)

    def load(self, ptrs, mask, other, *rest, _orig=interp.InterpreterBuilder.create_masked_load):
        return _orig(self, ptrs, inside(ptrs, mask, "load"), other, *rest)

    def store(self, ptrs, value, mask, *rest, _orig=interp.InterpreterBuilder.create_masked_store):
        return _orig(self, ptrs, value, inside(ptrs, mask, "store"), *rest)

    monkeypatch.setattr(interp.GridExecutor, "__call__", call)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", store)
    return violations


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [Shape(1, 33, 2, 1, 16, 16, 2, 32), Shape(1, 40, 2, 2, 18, 20, 3, 16),
                                   Shape(2, 16, 2, 1, 64, 16, 1, 8),
                                   Shape(1, 40, 2, 2, 64, 16, 2, 16, rotary_dim_divisor=2),
                                   Shape(1, 40, 2, 1, 16, 64, 4, 8)],
                         ids=lambda s: f"{s.name}_S{s.S}_G{s.G}")
def test_accesses_stay_inside_arguments(shape, impl, bounds_checked):
    args = op_args(make_inputs(shape, torch.float32, True, True, seed=seed_for(shape, "bounds")))
    run_op(args, impl, output_dtype=torch.bfloat16)
    assert not bounds_checked, "\n".join(bounds_checked[:10])


def test_careful_rerun_stays_inside_arguments(bounds_checked):
    """chunk_output's rerun of a tile that met a NaN (in v at step 20 of 40; two output tiles of
    two chunks and a partial one) stays inside its arguments too."""
    shape = Shape(1, 40, 2, 1, 16, 48, 2, 8)
    args = op_args(make_inputs(shape, torch.float32, True, True, seed=seed_for(shape, "nan")))
    args["v"] = args["v"].clone()
    args["v"][0, 20, 1, 5] = float("nan")
    run_op(args, output_dtype=torch.bfloat16)
    assert not bounds_checked, "\n".join(bounds_checked[:10])


@triton.jit
def _copy_kernel(src, dst, n_load, n_store, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n_load), mask=i < n_store)


def test_checker_flags_stray_and_spanning_accesses(bounds_checked):
    """The checker itself: a load that runs from one argument into the next one's memory, and a
    store past the end of every argument, are both reported."""
    buf = np.zeros(64, np.float32)
    a, b = torch.from_numpy(buf[:32]), torch.from_numpy(buf[32:])  # adjacent storages
    _copy_kernel[(1,)](a, b, 64, 32, BLOCK=64)
    assert bounds_checked == ["_copy_kernel: one load spans 2 arguments"]
    bounds_checked.clear()
    _copy_kernel[(1,)](b, b, 32, 64, BLOCK=64)
    assert bounds_checked == ["_copy_kernel: store outside every argument (32 addresses)"]


@pytest.mark.parametrize("case", ["z_d_gqa", "noz_nod", "per_rank", "norm_w"])
def test_operator_accesses_stay_inside_arguments(case, bounds_checked):
    """The whole operator's kernels, forward and backward, with its final states and from an
    initial state (the angles' walk in more parts than a row has blocks), and the final states
    alone (context parallelism's summary: phase 2 without dy)."""
    from test_operator import CASES, _leaves
    from test_reference_operator import make_args
    from mamba3_mimo import mamba3_mimo
    from mamba3_mimo.phases.operator import final_states
    make_kw, op_kw, w_shape = CASES[case]
    ours, _ = _leaves(make_args(**make_kw), torch.float32, "cpu", None)
    if w_shape is not None:
        ours["outproj_norm_weight"] = torch.ones(w_shape, requires_grad=True)
    ours.update(op_kw)
    out, *final = mamba3_mimo(**ours, return_state=True)
    (out.sum() + sum(x.sum() for x in final)).backward()
    out, *_ = mamba3_mimo(**ours, return_state=True, initial_state=tuple(
        x.detach().requires_grad_(True) for x in final))
    out.sum().backward()
    sum(x.sum() for x in final_states(**ours)).backward()
    assert not bounds_checked, "\n".join(bounds_checked[:10])


def test_packed_operator_accesses_stay_inside_arguments(bounds_checked):
    """Packed sequences (a 1-step one, one shorter than a chunk, one of several chunks) through
    the whole operator, forward and backward with the final states."""
    from test_operator import _leaves
    from test_reference_operator import make_args
    from mamba3_mimo import mamba3_mimo
    ours, _ = _leaves(make_args(B=1, S=23, H=2, G=1, R=2, N=8, P=6, chunk_size=4),
                      torch.float32, "cpu", None)
    cu = torch.tensor([0, 1, 4, 23], dtype=torch.int32)
    out, *final = mamba3_mimo(**ours, return_state=True, cu_seqlens=cu)
    (out.sum() + sum(x.sum() for x in final)).backward()
    assert not bounds_checked, "\n".join(bounds_checked[:10])


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_decode_step_accesses_stay_inside_arguments(norm, bounds_checked):
    """The decode step (mamba3_mimo_step), the state updated in place, with and without the
    fused norm."""
    from test_reference_operator import make_args, state_for
    from mamba3_mimo import mamba3_mimo_step
    from mamba3_mimo.phases.step import step_arguments
    args = make_args(B=2, S=1, H=4, G=2, R=3, N=12, P=10)
    state = tuple(x.float().contiguous() for x in state_for(args))
    token = {n: (x.float() if isinstance(x, torch.Tensor) else x)
             for n, x in step_arguments(args, 0).items()}
    if norm:
        token.update(fuse_pregate_headwise_rms_norm=True,
                     outproj_norm_weight=torch.ones(4, 10))
    mamba3_mimo_step(**token, state=state)
    assert not bounds_checked, "\n".join(bounds_checked[:10])
