"""Upper bound of running the state pass and chunk_output side by side (session 21; optimisation.md
next steps, item 0). For each official shape (bf16, Z on, bf16 outputs): the call's kernels
launched as the operator does (one stream), and with step_terms first, then the state pass on one
stream and chunk_output + rank_sums on another, both after step_terms, with no dependency between
the two (chunk_output reads the states the previous call left: wrong results, right work). Also
each group alone. GPU time per call from CUDA events over n calls, warm L2, no host gaps (a GPU
sleep first, so that every call is queued before the GPU reaches it).
Usage on the GPU machine: [OUT=dir] PYTHONPATH=. python3 bench/dev/2026-12-02_overlap_bound.py [n]
"""
import json
import os
import sys

import torch

from mamba3_mimo import api, dispatch
from mamba3_mimo.inputs import make_inputs, official_shapes
from mamba3_mimo.kernels import launcher

STATE = ("state_scan_kernel", "chunk_increment_kernel", "state_passing_kernel")
OUTPUT = ("chunk_output_kernel", "rank_sums_kernel")


def plan_launches(shape):
    """(name, kernel, grid, args) of each launch of one call, as _CallPlan.launch binds them."""
    a = make_inputs(shape, torch.bfloat16, device="cuda", seed=0)
    a.pop("adt")
    api.bwd_fwd(**a, output_dtype=torch.bfloat16)  # compiles and caches the plan
    torch.cuda.synchronize()
    ((pb, plan),) = list(dispatch._entry_calls.values())
    args = {k: a[k] for k in api._ARG_NAMES}
    env = dict(dispatch._prepare(args, pb), **dispatch._allocate(plan.outputs, pb.device))
    (kernels,) = list(plan.group.kernels.values())
    out = []
    for (template, slots), b, k in zip(plan.launches, plan.group.bounds, kernels):
        full = list(template)
        for i, name in slots:
            full[i] = env[name]
        out.append((b.fn.__name__, k, b.grid, tuple(full)))
    return out, env


def timed(fn, n):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(5e8))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3  # us per call


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    # the state pass is the longer chain: its stream goes first when both wait for a slot
    side_a, side_b = torch.cuda.Stream(priority=-1), torch.cuda.Stream()
    rows = []
    for shape in official_shapes():
        dispatch.clear_caches()
        launches, env = plan_launches(shape)

        def run(names, stream=None):
            s = (stream or torch.cuda.current_stream()).cuda_stream
            for name, k, grid, args in launches:
                if name in names:
                    launcher._run_kept(k, grid, s, args)

        every = tuple(name for name, *_ in launches)

        def overlapped():
            run(("step_terms_kernel",))
            ev = torch.cuda.Event()
            ev.record()
            done = []
            for stream, names in ((side_a, STATE), (side_b, OUTPUT)):
                stream.wait_event(ev)
                run(names, stream)
                e = torch.cuda.Event()
                e.record(stream)
                done.append(e)
            for e in done:
                torch.cuda.current_stream().wait_event(e)

        row = dict(shape=shape.name,
                   serial_us=timed(lambda: run(every), n),
                   overlapped_us=timed(overlapped, n),
                   state_us=timed(lambda: run(STATE), n),
                   output_us=timed(lambda: run(OUTPUT), n),
                   step_terms_us=timed(lambda: run(("step_terms_kernel",)), n))
        rows.append(row)
        print(f"{shape.name:18s} serial {row['serial_us']:7.1f}  overlapped {row['overlapped_us']:7.1f}"
              f" ({row['overlapped_us'] / row['serial_us']:.2f}x)  state {row['state_us']:6.1f}"
              f"  output {row['output_us']:6.1f}  step_terms {row['step_terms_us']:5.1f} us",
              flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "overlap_bound.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
