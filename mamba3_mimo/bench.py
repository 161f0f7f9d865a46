"""GPU benchmark of bwd_fwd following shared/BENCHMARK.md: `python -m mamba3_mimo.bench`.

Times the stage0 baseline and the production path ("auto"), and with `--previous DIR` the
public entry of an earlier commit's package (a checkout in DIR, e.g. a `git worktree`),
interleaved in one process over several rounds, on the official grid plus a B=8 control shape,
Z gate on and off, bf16 and fp32 outputs. Compares with the upstream TileLang anchor and with
the HBM floor; writes results.json, results.md and results.png.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import configs
from .inputs import make_inputs
from .phases import bwd_fwd
from .problem import Problem, Shape, official_shapes
from .runtime.device import interpreter_active
from .testing import DTYPE_NAMES

# upstream TileLang's bwd_fwd times on the H200, shipped with the package (BENCHMARK.md)
DEFAULT_UPSTREAM = Path(__file__).resolve().parent / "data" / "upstream_tilelang_h200.json"
COPY_BANDWIDTH = 4.3e12  # bytes/s: the H200's measured copy bandwidth (BENCHMARK.md)
CANDIDATES = ("stage0", "auto")
CONTROL = Shape(B=8, S=2048, H=16, G=1, N=128, P=64, R=4, C=16)


def problem_of(kwargs: dict) -> Problem:
    """The validated Problem of keyword arguments of `mamba3_mimo_bwd_fwd`."""
    bound = inspect.signature(bwd_fwd.mamba3_mimo_bwd_fwd).bind(**kwargs)
    bound.apply_defaults()
    return bwd_fwd.validate(*bound.arguments.values())


def hbm_bytes(shape: Shape, output_dtype: torch.dtype, z_gate: bool = True, d_skip: bool = True,
              input_dtype: torch.dtype = torch.bfloat16) -> int:
    """Fewest HBM bytes of one bwd_fwd call: every input read once, every output written once.

    dout, v, z, q, k and trap come in `input_dtype`; the other inputs and dmimo_o / dmimo_z are
    fp32; states, qk_dot and dz are written in `output_dtype` (SPEC sections 1 and 3).
    BENCHMARK.md's MB column is within 1 MB of this on every shape; it leaves out the tensors
    whose size does not grow with S (biases, mimo_*, d, dmimo_*: 0.1-0.5 MB), which moves a few of
    its floor times by 0.001 ms.
    """
    s = shape
    nc = math.ceil(s.S / s.C)
    bsh, bhs, hr = s.B * s.S * s.H, s.B * s.H * s.S, s.H * s.R
    x, o = input_dtype.itemsize, output_dtype.itemsize
    read_x = (2 + z_gate) * bsh * s.P + 2 * s.B * s.S * s.R * s.G * s.N + bhs
    read_f32 = (2 * hr * s.N + (2 + z_gate) * hr * s.P + bsh * (s.N // s.rotary_dim_divisor)
                + 3 * bhs + s.B * s.H * nc * s.C * s.C + d_skip * s.H)
    write_o = s.B * s.H * nc * s.N * s.P + bhs * s.R * s.R + z_gate * bsh * s.P
    write_f32 = (1 + z_gate) * s.B * hr * s.P
    return x * read_x + 4 * (read_f32 + write_f32) + o * write_o


def floor_ms(shape: Shape, output_dtype: torch.dtype, z_gate: bool = True) -> float:
    """Time to move hbm_bytes at the H200's copy bandwidth, in ms."""
    return hbm_bytes(shape, output_dtype, z_gate) / COPY_BANDWIDTH * 1e3


def load_upstream(path: Path) -> Dict[Tuple[str, bool], float]:
    """{(shape name, Z on): upstream bwd_fwd ms}; empty, with a warning, if the file is absent."""
    if not path.is_file():
        print(f"warning: no upstream anchor at {path}; no upstream columns", file=sys.stderr)
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {(r["shape"], r["z"]): r["bwd_fwd_ms"] for r in rows}


