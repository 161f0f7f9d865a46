"""The benchmark harness on the CPU: its HBM byte count against BENCHMARK.md's floor table, one
config's measurement (every candidate run, the plan named) and its reporting loop (JSON,
markdown, the per-row partial file), with the GPU timing replaced."""
import json

import pytest
import torch
import triton.testing

from conftest import DEVICE
from mamba3_mimo import bench, configs
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes

# BENCHMARK.md, "The floor": MB with bf16 and with fp32 outputs, Z gate on
FLOOR_MB = {
    "N16_P64_R4_C8": (115, 170), "N32_P64_R4_C16": (123, 178), "N64_P64_R4_C16": (165, 253),
    "N128_P64_R4_C16": (249, 404), "N256_P64_R4_C8": (681, 1239),
    "N64_P128_R4_C16": (300, 472), "N128_P32_R4_C16": (149, 228),
    "N128_P128_R4_C8": (715, 1289), "N128_P64_R8_C8": (409, 711),
    "N128_P64_R2_C32": (179, 264), "N128_P64_R1_C64": (157, 208),
}


@pytest.mark.parametrize("shape", official_shapes(), ids=lambda s: s.name)
def test_hbm_bytes_match_benchmark_md(shape):
    for out, mb in zip((torch.bfloat16, torch.float32), FLOOR_MB[shape.name]):
        got = bench.hbm_bytes(shape, out) / 1e6
        # BENCHMARK.md leaves out the tensors that do not grow with S (< 0.6 MB) and rounds
        assert abs(got - mb) <= 1.1, f"{shape.name} {out}: {got:.1f} MB, BENCHMARK.md {mb}"


def test_git_commit_prefers_the_callers_commit(monkeypatch):
    monkeypatch.setenv("MAMBA3_GIT_COMMIT", "abc1234")
    assert bench.git_commit() == "abc1234"


def test_report_loop_writes_results(tmp_path, monkeypatch):
    """main() over the quick grid with bench_config replaced by fixed timings: every config
    gives one row per candidate, the markdown has a table per (Z, output) group, and the
    partial rows file is gone once the report is written."""
    seen = []
    assert bench.CANDIDATES == ("stage0", "auto")

    def fake_config(cfg, rounds, with_stage0, upstream, bar, rep_ms, previous=None):
        assert previous is None  # no --previous
        seen.append(rep_ms)
        s = cfg.shape
        rows = []
        for n, ms in (("stage0", 4.0), ("auto", 1.0)):
            up = None if cfg.control else upstream.get((s.name, cfg.z))
            rows.append(dict(shape=s.name, label=cfg.label, control=cfg.control, B=s.B, S=s.S,
                             H=s.H, G=s.G, N=s.N, P=s.P, R=s.R, C=s.C, z=cfg.z, d_skip=True,
                             input_dtype="bf16", output_dtype=bench.DTYPE_NAMES[cfg.out],
                             candidate=n, plan=None, first_call_s=1.0, ms_rounds=[ms],
                             median_ms=ms, kernels_ms=0.8 if n == "auto" else None,
                             kernels_error=None, error=None, hbm_bytes=1, floor_ms=0.1,
                             upstream_ms=up, upstream_over_ms=up / ms if up else None,
                             stage0_over_ms=4.0 / ms, previous_over_ms=None,
                             ms_over_floor=ms / 0.1))
        bar.update(rounds + 1)
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench, "run_meta", lambda: dict(date="d", gpu="g", git_commit="c",
                                                        torch="t", triton="tr", python="p"))
    monkeypatch.setattr(bench, "bench_config", fake_config)
    assert bench.main(["--quick", "--rep-ms", "25", "--out", str(tmp_path)]) == 0
    n_cfgs = len(bench.bench_configs(None, (torch.bfloat16,)))
    assert seen == [25] * n_cfgs
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == len(bench.CANDIDATES) * n_cfgs
    assert [r["candidate"] for r in data["results"][:2]] == list(bench.CANDIDATES)
    assert not (tmp_path / "partial.jsonl").exists()
    md = (tmp_path / "results.md").read_text()
    assert md.count("### Z gate") == 2 and "geometric mean" in md
    assert "auto kernels ms" in md and "| 0.800 |" in md
    assert all(g["kernels_ms"] == pytest.approx(0.8) for g in data["geomean"])


