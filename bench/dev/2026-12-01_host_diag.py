"""Host-time diagnosis at host-bound shapes: GPU-asleep host time, launches through Triton, syncs, cProfile."""
import cProfile, io, json, os, pstats, sys, time, warnings
import torch
from triton.runtime.jit import JITFunction
sys.path.insert(0, "scripts")
from host_overhead import _call
from mamba3_mimo.inputs import official_shapes

def asleep(f, n=100):
    torch.cuda.synchronize(); torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize(); return dt

def awake(f, n=100):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize(); return dt

res = {}
for s in official_shapes():
    if s.name not in ("N128_P64_R1_C64", "N32_P64_R4_C16", "N128_P64_R4_C16"): continue
    for z in (False, True):
        f = _call(s, "cuda", z)
        for _ in range(3): f()
        torch.cuda.synchronize()
        r = dict(asleep=[asleep(f) for _ in range(3)], awake=[awake(f) for _ in range(3)])
        n_run = [0]; orig = JITFunction.run
        def cnt(self, *a, **k):
            n_run[0] += 1; return orig(self, *a, **k)
        JITFunction.run = cnt
        for _ in range(20): f()
        JITFunction.run = orig
        r["triton_runs_in_20_calls"] = n_run[0]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            f()
        torch.cuda.set_sync_debug_mode(0)
        r["sync_warnings"] = [str(x.message)[:200] for x in w][:5]
        torch.cuda.synchronize(); torch.cuda._sleep(int(4e9))
        pr = cProfile.Profile(); pr.enable()
        for _ in range(100): f()
        pr.disable(); torch.cuda.synchronize()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(18)
        r["profile"] = sio.getvalue()[-3500:]
        name = f"{s.name}_{'z' if z else 'noz'}"
        res[name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        if s.name == "N128_P64_R1_C64": print(r["profile"], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "host_diag.json"), "w"), indent=1)
