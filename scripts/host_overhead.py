"""Host time per call of the operator against its GPU time: is a shape launch-bound?

On a GPU, for each official shape (bf16 inputs, Z and D on, bf16 outputs):
- host_us: wall time per call of enqueueing n calls back to back behind a GPU sleep, so that
  the GPU's progress cannot hold the host back (n small enough that the launch queue does not
  fill: host_blocked says when it did, or when a call waited for the GPU);
- gpu_us: GPU time per call of the same n calls, which run back to back once the sleep ends
  whatever the host does (warm L2, no flush between calls);
- bench_ms: triton.testing.do_bench's median, as the benchmark times it (L2 flushed before
  each call, host gaps included).
When host_us approaches gpu_us plus do_bench's cache flush, do_bench measures the host.

Without CUDA (and without TRITON_INTERPRET: the kernels must be Triton's compiled kind), the
compiled kernels are replaced by no-ops that the launcher keeps and calls directly, as on a GPU,
and host_us is the Python side alone (argument checks, the call plan, the launcher's keys,
allocations on small CPU tensors), for comparing host code changes on a CPU-only machine; the
compiled launchers' own cost and CUDA's allocator are not in it.

With `operator` the same for the whole operator as a user calls it (bench_operator.operator_case:
the forward, and forward then backward), the backward's groups of batch entries as the rules
choose them, of two entries and in one group (configs.backward_group): on a GPU the three times
and the peak memory of each, whether the groups' extra launches make a shape wait for the host
and what larger groups would cost in memory; on a CPU its Python with the kernels stubbed, at
B = 4 in groups of one entry and in one group.

Usage: [OUT=dir] PYTHONPATH=. python3 scripts/host_overhead.py [shape filter] [n] [z|noz]
  [auto|split|operator]
(filter: substrings of shape names, comma-separated; n: calls per row, by default 8 on a GPU,
few enough that their launches do not fill the launch queue, and 200 on a CPU.)
(noz: without the Z gate; split: the split state pass where the rules would pick the fused
scan, through configs.override.) Writes $OUT/host_overhead.json when OUT is set.
"""
import contextlib
import json
import os
import sys
import time
import timeit

import torch

from mamba3_mimo import configs, mamba3_mimo_bwd_fwd
from mamba3_mimo.bench import problem_of
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes
from mamba3_mimo.runtime.device import interpreter_active


def _call(shape: Shape, device: str, z_gate: bool, split: bool):
    """(the call, a context in which to time it): with `split`, the rules' state candidates
    without the fused scan."""
    a = make_inputs(shape, torch.bfloat16, z_gate=z_gate, d_skip=True, device=device, seed=0)
    a.pop("adt")
    a["output_dtype"] = torch.bfloat16
    rules = contextlib.nullcontext()
    if split:
        state = [c for c in configs.state_candidates(problem_of(a)) if not c.scan]
        rules = configs.override(state=state)
    return (lambda: mamba3_mimo_bwd_fwd(**a)), rules


def on_gpu(shapes, n: int, z_gate: bool, split: bool) -> list:
    rows = []
    for s in shapes:
        f, rules = _call(s, "cuda", z_gate, split)
        with rules:
            rows.append(_on_gpu(s, f, n))
    return rows


def operator_on_gpu(shapes, n: int, z_gate: bool) -> list:
    """The forward, and forward+backward with the backward's groups as the rules choose them,
    of two entries and of the whole batch, each fwd+bwd row with its peak memory above the
    inputs and their gradients (bench.peak_extra_mib, MiB)."""
    from mamba3_mimo.bench import peak_extra_mib
    from mamba3_mimo.bench_operator import operator_case
    rows = []
    for s in shapes:
        fwd, fwd_bwd, _ = operator_case(s, z_gate)
        rows.append(_on_gpu(s, fwd, n, f"{s.name} fwd"))
        for group in dict.fromkeys((None, min(2, s.B), s.B)):
            with configs.override(backward_group=group):
                name = f"{s.name} fwd+bwd groups {'rules' if group is None else group}"
                row = _on_gpu(s, fwd_bwd, n, name)
                rows.append(dict(row, peak_mib=peak_extra_mib(fwd_bwd)))
    return rows