class _Bar:
    def __init__(self):
        self.n, self.descriptions = 0, []

    def set_description(self, desc: str) -> None:
        self.descriptions.append(desc)

    def update(self, k: int = 1) -> None:
        self.n += k


def test_bench_config_runs_every_candidate(monkeypatch):
    """bench_config on one official config, its model dims at B=1, S=2C, H=2 (on the CPU through
    the interpreter) and the GPU's timing replaced by fixed times around real calls: one row per
    candidate in bench.CANDIDATES' order, none failed, each with its rounds and ratios, each
    round starting from the next candidate, and the production row naming the configs the rules
    prefer for the problem."""
    cfg = bench.Config(official_shapes()[0], True, torch.bfloat16)
    s = cfg.shape
    small = Shape(1, 2 * s.C, 2, 1, s.N, s.P, s.R, s.C)
    calls = []

    def inputs(shape, *args, device, **kwargs):
        assert shape == s and device == "cuda"
        return make_inputs(small, *args, device=DEVICE, **kwargs)

    def do_bench(fn, rep, return_mode):
        assert return_mode == "median"
        calls.append(fn.keywords["impl"])
        fn()
        return {"stage0": 4.0, "auto": 1.0}[fn.keywords["impl"]]

    monkeypatch.setattr(bench, "make_inputs", inputs)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(bench, "kernel_ms", lambda fn, calls=20: (fn(), {"k": 0.5, "j": 0.25})[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    bar, rounds = _Bar(), 2
    rows = bench.bench_config(cfg, rounds, True, {(s.name, True): 2.0}, bar, rep_ms=5)
    assert [r["candidate"] for r in rows] == list(bench.CANDIDATES)
    names = list(bench.CANDIDATES)
    assert calls == names + names[1:] + names[:1]
    assert bar.n == rounds + 1 and len(bar.descriptions) == 1
    args = make_inputs(small, torch.bfloat16, True, True, device=DEVICE)
    args.pop("adt")
    plan = configs.preferred(bench.problem_of(dict(args, output_dtype=cfg.out))).describe()
    by = {r["candidate"]: r for r in rows}
    for name, ms in (("stage0", 4.0), ("auto", 1.0)):
        r = by[name]
        assert r["error"] is None and r["first_call_s"] is not None, r
        assert r["ms_rounds"] == [ms] * rounds and r["median_ms"] == ms
        assert r["upstream_ms"] == 2.0 and r["upstream_over_ms"] == pytest.approx(2.0 / ms)
        assert r["stage0_over_ms"] == pytest.approx(4.0 / ms)
        assert r["ms_over_floor"] == pytest.approx(ms / bench.floor_ms(s, cfg.out, True))
    assert by["auto"]["plan"] == plan and by["stage0"]["plan"] is None
    assert by["auto"]["kernels_ms"] == pytest.approx(0.75) and by["auto"]["kernels_error"] is None
    assert by["stage0"]["kernels_ms"] is None


def test_upstream_anchor_ships_with_the_package():
    """The benchmark's upstream anchor lies inside the package (package data in pyproject.toml),
    so that a non-editable install finds it, and has a row per official shape, Z on and off."""
    import pathlib
    package = pathlib.Path(bench.__file__).resolve().parent
    assert bench.DEFAULT_UPSTREAM.is_file() and package in bench.DEFAULT_UPSTREAM.parents
    anchor = bench.load_upstream(bench.DEFAULT_UPSTREAM)
    assert {(s.name, z) for s in official_shapes() for z in (True, False)} <= set(anchor)


# ---------------------------------------------------------------------------- the operator's

def test_operator_anchor_and_cases():
    """The operator benchmark's upstream figures ship with the package, one row per case it
    runs (the grid with Z on and off, the fused norm on two shapes)."""
    from mamba3_mimo import bench_operator as bo
    import pathlib
    package = pathlib.Path(bo.__file__).resolve().parent
    assert package in bo.DEFAULT_UPSTREAM.parents
    anchor = bo.load_upstream(bo.DEFAULT_UPSTREAM)
    todo = bo.cases(None)
    assert len(todo) == 2 * len(official_shapes()) + len(bo.NORM_SHAPES)
    assert {(c["shape"].name, c["z"], c["norm"]) for c in todo} == set(anchor)
    assert [c["shape"].name for c in bo.cases("N128_P64_R4")] == ["N128_P64_R4_C16"] * 3


def test_operator_report(tmp_path):
    """Ratios and geometric means of the operator benchmark's report, from rows with known
    times: ours twice as fast as upstream everywhere gives 2.00x in every column; a shape where
    upstream has kernel times only stays out of the means."""
    from mamba3_mimo import bench_operator as bo
    anchor = bo.load_upstream(bo.DEFAULT_UPSTREAM)
    rows = []
    for (name, z, norm), up in anchor.items():
        row = dict(shape=name, label=name, z=z, fused_norm=norm, upstream=up, errors={},
                   first_call_s=1.0, **{k: up[k] / 2 for k in bo.TIMES},
                   peak_extra_mib=(up["peak_extra_mib"] or 100) / 2)
        for key in bo.TIMES + ("peak_extra_mib",):
            row[f"upstream_over_{key}"] = (up[key] / row[key]) if up[key] else None
        rows.append(row)
    meta = dict(date="2026-12-03", gpu="test", git_commit="abc", torch="x", triton="y")
    text = bo.report(rows, meta, 1, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    for group in ("z_on", "z_off"):
        gm = data["geomean"][group]
        assert gm["shapes"] == len(official_shapes()) - 1  # N16: upstream's kernels only
        for k in bo.TIMES:
            assert gm[f"upstream_over_{k}"] == pytest.approx(2.0)
    assert "upstream: kernels only" in text and "geometric mean (10 shapes)" in text


def test_operator_benchmark_needs_a_gpu():
    from mamba3_mimo import bench_operator as bo
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bo.main(["--out", "/tmp/unused"])


# ---------------------------------------------------------------------------- sequences

def test_random_lengths():
    from mamba3_mimo.bench_sequences import random_lengths
    lengths = random_lengths(8192, 8, seed=3)
    assert len(lengths) == 8 and sum(lengths) == 8192 and min(lengths) >= 1
    assert lengths == random_lengths(8192, 8, seed=3) and len(set(lengths)) > 1


def test_sequences_report(tmp_path):
    """The sequences benchmark's report: the packed/dense ratio and the decode rows with their
    floors, in results.json and results.md."""
    from mamba3_mimo import bench_sequences as bs
    rows = [dict(kind="packed", shape="N128_P64_R4_C16", total_steps=8192, lengths=[8192],
                 dense_fwd_bwd_ms=2.0, packed_fwd_bwd_ms=2.2, packed_over_dense=1.1),
            dict(kind="decode", shape="N128_P64_R4_C16", B=16, ms_per_token=0.01,
                 graph_ms_per_token=0.006, floor_ms=0.002, over_floor=5.0, graph_over_floor=3.0)]
    meta = dict(date="2026-12-03", gpu="test", git_commit="abc", torch="x", triton="y")
    text = bs.report(rows, meta, 1, tmp_path)
    assert "| N128_P64_R4_C16 | 2.000 | 2.200 | 1.10 |" in text
    assert "| N128_P64_R4_C16 | 16 | 0.0100 | 0.0060 | 0.0020 | 5.0 | 3.0 |" in text
    assert json.loads((tmp_path / "results.json").read_text())["results"][1]["B"] == 16


def test_sequences_benchmark_needs_a_gpu():
    from mamba3_mimo import bench_sequences as bs
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bs.main(["--out", "/tmp/unused"])


# ---------------------------------------------------------------------------- clients

def test_clients_report(tmp_path):
    """The clients benchmark's report: ours against upstream's layer (the package's data file),
    the speed-up, the kernels' share and the decode rows, in results.json and results.md."""
    from mamba3_mimo import bench_clients as bc
    upstream = bc.load_upstream(bc.DEFAULT_UPSTREAM)
    assert upstream[False]["fwd_bwd_ms"] == pytest.approx(6.254, abs=1e-3)
    rows = [dict(kind="layer", outproj_norm=False, fwd_ms=0.5, fwd_bwd_ms=2.0, first_call_s=9.0,
                 peak_extra_mib=900.0, kernels_ms=1.9, our_kernels_ms=1.2, our_share=0.63),
            dict(kind="decode", B=64, ms_per_token=0.25)]
    meta = dict(date="2026-12-03", gpu="test", git_commit="abc", torch="x", triton="y")
    text = bc.report(rows, upstream, meta, 1, tmp_path)
    assert "| False | 0.500 | 1.311 | 2.000 | 6.254 | 3.13 | 900 | 1133 | 9.0 | 154.0 | 0.63 |" \
        in text
    assert "| 64 | 0.2500 |" in text
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["speedup_fwd_bwd"] \
        == pytest.approx(6.254112 / 2.0)


def test_clients_benchmark_needs_a_gpu():
    from mamba3_mimo import bench_clients as bc
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bc.main(["--out", "/tmp/unused"])


# ---------------------------------------------------------------------------- context parallelism

def test_context_parallel_report(tmp_path):
    """The context-parallel benchmark's tables: strong scaling's speed-up and efficiency against
    one GPU on the same total, weak scaling's efficiency against one GPU on a slice's length,
    the combine step's share; a one-GPU case out of memory shown as such."""
    from mamba3_mimo import bench_context_parallel as bcp
    rows = [dict(world=1, total_steps=1024, steps_per_rank=1024, fwd_bwd_ms=10.0,
                 tokens_per_s=102400.0, peak_mib_per_gpu=2048.0, combine_ms=None),
            dict(world=1, total_steps=4096, steps_per_rank=4096, fwd_bwd_ms=None,
                 tokens_per_s=None, peak_mib_per_gpu=None, combine_ms=None,
                 error="out of memory"),
            dict(world=2, total_steps=2048, steps_per_rank=1024, fwd_bwd_ms=12.5,
                 tokens_per_s=163840.0, peak_mib_per_gpu=2048.0, combine_ms=0.25),
            dict(world=4, total_steps=4096, steps_per_rank=1024, fwd_bwd_ms=16.0,
                 tokens_per_s=256000.0, peak_mib_per_gpu=1024.0, combine_ms=0.5)]
    meta = dict(date="2026-12-05", gpu="test", git_commit="abc", torch="x", triton="y")
    strong, weak = bcp.scaling(rows, (4096,), (1024,))
    assert [r["world"] for r in strong] == [1, 4] and strong[1]["speedup"] is None
    assert [r["world"] for r in weak] == [1, 2, 4]
    assert weak[1]["efficiency"] == pytest.approx(0.8) and weak[2]["combine_share"] == 0.5 / 16
    text = bcp.report(rows, meta, tmp_path, (1024, 4096), (1024,), 3)
    assert "| 1,024 | 1 | 1,024 | 10.00 | 102,400 | 1.00 | 1.00 | 2.00 | - | - |  |" in text
    assert "| 4,096 | 1 | 4,096 | - | - | - | - | - | - | - | out of memory |" in text
    assert "| 4,096 | 4 | 1,024 | 16.00 | 256,000 | - | 0.62 | 1.00 | 0.500 | 0.0312 |  |" in text
    assert json.loads((tmp_path / "results.json").read_text())["results"][2]["world"] == 2


def test_context_parallel_harness():
    """The benchmark's processes, timing and combine step end to end on a tiny shape: gloo ranks
    through the interpreter on the CPU (one and two ranks), one NCCL rank on a GPU (several
    ranks need several GPUs). Every row timed, the combine step where there are several
    ranks, the memory measured on the GPU."""
    from mamba3_mimo import bench_context_parallel as bcp
    from mamba3_mimo.problem import Shape
    on_gpu = DEVICE != "cpu"
    worlds, backend = ((1,), "nccl") if on_gpu else ((1, 2), "gloo")
    rows = bcp.run(worlds, (12,), (5,), shape=Shape(1, 0, 2, 1, 8, 4, 2, 4), backend=backend,
                   device=DEVICE, iterations=1)
    want = [(1, 5), (1, 12)] + ([] if on_gpu else [(2, 10), (2, 12)])
    assert [(r["world"], r["total_steps"]) for r in rows] == want
    for r in rows:
        assert r["fwd_bwd_ms"] > 0 and r["tokens_per_s"] > 0
        assert (r["combine_ms"] is not None) == (r["world"] > 1)
        assert (r["peak_mib_per_gpu"] is not None) == on_gpu


def test_context_parallel_benchmark_needs_a_gpu():
    from mamba3_mimo import bench_context_parallel as bcp
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bcp.main(["--out", "/tmp/unused"])
