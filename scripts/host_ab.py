"""A/B of the host side of a call: `scripts/host_overhead.py` run on each variant's package, one
process per (round, variant, gate), interleaved, so that the machine's state (which moves the
host's speed about 2x, docs/optimisation.md step 38) touches every variant alike. Per official
shape: host_us (enqueueing calls back to back, no sync), gpu_us and do_bench's ms on a GPU; on
a machine without CUDA, host_us of the Python side alone (kernels stubbed).

Usage: OUT=dir PYTHONPATH=. python3 scripts/host_ab.py VARIANTS_JSON [shape filter] [rounds]
VARIANTS_JSON: a list of {"name": str, "patch": path or [paths]} as in scripts/ab.py (no patch:
the repository's package); the first is the baseline. Writes $OUT/host_ab.json and prints, per
shape and gate, each variant's best host_us over the rounds and its ratio to the baseline's.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from ab import ROOT, variant_args


def main() -> int:
    variants, shape_filter, rounds, roots = variant_args(sys.argv)
    script = os.path.join(ROOT, "scripts", "host_overhead.py")
    runs = []
    for r in range(rounds):
        for gate in ("z", "noz"):
            for v in variants:
                t0 = time.time()
                out = tempfile.mkdtemp(prefix="host_ab_run_")
                p = subprocess.run([sys.executable, script, shape_filter, "200", gate],
                                   capture_output=True, text=True,
                                   env=dict(os.environ, PYTHONPATH=roots[v["name"]], OUT=out))
                path = os.path.join(out, "host_overhead.json")
                run = dict(name=v["name"], round=r, gate=gate, wall_s=time.time() - t0)
                if p.returncode == 0 and os.path.exists(path):
                    with open(path) as f:
                        run["rows"] = json.load(f)
                else:
                    run["failed"] = (p.stdout + p.stderr)[-2000:]
                runs.append(run)
                print(f"round {r} {gate} {v['name']}: {'ok' if 'rows' in run else 'FAILED'} "
                      f"({run['wall_s']:.0f} s)", flush=True)
                with open(os.path.join(os.environ.get("OUT", "."), "host_ab.json"), "w") as f:
                    json.dump(dict(variants=variants, runs=runs), f, indent=1)
    report(variants, runs)
    return 0


def report(variants: list, runs: list) -> None:
    """Best host_us per (shape, gate) and variant over the rounds, and the ratio to the first."""
    best = {}
    for run in runs:
        for row in run.get("rows", []):
            k = (row["shape"], run["gate"], run["name"])
            best[k] = min(best.get(k, float("inf")), row["host_us"])
    names = [v["name"] for v in variants]
    print("host us per call, best of the rounds (ratio to the first variant)")
    print(f"{'shape':18s} gate" + "".join(f"{n:>18s}" for n in names))
    for shape, gate in sorted({(s, g) for s, g, _ in best}):
        base = best.get((shape, gate, names[0]))
        cells = []
        for n in names:
            x = best.get((shape, gate, n))
            cells.append(f"{'-':>18s}" if x is None else
                         f"{x:9.1f} ({x / base:4.2f}x)" if base else f"{x:18.1f}")
        print(f"{shape:18s} {gate:4s}" + "".join(cells))


if __name__ == "__main__":
    sys.exit(main())
