"""The benchmark harness on the CPU: its HBM byte count against BENCHMARK.md's floor table, and
its reporting loop (JSON, markdown, the per-row partial file) with the GPU timing replaced."""
import json

import pytest
import torch

from mamba3_mimo import bench
from mamba3_mimo.inputs import official_shapes

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

    def fake_config(cfg, rounds, with_stage0, upstream, bar, rep_ms):
        seen.append(rep_ms)
        s = cfg.shape
        rows = []
        for n, ms in (("stage0", 4.0), ("chunked", 1.0), ("auto", 1.0)):
            up = None if cfg.control else upstream.get((s.name, cfg.z))
            rows.append(dict(shape=s.name, label=cfg.label, control=cfg.control, B=s.B, S=s.S,
                             H=s.H, G=s.G, N=s.N, P=s.P, R=s.R, C=s.C, z=cfg.z, d_skip=True,
                             input_dtype="bf16", output_dtype=bench.DTYPE_NAMES[cfg.out],
                             candidate=n, plan=None, first_call_s=1.0, ms_rounds=[ms],
                             median_ms=ms, kernels_ms=0.8 if n == "auto" else None,
                             kernels_error=None, error=None, hbm_bytes=1, floor_ms=0.1,
                             upstream_ms=up, upstream_over_ms=up / ms if up else None,
                             stage0_over_ms=4.0 / ms, ms_over_floor=ms / 0.1))
        bar.update(rounds + 1)
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench, "run_meta", lambda: dict(date="d", gpu="g", git_commit="c",
                                                        torch="t", triton="tr", python="p"))
    monkeypatch.setattr(bench, "bench_config", fake_config)
    assert bench.main(["--quick", "--rep-ms", "25", "--out", str(tmp_path)]) == 0
    n_cfgs = len(bench.configs(None, (torch.bfloat16,)))
    assert seen == [25] * n_cfgs
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == 3 * n_cfgs
    assert not (tmp_path / "partial.jsonl").exists()
    md = (tmp_path / "results.md").read_text()
    assert md.count("### Z gate") == 2 and "geometric mean" in md
    assert "auto kernels ms" in md and "| 0.800 |" in md
    assert all(g["kernels_ms"] == pytest.approx(0.8) for g in data["geomean"])
