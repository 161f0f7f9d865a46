"""GPU benchmark of the whole operator `mamba3_mimo(...)`, as a user calls it (autograd on):
`python -m mamba3_mimo.bench_operator`.

Per official shape (B=4, S=2048, H=16, G=1, bf16, D on), Z on and off, and the fused norm on two
shapes: the forward, forward+backward (`out.backward(dout)`) and their difference, do_bench
medians over several rounds; the peak memory forward+backward allocates above the inputs and
their gradients; the first call's time (compilation included). Compared with upstream's
operator measured on the same H200 (data/upstream_operator_h200.json, shared/BENCHMARK.md);
writes results.json, results.md and results.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .bench import (_attempt, _fmt, arg_parser, bar_plot, first_call_s, geomean, grad_leaves,
                    md_table, peak_extra_mib, progress, require_gpu, run_meta, write_results)
from .inputs import operator_inputs
from .phases.operator import mamba3_mimo
from .problem import Shape, official_shapes

DEFAULT_UPSTREAM = Path(__file__).resolve().parent / "data" / "upstream_operator_h200.json"
NORM_SHAPES = ("N32_P64_R4_C16", "N128_P64_R4_C16")  # upstream measured the fused norm there
TIMES = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")


def cases(shape_filter: Optional[str]) -> List[dict]:
    """(shape, Z, fused norm) of the benchmark: the grid with Z on and off, the norm rows."""
    out = [dict(shape=s, z=z, norm=False) for z in (True, False) for s in official_shapes()]
    out += [dict(shape=s, z=True, norm=True) for s in official_shapes() if s.name in NORM_SHAPES]
    if shape_filter:
        keys = [k for k in shape_filter.split(",") if k]
        out = [c for c in out if any(k in c["shape"].name for k in keys)]
    return out


def label(case: dict) -> str:
    return case["shape"].name + (" + fused norm" if case["norm"] else "")


def operator_case(shape: Shape, z: bool, norm: bool = False, device="cuda", seed: int = 0):
    """(forward, forward+backward, the leaves) of one case: `mamba3_mimo` on bf16 inputs of
    `shape` (inputs.operator_inputs, every tensor a leaf that requires grad), the Z gate on or
    off, the fused norm with a weight of ones or not, and a random output gradient."""
    args = operator_inputs(shape, torch.bfloat16, z_gate=z, device=device, seed=seed)
    leaves = grad_leaves(args)
    if norm:
        args["fuse_pregate_headwise_rms_norm"] = True
        args["outproj_norm_weight"] = torch.ones(shape.H, shape.P, device=device,
                                                 requires_grad=True)
        leaves.append(args["outproj_norm_weight"])
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(shape.B, shape.S, shape.H, shape.P, generator=gen).to(device,
                                                                                torch.bfloat16)

    def fwd():
        return mamba3_mimo(**args)

    def fwd_bwd():
        mamba3_mimo(**args).backward(dout)

    return fwd, fwd_bwd, leaves


def run_case(case: dict, rounds: int, rep_ms: int, upstream: Dict[tuple, dict], bar) -> dict:
    from triton.testing import do_bench
    shape, z, norm = case["shape"], case["z"], case["norm"]
    errors: Dict[str, str] = {}
    fwd, fwd_bwd, leaves = operator_case(shape, z, norm)
    row = dict(shape=shape.name, label=label(case), z=z, fused_norm=norm, B=shape.B, S=shape.S,
               H=shape.H, G=shape.G, N=shape.N, P=shape.P, R=shape.R, C=shape.C)
    bar.set_description(f"{label(case)} Z {'on' if z else 'off'}: first call")
    row["first_call_s"] = _attempt(errors, "first_call", lambda: first_call_s(fwd_bwd))
    samples: Dict[str, list] = {"fwd_ms": [], "fwd_bwd_ms": []}
    for i in range(rounds if not errors else 0):
        bar.set_description(f"{label(case)} Z {'on' if z else 'off'}: round {i + 1}/{rounds}")
        samples["fwd_ms"].append(do_bench(fwd, rep=rep_ms, return_mode="median"))
        samples["fwd_bwd_ms"].append(do_bench(fwd_bwd, rep=rep_ms, grad_to_none=leaves,
                                              return_mode="median"))
        bar.update()
    if samples["fwd_ms"]:
        row["fwd_ms"] = statistics.median(samples["fwd_ms"])
        row["fwd_bwd_ms"] = statistics.median(samples["fwd_bwd_ms"])
        row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
        row["peak_extra_mib"] = _attempt(errors, "peak", lambda: peak_extra_mib(fwd_bwd))
    up = upstream.get((shape.name, z, norm), {})
    row["upstream"] = up or None
    for key in TIMES + ("peak_extra_mib",):
        ours, theirs = row.get(key), up.get(key)
        row[f"upstream_over_{key}"] = theirs / ours if ours and theirs else None
    row["errors"] = errors
    return row


def load_upstream(path: Path) -> Dict[tuple, dict]:
    rows = json.loads(path.read_text())["rows"]
    return {(r["shape"], r["z"], r["fused_norm"]): r for r in rows}


def report(rows: List[dict], meta: dict, rounds: int, out_dir: Path) -> str:
    """results.json, results.md and results.png in out_dir; the markdown."""
    headers = ["shape", "fwd ms", "bwd ms", "fwd+bwd ms", "upstream fwd", "upstream bwd",
               "upstream fwd+bwd", "x fwd", "x bwd", "x fwd+bwd", "peak MiB", "upstream MiB",
               "1st call s", "note"]
    parts, gms = [], {}
    for z in (True, False):
        sel = [r for r in rows if r["z"] == z]
        if not sel:
            continue
        lines = []
        for r in sel:
            up = r["upstream"] or {}
            note = "upstream: kernels only" if up.get("kernels_only") else (
                "; ".join(f"{k}: {v}" for k, v in r["errors"].items()))
            lines.append([r["label"]] + [_fmt(r.get(k)) for k in TIMES]
                         + [_fmt(up.get(k)) for k in TIMES]
                         + [_fmt(r.get(f"upstream_over_{k}"), 2) for k in TIMES]
                         + [_fmt(r.get("peak_extra_mib"), 0), _fmt(up.get("peak_extra_mib"), 0),
                            _fmt(r.get("first_call_s"), 1), note])
        grid = [r for r in sel if not r["fused_norm"] and r["upstream"]
                and not r["upstream"].get("kernels_only")]
        gm = {k: geomean([r.get(k) for r in grid]) for k in TIMES}
        gm.update({f"upstream_{k}": geomean([r["upstream"][k] for r in grid]) for k in TIMES})
        gm.update({f"upstream_over_{k}": geomean([r.get(f"upstream_over_{k}") for r in grid])
                   for k in TIMES})
        gms["z_on" if z else "z_off"] = dict(gm, shapes=len(grid))
        lines.append([f"geometric mean ({len(grid)} shapes)"] + [_fmt(gm[k]) for k in TIMES]
                     + [_fmt(gm[f"upstream_{k}"]) for k in TIMES]
                     + [_fmt(gm[f"upstream_over_{k}"], 2) for k in TIMES] + ["", "", "", ""])
        parts.append(f"### Z gate {'on' if z else 'off'}\n\n{md_table(headers, lines)}")
    text = (f"# mamba3_mimo operator benchmark\n\n{meta['date']}, {meta['gpu']}, commit "
            f"{meta['git_commit']}, torch {meta['torch']}, triton {meta['triton']}; as a user "
            f"calls it, autograd on: fwd = the forward, fwd+bwd = forward then out.backward(dout), "
            f"bwd = their difference; median of {rounds} round(s) of triton.testing.do_bench "
            f"medians, ms. B=4 S=2048 H=16 G=1, bf16, D on. peak MiB: above the inputs and their "
            f"gradients. upstream: its operator on the same H200 (data/upstream_operator_h200.json"
            f"); x = upstream / ours; geometric means over the shapes where upstream's operator "
            f"compiles.\n\n" + "\n\n".join(parts) + "\n")
    write_results(out_dir, rows, gms, text, plot)
    return text


def plot(rows: List[dict], path: Path) -> None:
    """Bars per shape (Z on, no norm), log scale: ours and upstream's forward+backward and
    forward."""
    sel = [r for r in rows if r["z"] and not r["fused_norm"]]
    if not sel:
        return
    nan = float("nan")
    series = [(f"{who}, {what}", [((r if who == "ours" else r["upstream"] or {}).get(key)
                                   or nan) for r in sel])
              for what, key in (("fwd+bwd", "fwd_bwd_ms"), ("fwd", "fwd_ms"))
              for who in ("ours", "upstream")]
    bar_plot([r["shape"] for r in sel], series,
             "mamba3_mimo(...) on one GPU, autograd: B=4 S=2048 H=16, bf16, Z on, D on", path)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return arg_parser("mamba3_mimo.bench_operator", "Benchmark the whole operator on the GPU.",
                      "bench/operator", DEFAULT_UPSTREAM).parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    require_gpu("mamba3_mimo.bench_operator")
    todo = cases(opts.shapes)
    if not todo:
        raise SystemExit(f"error: no shape matches --shapes {opts.shapes!r}")
    upstream = load_upstream(opts.upstream)
    meta = run_meta()
    bar = progress(len(todo) * opts.rounds)
    rows = []
    for case in todo:
        rows.append({**meta, **run_case(case, opts.rounds, opts.rep_ms, upstream, bar)})
    bar.close()
    print(report(rows, meta, opts.rounds, opts.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
