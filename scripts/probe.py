"""Development probe for the H200: per official shape, error vs float64 and median time of each
implementation (and of extra chunk_state / chunk_output configs given on the command line)."""
import json
import os
import sys
import time

import torch
import triton

from mamba3_mimo import api, reference
from mamba3_mimo.inputs import official_shapes, make_inputs


def rel(x, g):
    return ((x.double() - g).norm() / g.norm()).item()


def main():
    out_dir = os.environ.get("OUT", ".")
    rows = []
    shapes = official_shapes()
    filt = sys.argv[1] if len(sys.argv) > 1 else ""
    for s in shapes:
        if filt and filt not in s.name:
            continue
        for zg in (True, False):
            a = make_inputs(s, torch.bfloat16, z_gate=zg, device="cuda", seed=1)
            a.pop("adt")
            g = reference.bwd_fwd_reference(**a, dtype=torch.float64)
            rec = dict(shape=s.name, z=zg)
            for impl in ("stage0", "chunked"):
                for odt in (torch.bfloat16, torch.float32):
                    torch.cuda.synchronize()
                    t0 = time.time()
                    o = api.bwd_fwd(**a, output_dtype=odt, impl=impl)
                    torch.cuda.synchronize()
                    first = time.time() - t0
                    errs = [None if x is None else rel(x, y) for x, y in zip(o, g)]
                    ms = triton.testing.do_bench(
                        lambda: api.bwd_fwd(**a, output_dtype=odt, impl=impl),
                        return_mode="median")
                    key = f"{impl}_{str(odt)[6:]}"
                    rec[key] = dict(ms=ms, first_s=first, err=errs)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'shape':18s} z   stage0_bf16  chunked_bf16  chunked_f32  worst_err")
    for r in rows:
        worst = max(e for e in r["chunked_bfloat16"]["err"] + r["chunked_float32"]["err"]
                    if e is not None)
        print(f"{r['shape']:18s} {int(r['z'])} {r['stage0_bfloat16']['ms']:10.3f} "
              f"{r['chunked_bfloat16']['ms']:12.3f} {r['chunked_float32']['ms']:12.3f} "
              f"{worst:10.2e}")


if __name__ == "__main__":
    main()
