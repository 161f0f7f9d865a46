"""GPU benchmark of context parallelism, `mamba3_mimo(..., context_parallel_group=...)`:
`python -m mamba3_mimo.bench_context_parallel [--worlds 1,2,4] [--lengths 65536,...]`.

One sequence (B = 1) of N128_P64_R4_C16 (H = 16, G = 1, bf16, Z and D on) split into equal
contiguous slices over W ranks, one process per GPU, spawned here and joined in an NCCL group:
- strong scaling: each total length split over each W;
- weak scaling: each length per rank (a sequence W times as long).
Per case: the forward+backward time per step (the slowest rank's, median over the iterations;
every rank starts each one together), tokens per second, the peak memory per GPU above its
inputs and their gradients, and the combine step alone on the same group (the summaries'
all-gather and fold of the forward, the all-reduce of their gradients of the backward). A case
whose memory does not fit one GPU is reported as such (several ranks: the run fails). The steps
are timed by the wall clock between barriers, not by do_bench, which would run a different number
of calls on each rank (each call holds collectives). Writes results.json, results.md and
results.png.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .bench import (_fmt, arg_parser, bar_plot, grad_leaves, md_table, require_gpu, run_meta,
                    write_results)
from .inputs import operator_inputs
from .phases.context_parallel import FIELDS, entering_state, flatten, unflatten
from .phases.operator import mamba3_mimo
from .problem import Shape

SHAPE = Shape(1, 0, 16, 1, 128, 64, 4, 16)  # N128_P64_R4_C16, H = 16, one sequence (S per case)
LENGTHS = (1 << 16, 1 << 18, 1 << 20)  # strong scaling: total steps
PER_RANK = (1 << 16, 1 << 18)  # weak scaling: steps per rank
COMBINE_ITERATIONS = 20


def slice_inputs(shape: Shape, S: int, device, seed: int) -> Dict[str, object]:
    """A rank's slice of S steps as `mamba3_mimo` takes it (inputs.operator_inputs, bf16, drawn
    on the device)."""
    return operator_inputs(Shape(1, S, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C,
                                 shape.rotary_dim_divisor), torch.bfloat16, device=device,
                           seed=seed, drawn_on_device=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: List[float], device) -> List[float]:
    """Each iteration's time on the slowest rank (all_reduce MAX), in ms."""
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [x * 1e3 for x in t.tolist()]


def _timed(fn, iterations: int, device) -> List[float]:
    """fn's wall time per call on this rank, s, every call started by all ranks together."""
    out = []
    for _ in range(iterations):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def step_case(shape: Shape, total: int, rank: int, world: int, device,
              iterations: int) -> dict:
    """One sequence of `total` steps over the group: forward+backward of this rank's slice
    (equal slices, the last one taking the remainder), the peak memory above its inputs and their
    gradients (the largest over the ranks; None off a GPU) and the slowest rank's median time.
    Every rank returns the same row."""
    S = total // world if rank < world - 1 else total - (world - 1) * (total // world)
    args = slice_inputs(shape, S, device, seed=rank)
    leaves = grad_leaves(args)
    dout = torch.randn(args["V"].shape, device=device, dtype=torch.bfloat16)
    group = dist.group.WORLD if world > 1 else None

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        mamba3_mimo(**args, context_parallel_group=group).backward(dout)

    fwd_bwd()  # compiles where needed
    peak = -1.0
    if torch.device(device).type == "cuda":
        for x in leaves:
            x.grad = None
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd()
        _sync(device)
        grads = sum(x.grad.numel() * x.grad.element_size() for x in leaves if x.grad is not None)
        peak = (torch.cuda.max_memory_allocated(device) - base - grads) / 2**20
    step_ms = statistics.median(_slowest(_timed(fwd_bwd, iterations, device), device))
    peaks = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return dict(world=world, total_steps=total, steps_per_rank=total // world,
                fwd_bwd_ms=step_ms, tokens_per_s=total / step_ms * 1e3,
                peak_mib_per_gpu=None if peaks.item() < 0 else peaks.item())


