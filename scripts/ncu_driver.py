"""Calls the production op twice on one official shape (bf16, Z on unless the second argument
is "noz"), for `ncu` to profile the second call's kernels:
PYTHONPATH=. ncu ... python3 scripts/ncu_driver.py N128_P64_R4_C16 [noz]"""
import sys

import torch

from mamba3_mimo import mamba3_mimo_bwd_fwd
from mamba3_mimo.inputs import make_inputs, official_shapes

if len(sys.argv) < 2 or sys.argv[2:] not in ([], ["noz"]):
    sys.exit(f"usage: {sys.argv[0]} SHAPE [noz]; got {sys.argv[1:]}")
shapes = {s.name: s for s in official_shapes()}
if sys.argv[1] not in shapes:
    sys.exit(f"unknown shape {sys.argv[1]!r}; official shapes: {', '.join(shapes)}")
a = make_inputs(shapes[sys.argv[1]], torch.bfloat16, z_gate=sys.argv[2:] != ["noz"],
                device="cuda", seed=1)
a.pop("adt")
for _ in range(2):
    mamba3_mimo_bwd_fwd(**a, output_dtype=torch.bfloat16)
torch.cuda.synchronize()
