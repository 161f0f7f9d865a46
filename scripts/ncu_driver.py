"""Calls the production op twice on one official shape (bf16, Z on unless "noz" is given), for
`ncu` to profile the second call's kernels: bwd_fwd, or with "operator" the whole operator's
forward and backward (its phase 2 kernels, chunk_grads_qk among them):
PYTHONPATH=. ncu ... python3 scripts/ncu_driver.py N128_P64_R4_C16 [noz] [operator]
(e.g. ncu -k regex:chunk_grads_qk --launch-skip 4 --launch-count 1: the second call's first
group of batch entries, where the backward runs in groups of one entry)."""
import sys

import torch

from mamba3_mimo import mamba3_mimo_bwd_fwd
from mamba3_mimo.bench_operator import operator_case
from mamba3_mimo.inputs import make_inputs, official_shapes

flags = sys.argv[2:]
if len(sys.argv) < 2 or any(f not in ("noz", "operator") for f in flags):
    sys.exit(f"usage: {sys.argv[0]} SHAPE [noz] [operator]; got {sys.argv[1:]}")
shapes = {s.name: s for s in official_shapes()}
if sys.argv[1] not in shapes:
    sys.exit(f"unknown shape {sys.argv[1]!r}; official shapes: {', '.join(shapes)}")
z_gate = "noz" not in flags
if "operator" in flags:
    _, call, _ = operator_case(shapes[sys.argv[1]], z_gate, seed=1)
else:
    a = make_inputs(shapes[sys.argv[1]], torch.bfloat16, z_gate=z_gate, device="cuda", seed=1)
    a.pop("adt")

    def call():
        mamba3_mimo_bwd_fwd(**a, output_dtype=torch.bfloat16)
for _ in range(2):
    call()
torch.cuda.synchronize()
