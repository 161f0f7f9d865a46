"""GPU benchmark of sequences as users feed them: `python -m mamba3_mimo.bench_sequences`.

- Packed batches: forward+backward of `mamba3_mimo(..., cu_seqlens=...)` on eight sequences of
  random lengths (seeded) summing to 4 x 2048 steps, against the dense call on B=4, S=2048 of the
  same total, and their ratio (the issue asks for at most 1.15).
- Decode: the time per token of `mamba3_mimo_step` (the state updated in place, the output
  written into a given buffer) at B = 1, 16 and 256, called from Python and replayed from a CUDA
  graph, against the floor of reading and writing the state once at 4.3 TB/s (the H200's
  bandwidth), and their ratios.

Two official shapes (H=16, G=1, bf16, Z and D on), do_bench medians over several rounds;
writes results.json, results.md and results.png.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .bench import _fmt, arg_parser, bar_plot, md_table, progress, require_gpu, run_meta
from .bench import grad_leaves, write_results
from .inputs import operator_inputs
from .phases.operator import mamba3_mimo
from .phases.operator import SEQ_DIM
from .phases.step import mamba3_mimo_step, step_arguments
from .problem import Shape, official_shapes

SHAPES = ("N64_P64_R4_C16", "N128_P64_R4_C16")
DECODE_BATCHES = (1, 16, 256)
PACKED_SEQUENCES = 8
HBM_BYTES_PER_S = 4.3e12  # the H200's bandwidth (shared/BENCHMARK.md)
GRAPH_STEPS = 10  # decode steps per captured CUDA graph


def random_lengths(total: int, n: int, seed: int = 0) -> List[int]:
    """n lengths >= 1 summing to total, at random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(total - 1, generator=gen)[:n - 1].add(1).tolist())
    bounds = [0] + cuts + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _median(fn: Callable[[], object], rounds: int, rep_ms: int, leaves=None) -> float:
    from triton.testing import do_bench
    return statistics.median(do_bench(fn, rep=rep_ms, grad_to_none=leaves, return_mode="median")
                             for _ in range(rounds))


def packed_case(shape: Shape, rounds: int, rep_ms: int) -> dict:
    """fwd+bwd ms of the dense call and of the same total packed into PACKED_SEQUENCES
    sequences."""
    dense = operator_inputs(shape, torch.bfloat16, device="cuda", seed=0)
    total = shape.B * shape.S
    flat = Shape(1, total, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C)
    packed = operator_inputs(flat, torch.bfloat16, device="cuda", seed=0)
    lengths = random_lengths(total, PACKED_SEQUENCES)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    row = dict(kind="packed", shape=shape.name, total_steps=total, lengths=lengths)
    for name, args, extra in (("dense", dense, {}), ("packed", packed, dict(cu_seqlens=cu))):
        leaves = grad_leaves(args)
        dout = torch.randn(args["V"].shape, device="cuda", dtype=torch.bfloat16)

        def fwd_bwd(args=args, extra=extra, dout=dout):
            mamba3_mimo(**args, **extra).backward(dout)

        fwd_bwd()
        row[f"{name}_fwd_bwd_ms"] = _median(fwd_bwd, rounds, rep_ms, leaves)
    row["packed_over_dense"] = row["packed_fwd_bwd_ms"] / row["dense_fwd_bwd_ms"]
    return row


def decode_case(shape: Shape, B: int, rounds: int, rep_ms: int) -> dict:
    """ms per token of the decode step at batch B, and the floor of moving the state once."""
    s = Shape(B, 1, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C)
    args = operator_inputs(s, torch.bfloat16, device="cuda", seed=0)
    token = step_arguments(args, 0)
    H, P, N, R = shape.H, shape.P, shape.N, shape.R
    RD = token["Angles"].shape[-1]
    f32 = dict(device="cuda", dtype=torch.float32)
    state = (torch.zeros(B, H, RD, **f32), torch.randn(B, H, P, N, **f32) * 0.1,
             torch.randn(B, R, H, N, **f32), torch.randn(B, H, P, device="cuda",
                                                          dtype=torch.bfloat16))
    out = torch.empty(B, H, P, device="cuda", dtype=torch.bfloat16)

    def step():
        mamba3_mimo_step(**token, state=state, out=out)

    step()
    ms = _median(step, rounds, rep_ms)
    # as a server runs it: GRAPH_STEPS steps captured in one CUDA graph, replayed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_STEPS):
            step()
    graph_ms = _median(graph.replay, rounds, rep_ms) / GRAPH_STEPS
    # the state read and written once: h [P, N] and k [R, N] fp32, angle, v; and the token's
    # inputs read and output written
    state_bytes = B * H * (P * N + R * N + RD) * 4 + B * H * P * 2
    token_bytes = sum(token[name].numel() * token[name].element_size() for name in SEQ_DIM
                      if token[name] is not None)
    floor_ms = (2 * state_bytes + token_bytes + out.numel() * 2) / HBM_BYTES_PER_S * 1e3
    return dict(kind="decode", shape=shape.name, B=B, ms_per_token=ms,
                graph_ms_per_token=graph_ms, floor_ms=floor_ms, over_floor=ms / floor_ms,
                graph_over_floor=graph_ms / floor_ms)