def combine_ms(shape: Shape, world: int, device, iterations: int) -> Optional[float]:
    """The combine step alone, ms (the slowest rank's median): the forward's all-gather of one
    summary per rank and this rank's fold of those before it, and the backward's all-reduce of
    the gathered summaries' gradients. None for one rank (no combine)."""
    if world == 1:
        return None
    H, R, N, P, RD = shape.H, shape.R, shape.N, shape.P, shape.RD
    f32 = dict(device=device, dtype=torch.float32)
    sizes = dict(angle=(1, H, RD), state=(1, H, P, N), k=(1, R, H, N), v=(1, H, P),
                 decay=(1, H), shift=(1, H))
    like = {name: torch.zeros(sizes[name], **f32) for name in FIELDS}
    flat = torch.randn(flatten(like).numel(), **f32) * 0.1
    mimo_v = torch.randn(H, R, P, **f32)
    rank = dist.get_rank()

    def combine():
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        if rank > 0:
            entering_state([unflatten(row, like) for row in parts[:rank]], mimo_v)
        grad = torch.stack(parts)
        dist.all_reduce(grad)

    combine()
    return statistics.median(_slowest(_timed(combine, iterations, device), device))


def _worker(rank: int, world: int, totals: List[int], shape: Shape, backend: str, device: str,
            iterations: int, folder: str) -> None:
    """One rank of a group of `world`: every total length, then (rank 0) the rows into folder."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)
    try:
        rows = []
        combine = combine_ms(shape, world, device, COMBINE_ITERATIONS)
        for total in totals:
            try:
                row = step_case(shape, total, rank, world, device, iterations)
            except torch.cuda.OutOfMemoryError:
                # with several ranks a failed rank would leave the others in a collective
                if world > 1:
                    raise
                row = dict(world=1, total_steps=total, steps_per_rank=total, fwd_bwd_ms=None,
                           tokens_per_s=None, peak_mib_per_gpu=None, error="out of memory")
                torch.cuda.empty_cache()
            rows.append(dict(row, combine_ms=combine))
        if rank == 0:
            (Path(folder) / "rows.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run(worlds: Sequence[int], lengths: Sequence[int], per_rank: Sequence[int],
        shape: Shape = SHAPE, backend: str = "nccl", device: str = "cuda",
        iterations: int = 3) -> List[dict]:
    """Every world size W in its own group of W spawned processes, over the total lengths of
    strong scaling (`lengths`) and of weak scaling (W x `per_rank`), each once: the rows."""
    rows = []
    for world in worlds:
        totals = sorted(set(lengths) | {n * world for n in per_rank})
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(world, totals, shape, backend, device, iterations, folder),
                     nprocs=world, join=True)
            rows += json.loads((Path(folder) / "rows.json").read_text())
    return rows


def scaling(rows: List[dict], lengths: Sequence[int], per_rank: Sequence[int]
            ) -> Tuple[List[dict], List[dict]]:
    """(strong, weak): the rows of strong scaling (a total of `lengths` over each W) with their
    speed-up against one GPU on the same total and efficiency = speed-up / W, and those of weak
    scaling (W x a length of `per_rank`) with efficiency = one GPU's time on a slice's length /
    this time; with the combine step's share of a step."""
    one = {r["total_steps"]: r["fwd_bwd_ms"] for r in rows if r["world"] == 1}

    def with_ratios(r: dict, base_steps: int, strong: bool) -> dict:
        base, ms = one.get(base_steps), r["fwd_bwd_ms"]
        speedup = base / ms if base and ms else None
        eff = speedup / r["world"] if strong and speedup else speedup
        share = r["combine_ms"] / ms if ms and r.get("combine_ms") is not None else None
        return dict(r, speedup=speedup if strong else None, efficiency=eff,
                    combine_share=share)

    strong = [with_ratios(r, r["total_steps"], True) for r in rows
              if r["total_steps"] in lengths]
    weak = [with_ratios(r, r["steps_per_rank"], False) for r in rows
            if r["steps_per_rank"] in per_rank and r["total_steps"] == r["steps_per_rank"]
            * r["world"]]
    return strong, weak


