"""`python -m mamba3_mimo demo`: run bwd_fwd once, check it against the reference, print a table.

On a CUDA GPU: the official shape N128_P64_R4_C16 (B=4, S=2048, H=16, G=1), bf16, Z and D on,
timed with triton.testing.do_bench. Without CUDA: a small fp32 problem through the Triton
interpreter, timed with time.perf_counter. Exits non-zero when an output's relative RMS error
against the float64 reference exceeds the input dtype's threshold.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import torch

def _use_interpreter_without_cuda() -> bool:
    """True on CUDA. Otherwise make sure Triton runs through its interpreter: TRITON_INTERPRET
    must be set before the kernels are defined, so if `python -m` already imported them, re-exec."""
    if torch.cuda.is_available():
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            os.execv(sys.executable, [sys.executable, "-m", "mamba3_mimo", *sys.argv[1:]])
    return False


def demo() -> int:
    on_gpu = _use_interpreter_without_cuda()
    from . import configs, mamba3_mimo_bwd_fwd
    from .bench import problem_of
    from .inputs import Shape, make_inputs
    from .reference import bwd_fwd_reference
    from .testing import OUTPUTS, THRESHOLDS, rel_rms

    if on_gpu:
        shape, dtype, device = Shape(4, 2048, 16, 1, 128, 64, 4, 16), torch.bfloat16, "cuda"
        where = f"{torch.cuda.get_device_name()}, compiled Triton kernels"
    else:
        shape, dtype, device = Shape(1, 64, 2, 1, 32, 16, 2, 16), torch.float32, "cpu"
        where = "CPU, Triton interpreter (TRITON_INTERPRET=1): slow, for correctness only"
    args = make_inputs(shape, dtype, z_gate=True, d_skip=True, device=device)
    args.pop("adt")
    plan = configs.preferred(problem_of(args)).describe()

    def run():
        return mamba3_mimo_bwd_fwd(**args)

    t0 = time.perf_counter()
    ours = run()
    if on_gpu:
        torch.cuda.synchronize()
        from triton.testing import do_bench
        first_s, ms = time.perf_counter() - t0, do_bench(run, return_mode="median")
        timing = f"first call {first_s:.2f} s (incl. compile); median {ms:.3f} ms (do_bench)"
    else:
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run()
        timing = (f"first call {first_s:.2f} s; second call {time.perf_counter() - t0:.2f} s "
                  "(interpreter, time.perf_counter)")
    gold = bwd_fwd_reference(**args, dtype=torch.float64)
    bench = bwd_fwd_reference(**args, dtype=torch.float32)

    limit = THRESHOLDS[dtype]
    print(f"mamba3_mimo demo: {shape.name} B={shape.B} S={shape.S} H={shape.H} G={shape.G}, "
          f"{str(dtype).replace('torch.', '')} inputs, Z on, D on, output float32")
    print(f"device:         {where}")
    print(f"implementation: {plan}")
    print(f"\n{'output':<9} {'ours vs f64':>12} {'fp32 ref vs f64':>16} {'limit':>8}  ok")
    failed = []
    for name, x, g, b in zip(OUTPUTS, ours, gold, bench):
        err, ref_err = rel_rms(x, g), rel_rms(b, g)
        ok = err <= limit
        failed += [] if ok else [name]
        print(f"{name:<9} {err:>12.2e} {ref_err:>16.2e} {limit:>8.0e}  {'yes' if ok else 'NO'}")
    print(f"\ntime: {timing}")
    print("FAILED: " + ", ".join(failed) if failed else "all outputs within the threshold")
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba3_mimo",
                                     description="Mamba-3 MIMO bwd_fwd in Triton.")
    parser.add_argument("command", choices=["demo"],
                        help="demo: run one problem, check it against the reference, time it")
    parser.parse_args(argv)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
