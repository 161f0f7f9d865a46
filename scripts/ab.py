"""A/B of production-path variants on a GPU, one process per (round, variant) so that a CUDA fault
in one variant cannot poison the others: end-to-end time on official shapes (do_bench's median
in each round, the best round reported), the kernels' own device time per call (the profiler's,
free of host time, which decides the small shapes' end-to-end times), the registers and spills
of each launched kernel, the configs the rules prefer under the variant (in ab.json), and
(first round only) the errors against the float64 golden on the test sweep's shapes
(inputs.sweep_shapes; bf16 inputs, Z and D on, fp32 outputs).

AB_TARGET=operator in the environment times the whole operator instead: `mamba3_mimo(...)`'s
forward and backward as a user calls them (bench_operator.operator_case), each kernel's device
time per forward+backward, and (first round) the error of its output and of every input's
gradient against the float64 reference operator on the sweep's shapes (bf16 inputs, Z and D on).

Usage: OUT=dir PYTHONPATH=. python3 scripts/ab.py VARIANTS_JSON [shape filter] [rounds]
(filter: substrings of shape names, comma-separated; "" = every official shape; "none" = none,
e.g. for the error sweep alone.) The first variant is the baseline. Writes $OUT/ab.json and
prints the comparison table. The timed calls have the Z gate on; AB_Z=0 in the environment
times them with it off (the sweep keeps it on).

VARIANTS_JSON: a list of objects with a "name" and any of
- rules, applied through `configs.override` around every call of the variant:
  "state" / "output": the whole candidate list of the state pass / chunk_output, as lists of
  StateConfig / OutputConfig fields (e.g. [{"scan": false, "BJ": 16, "BP": 32}]);
  "state_cfg" / "output_cfg": entries that replace those of the rules' first candidate for each
  problem, the fallbacks staying (e.g. {"BP": 64}); "state_min" / "output_min": entries of it
  raised to a lower bound (e.g. {"BP": 32}); "tile_chunks" (int), "scan_sync" (bool),
  "measured_arch" (bool), "smem_limit" (bytes), "dependent_launches" (bool: false times the
  kernels without programmatic dependent launches), "backward_group" (int: the operator's
  backward in groups of that many batch entries), "angle_parts" (int: the parts of each row's
  walk in the angles' running sum, 1 for one walk);
- "grads_cfg": entries that replace those of phase 2's blocks (kernels.chunk_grads.config, a
  GradsConfig) for every problem, e.g. {"BJ": 32, "QK_WARPS": 8} (AB_TARGET=operator);
- "direct": false sends every production launch through Triton's JITFunction.run instead of
  the launcher's direct launches (runtime.launcher.DIRECT), e.g.
  [{"name": "triton", "direct": false}, {"name": "direct"}];
- "addresses": false has the call plans' direct launches pass their tensors rather than
  their addresses (runtime.plans.ADDRESSES), e.g. [{"name": "base"}, {"name": "tensors",
  "addresses": false, "check": false}];
- "check": false skips the error sweep for a variant whose arithmetic is the baseline's (a
  launch path, a prefetch), which saves most of its first round;
- "patch": "path/to.patch" runs the variant on a copy of the package with that patch applied
  (`git apply`, paths as in `git diff` from the repository root; a list of patches is applied
  in order), so that kernel changes, and changes of constants that `configs.override` does not
  reach (dot precisions, prefetch, alignment: configs.py), are timed interleaved with the
  baseline.

Without CUDA (TRITON_INTERPRET=1) it is a dry run: the official shapes' model dimensions at
B=1, S=2C, H=2, each call timed once by the wall clock, no profiler, no kernel resources.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# the fields of configs.override taken as they are, and those built from config fields
SCALAR_RULES = ("tile_chunks", "scan_sync", "measured_arch", "smem_limit", "dependent_launches",
                "backward_group", "angle_parts")
LIST_RULES = ("state", "output")
KEYS = ({"name", "direct", "addresses", "check", "patch", "grads_cfg"} | set(SCALAR_RULES)
        | set(LIST_RULES) | {f"{k}_{s}" for k in LIST_RULES for s in ("cfg", "min")})


def check_variant(variant: dict) -> None:
    """Raise ValueError for a variant without a name or with a key this script does not know (a
    misspelt key would otherwise change nothing, silently)."""
    if not isinstance(variant.get("name"), str):
        raise ValueError(f"every variant needs a \"name\": {variant}")
    unknown = sorted(set(variant) - KEYS)
    if unknown:
        hint = (" (meta entries are no longer overridden: change mamba3_mimo/configs.py "
                "through a \"patch\")" if any("meta" in k for k in unknown) else "")
        raise ValueError(f"{variant['name']}: unknown keys {unknown}; known: {sorted(KEYS)}"
                         + hint)


def kernel_problem(pb):
    """The Problem whose configs the kernels of a call of `pb` run with: its chunks as the
    kernels take them (a single chunk shortened to the length, sub-chunks of chunks beyond a
    tile), as the public entry rewrites them."""
    import dataclasses
    from mamba3_mimo import configs
    from mamba3_mimo.phases import bwd_fwd
    C = pb.C if pb.C <= pb.S else bwd_fwd.one_chunk_size(pb.C, pb.S, pb.R)
    return dataclasses.replace(pb, C=configs.kernel_chunk_size(C, pb.R))


def rules(variant: dict, pb) -> dict:
    """The keyword arguments of configs.override for this variant on problem `pb`."""
    import dataclasses
    from mamba3_mimo import configs
    scalars = {k: variant[k] for k in SCALAR_RULES if k in variant}
    over = dict(scalars)
    with configs.override(**scalars):  # e.g. measured_arch decides chunk_output's list
        for key, cls, candidates in (("state", configs.StateConfig, configs.state_candidates),
                                     ("output", configs.OutputConfig,
                                      configs.output_candidates)):
            listed = ([cls(**c) for c in variant[key]] if key in variant
                      else candidates(kernel_problem(pb)))
            first, low = variant.get(f"{key}_cfg", {}), variant.get(f"{key}_min", {})
            if first or low:
                cfg = dataclasses.replace(listed[0], **first)
                cfg = dataclasses.replace(cfg, **{k: max(getattr(cfg, k), v)
                                                  for k, v in low.items()})
                listed = [cfg] + list(listed[1:])
            if key in variant or first or low:
                over[key] = listed
    return over


def kernel_functions() -> list:
    """Every triton.JITFunction defined in the modules of mamba3_mimo.kernels, each once."""
    import importlib
    import pkgutil
    import mamba3_mimo.kernels
    from triton.runtime.jit import JITFunction
    found = {}
    for info in pkgutil.iter_modules(mamba3_mimo.kernels.__path__):
        module = importlib.import_module(f"mamba3_mimo.kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                found[id(obj)] = obj
    return list(found.values())


def launched_kernels() -> list:
    """Record (name, registers, spills) of every compiled kernel launched from now on; spills is
    Triton's n_spills, the local memory per thread in 4-byte words (bytes / 4)."""
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


