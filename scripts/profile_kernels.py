"""Development profile for the H200: median time of chunk_state and chunk_output alone, per
config, on a few official shapes (bf16 inputs, Z on, bf16 outputs)."""
import json
import os
import sys

import torch
import triton

from mamba3_mimo import api, dispatch
from mamba3_mimo.__main__ import rel_err
from mamba3_mimo.inputs import official_shapes, make_inputs
from mamba3_mimo.kernels import chunk_output, chunk_state, launcher, step_terms


def go(launches: list):
    """Launch a kernel family's launches; the last compiled kernel."""
    k = None
    for fn, grid, args, options in launches:
        if 0 not in grid:
            k = launcher.launch_kernel(fn, grid, args, **options)
    return k


def bench(fn):
    k = fn()
    info = ""
    if hasattr(k, "n_regs"):
        info = f" regs={k.n_regs} spills={k.n_spills} smem={k.metadata.shared}"
    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    return f"{ms:.4f}{info}"


def main():
    names = sys.argv[1].split(",")
    state_cfgs = json.loads(sys.argv[2])
    out_cfgs = json.loads(sys.argv[3])
    res = []
    for s in official_shapes():
        if s.name not in names:
            continue
        a = make_inputs(s, torch.bfloat16, device="cuda", seed=1)
        a.pop("adt")
        pb = api._validate(*[a[k] for k in ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v",
                                              "mimo_o", "angles", "da_cs", "da_cs_rev", "dt",
                                              "trap", "segsum", "mimo_z", "d", "z")],
                           s.C, 4, torch.bfloat16)
        m = dispatch._meta(pb)
        p = dispatch._prepare(a, pb)
        out = dict(states=torch.empty(s.B, s.H, m["nc"], s.N, s.P, device="cuda",
                                      dtype=torch.bfloat16),
                   qk_dot=torch.empty(s.B, s.H, s.S, s.R, s.R, device="cuda", dtype=torch.bfloat16),
                   dz=torch.empty_like(a["v"]),
                   inc=torch.empty(s.B, s.H, m["nc"], s.N, s.P, device="cuda"),
                   part_o=torch.empty(s.B * s.H, m["nc"], s.R, s.P, device="cuda"),
                   part_z=torch.empty(s.B * s.H, m["nc"], s.R, s.P, device="cuda"))
        out.update(step_terms.tables(m, torch.device("cuda")))
        go(step_terms.launches(p, out, m))
        ref = api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked")
        total = bench(lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked"))
        print(s.name, "total", total, dispatch.select(pb).describe(), flush=True)
        for cfg in state_cfgs:
            try:
                ms = bench(lambda: go(chunk_state.launches(p, out, m, cfg)))
            except Exception as e:  # noqa: BLE001 - report and go on
                ms = repr(e)[:80]
            res.append(dict(shape=s.name, kernel="state", cfg=cfg, ms=ms))
            print(s.name, "state", cfg, ms, flush=True)
        for cfg in out_cfgs:
            try:
                ms = bench(lambda: go(chunk_output.launches(p, out, m, cfg)))
                # the config's outputs against the dispatcher's (needs out["inc"] = the fp32
                # states, left there by the state configs above)
                groups = triton.cdiv(m["nc"], m["U"])
                bh = s.B * s.H
                po = out["part_o"].view(-1)[:bh * groups * s.R * s.P].view(bh, groups, s.R, s.P)
                pairs = ((out["dz"], ref[4]), (out["qk_dot"], ref[1]),
                         (po.sum(1), ref[2].view(bh, s.R, s.P)))
                err = max(rel_err(x, y) for x, y in pairs)
                ms += f" rel_diff={err:.2e}" + (" WRONG" if err > 1e-2 else "")
            except Exception as e:  # noqa: BLE001
                ms = repr(e)[:80]
            res.append(dict(shape=s.name, kernel="output", cfg=cfg, ms=ms))
            print(s.name, "output", cfg, ms, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
