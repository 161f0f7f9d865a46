"""Host time per call of the operator against its GPU time: is a shape launch-bound?

On a GPU, for each official shape (bf16 inputs, Z and D on, bf16 outputs):
- host_us: wall time per call of enqueueing n calls back to back, without synchronising;
- gpu_us: GPU time per call of the same n calls queued behind a GPU sleep, so that they run
  back to back whatever the host does (warm L2, no flush between calls);
- bench_ms: triton.testing.do_bench's median, as the benchmark times it (L2 flushed before
  each call, host gaps included).
When host_us approaches gpu_us plus do_bench's cache flush, do_bench measures the host.

Without CUDA, the compiled kernels are replaced by no-ops that the launcher keeps and calls
directly, as on a GPU, and host_us is the Python side alone (argument checks, the dispatcher,
the launcher's keys, allocations on small CPU tensors), for comparing host code changes on a
CPU-only machine; the compiled launchers' own cost and CUDA's allocator are not in it.

Usage: [OUT=dir] PYTHONPATH=. python3 scripts/host_overhead.py [shape filter] [n] [z|noz]
  [auto|split]
(noz: without the Z gate; split: the split state pass where the dispatcher would run the fused
scan.) Writes $OUT/host_overhead.json when OUT is set.
"""
import json
import os
import sys
import time
import timeit

import torch

from mamba3_mimo import api, dispatch
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes


def _call(shape: Shape, device: str, z_gate: bool = True):
    a = make_inputs(shape, torch.bfloat16, z_gate=z_gate, d_skip=True, device=device, seed=0)
    a.pop("adt")
    return lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16)


def on_gpu(shapes, n: int, z_gate: bool) -> list:
    from triton.testing import do_bench
    rows = []
    for s in shapes:
        f = _call(s, "cuda", z_gate)
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e9))  # about a second: every call below is queued before it ends
        start.record()
        for _ in range(n):
            f()
        end.record()
        torch.cuda.synchronize()
        gpu_us = start.elapsed_time(end) / n * 1e3
        bench_ms = do_bench(f, rep=100, return_mode="median")
        rows.append(dict(shape=s.name, host_us=host_us, gpu_us=gpu_us, bench_ms=bench_ms))
        print(f"{s.name:18s} host {host_us:7.1f} us  gpu {gpu_us:7.1f} us  "
              f"do_bench {bench_ms * 1e3:7.1f} us", flush=True)
    return rows


class _NoOpKernel:
    """Stands for a compiled kernel on a machine without CUDA: launching it does nothing."""
    function, packed_metadata = 0, ()

    def run(self, *args) -> None:
        return None


def on_cpu(shapes, n: int, z_gate: bool) -> list:
    import types
    from triton.runtime.jit import JITFunction
    from mamba3_mimo.kernels import launcher
    # Triton's path "compiles" to a no-op kernel, which the launcher then keeps and calls
    # directly, as on a GPU: the key building of launcher.launch_kernel is measured too
    JITFunction.run = lambda self, *a, **k: _NoOpKernel()
    launcher.driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0))
    dispatch.check_device = lambda device: None
    # on CUDA the configs come from the cache after a model's first call; on a CPU device
    # _choose rebuilds the candidate lists each time, which a GPU call does not pay
    chosen = {}

    def choose(launch, candidates, a, out, m, pb):
        key = (launch.__module__, pb.N, pb.P, pb.R, pb.C, pb.dtype, pb.has_z, pb.has_d)
        if key not in chosen:
            chosen[key] = candidates(pb, m)[0]
        return chosen[key]

    dispatch._choose = choose
    rows = []
    for s in shapes:
        small = Shape(1, 2 * s.C, 2, 1, s.N, s.P, s.R, s.C)  # the host path ignores B and S
        f = _call(small, "cpu", z_gate)
        f()
        host_us = min(timeit.repeat(f, number=n, repeat=15)) / n * 1e6
        rows.append(dict(shape=s.name, host_us=host_us, gpu_us=None, bench_ms=None))
        print(f"{s.name:18s} python {host_us:6.1f} us per call (kernels stubbed)", flush=True)
    return rows


def main() -> None:
    filt = sys.argv[1] if len(sys.argv) > 1 else ""
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    z_gate = (sys.argv[3] if len(sys.argv) > 3 else "z") == "z"
    if len(sys.argv) > 4 and sys.argv[4] == "split":
        scan_first = dispatch._state_candidates
        dispatch._state_candidates = lambda pb, m: [c for c in scan_first(pb, m) if not c["SCAN"]]
    shapes = [s for s in official_shapes() if filt in s.name]
    rows = (on_gpu if torch.cuda.is_available() else on_cpu)(shapes, n, z_gate)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_overhead.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
