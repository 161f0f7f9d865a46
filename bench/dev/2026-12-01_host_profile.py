"""cProfile of 40 calls per shape on the GPU machine (optimisation.md step 24).
Usage: PYTHONPATH=. python3 bench/dev/2026-12-01_host_profile.py"""
import cProfile, pstats, time, io, sys
import torch
sys.path.insert(0, "scripts")
from host_overhead import _call
from mamba3_mimo.inputs import official_shapes
for s in official_shapes():
    if s.name not in ("N128_P64_R1_C64", "N128_P64_R4_C16"):
        continue
    f = _call(s, "cuda")
    for _ in range(3): f()
    torch.cuda.synchronize()
    n = 40
    torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): f()
    pr.disable()
    torch.cuda.synchronize()
    print(f"=== {s.name} host {host:.1f} us per call (GPU asleep, queue not full)")
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out); st.sort_stats("tottime").print_stats(28)
    print(out.getvalue()[-6000:])
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out); st.sort_stats("cumulative").print_stats(22)
    print(out.getvalue()[-4500:])
