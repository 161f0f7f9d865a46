"""Development profile for the H200: the fused path (chunk_scan) per config on official shapes
(bf16 inputs, Z on, bf16 outputs): time of its three launches together and of the output pass
alone, registers and spills, and its outputs against the chunked path's.

Usage: PYTHONPATH=. python3 scripts/profile_scan.py SHAPES '[{"BP":64,"num_warps":8,"num_stages":1,"K":8}, ...]'
"""
import json
import os
import sys

import torch
import triton

from mamba3_mimo import api, dispatch
from mamba3_mimo.__main__ import rel_err
from mamba3_mimo.inputs import official_shapes, make_inputs
from mamba3_mimo.kernels import chunk_scan, step_terms

ARGS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
        "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z")


def ms_of(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main():
    names = sys.argv[1].split(",")
    cfgs = json.loads(sys.argv[2])
    res = []
    for s in official_shapes():
        if s.name not in names:
            continue
        a = make_inputs(s, torch.bfloat16, device="cuda", seed=1)
        a.pop("adt")
        pb = api._validate(*[a[k] for k in ARGS], s.C, 4, torch.bfloat16)
        m = dispatch._meta(pb)
        p = dispatch._prepare(a, pb)
        ref = api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked")
        row = dict(shape=s.name, chunked=ms_of(lambda: api.bwd_fwd(
            **a, output_dtype=torch.bfloat16, impl="chunked")),
            fused=ms_of(lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="fused")),
            plan=dispatch.select(pb).describe())
        print(json.dumps(row), flush=True)
        res.append(row)
        for cfg in cfgs:
            out = dict(states=torch.empty(s.B, s.H, m["nc"], s.N, s.P, device="cuda",
                                          dtype=torch.bfloat16),
                       qk_dot=torch.empty(s.B, s.H, s.S, s.R, s.R, device="cuda",
                                          dtype=torch.bfloat16),
                       dz=torch.empty_like(a["v"]))
            step_terms.launch(p, out, m)
            n_sc = triton.cdiv(m["nc"], cfg["K"])
            out["part_o"] = torch.empty(s.B * s.H, n_sc, s.R, s.P, device="cuda")
            out["part_z"] = torch.empty_like(out["part_o"])
            rec = dict(shape=s.name, cfg=cfg)
            try:
                rec["total_ms"] = ms_of(lambda: chunk_scan.launch(p, out, m, cfg))
                n_pb = triton.cdiv(s.P, cfg["BP"])
                k_out = chunk_scan._launch_scan(p, out, m, cfg, n_sc, True,
                                                (s.B * s.H, n_sc, n_pb), False)
                rec["output_ms"] = ms_of(lambda: chunk_scan._launch_scan(
                    p, out, m, cfg, n_sc, True, (s.B * s.H, n_sc, n_pb), False))
                k_inc = chunk_scan._launch_scan(p, out, m, cfg, n_sc, False,
                                                (s.B * s.H, max(n_sc - 1, 1), n_pb), False)
                rec["inc_ms"] = ms_of(lambda: chunk_scan._launch_scan(
                    p, out, m, cfg, n_sc, False, (s.B * s.H, max(n_sc - 1, 1), n_pb), False))
                rec["out_regs"] = [k_out.n_regs, k_out.n_spills, k_out.metadata.shared]
                rec["inc_regs"] = [k_inc.n_regs, k_inc.n_spills, k_inc.metadata.shared]
                chunk_scan.launch(p, out, m, cfg)
                bh = s.B * s.H
                pairs = ((out["states"], ref[0]), (out["dz"], ref[4]), (out["qk_dot"], ref[1]),
                         (out["part_o"].sum(1), ref[2].view(bh, s.R, s.P)),
                         (out["part_z"].sum(1), ref[3].view(bh, s.R, s.P)))
                rec["rel_diff"] = max(rel_err(x, y) for x, y in pairs)
            except Exception as e:  # noqa: BLE001 - report and go on
                rec["error"] = repr(e)[:200]
            print(json.dumps(rec), flush=True)
            res.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "profile_scan.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
