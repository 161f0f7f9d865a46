"""Run the production path on small shapes, for compute-sanitizer on a GPU: the test sweep's
shapes (inputs.sweep_shapes: every R, N, P and rotary divisor, GQA, tails), two chunks run as
sub-chunks and, for bf16, the eleven official model shapes at B=1, S=64 (their configs and output
tiles). With `operator` for the dtype, the whole operator in bf16 on the sweep's shapes and the
official ones instead: forward and backward with the final states, again from them as an initial
state, with the fused norm, the final states alone (no output gradient), a decode step, and
packed sequences (1 step, shorter than a chunk, the rest).
Usage: compute-sanitizer --tool memcheck python3 scripts/sanitize.py {bf16|fp16|fp32|operator}
[filter] [repeats]: filter keeps the shapes whose repr contains it (e.g. "R=8, C=16"); each shape
runs `repeats` times (default 1); MAMBA3_DIRECT=0 sends every launch through Triton's own path
(runtime.launcher.DIRECT = False). Without CUDA (a dry run under TRITON_INTERPRET=1) the same
calls run on CPU tensors through the interpreter.
"""
import os
import sys

import torch

from mamba3_mimo import mamba3_mimo, mamba3_mimo_bwd_fwd, mamba3_mimo_step
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes, operator_inputs, sweep_shapes
from mamba3_mimo.phases.operator import final_states
from mamba3_mimo.phases.step import step_arguments
from mamba3_mimo.runtime import launcher

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "operator": torch.bfloat16}


def _backward(outs) -> None:
    sum(x.float().sum() for x in outs).backward()


def operator_calls(s: Shape, device: str) -> None:
    """The whole operator's paths on one shape, bf16 (the module's docstring)."""
    args = operator_inputs(s, torch.bfloat16, device=device, seed=5)
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.requires_grad_(True)
    outs = mamba3_mimo(**args, return_state=True)
    _backward(outs)
    state = tuple(x.detach().requires_grad_(True) for x in outs[1:])
    _backward(mamba3_mimo(**args, return_state=True, initial_state=state))
    weight = torch.ones(s.H, s.P, device=device, requires_grad=True)
    _backward([mamba3_mimo(**args, fuse_pregate_headwise_rms_norm=True,
                           outproj_norm_weight=weight)])
    _backward(final_states(**args))
    step = tuple(x.detach().clone().contiguous() for x in outs[1:])
    with torch.no_grad():
        mamba3_mimo_step(**step_arguments({n: (x.detach() if isinstance(x, torch.Tensor)
                                               else x) for n, x in args.items()}, 0),
                         state=step)
    flat = operator_inputs(Shape(1, s.B * s.S, s.H, s.G, s.N, s.P, s.R, s.C,
                                 s.rotary_dim_divisor), torch.bfloat16, device=device, seed=6)
    for x in flat.values():
        if isinstance(x, torch.Tensor):
            x.requires_grad_(True)
    total = s.B * s.S
    cuts = sorted({0, min(1, total), min(1 + s.C // 2, total), total})
    cu = torch.tensor(cuts, dtype=torch.int32, device=device)
    _backward(mamba3_mimo(**flat, return_state=True, cu_seqlens=cu))


def shapes_for(dtype: torch.dtype, shape_filter: str = "") -> list:
    """The shapes run for one input dtype, those whose repr contains shape_filter."""
    # and two chunks beyond the kernels' tiles, run as sub-chunks (test_bwd_fwd's large chunks)
    shapes = sweep_shapes() + [Shape(1, 150, 2, 1, 16, 16, 4, 64),
                               Shape(1, 130, 2, 1, 16, 16, 2, 65)]
    if dtype == torch.bfloat16:
        shapes += [Shape(1, 64, 2, 1, s.N, s.P, s.R, s.C) for s in official_shapes()]
    return [s for s in shapes if shape_filter in repr(s)]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in DTYPES:
        raise SystemExit(f"usage: {sys.argv[0]} {{bf16|fp16|fp32|operator}} [filter] [repeats]")
    dtype = DTYPES[sys.argv[1]]
    shape_filter = sys.argv[2] if len(sys.argv) > 2 else ""
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    if os.environ.get("MAMBA3_DIRECT") == "0":
        launcher.DIRECT = False
    shapes = shapes_for(dtype, shape_filter)
    if not shapes:
        raise SystemExit(f"no shape matches {shape_filter!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 also with a bf16 output: the fp32 state scratch is then separate from `states`
    # (with an fp32 output they are one tensor)
    outputs = (torch.bfloat16, torch.float32) if dtype == torch.bfloat16 else (torch.float32,)
    for s in shapes:
        if sys.argv[1] == "operator":
            for _ in range(repeats):
                operator_calls(s, device)
                if device == "cuda":
                    torch.cuda.synchronize()
            print(sys.argv[1], s, "done", flush=True)
            continue
        a = make_inputs(s, dtype, device=device, seed=5)
        a.pop("adt")
        for _ in range(repeats):
            for out_dtype in outputs:
                mamba3_mimo_bwd_fwd(**a, output_dtype=out_dtype)
                if device == "cuda":
                    torch.cuda.synchronize()
        print(sys.argv[1], s, "done", flush=True)


if __name__ == "__main__":
    main()
