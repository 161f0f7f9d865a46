"""A/B of production-path variants on a GPU, one process per (round, variant) so that a CUDA fault
in one variant cannot poison the others: end-to-end time on official shapes (do_bench's median
in each round, the best round reported), the kernels' own device time per call (the profiler's,
free of host time, which decides the small shapes' end-to-end times), the registers and spills
of each launched kernel, and (first round only) the errors against the float64 golden on the
test sweep's shapes (bf16 inputs, Z and D on, fp32 outputs).

Usage: OUT=dir PYTHONPATH=. python3 scripts/ab.py VARIANTS_JSON [shape filter] [rounds]
(filter "" = every official shape; "none" = none, e.g. for a CPU dry run with TRITON_INTERPRET=1)
VARIANTS_JSON: a list of {"name": str, "meta": {...}, "state_cfg": {...}, "output_cfg": {...},
"state_min": {...}, "output_min": {...}, "state_meta": {...}, "output_meta": {...},
"direct": bool};
"meta" overrides entries of dispatch._meta (e.g. {"PREC": "bf16x3"}), a cfg overrides entries of
the first candidate of that kernel's list (e.g. {"BP": 64}; the fallbacks stay), and
"state_min" / "output_min" raise entries of it to a lower bound (e.g. {"BP": 32}), and
"state_meta" / "output_meta" override meta entries for that kernel's launcher only (e.g.
{"PREC": "bf16x3"} for chunk_increment alone); "direct": false sends every production launch
through Triton's JITFunction.run instead of kernels.launcher's direct launches (launcher.DIRECT),
e.g. [{"name": "triton", "direct": false}, {"name": "direct"}]; "check": false skips the error
sweep for a variant whose arithmetic is the baseline's (a launch path, a prefetch), which saves
most of its first round; "patch": "path/to.patch" runs the variant on a copy of the package with
that patch applied (`git apply`, paths as in `git diff` from the repository root; a list of
patches is applied in order), so that
kernel changes are timed interleaved with the baseline. The first variant is the baseline.
Writes $OUT/ab.json and prints the comparison table. The timed calls have the Z gate on;
AB_Z=0 in the environment times them with it off (the error sweep keeps it on).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _override(m: dict, over: dict, what: str) -> dict:
    unknown = set(over) - set(m)
    if unknown:  # a misspelt key would otherwise change nothing, silently
        raise KeyError(f"{what}: no meta entries {sorted(unknown)}")
    return dict(m, **over)


def apply(variant: dict) -> None:
    """Patch the dispatcher so that `impl="chunked"` runs this variant."""
    import functools
    from mamba3_mimo import dispatch
    from mamba3_mimo.kernels import chunk_output, chunk_state, launcher
    if "direct" in variant:
        launcher.DIRECT = bool(variant["direct"])
    meta, states, outputs = dispatch._meta, dispatch._state_candidates, dispatch._output_candidates
    dispatch._meta = lambda pb: _override(meta(pb), variant.get("meta", {}), variant["name"])
    # meta entries for one kernel only (e.g. its PREC); wraps keeps the launcher's __module__,
    # which keys the dispatcher's config cache
    for key, module in (("state_meta", chunk_state), ("output_meta", chunk_output)):
        if key in variant:
            module.launches = functools.wraps(module.launches)(
                lambda a, out, m, *rest, _orig=module.launches, _over=variant[key], **kw:
                _orig(a, out, _override(m, _over, variant["name"]), *rest, **kw))
    def first(cfg: dict, over: dict, low: dict) -> dict:
        cfg = dict(cfg, **over)
        return dict(cfg, **{k: max(cfg[k], v) for k, v in low.items()})

    for key, orig, name in (("state", states, "_state_candidates"),
                            ("output", outputs, "_output_candidates")):
        over, low = variant.get(f"{key}_cfg", {}), variant.get(f"{key}_min", {})
        if over or low:
            setattr(dispatch, name, lambda pb, m, orig=orig, over=over, low=low:
                    [first(orig(pb, m)[0], over, low)] + orig(pb, m)[1:])


def launched_kernels() -> list:
    """Record (name, registers, spills) of every compiled kernel launched from now on; spills is
    Triton's n_spills, the local memory per thread in 4-byte words (bytes / 4)."""
    from test_gpu import kernel_functions
    log = []
    for fn in kernel_functions():
        def run(*args, _orig=fn.run, _fn=fn, grid, warmup, **kwargs):
            kernel = _orig(*args, grid=grid, warmup=warmup, **kwargs)
            if not warmup:
                k = kernel.result() if hasattr(kernel, "result") else kernel
                log.append((_fn.__name__, k.n_regs, k.n_spills))
            return kernel
        fn.run = run
    return log