def grads_rule(variant: dict) -> None:
    """Replace phase 2's blocks rule by the variant's "grads_cfg" entries over it (this process
    only: each variant runs in its own)."""
    import dataclasses
    from mamba3_mimo.kernels import chunk_grads
    if "grads_cfg" in variant:
        rule = chunk_grads.config
        chunk_grads.config = lambda *a: dataclasses.replace(rule(*a), **variant["grads_cfg"])


def operator_errors(shape, dev: str) -> dict:
    """Relative RMS error of the operator's output and of every input's gradient against the
    float64 reference operator on the same inputs (bf16, Z and D on) and output gradient."""
    import torch
    from mamba3_mimo import mamba3_mimo
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo.reference import mamba3_mimo_reference
    from mamba3_mimo.testing import rel_rms
    args = operator_inputs(shape, torch.bfloat16, device=dev, seed=7)
    names = [k for k, x in args.items() if isinstance(x, torch.Tensor)]
    ref = dict(args, dtype=torch.float64)
    for k in names:
        ref[k] = args[k].detach().double().cpu().requires_grad_(True)
        args[k].requires_grad_(True)
    out = mamba3_mimo(**args)
    gold = mamba3_mimo_reference(**ref)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out.dtype)
    out.backward(dout.to(dev))
    gold.backward(dout.double())
    errs = {"out": rel_rms(out.detach().cpu(), gold.detach())}
    errs.update({f"d{k}": rel_rms(args[k].grad.cpu(), ref[k].grad) for k in names})
    return errs