@dataclass(frozen=True)
class Config:
    """One benchmarked problem: shape, Z gate, output dtype (bf16 inputs, D-skip on)."""
    shape: Shape
    z: bool
    out: torch.dtype
    control: bool = False

    @property
    def label(self) -> str:
        return self.shape.name + (f"_B{self.shape.B} (control)" if self.control else "")


def bench_configs(shape_filter: Optional[str], outs: Sequence[torch.dtype]) -> List[Config]:
    """Official grid and control shape, Z on and off, each output dtype; `shape_filter` keeps
    labels containing any of its comma-separated substrings."""
    shapes = [(s, False) for s in official_shapes()] + [(CONTROL, True)]
    cfgs = [Config(s, z, out, control) for out in outs for z in (True, False)
            for s, control in shapes]
    if shape_filter:
        keys = [k for k in shape_filter.split(",") if k]
        cfgs = [c for c in cfgs if any(k in c.label for k in keys)]
    return cfgs


def git_commit() -> str:
    """$MAMBA3_GIT_COMMIT when set (on a machine that got a copy of the tree its .git may be
    stale: the caller names the commit), else HEAD of the repository the package is in (an
    editable install) with -dirty, else 'unknown'."""
    if os.environ.get("MAMBA3_GIT_COMMIT"):
        return os.environ["MAMBA3_GIT_COMMIT"]
    try:
        run = functools.partial(subprocess.run, cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, check=True)
        head = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta() -> dict:
    import triton
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                git_commit=git_commit(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version())


