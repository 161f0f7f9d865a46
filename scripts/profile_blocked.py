"""Development profile for the H200: end-to-end median time of bwd_fwd through the chunked path
and through the blocked path at several block_scan configs (bf16 inputs, Z on, bf16 outputs),
with each blocked result compared to the chunked one, and the compiled kernels' registers and
spills. Usage: python scripts/profile_blocked.py SHAPES '[{cfg}, ...]'  (writes $OUT/profile.json)
"""
import json
import os
import sys

import torch
import triton

from mamba3_mimo import api, dispatch
from mamba3_mimo.inputs import make_inputs, official_shapes
from mamba3_mimo.kernels import block_scan


def _resources():
    out = []
    for cache in block_scan.block_scan_kernel.device_caches.values():
        for k in cache[0].values():
            out.append((k.n_regs, k.n_spills, k.metadata.shared))
    return sorted(set(out))


def main():
    names = sys.argv[1].split(",")
    cfgs = json.loads(sys.argv[2])
    res = []
    for s in official_shapes():
        if s.name not in names:
            continue
        a = make_inputs(s, torch.bfloat16, device="cuda", seed=1)
        a.pop("adt")
        run = lambda impl: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl=impl)  # noqa: E731
        ref = run("chunked")
        ms = triton.testing.do_bench(lambda: run("chunked"), warmup=10, rep=40,
                                     return_mode="median")
        print(s.name, "chunked", f"{ms:.4f}", flush=True)
        res.append(dict(shape=s.name, impl="chunked", ms=ms))
        for cfg in cfgs:
            try:
                with dispatch.block_config_override(**cfg):
                    out = run("blocked")
                    err = max(((x.float() - y.float()).norm() / y.float().norm()).item()
                              for x, y in zip(out, ref) if x is not None)
                    ms = triton.testing.do_bench(lambda: run("blocked"), warmup=10, rep=40,
                                                 return_mode="median")
                row = dict(shape=s.name, impl="blocked", cfg=cfg, ms=ms, rel_diff_vs_chunked=err,
                           resources=_resources())
            except Exception as e:  # noqa: BLE001 - report and go on
                row = dict(shape=s.name, impl="blocked", cfg=cfg, error=repr(e)[:200])
            print(json.dumps(row), flush=True)
            res.append(row)
            block_scan.block_scan_kernel.device_caches.clear()
    with open(os.path.join(os.environ.get("OUT", "."), "profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
