"""Every address a kernel touches lies inside a tensor it was given (CPU interpreter only).

The interpreter does not fault on a stray address, so this wraps its load and store builders and
checks each active (unmasked) address against the byte ranges of the launch's tensor arguments.
On a GPU the same property is what compute-sanitizer checks.
"""
import numpy as np
import pytest
import torch

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
        that the access itself stays harmless."""
        addr = np.asarray(ptrs.data).astype(np.int64)
        width = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        active = np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi, _ in ranges:
            ok |= (addr >= lo) & (addr + width <= hi)
        stray = active & ~ok
        if stray.any():
            violations.append(f"{ranges[0][2] if ranges else '?'}: {what} outside every "
                              f"argument ({int(stray.sum())} addresses)")
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
                                   Shape(2, 16, 2, 1, 64, 16, 1, 8)], ids=lambda s: f"{s.name}_S{s.S}")
def test_accesses_stay_inside_arguments(shape, impl, bounds_checked):
    args = op_args(make_inputs(shape, torch.float32, True, True, seed=seed_for(shape, "bounds")))
    run_op(args, impl, output_dtype=torch.bfloat16)
    assert not bounds_checked, "\n".join(bounds_checked[:10])