class _Counter:
    """Progress without tqdm or off a terminal: prints "[done/total] config" as a config starts."""

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0

    def set_description(self, desc: str) -> None:
        print(f"[{self.n}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def update(self, k: int = 1) -> None:
        self.n += k

    def close(self) -> None:
        print(f"[{self.n}/{self.total}] done", file=sys.stderr, flush=True)


def progress(total: int):
    """tqdm on a terminal when installed, else a line per config."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    if not sys.stderr.isatty():
        return _Counter(total)
    return tqdm(total=total, unit="step", file=sys.stderr)


def first_call_s(fn: Callable[[], object]) -> float:
    """Wall time of one call including Triton compilation, synchronised."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_extra_mib(fwd_bwd: Callable[[], object]) -> float:
    """The peak memory of one forward+backward above what exists after a first one (the inputs,
    the parameters and their allocated gradients), MiB."""
    fwd_bwd()  # the gradients exist from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def kernel_ms(fn: Callable[[], object], calls: int = 20) -> Dict[str, float]:
    """Device time per call of each kernel that fn launches, in ms (torch.profiler's CUDA
    events): the kernels alone, without the host's time between them, which decides the
    end-to-end time of the small shapes (docs/performance.md, "Host side")."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / 1e3 / calls for e in prof.key_averages()
            if e.self_device_time_total > 0}


def _attempt(errors: Dict[str, str], name: str, fn: Callable[[], float]) -> Optional[float]:
    """fn(), or None with the error kept, so that one failing candidate spares the others."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
        errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"warning: {name} failed: {errors[name]}", file=sys.stderr)
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def load_previous(checkout: Path) -> Callable:
    """The public `mamba3_mimo_bwd_fwd` of the package in checkout/mamba3_mimo, imported under
    another name (mamba3_mimo_previous) beside this one; its modules must import each other
    relatively, as this package's do."""
    init = checkout / "mamba3_mimo" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"error: --previous: no mamba3_mimo package in {checkout}")
    spec = importlib.util.spec_from_file_location(
        "mamba3_mimo_previous", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.mamba3_mimo_bwd_fwd


def bench_config(cfg: Config, rounds: int, with_stage0: bool,
                 upstream: Dict[Tuple[str, bool], float], bar, rep_ms: int = 100,
                 previous: Optional[Callable] = None) -> List[dict]:
    """Warm up then time every candidate on one config, interleaved over `rounds`, each round
    starting from the next candidate (so that no candidate always runs first); one row each."""
    from triton.testing import do_bench
    args = make_inputs(cfg.shape, torch.bfloat16, z_gate=cfg.z, d_skip=True, device="cuda")
    args.pop("adt")
    args["output_dtype"] = cfg.out
    problem = problem_of(args)
    plan = configs.preferred(problem).describe()
    names = [c for c in CANDIDATES if with_stage0 or c != "stage0"]
    fns = {n: functools.partial(bwd_fwd.bwd_fwd, **args, impl=n) for n in names}
    if previous is not None:
        names.append("previous")
        fns["previous"] = functools.partial(previous, **args)
    errors: Dict[str, str] = {}
    bar.set_description(f"{cfg.label} Z={'on' if cfg.z else 'off'} {DTYPE_NAMES[cfg.out]}")
    first = {n: _attempt(errors, n, functools.partial(first_call_s, fns[n])) for n in names}
    bar.update()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            if n not in errors:
                ms = _attempt(errors, n, functools.partial(do_bench, fns[n], rep=rep_ms,
                                                              return_mode="median"))
                times[n] += [] if ms is None else [ms]
        bar.update()
    median = {n: statistics.median(t) if t and n not in errors else None
              for n, t in times.items()}
    # informational: the official time is do_bench's median above
    kernels = (_attempt(errors, "auto kernels",
                        lambda: sum(kernel_ms(fns["auto"]).values()))
               if "auto" in names and median["auto"] is not None else None)
    s = cfg.shape
    up = None if cfg.control else upstream.get((s.name, cfg.z))
    floor = floor_ms(s, cfg.out, cfg.z)
    return [dict(shape=s.name, label=cfg.label, control=cfg.control, B=s.B, S=s.S, H=s.H, G=s.G,
                 N=s.N, P=s.P, R=s.R, C=s.C, z=cfg.z, d_skip=True, input_dtype="bf16",
                 output_dtype=DTYPE_NAMES[cfg.out], candidate=n,
                 plan=plan if n == "auto" else None,
                 first_call_s=first[n], ms_rounds=times[n], median_ms=median[n],
                 kernels_ms=kernels if n == "auto" else None,
                 kernels_error=errors.get("auto kernels") if n == "auto" else None,
                 error=errors.get(n), hbm_bytes=hbm_bytes(s, cfg.out, cfg.z), floor_ms=floor,
                 upstream_ms=up,
                 upstream_over_ms=_ratio(up, median[n]) if cfg.out == torch.bfloat16 else None,
                 stage0_over_ms=_ratio(median.get("stage0"), median[n]),
                 previous_over_ms=_ratio(median.get("previous"), median[n]),
                 ms_over_floor=_ratio(median[n], floor))
            for n in names]


def geomean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _fmt(v: Optional[float], digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def md_table(headers: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Markdown table; the first and last columns are text, the others numbers."""
    last = len(headers) - 1
    rule = "|" + "|".join("---" if i in (0, last) else "---:" for i in range(len(headers))) + "|"
    return "\n".join(["| " + " | ".join(headers) + " |", rule]
                     + ["| " + " | ".join(line) + " |" for line in lines])


RATIOS = (("upstream/auto", "upstream_over_ms"), ("stage0/auto", "stage0_over_ms"),
          ("previous/auto", "previous_over_ms"), ("auto/floor", "ms_over_floor"))


def _geomean_row(grid: List[dict], names: Sequence[str]) -> dict:
    """Geometric means over the official shapes of one (Z, output dtype) group."""
    auto = [r for r in grid if r["candidate"] == "auto"]
    return dict(shapes=len(auto),
                **{f"{n}_ms": geomean([r["median_ms"] for r in grid if r["candidate"] == n])
                   for n in names},
                kernels_ms=geomean([r.get("kernels_ms") for r in auto]),
                upstream_ms=geomean([r["upstream_ms"] for r in auto]),
                floor_ms=geomean([r["floor_ms"] for r in auto]),
                **{key: geomean([r.get(key) for r in auto]) for _, key in RATIOS})


def group_summary(rows: List[dict]) -> Tuple[str, List[dict]]:
    """One markdown table per (Z, output dtype), each closed by its geometric-mean row; and
    those geometric means as dicts."""
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    headers = (["shape"] + [f"{n} ms" for n in names] + ["auto kernels ms", "upstream ms",
                                                          "floor ms"]
               + [h for h, _ in RATIOS] + ["auto 1st call s", "auto plan"])
    sections, gms = [], []
    for out in dict.fromkeys(r["output_dtype"] for r in rows):
        for z in (True, False):
            grp = [r for r in rows if r["z"] == z and r["output_dtype"] == out]
            if not grp:
                continue
            by = {(r["label"], r["candidate"]): r for r in grp}
            lines = []
            for label in dict.fromkeys(r["label"] for r in grp):
                auto = by.get((label, "auto"), {})
                ms = [_fmt(by.get((label, n), {}).get("median_ms")) for n in names]
                lines.append([label] + ms
                             + [_fmt(auto.get("kernels_ms")), _fmt(auto.get("upstream_ms")),
                                _fmt(auto.get("floor_ms"))]
                             + [_fmt(auto.get(key), 2) for _, key in RATIOS]
                             + [_fmt(auto.get("first_call_s"), 1), auto.get("plan") or "-"])
            gm = dict(z=z, output_dtype=out,
                      **_geomean_row([r for r in grp if not r["control"]], names))
            gms.append(gm)
            lines.append(["geometric mean (grid)"] + [_fmt(gm[f"{n}_ms"]) for n in names]
                         + [_fmt(gm["kernels_ms"]), _fmt(gm["upstream_ms"]),
                            _fmt(gm["floor_ms"])]
                         + [_fmt(gm[key], 2) for _, key in RATIOS] + ["", ""])
            sections.append(f"### Z gate {'on' if z else 'off'}, output {out}\n\n"
                            + md_table(headers, lines))
    return "\n\n".join(sections), gms


def bar_plot(labels: Sequence[str], series: Sequence[Tuple[str, Sequence[float]]], title: str,
             path: Path) -> None:
    """Grouped bars per label, one per (name, values) series, log scale, into a PNG at path
    (a warning and no file without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no results.png", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(14, 5))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series):
        shift = (i - (len(series) - 1) / 2) * width
        ax.bar([j + shift for j in range(len(labels))], vals, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("ms (median, log scale)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: List[dict], path: Path) -> None:
    """Grouped bars per shape, log scale: stage0, auto, upstream, floor (Z on, bf16 out)."""
    sel = [r for r in rows if r["z"] and r["output_dtype"] == "bf16" and not r["control"]]
    labels = list(dict.fromkeys(r["label"] for r in sel))
    if not labels:
        return
    by = {(r["label"], r["candidate"]): r for r in sel}

    def value(label: str, cand: str, key: str) -> float:
        v = by.get((label, cand), {}).get(key)
        return float("nan") if v is None else v

    series = [("stage0", [value(lb, "stage0", "median_ms") for lb in labels]),
              ("production (auto)", [value(lb, "auto", "median_ms") for lb in labels]),
              ("upstream TileLang", [value(lb, "auto", "upstream_ms") for lb in labels]),
              ("HBM floor", [value(lb, "auto", "floor_ms") for lb in labels])]
    bar_plot(labels, series, "Mamba-3 MIMO bwd_fwd on one GPU: B=4 S=2048 H=16, bf16, Z on, "
             "D on, bf16 out", path)


def report(rows: List[dict], meta: dict, rounds: int, out_dir: Path) -> str:
    """Write results.json, results.md and results.png into out_dir; return the markdown."""
    tables, gms = group_summary(rows)
    text = (f"# bwd_fwd benchmark\n\n{meta['date']}, {meta['gpu']}, commit {meta['git_commit']}, "
            f"torch {meta['torch']}, triton {meta['triton']}; median of {rounds} interleaved "
            f"round(s) of triton.testing.do_bench (median), ms. S=2048 H=16 G=1 (B=4; the control "
            f"shape B=8), bf16 inputs, D on. floor: HBM bytes at {COPY_BANDWIDTH / 1e12:.1f} TB/s; "
            f"upstream compared at bf16 output only; geometric means exclude the control shape. "
            f"auto kernels ms, for information: the device time per call of the kernels of auto "
            f"(torch.profiler, 20 calls), without the host's time between calls."
            f"\n\n{tables}\n")
    write_results(out_dir, rows, gms, text, plot)
    return text


def write_results(out_dir: Path, rows: List[dict], gms: dict, text: str,
                  plot_fn: Callable[[List[dict], Path], None]) -> None:
    """results.json (the rows and geometric means), results.md (text) and results.png
    (plot_fn) in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(
        json.dumps({"results": rows, "geomean": gms}, indent=1, default=str) + "\n")
    (out_dir / "results.md").write_text(text)
    plot_fn(rows, out_dir / "results.png")
    print(f"wrote results.json, results.md, results.png to {out_dir}", file=sys.stderr)


def arg_parser(prog: str, description: str, out: str,
               upstream: Optional[Path] = None, shapes: bool = True,
               do_bench: bool = True) -> argparse.ArgumentParser:
    """The options the benchmarks take: --shapes (where there is a choice of shapes), --rounds,
    --rep-ms (where do_bench times), --out, and --upstream where there are upstream times to
    compare with."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    if shapes:
        p.add_argument("--shapes", help="keep shapes whose label contains one of these "
                       "comma-separated substrings (e.g. N128_P64,control)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case (default 3)")
    if do_bench:
        p.add_argument("--rep-ms", type=int, default=100,
                       help="do_bench's timing window per candidate and round, ms (default "
                            "100, Triton's default; 25 fits the whole grid in a few minutes)")
    p.add_argument("--out", type=Path, default=Path(out),
                   help=f"folder for results.json, results.md, results.png (default {out})")
    if upstream is not None:
        p.add_argument("--upstream", type=Path, default=upstream,
                       help=f"upstream's times (default: the package's data/{upstream.name})")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = arg_parser("mamba3_mimo.bench", "Benchmark bwd_fwd on the GPU (shared/BENCHMARK.md).",
                   "bench/results", DEFAULT_UPSTREAM)
    p.add_argument("--quick", action="store_true", help="bf16 output only, Z on and off, 1 round")
    p.add_argument("--bf16-only", action="store_true",
                   help="bf16 output only (the comparison with upstream), Z on and off")
    p.add_argument("--no-stage0", action="store_true", help="skip the stage0 baseline")
    p.add_argument("--previous", type=Path,
                   help="a checkout of an earlier commit (its mamba3_mimo package is timed "
                        "interleaved, as candidate 'previous')")
    return p.parse_args(argv)


def grad_leaves(args: dict) -> list:
    """The tensors among a call's keyword arguments, each made a leaf that requires grad."""
    return [x.requires_grad_(True) for x in args.values() if isinstance(x, torch.Tensor)]


def require_gpu(prog: str) -> None:
    """SystemExit unless a CUDA GPU runs compiled Triton kernels: timings come from the GPU."""
    if not torch.cuda.is_available() or interpreter_active():
        raise SystemExit(f"error: {prog} needs a CUDA GPU with compiled Triton kernels "
                         "(BENCHMARK.md: time on the H200, never on the CPU interpreter)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    require_gpu("mamba3_mimo.bench")
    rounds = 1 if opts.quick else opts.rounds
    outs = (torch.bfloat16,) if opts.quick or opts.bf16_only else (torch.bfloat16, torch.float32)
    cfgs = bench_configs(opts.shapes, outs)
    if not cfgs:
        raise SystemExit(f"error: no shape matches --shapes {opts.shapes!r}")
    upstream = load_upstream(opts.upstream)
    previous = load_previous(opts.previous) if opts.previous else None
    meta = run_meta()
    bar = progress(len(cfgs) * (rounds + 1))
    rows: List[dict] = []
    partial = opts.out / "partial.jsonl"  # one line per row as it comes: survives a cut run
    opts.out.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    for cfg in cfgs:
        new = bench_config(cfg, rounds, not opts.no_stage0, upstream, bar, opts.rep_ms,
                           previous)
        rows += new
        with partial.open("a") as f:
            f.writelines(json.dumps({**meta, **r}, default=str) + "\n" for r in new)
    bar.close()
    partial.unlink()
    print(report([{**meta, **r} for r in rows], meta, rounds, opts.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
