"""Shared fixtures and helpers of the bwd_fwd test suite.

Every Triton result is checked against the float64 golden of `mamba3_mimo.reference` by relative
RMS error, next to a float32 "bench" run of the same reference that must itself stay within a tenth
of the threshold (otherwise the reference, not the kernel, is suspect). The worst error per output
is printed at the end of the run (the table docs/validation.md is built from).

On a machine without CUDA the kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be
set before triton is imported (importing torch does not import triton).
"""
from __future__ import annotations

import functools
import json
import os
import weakref
import zlib
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import mamba3_mimo  # noqa: E402
from mamba3_mimo import configs  # noqa: E402
from mamba3_mimo.inputs import Shape, make_inputs  # noqa: E402
from mamba3_mimo.phases import bwd_fwd  # noqa: E402
from mamba3_mimo.reference import bwd_fwd_reference  # noqa: E402
from mamba3_mimo.testing import (DTYPE_NAMES, OUTPUTS, SEQ_OUTPUT_DTYPE,  # noqa: E402,F401
                                 THRESHOLDS, rel_max, rel_rms, threshold)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _round_bf16_to_nearest_even() -> None:
    """Make the interpreter convert fp32 to bf16 as the GPU does, to nearest even; Triton 3.6's
    interpreter truncates, which biases every bf16 output toward zero by up to 1 ulp and makes
    the CPU errors of bf16 outputs about 1.5x the GPU's. Only the conversion changes; test
    `test_interpreter.py::test_bf16_stores_round_to_nearest_even` checks it (on the GPU, the
    hardware's)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16:
            return truncating(data, input_dtype, output_dtype, rounding_mode)
        bits = np.frombuffer(data.tobytes(), dtype=np.uint32).astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # stays a (quiet) NaN
        return out.reshape(data.shape)

    interpreter._convert_float = convert


if not ON_GPU:
    _round_bf16_to_nearest_even()

requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (CPU runs the interpreter)")

MAX_CHECKED = ("qk_dot", "dmimo_z")  # also checked by max error
DTYPE_IDS = DTYPE_NAMES

# "dispatch" is the public entry (mamba3_mimo_bwd_fwd, the production path); "stage0" the
# baseline, through bwd_fwd(impl="stage0").
IMPLS = ("dispatch", "stage0")


def seed_for(*parts) -> int:
    """A fresh, reproducible seed per test, derived from its parameters."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def run_op(args: dict, impl: str = "dispatch", **extra):
    """Run the operator on make_inputs-style kwargs (without 'adt')."""
    kwargs = {**args, **extra}
    if impl == "dispatch":
        return mamba3_mimo.mamba3_mimo_bwd_fwd(**kwargs)
    return bwd_fwd.bwd_fwd(**kwargs, impl=impl)


def op_args(inputs: dict) -> dict:
    """make_inputs' dict without the 'adt' entry."""
    return {k: v for k, v in inputs.items() if k != "adt"}


@functools.lru_cache(maxsize=16)
def problem(shape: Shape, dtype: torch.dtype, z_gate: bool = True, d_skip: bool = True,
            seed: Optional[int] = None, trap_dtype: Optional[torch.dtype] = None):
    """(args, golden, bench) for one problem; cached so several impls share the references.

    Callers must not modify args in place (test_properties checks that the op does not).
    """
    if seed is None:
        seed = seed_for(shape, dtype, z_gate, d_skip, trap_dtype)
    inputs = make_inputs(shape, dtype, z_gate, d_skip, device=DEVICE, seed=seed,
                         trap_dtype=trap_dtype)
    adt = inputs.pop("adt")
    del adt
    golden = bwd_fwd_reference(**inputs, dtype=torch.float64)
    bench = bwd_fwd_reference(**inputs, dtype=torch.float32)
    return inputs, golden, bench


# ---------------------------------------------------------------------------- error measures


# worst error seen per (output, input dtype): filled by assert_close_to_golden, printed at the end
SUMMARY: Dict[tuple, dict] = {}


def _record(name: str, dtype: torch.dtype, rec: dict) -> None:
    key = (name, DTYPE_IDS[dtype])
    old = SUMMARY.get(key)
    if old is None or rec["err"] / rec["thr"] > old["err"] / old["thr"]:
        SUMMARY[key] = rec


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def assert_close_to_golden(name: str, out, golden, bench, dtype: torch.dtype,
                           output_dtype: torch.dtype = torch.float32) -> None:
    """Check one output against the float64 golden; the float32 bench must be 10x closer.

    Thresholds (relative RMS) follow the input dtype: fp32 1e-4, fp16 2e-3, bf16 5e-3; an output
    written in a narrower output_dtype gets that dtype's threshold. qk_dot and dmimo_z must also
    keep max|x - golden| / max|golden| within 2x the threshold.
    """
    if golden is None:
        assert out is None, f"{name}: expected None, got a tensor"
        assert bench is None
        return
    assert out is not None, f"{name}: expected a tensor, got None"
    assert tuple(out.shape) == tuple(golden.shape), (
        f"{name}: shape {list(out.shape)}, expected {list(golden.shape)}")
    assert out.device.type == torch.device(DEVICE).type, f"{name} on {out.device}"
    out_written = output_dtype if name in SEQ_OUTPUT_DTYPE else torch.float32
    assert out.dtype == out_written, f"{name}: dtype {out.dtype}, expected {out_written}"
    n_bad = (~torch.isfinite(out)).sum().item()
    assert n_bad == 0, f"{name}: {n_bad} non-finite elements (unwritten or overflow)"

    thr = threshold(dtype, out_written)
    err, bench_err = rel_rms(out, golden), rel_rms(bench, golden)
    mx = rel_max(out, golden) if name in MAX_CHECKED else None
    bench_mx = rel_max(bench, golden) if name in MAX_CHECKED else None
    test = _current_test()
    msg = (f"{name:8s} rel_rms {err:.3e} (bench {bench_err:.3e})"
           + (f" rel_max {mx:.3e} (bench {bench_mx:.3e})" if mx is not None else "")
           + f" thr {thr:.0e} [{DTYPE_IDS[dtype]}]")
    print(f"\n{test}: {msg}", end="")
    _record(name, dtype, dict(err=err, bench=bench_err, max=mx, thr=thr, test=test))

    assert bench_err <= thr / 10, f"reference suspect: float32 bench vs golden: {msg}"
    assert err <= thr, f"relative RMS error over threshold: {msg}"
    if mx is not None:
        assert bench_mx <= 2 * thr / 10, f"reference suspect (max error): {msg}"
        assert mx <= 2 * thr, f"relative max error over 2x threshold: {msg}"


