"""Diagnosis on the H200: where the host's time per call goes (cProfile with the real GPU path),
and whether do_bench's slow readings of the small shapes follow the host's speed in a process
that interleaves candidates as the benchmark does."""
import cProfile, gc, io, json, os, pstats, sys, time, warnings
import torch
from triton.testing import do_bench
from mamba3_mimo import api
from mamba3_mimo.inputs import make_inputs, official_shapes

out = {}
def fns(name, z=True):
    s = next(x for x in official_shapes() if x.name == name)
    a = make_inputs(s, torch.bfloat16, z_gate=z, d_skip=True, device="cuda")
    a.pop("adt")
    return {n: (lambda n=n: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl=n))
            for n in ("stage0", "auto")}

def host_us(f, n=200):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t

# C: does a call synchronise? (torch-side syncs only)
f = fns("N128_P64_R1_C64")
f["auto"](); f["stage0"]()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f["auto"]()
torch.cuda.set_sync_debug_mode(0)
out["sync_warnings"] = [str(x.message)[:200] for x in w]
print("sync warnings:", out["sync_warnings"], flush=True)

# A: cProfile of the real path
g = f["auto"]
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(3000):
    g()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
out["cprofile"] = s.getvalue()
print(s.getvalue()[:6000], flush=True)

# B: bench-like interleaving, host speed against do_bench
rows = []
for name in ("N128_P64_R1_C64", "N32_P64_R4_C16", "N128_P64_R2_C32"):
    f = fns(name)
    f["auto"](); f["stage0"]()
    for rnd in range(8):
        gc_off = rnd >= 4
        if gc_off:
            gc.disable()
        st = do_bench(f["stage0"], rep=25, return_mode="median")
        h1 = host_us(f["auto"])
        ms = do_bench(f["auto"], rep=25, return_mode="median")
        h2 = host_us(f["auto"])
        ms100 = do_bench(f["auto"], rep=100, return_mode="median")
        gc.enable()
        r = dict(shape=name, round=rnd, gc_off=gc_off, host_before=h1, host_after=h2,
                 auto_ms=ms, auto_ms_rep100=ms100, stage0_ms=st)
        rows.append(r)
        print(json.dumps(r), flush=True)
out["rows"] = rows
with open(os.path.join(os.environ["OUT"], "host_diag2.json"), "w") as fh:
    json.dump(out, fh, indent=1)