def report(rows: List[dict], meta: dict, rounds: int, out_dir: Path) -> str:
    packed = [r for r in rows if r["kind"] == "packed"]
    decode = [r for r in rows if r["kind"] == "decode"]
    text = (f"# mamba3_mimo sequences benchmark\n\n{meta['date']}, {meta['gpu']}, commit "
            f"{meta['git_commit']}, torch {meta['torch']}, triton {meta['triton']}; H=16 G=1, "
            f"bf16, Z and D on; median of {rounds} round(s) of triton.testing.do_bench "
            f"medians, ms.\n\n### Packed batches\n\nforward+backward of {PACKED_SEQUENCES} "
            f"sequences of random lengths packed into one batch entry (cu_seqlens) against the "
            f"dense call of the same total (B=4, S=2048).\n\n")
    text += md_table(["shape", "dense ms", "packed ms", "packed / dense", "lengths"],
                     [[r["shape"], _fmt(r["dense_fwd_bwd_ms"]), _fmt(r["packed_fwd_bwd_ms"]),
                       _fmt(r["packed_over_dense"], 2), str(r["lengths"])] for r in packed])
    text += ("\n\n### Decode\n\ntime per token of `mamba3_mimo_step` (state updated in place, "
             "output into a given buffer), called from Python (eager) and replayed from a CUDA "
             f"graph of {GRAPH_STEPS} steps (graph), against the floor of reading and writing "
             f"the state once at {HBM_BYTES_PER_S / 1e12:.1f} TB/s.\n\n")
    text += md_table(["shape", "B", "eager ms", "graph ms", "floor ms", "eager x floor",
                      "graph x floor"],
                     [[r["shape"], str(r["B"]), _fmt(r["ms_per_token"], 4),
                       _fmt(r["graph_ms_per_token"], 4), _fmt(r["floor_ms"], 4),
                       _fmt(r["over_floor"], 1), _fmt(r["graph_over_floor"], 1)]
                      for r in decode])
    text += "\n"
    write_results(out_dir, rows, {}, text, plot)
    return text


def plot(rows: List[dict], path: Path) -> None:
    """Decode time per token and its floor, per (shape, B), log scale."""
    sel = [r for r in rows if r["kind"] == "decode"]
    if sel:
        bar_plot([f"{r['shape']} B={r['B']}" for r in sel],
                 [("eager", [r["ms_per_token"] for r in sel]),
                  ("CUDA graph", [r["graph_ms_per_token"] for r in sel]),
                  ("floor", [r["floor_ms"] for r in sel])],
                 "mamba3_mimo_step: time per token against moving the state once", path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = arg_parser("mamba3_mimo.bench_sequences", "Benchmark packed batches and decoding.",
                   "bench/sequences")
    opts = p.parse_args(argv)
    require_gpu("mamba3_mimo.bench_sequences")
    keep = [k for k in (opts.shapes or "").split(",") if k]
    shapes = [s for s in official_shapes() if s.name in SHAPES
              and (not keep or any(k in s.name for k in keep))]
    meta = run_meta()
    bar = progress(len(shapes) * (1 + len(DECODE_BATCHES)))
    rows: List[Dict] = []
    for shape in shapes:
        rows.append({**meta, **packed_case(shape, opts.rounds, opts.rep_ms)})
        bar.update()
        for B in DECODE_BATCHES:
            rows.append({**meta, **decode_case(shape, B, opts.rounds, opts.rep_ms)})
            bar.update()
    bar.close()
    print(report(rows, meta, opts.rounds, opts.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
