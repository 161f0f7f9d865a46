"""Reproduce the illegal memory access at Shape(1,32,2,2,64,16,2,16,rdd=2) (bf16): one case per process."""
import os, sys, traceback
import torch
from mamba3_mimo import api, dispatch
import triton.language as tl
_m = dispatch._meta
def _meta(pb):
    m = _m(pb)
    if os.environ.get("PREC_X"):
        m["PREC"] = os.environ["PREC_X"]; m["OPD"] = tl.float32; m["STATES_OUT"] = False
    return m
dispatch._meta = _meta
from mamba3_mimo.inputs import Shape, make_inputs
case = sys.argv[1]
shapes = {"bad": Shape(1, 32, 2, 2, 64, 16, 2, 16, 2), "first": Shape(1, 32, 2, 1, 16, 16, 3, 16)}
seq = {"A": ["bad"], "B": ["first", "bad"], "F": ["first"]}[case[0]]
impl = "stage0" if "s" in case else "chunked"
odt = torch.bfloat16 if "o" in case else torch.float32
try:
    for name in seq:
        s = shapes[name]
        a = make_inputs(s, torch.bfloat16, device="cuda", seed=3); a.pop("adt")
        for rep in range(3):
            o = api.bwd_fwd(**a, impl=impl, output_dtype=odt)
            torch.cuda.synchronize()
        print(case, name, "ok", [None if x is None else float(x.float().abs().sum()) for x in o], flush=True)
except Exception:
    print(case, "FAULT"); traceback.print_exc(limit=6)