def _table(rows: List[dict]) -> str:
    lines = []
    for r in rows:
        peak = r["peak_mib_per_gpu"]
        lines.append([f"{r['total_steps']:,}", str(r["world"]), f"{r['steps_per_rank']:,}",
                      _fmt(r["fwd_bwd_ms"], 2),
                      "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
                      _fmt(r["speedup"], 2), _fmt(r["efficiency"], 2),
                      _fmt(None if peak is None else peak / 1024, 2), _fmt(r["combine_ms"]),
                      _fmt(r["combine_share"], 4), r.get("error", "")])
    return md_table(["total steps", "GPUs", "steps per GPU", "fwd+bwd ms", "tokens/s",
                     "speed-up", "efficiency", "peak GiB per GPU", "combine ms",
                     "combine share", "note"], lines)


def report(rows: List[dict], meta: dict, out_dir: Path, lengths: Sequence[int],
           per_rank: Sequence[int], iterations: int, shape: Shape = SHAPE) -> str:
    """results.md's text (and results.json, results.png in out_dir) of run's rows."""
    strong, weak = scaling(rows, lengths, per_rank)
    text = (f"# mamba3_mimo context parallelism benchmark\n\n{meta['date']}, {meta['gpu']}, "
            f"commit {meta['git_commit']}, torch {meta['torch']}, triton {meta['triton']}; one "
            f"sequence of {shape.name}, H={shape.H} G={shape.G}, bf16, Z and D on, split in "
            "equal slices over the GPUs (NCCL); forward+backward per step, the slowest GPU's "
            f"median of {iterations} steps; peak: above each GPU's inputs and their gradients; "
            "combine: the summaries' all-gather and fold and the backward's all-reduce alone, "
            "and its share of a step.\n\n### Strong scaling (one sequence over more GPUs)\n\n")
    text += _table(strong)
    text += "\n\n### Weak scaling (the same steps per GPU)\n\n" + _table(weak) + "\n"
    write_results(out_dir, rows, {}, text, plot)
    return text


def plot(rows: List[dict], path: Path) -> None:
    """Tokens per second per (total steps, GPUs)."""
    sel = [r for r in rows if r.get("tokens_per_s")]
    if sel:
        bar_plot([f"{r['total_steps'] // 1024}k steps, {r['world']} GPU" for r in sel],
                 [("tokens/s", [r["tokens_per_s"] for r in sel])],
                 "mamba3_mimo context parallelism: tokens per second", path)


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = arg_parser("mamba3_mimo.bench_context_parallel",
                   "Benchmark one long sequence split across GPUs (--rounds: timed steps per "
                   "case).", "bench/context_parallel", shapes=False, do_bench=False)
    p.add_argument("--worlds", default="", help="numbers of GPUs, comma-separated (default: "
                   "1, 2, 4 up to the GPUs present)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                   help="strong scaling's total steps, comma-separated")
    p.add_argument("--per-rank", default=",".join(map(str, PER_RANK)),
                   help="weak scaling's steps per GPU, comma-separated")
    opts = p.parse_args(argv)
    require_gpu("mamba3_mimo.bench_context_parallel")
    n_gpus = torch.cuda.device_count()
    worlds = _ints(opts.worlds) or [w for w in (1, 2, 4, 8) if w <= n_gpus]
    if max(worlds) > n_gpus:
        raise SystemExit(f"error: --worlds {opts.worlds} needs {max(worlds)} GPUs, "
                         f"{n_gpus} present")
    lengths, per_rank = _ints(opts.lengths), _ints(opts.per_rank)
    meta = run_meta()
    rows = [{**meta, **r} for r in run(worlds, lengths, per_rank, iterations=opts.rounds)]
    print(report(rows, meta, opts.out, lengths, per_rank, opts.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
