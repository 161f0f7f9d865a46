"""Host cost per part of one call on the GPU machine (GPU asleep, so that no launch waits for a full
queue): optimisation.md step 24. Usage: OUT=dir PYTHONPATH=. python3 bench/dev/2026-12-01_host_parts.py"""
import time, sys, json, os
import torch
from triton.runtime.jit import JITFunction
from triton import knobs
from triton.runtime.driver import driver
sys.path.insert(0, "scripts")
from host_overhead import _call
from mamba3_mimo import api, dispatch
from mamba3_mimo.inputs import official_shapes, make_inputs
from mamba3_mimo.kernels import launcher  # its direct launches bypass JITFunction.run: off below

def per_call(f, n=100):
    torch.cuda.synchronize(); torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt

res = {}
for s in official_shapes():
    if s.name not in ("N128_P64_R1_C64", "N128_P128_R4_C8"):
        continue
    f = _call(s, "cuda")
    for _ in range(3): f()
    r = dict(full=min(per_call(f) for _ in range(3)))
    # capture the launches of one call
    caps = []
    orig = JITFunction.run
    def cap(self, *a, grid, warmup, **kw):
        k = orig(self, *a, grid=grid, warmup=warmup, **kw)
        if not warmup: caps.append((self, a, grid, kw, k))
        return k
    JITFunction.run = cap
    launcher.DIRECT = False
    f(); torch.cuda.synchronize()
    launcher.DIRECT = True
    JITFunction.run = orig
    r["launches"] = [c[0].fn.__name__ for c in caps]
    r["nargs"] = [len(c[1]) for c in caps]
    def triton_launches():
        for self, a, grid, kw, k in caps:
            self.run(*a, grid=grid, warmup=False, **kw)
    r["triton_launches"] = min(per_call(triton_launches) for _ in range(3))
    dev = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev)
    def direct():
        for self, a, grid, kw, k in caps:
            g = grid if not callable(grid) else None
            k.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, k.function,
                  k.packed_metadata, None, None, None, *a)
    try:
        f(); torch.cuda.synchronize()
        direct(); torch.cuda.synchronize()
        r["direct_run"] = min(per_call(direct) for _ in range(3))
    except Exception as e:
        r["direct_run"] = repr(e)[:300]
    def binder_only():
        for self, a, grid, kw, k in caps:
            kc, kkc, target, backend, binder = self.device_caches[dev]
            binder(*a, **{**kw, "debug": False, "instrumentation_mode": ""})
    try:
        r["binder_only"] = min(per_call(binder_only) for _ in range(3))
    except Exception as e:
        r["binder_only"] = repr(e)[:300]
    run = dispatch.run
    dispatch.run = lambda pb, args, impl="auto": None
    r["api_without_run"] = min(per_call(f) for _ in range(3))
    dispatch.run = run
    JITFunction.run = lambda self, *a, **k: None
    launcher.DIRECT = False
    r["full_launches_stubbed"] = min(per_call(f) for _ in range(3))
    launcher.DIRECT = True
    JITFunction.run = orig
    shp = (4, 16, 32, 64, 64)
    r["empty_x9"] = min(per_call(lambda: [torch.empty(shp, device="cuda", dtype=torch.float32) for _ in range(9)]) for _ in range(3))
    po = torch.zeros(64, 32, 4, 64, device="cuda")
    r["sum_x2"] = min(per_call(lambda: [po.view(4, 16, 32, 4, 64).sum(2) for _ in range(2)]) for _ in range(3))
    res[s.name] = r
    print(s.name, json.dumps(r), flush=True)
if os.environ.get("OUT"):
    json.dump(res, open(os.path.join(os.environ["OUT"], "host_parts.json"), "w"), indent=1)
