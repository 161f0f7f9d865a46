"""Emulated bf16 operands (see 2026-12-01_bf16_operand_emulation.py) on the test sweep's own inputs: worst rel. RMS of dmimo_o, dmimo_z, dz per variant."""
import sys, math, torch
sys.path.insert(0, "tests")
src = open("bench/dev/2026-12-01_bf16_operand_emulation.py").read()
src = src[:src.index("N,P,R,C = ")]
exec(src)
from conftest import problem
from mamba3_mimo.inputs import Shape
from test_bwd_fwd import _sweep_shapes
variants = {"all bf16": dict(q=1,st=1,sw=1,pv=1,inc=0), "q,k,st": dict(q=1,st=1,sw=0,pv=0,inc=0), "q,k": dict(q=1,st=0,sw=0,pv=0,inc=0)}
worst = {v: 0 for v in variants}
for s in _sweep_shapes():
    args, golden, bench = problem(s, torch.bfloat16, True, True)
    inp = dict(args); inp["chunk_size"] = s.C
    C = s.C; S = s.S; nc = math.ceil(S / C)
    if S % C: continue  # the emulation has no tail handling
    line = f"{s.name} S{S}:"
    for v, fl in variants.items():
        raw, st = fwd(inp, fl, torch.float32)
        o = outs(inp, raw, torch.float32)
        e = max(rr(o[0], golden[2]), rr(o[1], golden[3]), rr(o[2].to(torch.bfloat16), golden[4]))
        worst[v] = max(worst[v], e)
        line += f" {v} {e:.2e}"
    print(line, flush=True)
print(worst)
