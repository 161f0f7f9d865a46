"""Host time per call (GPU asleep) of two package trees, three interleaved rounds, one process each
(optimisation.md step 39): OUT=dir python3 bench/dev/2026-12-01_host_ab.py OLD_TREE NEW_TREE"""
import json, os, subprocess, sys
CHILD = r'''
import sys, time, json, torch
from mamba3_mimo import api
from mamba3_mimo.inputs import make_inputs, official_shapes
res = {}
for s in official_shapes():
    if s.name not in ("N128_P64_R1_C64", "N32_P64_R4_C16", "N16_P64_R4_C8", "N128_P64_R4_C16"):
        continue
    for z in (True, False):
        a = make_inputs(s, torch.bfloat16, z_gate=z, d_skip=True, device="cuda", seed=0)
        a.pop("adt")
        f = lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16)
        for _ in range(3): f()
        best = 1e9
        for _ in range(5):
            torch.cuda.synchronize(); torch.cuda._sleep(int(2e9))
            t0 = time.perf_counter()
            for _ in range(100): f()
            best = min(best, (time.perf_counter() - t0) / 100 * 1e6)
            torch.cuda.synchronize()
        res[f"{s.name}_{'z' if z else 'noz'}"] = best
print("RESULT" + json.dumps(res))
'''
trees = {"old": os.path.abspath(sys.argv[1]), "new": os.path.abspath(sys.argv[2])}
rows = []
for rnd in range(3):
    for name, path in trees.items():
        p = subprocess.run([sys.executable, "-c", CHILD], cwd=path, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=path))
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
        r = json.loads(line[0][6:]) if line else {"error": p.stderr[-800:]}
        rows.append(dict(round=rnd, tree=name, host_us=r))
        print(rnd, name, json.dumps(r), flush=True)
keys = [k for k in rows[0]["host_us"]] if "error" not in rows[0]["host_us"] else []
for k in keys:
    o = min(r["host_us"][k] for r in rows if r["tree"] == "old" and k in r["host_us"])
    n = min(r["host_us"][k] for r in rows if r["tree"] == "new" and k in r["host_us"])
    print(f"{k:22s} old {o:6.1f} us  new {n:6.1f} us  {n / o:5.2f}x")
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "host_ab.json"), "w"), indent=1)
