"""A/B of dispatch.MAX_TILE_ROWS (128 vs 64): times on R8_C16 / R4_C32 / R4_C64 shapes, kernels'
registers and spills, and errors vs the float64 golden on two small shapes. One process per variant."""
import json, os, subprocess, sys
import torch
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
SHAPES = [(128, 64, 8, 16), (128, 64, 4, 32), (64, 64, 8, 16), (32, 64, 8, 16), (128, 64, 4, 64), (128, 64, 8, 8)]

def one(rows):
    import triton
    from mamba3_mimo import api, dispatch
    from mamba3_mimo.inputs import Shape, make_inputs
    from mamba3_mimo.reference import bwd_fwd_reference
    from mamba3_mimo.kernels import launcher
    import ab
    dispatch.MAX_TILE_ROWS = rows
    dispatch.kernel_chunk_size.cache_clear()
    log = ab.launched_kernels()
    res = dict(rows=rows, times={}, kernels={}, errors={})
    for N, P, R, C in SHAPES:
        s = Shape(4, 2048, 16, 1, N, P, R, C)
        a = make_inputs(s, torch.bfloat16, device="cuda", seed=1); a.pop("adt")
        log.clear(); d, launcher.DIRECT = launcher.DIRECT, False
        api.bwd_fwd(**a, output_dtype=torch.bfloat16); launcher.DIRECT = d
        res["kernels"][s.name] = sorted(set(log))
        res["times"][s.name] = triton.testing.do_bench(lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16), rep=25, return_mode="median")
    for N, P, R, C, S in [(64, 32, 8, 16, 300), (64, 32, 4, 64, 300), (16, 16, 8, 16, 32)]:
        s = Shape(1, S, 4, 2, N, P, R, C)
        for dt in (torch.bfloat16, torch.float16):
            a = make_inputs(s, dt, device="cuda", seed=7); a.pop("adt")
            g = bwd_fwd_reference(**a)
            outs = api.bwd_fwd(**a)
            res["errors"][f"{s.name}_S{S}_{dt}"] = [float(((x.double() - y.double()).norm() / y.double().norm()).item()) for x, y in zip(outs, g) if x is not None]
    print("RESULT " + json.dumps(res), flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(int(sys.argv[1])); sys.exit(0)
    allr = []
    for rnd in range(2):
        for rows in (128, 64):
            p = subprocess.run([sys.executable, __file__, str(rows)], capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            allr.append(json.loads(line[0][7:]) if line else dict(rows=rows, failed=(p.stdout + p.stderr)[-3000:]))
            print(rnd, rows, "ok" if line else allr[-1]["failed"], flush=True)
    json.dump(allr, open(os.path.join(os.environ.get("OUT", "."), "tiles_ab.json"), "w"), indent=1)
    for r in allr:
        if "times" in r:
            print(r["rows"], {k: round(v, 3) for k, v in r["times"].items()})
            print("  err", {k: max(v) for k, v in r["errors"].items()})
            print("  kernels", {k: [x for x in v if x[2]] for k, v in r["kernels"].items()})