def measure(variant: dict, shape_filter: str, check: bool) -> dict:
    """Time one variant in this process; with `check`, also its errors on the sweep."""
    import torch
    from mamba3_mimo import configs, mamba3_mimo_bwd_fwd
    from mamba3_mimo.bench import kernel_ms, problem_of
    from mamba3_mimo.bench_operator import operator_case
    from mamba3_mimo.kernels import chunk_grads
    from mamba3_mimo.problem import Problem
    from mamba3_mimo.inputs import Shape, make_inputs, official_shapes, sweep_shapes
    from mamba3_mimo.reference import bwd_fwd_reference
    from mamba3_mimo.runtime import launcher, plans
    from mamba3_mimo.testing import OUTPUTS, THRESHOLDS, rel_rms

    check_variant(variant)
    if "direct" in variant:
        launcher.DIRECT = bool(variant["direct"])
    if "addresses" in variant:
        plans.ADDRESSES = bool(variant["addresses"])
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"  # cpu: a dry run in the interpreter
    log = launched_kernels() if gpu else []
    res = dict(name=variant["name"], times={}, device={}, kernels={}, plans={},
               worst_err_over_thr=0.0, errors={})
    operator = os.environ.get("AB_TARGET", "bwd_fwd") == "operator"
    z_gate = os.environ.get("AB_Z", "1") != "0"
    grads_rule(variant)
    # the filter: substrings of shape names, comma-separated (any one selects a shape)
    shapes = [] if shape_filter == "none" else [
        s for s in official_shapes() if any(f in s.name for f in shape_filter.split(","))]
    for s in shapes:
        run_shape = s if gpu else Shape(1, 2 * s.C, 2, 1, s.N, s.P, s.R, s.C)
        if operator:
            _, fwd_bwd, leaves = operator_case(run_shape, z_gate, device=dev, seed=1)
            # the problem the configs' rules see (the state pass's); phase 2's blocks recorded
            pb = Problem(**vars(run_shape), dtype=torch.bfloat16, has_z=z_gate, has_d=True,
                         output_dtype=torch.bfloat16, device=torch.device(dev))
            plan = repr(chunk_grads.config(s.N, s.P))

            def call(fwd_bwd=fwd_bwd, leaves=leaves):
                for x in leaves:
                    x.grad = None
                fwd_bwd()
        else:
            a = make_inputs(run_shape, torch.bfloat16, z_gate, device=dev, seed=1)
            a.pop("adt")
            a["output_dtype"] = torch.bfloat16
            pb = problem_of(a)
            plan = None

            def call(a=a):
                return mamba3_mimo_bwd_fwd(**a)

        with configs.override(**rules(variant, pb)):
            res["plans"][s.name] = plan or configs.preferred(pb).describe()
            log.clear()
            # the log patches fn.run, which direct launches bypass after a signature's first
            # launch
            direct, launcher.DIRECT = launcher.DIRECT, False
            call()
            launcher.DIRECT = direct
            res["kernels"][s.name] = sorted(set(log))
            if gpu:
                from triton.testing import do_bench
                res["times"][s.name] = do_bench(call, rep=25, return_mode="median")
                res["device"][s.name] = kernel_ms(call)
            else:
                t0 = time.perf_counter()
                call()
                res["times"][s.name] = (time.perf_counter() - t0) * 1e3
    for s in sweep_shapes() if check else []:
        key = f"{s.name}_S{s.S}_G{s.G}_rdd{s.rotary_dim_divisor}"
        if operator:
            res["errors"][key] = errs = operator_errors(s, dev)
            res["worst_err_over_thr"] = max(res["worst_err_over_thr"],
                                            max(errs.values()) / THRESHOLDS[torch.bfloat16])
            continue
        a = make_inputs(s, torch.bfloat16, device=dev, seed=7)
        a.pop("adt")
        golden = bwd_fwd_reference(**a)
        with configs.override(**rules(variant, problem_of(a))):
            outs = mamba3_mimo_bwd_fwd(**a)
        errs = {n: rel_rms(x, g) for n, x, g in zip(OUTPUTS, outs, golden)}
        res["errors"][key] = errs
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
    for v in variants:
        check_variant(v)
    names = [v["name"] for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ: {names}")
    shape_filter = argv[2] if len(argv) > 2 else ""
    rounds = int(argv[3]) if len(argv) > 3 else 2
    trees = tempfile.mkdtemp(prefix="ab_trees_")
    roots = {v["name"]: patched_tree(v["patch"], os.path.join(trees, v["name"]))
             if "patch" in v else ROOT for v in variants}
    return variants, shape_filter, rounds, roots


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    if sys.argv[1] == "--one":
        res = measure(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "check")
        import mamba3_mimo
        res["package"] = os.path.dirname(os.path.abspath(mamba3_mimo.__file__))
        print("AB_RESULT " + json.dumps(res), flush=True)
        return 0
    variants, shape_filter, rounds, roots = variant_args(sys.argv)
    runs = []
    for r in range(rounds):
        for v in variants:
            t0 = time.time()
            root = roots[v["name"]]
            env = dict(os.environ, PYTHONPATH=root)
            # the errors are deterministic: checked in the first round only
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(v),
                                shape_filter,
                                "check" if r == 0 and v.get("check", True) else "time"],
                               capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("AB_RESULT ")]
            run = (json.loads(line[0][10:]) if line else
                   dict(name=v["name"], failed=(p.stdout + p.stderr)[-2000:]))
            want = os.path.realpath(os.path.join(root, "mamba3_mimo"))
            if line and os.path.realpath(run["package"]) != want:
                # e.g. an installed copy that shadows the patched tree: not this variant's code
                run = dict(name=v["name"], failed=f"imported {run['package']}, not {want}")
            run.update(round=r, wall_s=time.time() - t0)
            runs.append(run)
            print(f"round {r} {v['name']}: {'ok' if 'times' in run else 'FAILED'} "
                  f"({run['wall_s']:.0f} s)" + ("" if "times" in run else
                                                 f"\n{run['failed'][-800:]}"), flush=True)
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
