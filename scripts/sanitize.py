"""Run the production path once per small shape, for compute-sanitizer on a GPU: the test sweep's
shapes (every R, N, P and rotary divisor, GQA, tails) and, for bf16, the eleven official model
shapes at B=1, S=64 (their dispatcher configs and output tiles).
Usage: compute-sanitizer --tool memcheck python3 scripts/sanitize.py {bf16|fp16|fp32}"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_bwd_fwd import _sweep_shapes  # noqa: E402

from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes  # noqa: E402


def main() -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sys.argv[1]]
    shapes = _sweep_shapes()
    if dtype == torch.bfloat16:
        shapes += [Shape(1, 64, 2, 1, s.N, s.P, s.R, s.C) for s in official_shapes()]
    # bf16 also with a bf16 output: the fp32 state scratch is then separate from `states`
    # (with an fp32 output they are one tensor)
    outputs = (torch.bfloat16, torch.float32) if dtype == torch.bfloat16 else (torch.float32,)
    for s in shapes:
        a = make_inputs(s, dtype, device="cuda", seed=5)
        a.pop("adt")
        for out_dtype in outputs:
            api.bwd_fwd(**a, output_dtype=out_dtype, impl="chunked")
            torch.cuda.synchronize()
        print(sys.argv[1], s, "done", flush=True)


if __name__ == "__main__":
    main()
