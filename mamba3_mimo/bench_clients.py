"""GPU benchmark of flash-linear-attention's Mamba3 layer (is_mimo=True) on this package's
operator, switched in by `compat.install()`: `python -m mamba3_mimo.bench_clients`.

The configuration upstream's layer was measured at (data/fla_layer_upstream_h200.json: hidden
1024, expand 2, head_dim 64 so 32 heads, state 128, R = 4, chunk 16, B = 4, S = 2048), with
and without the layer's output-projection norm; fp32 parameters under bf16 autocast. Per
configuration: the layer's forward and forward+backward (do_bench medians over several rounds),
the peak memory forward+backward allocates above the inputs and the parameters' gradients, the
first call's time (compilation included: run it with a fresh TRITON_CACHE_DIR), the share of
the forward+backward's device time in this package's kernels, and the time per generated token
of the layer's cached decode step at B = 1 and 64. Writes results.json, results.md and
results.png.
"""
from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from . import compat
from .bench import (_fmt, arg_parser, bar_plot, first_call_s, kernel_ms, md_table,
                    peak_extra_mib, progress, require_gpu, run_meta, write_results)

DEFAULT_UPSTREAM = Path(__file__).resolve().parent / "data" / "fla_layer_upstream_h200.json"
LAYER = dict(hidden_size=1024, state_size=128, expand=2, head_dim=64, is_mimo=True, mimo_rank=4,
             chunk_size=16)
B, S = 4, 2048
DECODE_BATCHES = (1, 64)
DECODE_PREFILL = 128
# this package's kernels, by the names the profiler reports
OUR_KERNELS = ("chunk_forward_kernel", "chunk_grads_qk_kernel", "chunk_grads_v_kernel",
               "state_grad_kernel", "state_scan_kernel", "chunk_increment_kernel",
               "state_passing_kernel", "angle_sum_kernel", "decay_pieces_kernel",
               "step_terms_kernel")


def fla_layer_module():
    """fla.layers.mamba3 with upstream's paths answered by this package (imported, or
    re-imported, after compat.install())."""
    if not compat.install():
        raise SystemExit("error: a real mamba_ssm is installed; this benchmark times ours "
                         "(compat.install(force=True) would replace it)")
    module = sys.modules.get("fla.layers.mamba3")
    return importlib.reload(module) if module else importlib.import_module("fla.layers.mamba3")


def _median(fn, rounds: int, rep_ms: int, leaves=None) -> float:
    from triton.testing import do_bench
    return statistics.median(do_bench(fn, rep=rep_ms, grad_to_none=leaves, return_mode="median")
                             for _ in range(rounds))


def layer_case(module, outproj_norm: bool, rounds: int, rep_ms: int) -> dict:
    """The layer's times, memory and kernel share at one configuration."""
    torch.manual_seed(0)
    layer = module.Mamba3(is_outproj_norm=outproj_norm, **LAYER).cuda()
    x = torch.randn(B, S, LAYER["hidden_size"], device="cuda")
    dout = torch.randn_like(x)
    params = list(layer.parameters())

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(x)[0]

    def fwd_bwd():
        fwd().backward(dout)

    row = dict(kind="layer", outproj_norm=outproj_norm, first_call_s=first_call_s(fwd_bwd))
    row["fwd_ms"] = _median(fwd, rounds, rep_ms)
    row["fwd_bwd_ms"] = _median(fwd_bwd, rounds, rep_ms, params)
    row["peak_extra_mib"] = peak_extra_mib(fwd_bwd)
    kernels = kernel_ms(fwd_bwd)
    ours = sum(ms for name, ms in kernels.items() if name.startswith(OUR_KERNELS))
    row["kernels_ms"], row["our_kernels_ms"] = sum(kernels.values()), ours
    row["our_share"] = ours / row["kernels_ms"]
    return row