def _on_gpu(s: Shape, f, n: int, name: str = "") -> dict:
    """One shape's row on the GPU (named `name`, else the shape's). The n calls are enqueued
    behind a GPU sleep, so the host's enqueueing (host_us) is timed while the GPU runs nothing
    of them and cannot hold the host back, and the calls then run back to back (gpu_us). A
    launch queue that fills, or a call that waits for the GPU, holds the host until the sleep
    ends: host_blocked says so (the host time is then not the host's own)."""
    name = name or s.name
    from triton.testing import do_bench
    f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep_s = 1.0
    torch.cuda._sleep(int(sleep_s * 2e9))  # about a second at the H100's and H200's clocks
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        f()
    end.record()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    host_us, gpu_us = host_s / n * 1e6, start.elapsed_time(end) / n * 1e3
    blocked = host_s > 0.5 * sleep_s  # far more than any n calls' Python: held back
    bench_ms = do_bench(f, rep=100, return_mode="median")
    print(f"{name:18s} host {host_us:7.1f} us  gpu {gpu_us:7.1f} us  "
          f"do_bench {bench_ms * 1e3:7.1f} us" + ("  (host blocked)" if blocked else ""),
          flush=True)
    return dict(shape=name, host_us=host_us, gpu_us=gpu_us, bench_ms=bench_ms,
                host_blocked=blocked)


class _NoOpKernel:
    """Stands for a compiled kernel on a machine without CUDA: launching it does nothing."""
    function, packed_metadata = 0, ()

    def run(self, *args) -> None:
        return None


def _stub_kernels() -> None:
    """Compiled kernels replaced by no-ops on a machine without CUDA (on_cpu's docstring)."""
    import types
    from triton.runtime.jit import JITFunction
    from mamba3_mimo.phases import bwd_fwd, operator
    from mamba3_mimo.runtime import launcher
    if interpreter_active():
        raise SystemExit("host_overhead.py on a CPU stubs Triton's compiled kernels: run it "
                         "without TRITON_INTERPRET")
    # Triton's path "compiles" to a no-op kernel, which the launcher then keeps and calls
    # directly, as on a GPU: the key building of the launcher is measured too
    JITFunction.run = lambda self, *a, **k: _NoOpKernel()
    launcher.driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0))
    # CPU tensors without the interpreter: the device checks would refuse them (their own
    # cost, a few comparisons, is left out)
    bwd_fwd.check_device = operator.check_device = lambda device: None


def on_cpu(shapes, n: int, z_gate: bool, split: bool) -> list:
    _stub_kernels()
    rows = []
    for s in shapes:
        small = Shape(1, 2 * s.C, 2, 1, s.N, s.P, s.R, s.C)  # the host path ignores B and S
        f, rules = _call(small, "cpu", z_gate, split)
        with rules:
            f()
            host_us = min(timeit.repeat(f, number=n, repeat=15)) / n * 1e6
        rows.append(dict(shape=s.name, host_us=host_us, gpu_us=None, bench_ms=None))
        print(f"{s.name:18s} python {host_us:6.1f} us per call (kernels stubbed)", flush=True)
    return rows


def operator_on_cpu(shapes, n: int, z_gate: bool) -> list:
    """The operator's Python per call with the kernels stubbed, at the official shapes' model
    dimensions with B = 4 and a short S (the host's path does not depend on S), its backward in
    groups of one batch entry (as the rules choose on the official grid) and in one group."""
    from mamba3_mimo.bench_operator import operator_case
    _stub_kernels()
    rows = []
    for s in shapes:
        small = Shape(4, 2 * s.C, 2, 1, s.N, s.P, s.R, s.C)
        fwd, fwd_bwd, _ = operator_case(small, z_gate, device="cpu")
        for group in (1, small.B):
            with configs.override(backward_group=group):
                for what, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    f()
                    host_us = min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6
                    name = f"{s.name} {what} groups of {group}"
                    rows.append(dict(shape=name, host_us=host_us, gpu_us=None, bench_ms=None))
                    print(f"{name:36s} python {host_us:7.1f} us per call (kernels stubbed)",
                          flush=True)
    return rows


def main() -> None:
    filt = sys.argv[1] if len(sys.argv) > 1 else ""
    n = int(sys.argv[2]) if len(sys.argv) > 2 else (8 if torch.cuda.is_available() else 200)
    z_gate = (sys.argv[3] if len(sys.argv) > 3 else "z") == "z"
    mode = sys.argv[4] if len(sys.argv) > 4 else "auto"
    if mode not in ("auto", "split", "operator"):
        raise SystemExit(f"the fourth argument is auto, split or operator, not {mode!r}")
    shapes = [s for s in official_shapes() if any(f in s.name for f in filt.split(","))]
    if not shapes:
        raise SystemExit(f"no official shape matches {filt!r}")
    if mode == "operator":
        rows = (operator_on_gpu if torch.cuda.is_available() else operator_on_cpu)(shapes, n,
                                                                                  z_gate)
    else:
        rows = (on_gpu if torch.cuda.is_available() else on_cpu)(shapes, n, z_gate,
                                                                    mode == "split")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_overhead.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