def measure(variant: dict, shape_filter: str, check: bool) -> dict:
    """Time one variant in this process; with `check`, also its errors on the sweep."""
    import triton
    from conftest import THRESHOLDS, rel_rms
    from mamba3_mimo import api
    from mamba3_mimo.bench import kernel_ms
    from mamba3_mimo.inputs import make_inputs, official_shapes
    from mamba3_mimo.kernels import launcher
    from mamba3_mimo.reference import bwd_fwd_reference
    from test_bwd_fwd import _sweep_shapes

    apply(variant)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in the interpreter
    log = launched_kernels() if dev == "cuda" else []
    res = dict(name=variant["name"], times={}, device={}, kernels={}, worst_err_over_thr=0.0,
               errors={})
    for s in official_shapes():
        if shape_filter not in s.name:
            continue
        a = make_inputs(s, torch.bfloat16, os.environ.get("AB_Z", "1") != "0", device=dev,
                        seed=1)
        a.pop("adt")
        log.clear()
        # the log patches fn.run, which direct launches bypass after a signature's first launch
        direct, launcher.DIRECT = launcher.DIRECT, False
        api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked")
        launcher.DIRECT = direct
        res["kernels"][s.name] = sorted(set(log))
        res["times"][s.name] = triton.testing.do_bench(
            lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked"), rep=25,
            return_mode="median")
        if dev == "cuda":
            res["device"][s.name] = kernel_ms(
                lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked"))
    names = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
    for s in _sweep_shapes() if check else []:
        a = make_inputs(s, torch.bfloat16, device=dev, seed=7)
        a.pop("adt")
        golden = bwd_fwd_reference(**a)
        outs = api.bwd_fwd(**a, impl="chunked")
        errs = {n: rel_rms(x, g) for n, x, g in zip(names, outs, golden)}
        res["errors"][f"{s.name}_S{s.S}_G{s.G}_rdd{s.rotary_dim_divisor}"] = errs
        res["worst_err_over_thr"] = max(res["worst_err_over_thr"],
                                        max(errs.values()) / THRESHOLDS[torch.bfloat16])
    return res


def patched_tree(patch, into: str) -> str:
    """A copy of the mamba3_mimo package with `patch` (a path, or a list of paths applied in
    order) applied, under `into`; its root."""
    shutil.copytree(os.path.join(ROOT, "mamba3_mimo"), os.path.join(into, "mamba3_mimo"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for p in [patch] if isinstance(patch, str) else patch:
        subprocess.run(["git", "apply", "--include=mamba3_mimo/*", os.path.abspath(p)],
                       cwd=into, check=True)
    return into


def variant_args(argv: list) -> tuple:
    """(variants, shape filter, rounds, {name: package root}) from the command line
    VARIANTS_JSON [shape filter] [rounds]: each variant imports the repository's package, or
    with "patch" a patched copy."""
    variants = json.loads(argv[1])
    shape_filter = argv[2] if len(argv) > 2 else ""
    rounds = int(argv[3]) if len(argv) > 3 else 2
    trees = tempfile.mkdtemp(prefix="ab_trees_")
    roots = {v["name"]: patched_tree(v["patch"], os.path.join(trees, v["name"]))
             if "patch" in v else ROOT for v in variants}
    return variants, shape_filter, rounds, roots


def main() -> int:
    if sys.argv[1] == "--one":
        res = measure(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "check")
        import mamba3_mimo
        res["package"] = os.path.dirname(mamba3_mimo.__file__)
        print("AB_RESULT " + json.dumps(res), flush=True)
        return 0
    variants, shape_filter, rounds, roots = variant_args(sys.argv)
    runs = []
    for r in range(rounds):
        for v in variants:
            t0 = time.time()
            env = dict(os.environ, PYTHONPATH=roots[v["name"]])
            # the errors are deterministic: checked in the first round only
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(v), shape_filter,
                                "check" if r == 0 and v.get("check", True) else "time"],
                               capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("AB_RESULT ")]
            run = (json.loads(line[0][10:]) if line else
                   dict(name=v["name"], failed=(p.stdout + p.stderr)[-2000:]))
            run.update(round=r, wall_s=time.time() - t0)
            runs.append(run)
            print(f"round {r} {v['name']}: {'ok' if line else 'FAILED'} "
                  f"({run['wall_s']:.0f} s)", flush=True)
            # rewritten after every run, so that a call cut off by its time limit keeps its runs
            with open(os.path.join(os.environ.get("OUT", "."), "ab.json"), "w") as f:
                json.dump(dict(variants=variants, runs=runs), f, indent=1)
    report(variants, runs, rounds)
    return 0


def report(variants: list, runs: list, rounds: int) -> None:
    """Print the comparison tables of ab.json's runs: end to end, then the kernels' device
    time."""
    ok = [x for x in runs if "times" in x]
    # the best round of each variant: interference (another process, the host, clocks) only
    # adds time; "~" marks a shape whose rounds differ by more than 10 %
    print(f"end to end (do_bench), best of {rounds} rounds, ms (~: rounds differ by > 10 %)")
    table(variants, [(x["name"], x["times"]) for x in ok])
    dev = [(x["name"], {s: sum(k.values()) for s, k in x.get("device", {}).items()}) for x in ok]
    if any(d for _, d in dev):
        print(f"kernels' device time per call (profiler), best of {rounds} rounds, ms")
        table(variants, dev)
    for v in variants:
        worst = [x["worst_err_over_thr"] for x in ok if x["name"] == v["name"] and x["errors"]]
        print(f"{v['name']}: worst error / threshold on the sweep "
              f"{max(worst) if worst else float('nan'):.2f}")


def table(variants: list, runs: list) -> None:
    """One row per shape, one column per variant: the best of its runs' (name, {shape: ms})."""
    base = variants[0]["name"]
    shapes = sorted({s for _, t in runs for s in t})
    print(f"{'shape':18s}" + "".join(f"{v['name']:>17s}" for v in variants))
    for s in shapes:
        best, wide = {}, {}
        for v in variants:
            t = [times[s] for name, times in runs if name == v["name"] and s in times]
            best[v["name"]] = min(t) if t else None
            wide[v["name"]] = bool(t) and max(t) > 1.1 * min(t)
        print(f"{s:18s}" + "".join(
            f"{'-':>17s}" if best[n] is None else
            f"{best[n]:9.3f}{'~' if wide[n] else ' '}" +
            (f" {best[n] / best[base]:5.2f}x" if best.get(base) else "      ")
            for n in (v["name"] for v in variants)))


if __name__ == "__main__":
    sys.exit(main())