def decode_case(module, batch: int, rounds: int, rep_ms: int) -> dict:
    """Time per token of the layer's cached decode step after a prefill, batch entries `batch`
    (the layer's `step`: its projections, upstream's rotary step and step function)."""
    torch.manual_seed(0)
    layer = module.Mamba3(**LAYER).cuda()
    x = torch.randn(batch, DECODE_PREFILL + 1, LAYER["hidden_size"], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        _, state = layer.cuda_kernels_forward(x[:, :DECODE_PREFILL], use_cache=True)
        token = x[:, DECODE_PREFILL:]
        ms = _median(lambda: layer.step(token, *state), rounds, rep_ms)
    return dict(kind="decode", B=batch, ms_per_token=ms)


def load_upstream(path: Path) -> Dict[bool, dict]:
    """Upstream's layer rows by outproj_norm."""
    return {r["outproj_norm"]: r for r in json.loads(path.read_text())["rows"]}


def report(rows: List[dict], upstream: Dict[bool, dict], meta: dict, rounds: int,
           out_dir: Path) -> str:
    layers = [r for r in rows if r["kind"] == "layer"]
    decode = [r for r in rows if r["kind"] == "decode"]
    for r in layers:
        up = upstream.get(r["outproj_norm"], {})
        r["upstream_fwd_ms"], r["upstream_fwd_bwd_ms"] = up.get("fwd_ms"), up.get("fwd_bwd_ms")
        r["upstream_peak_extra_mib"] = up.get("peak_extra_mib")
        r["upstream_first_call_s"] = up.get("first_call_s")
        r["speedup_fwd_bwd"] = (up["fwd_bwd_ms"] / r["fwd_bwd_ms"]) if up else None
    text = (f"# flash-linear-attention's Mamba3 layer on mamba3_mimo\n\n{meta['date']}, "
            f"{meta['gpu']}, commit {meta['git_commit']}, torch {meta['torch']}, triton "
            f"{meta['triton']}; hidden 1024, 32 heads of 64, state 128, R = 4, chunk 16, B = {B}, "
            f"S = {S}, fp32 parameters under bf16 autocast; median of {rounds} round(s) of "
            "triton.testing.do_bench medians, ms; upstream: the same layer on upstream's TileLang "
            "operator (data/fla_layer_upstream_h200.json).\n\n")
    text += md_table(
        ["outproj norm", "fwd ms", "upstream", "fwd+bwd ms", "upstream", "x upstream",
         "peak MiB", "upstream", "first call s", "upstream", "our kernels' share"],
        [[str(r["outproj_norm"]), _fmt(r["fwd_ms"]), _fmt(r["upstream_fwd_ms"]),
          _fmt(r["fwd_bwd_ms"]), _fmt(r["upstream_fwd_bwd_ms"]), _fmt(r["speedup_fwd_bwd"], 2),
          _fmt(r["peak_extra_mib"], 0), _fmt(r["upstream_peak_extra_mib"], 0),
          _fmt(r["first_call_s"], 1), _fmt(r["upstream_first_call_s"], 1),
          _fmt(r["our_share"], 2)] for r in layers])
    text += ("\n\n### Generation\n\ntime per token of the layer's cached decode step (its "
             f"projections and the two decode functions) after a prefill of {DECODE_PREFILL} "
             "tokens, under bf16 autocast.\n\n")
    text += md_table(["B", "ms per token"], [[str(r["B"]), _fmt(r["ms_per_token"], 4)]
                                             for r in decode])
    text += "\n"
    write_results(out_dir, rows, {}, text, plot)
    return text


def plot(rows: List[dict], path: Path) -> None:
    """The layer's forward and forward+backward, ours against upstream's."""
    sel = [r for r in rows if r["kind"] == "layer" and r.get("upstream_fwd_bwd_ms")]
    if sel:
        labels = [("outproj norm" if r["outproj_norm"] else "plain") + f" {t}"
                  for r in sel for t in ("fwd", "fwd+bwd")]
        bar_plot(labels, [("ours", [r[k] for r in sel for k in ("fwd_ms", "fwd_bwd_ms")]),
                          ("upstream", [r[k] for r in sel
                                        for k in ("upstream_fwd_ms", "upstream_fwd_bwd_ms")])],
                 "flash-linear-attention Mamba3 layer (MIMO): ms", path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = arg_parser("mamba3_mimo.bench_clients",
                   "Benchmark flash-linear-attention's Mamba3 layer on this package.",
                   "bench/clients", DEFAULT_UPSTREAM, shapes=False)
    opts = p.parse_args(argv)
    require_gpu("mamba3_mimo.bench_clients")
    module = fla_layer_module()
    meta = run_meta()
    bar = progress(2 + len(DECODE_BATCHES))
    rows: List[dict] = []
    t0 = time.perf_counter()
    for outproj_norm in (False, True):
        rows.append({**meta, **layer_case(module, outproj_norm, opts.rounds, opts.rep_ms)})
        bar.update()
    for batch in DECODE_BATCHES:
        rows.append({**meta, **decode_case(module, batch, opts.rounds, opts.rep_ms)})
        bar.update()
    bar.close()
    print(report(rows, load_upstream(opts.upstream), meta, opts.rounds, opts.out))
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