def check_outputs(outs, golden, bench, dtype: torch.dtype,
                  output_dtype: torch.dtype = torch.float32) -> None:
    """assert_close_to_golden on each of the five outputs."""
    assert isinstance(outs, tuple) and len(outs) == 5, f"expected a 5-tuple, got {type(outs)}"
    for name, o, g, b in zip(OUTPUTS, outs, golden, bench):
        assert_close_to_golden(name, o, g, b, dtype, output_dtype)


def assert_outputs_equal(a, b, what: str = "") -> None:
    """Bitwise equality of two 5-tuples of outputs (None matches None)."""
    for name, x, y in zip(OUTPUTS, a, b):
        if x is None or y is None:
            assert x is None and y is None, f"{what}{name}: one None, one tensor"
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}{name}: dtype/shape differ"
        if not torch.equal(x, y):
            n = (x != y).sum().item()
            raise AssertionError(f"{what}{name}: {n} of {x.numel()} elements differ "
                                 f"(max |diff| {(x.double() - y.double()).abs().max().item():.3e})")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that the ops run under it create and that are still alive
    (`current`), and their high-water mark (`peak`). Storages it has not seen created (the
    inputs, given to `known`) are not counted when an op returns a view of them."""

    def __init__(self, known=()):
        super().__init__()
        self.current = self.peak = 0
        self._seen = {t.untyped_storage().data_ptr() for t in known}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._seen:
                    self._seen.add(key)
                    self.current += size
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key, size):
        self._seen.discard(key)
        self.current -= size


def record_launches(monkeypatch, forward: bool = True) -> list:
    """Record (fn, grid, args, options) of each production launch (every one goes through
    `launcher.launch_kernel` or a call plan's `launcher.BoundLaunch`, which its
    `launcher.BoundGroup` is made to call every time); forward=False records
    without launching, which leaves the outputs unwritten."""
    from mamba3_mimo.runtime import launcher
    log = []
    launch, bound_launch = launcher.launch_kernel, launcher.BoundLaunch.__call__

    def record(fn, grid, args, **options):
        log.append((fn, grid, args, options))
        return launch(fn, grid, args, **options) if forward else None

    def record_bound(bound, args):
        log.append((bound.fn, bound.grid, args, bound.options))
        return bound_launch(bound, args) if forward else None

    def record_group(group, arg_lists, tensors):
        for bound, args in zip(group.bounds, arg_lists):
            bound(args)

    monkeypatch.setattr(launcher, "launch_kernel", record)
    monkeypatch.setattr(launcher.BoundLaunch, "__call__", record_bound)
    monkeypatch.setattr(launcher.BoundGroup, "__call__", record_group)
    return log


@pytest.fixture(autouse=True)
def fresh_dispatch_caches():
    """Each test starts without cached configs and call plans: tests change what the dispatcher
    picks (monkeypatched candidates, tile sizes, shared-memory limits), and a plan cached by an
    earlier test for the same signature would skip those choices."""
    configs.clear_caches()
    yield
    configs.clear_caches()


# ---------------------------------------------------------------------------- summary hook


def pytest_configure(config):
    # the interpreter's own numpy usage (triton 3.6), not ours
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_terminal_summary(terminalreporter):
    if not SUMMARY:
        return
    tr = terminalreporter
    tr.section("bwd_fwd: worst error vs float64 golden, per output and input dtype")
    tr.write_line(f"{'output':8s} {'dtype':5s} {'rel_rms':>10s} {'bench':>10s} {'rel_max':>10s} "
                  f"{'thr':>7s} {'err/thr':>7s}  test")
    for (name, dt), r in sorted(SUMMARY.items()):
        mx = f"{r['max']:.3e}" if r["max"] is not None else "-"
        tr.write_line(f"{name:8s} {dt:5s} {r['err']:10.3e} {r['bench']:10.3e} {mx:>10s} "
                      f"{r['thr']:7.0e} {r['err'] / r['thr']:7.3f}  {r['test']}")
    path = os.environ.get("MAMBA3_VALIDATION_JSON")
    if path:
        with open(path, "w") as f:
            json.dump([{"output": n, "dtype": d, **r} for (n, d), r in sorted(SUMMARY.items())],
                      f, indent=1)
        tr.write_line(f"(written to {path})")
