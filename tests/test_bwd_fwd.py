"""The operator against the float64 golden: pairwise grid, official shapes, sequence tails and a
sweep over R, N, P and rotary_dim_divisor. The pairwise grid and the tails run every impl."""
import dataclasses
import itertools
import os

import pytest
import torch

from conftest import (DEVICE, DTYPE_IDS, IMPLS, ON_GPU, check_outputs, op_args, problem,
                      run_op, seed_for)
from mamba3_mimo import configs
from mamba3_mimo.configs import OutputConfig, StateConfig
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes, sweep_shapes
from mamba3_mimo.runtime.device import interpreter_active
from mamba3_mimo.reference import bwd_fwd_reference, decay_pieces

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


# ---------------------------------------------------------------------------- pairwise grid

PAIRWISE_FACTORS = {
    "B": (1, 2),
    "S": (32, 64),
    "H": (2, 4),
    "dtype": (FP16, BF16, FP32),
    "z_gate": (False, True),
    "d_skip": (False, True),
    "G": (1, 2),
}


def _pairs_of(row: dict, names):
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def all_pairs(factors: dict) -> list:
    """A deterministic all-pairs covering array, in-parameter-order (IPOG) style.

    Factors are taken most levels first; the first two give the full product. Each further
    factor gets, over the existing rows, the column of values that covers most of its uncovered
    pairs (exhaustive over columns, so for small grids only; the first column wins ties); pairs
    still uncovered fill a free slot of an added row or add a row. Free slots left at the end
    take the factor's first value.
    """
    names = sorted(factors, key=lambda n: -len(factors[n]))
    a, b = names[:2]
    rows = [{a: va, b: vb} for va in factors[a] for vb in factors[b]]
    for i, name in enumerate(names[2:], 2):
        prev = names[:i]
        assert len(factors[name]) ** len(rows) <= 1 << 16, "grid too large for this generator"
        want = {(p, vp, v) for p in prev for vp in factors[p] for v in factors[name]}

        def covered(column):
            return {(p, r[p], v) for r, v in zip(rows, column) for p in prev if r[p] is not None}

        best = max(itertools.product(factors[name], repeat=len(rows)),
                   key=lambda column: len(covered(column) & want))
        for r, v in zip(rows, best):
            r[name] = v
        for p, vp, v in sorted(want - covered(best), key=lambda t: (
                prev.index(t[0]), factors[t[0]].index(t[1]), factors[name].index(t[2]))):
            free = [r for r in rows if r[name] == v and r[p] is None]
            if free:
                free[0][p] = vp
            else:
                rows.append({**{q: None for q in prev}, p: vp, name: v})
    return [{n: factors[n][0] if r[n] is None else r[n] for n in factors} for r in rows]


PAIRWISE = all_pairs(PAIRWISE_FACTORS)
PAIRWISE_MODEL = dict(N=32, P=32, R=2, C=16)


def _row_id(r):
    return (f"B{r['B']}_S{r['S']}_H{r['H']}_G{r['G']}_{DTYPE_IDS[r['dtype']]}"
            f"_z{int(r['z_gate'])}_d{int(r['d_skip'])}")


def test_pairwise_grid_covers_all_pairs():
    names = list(PAIRWISE_FACTORS)
    want = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
            for va in PAIRWISE_FACTORS[a] for vb in PAIRWISE_FACTORS[b]}
    got = set().union(*(_pairs_of(r, names) for r in PAIRWISE))
    assert got == want
    full = 1
    for values in PAIRWISE_FACTORS.values():
        full *= len(values)
    assert len(PAIRWISE) < full / 4, f"{len(PAIRWISE)} rows: not much of a pairwise design"
    assert PAIRWISE == all_pairs(PAIRWISE_FACTORS), "the generator must be deterministic"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("row", PAIRWISE, ids=_row_id)
def test_pairwise(row, impl):
    shape = Shape(row["B"], row["S"], row["H"], row["G"], **PAIRWISE_MODEL)
    args, golden, bench = problem(shape, row["dtype"], row["z_gate"], row["d_skip"])
    check_outputs(run_op(args, impl), golden, bench, row["dtype"])


# ---------------------------------------------------------------------------- official shapes

QUICK_NAMES = ("N16_P64_R4_C8", "N256_P64_R4_C8", "N64_P128_R4_C16", "N128_P64_R2_C32",
               "N128_P64_R1_C64")


def _official(names=None):
    if ON_GPU:
        shapes = official_shapes(B=4, S=2048, H=16, G=1)
    else:  # keep N, P, R, C; two chunks of one (b, h) pair so the interpreter finishes
        shapes = [Shape(1, 2 * s.C, 1, 1, s.N, s.P, s.R, s.C) for s in official_shapes()]
    return [s for s in shapes if names is None or s.name in names]


@pytest.mark.parametrize("z_gate", [True, False], ids=["z", "noz"])
@pytest.mark.parametrize("shape", _official(QUICK_NAMES), ids=lambda s: s.name)
def test_official_quick(shape, z_gate):
    """Five official shapes (full size on a GPU, cut B, S, H on the interpreter), bf16 like the
    benchmark."""
    args, golden, bench = problem(shape, BF16, z_gate, True)
    check_outputs(run_op(args), golden, bench, BF16)


@pytest.mark.skipif(os.environ.get("MAMBA3_FULL_GRID") != "1" or not ON_GPU,
                    reason="all eleven official shapes at full size: set MAMBA3_FULL_GRID=1, GPU")
@pytest.mark.parametrize("z_gate", [True, False], ids=["z", "noz"])
@pytest.mark.parametrize("shape", _official(), ids=lambda s: s.name)
def test_official_full(shape, z_gate):
    args, golden, bench = problem(shape, BF16, z_gate, True)
    check_outputs(run_op(args), golden, bench, BF16)
    problem.cache_clear()  # full-size goldens are large


# ---------------------------------------------------------------------------- tails

TAIL_DTYPE = {33: FP32, 40: BF16, 48: FP16, 50: FP32}  # one dtype per S keeps the product small


def pad_to_chunks(inputs: dict, C: int) -> dict:
    """The caller's padding of SPEC section 4, built independently of the package: sequence
    inputs get zeros, adt gets zeros (so da_cs keeps its last valid value), and da_cs, da_cs_rev,
    segsum are rebuilt for whole chunks."""
    S = inputs["q"].shape[1]
    pad = -S % C
    out = dict(inputs)
    for name in ("dout", "q", "k", "v", "angles", "z"):
        x = inputs[name]
        if x is not None:
            out[name] = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
    for name in ("dt", "trap", "adt"):
        out[name] = torch.nn.functional.pad(inputs[name], (0, pad))
    out["da_cs"], out["da_cs_rev"], out["segsum"] = decay_pieces(out["adt"], C)
    return out


def _assert_valid_part_equal(a, b, S: int):
    """Outputs of a run on caller-padded input (a) vs the plain run (b): equal to fp32 rounding on
    the valid steps."""
    names = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
    seq_axis = {"qk_dot": 2, "dz": 1}
    for name, x, y in zip(names, a, b):
        if y is None:
            assert x is None
            continue
        if name in seq_axis:
            x = x.narrow(seq_axis[name], 0, S)
        assert x.shape == y.shape, name
        scale = y.double().abs().max().item()
        diff = (x.double() - y.double()).abs().max().item()
        assert diff <= 1e-5 * scale, f"{name}: padded-by-caller run differs by {diff:.3e} " \
                                     f"(max |value| {scale:.3e})"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("C", [16, 32])
@pytest.mark.parametrize("S", sorted(TAIL_DTYPE))
def test_tail(S, C, impl):
    """S not a multiple of C: against the reference on the unpadded input (it handles a partial
    chunk natively), and against a run on the caller-padded input."""
    dtype = TAIL_DTYPE[S]
    shape = Shape(1, S, 2, 1, 16, 16, 2, C)
    inputs = make_inputs(shape, dtype, True, True, device=DEVICE, seed=seed_for(shape, dtype))
    args = op_args(inputs)
    golden = bwd_fwd_reference(**args, dtype=torch.float64)
    bench = bwd_fwd_reference(**args, dtype=torch.float32)
    outs = run_op(args, impl)
    check_outputs(outs, golden, bench, dtype)
    if S % C:
        padded = op_args(pad_to_chunks(inputs, C))
        _assert_valid_part_equal(run_op(padded, impl), outs, S)


# ---------------------------------------------------------------------------- sweep

def _shape_id(s):
    return f"{s.name}_rdd{s.rotary_dim_divisor}_B{s.B}_S{s.S}_H{s.H}_G{s.G}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", sweep_shapes(), ids=_shape_id)
def test_sweep(shape, impl):
    dtype = BF16
    args, golden, bench = problem(shape, dtype, True, True)
    check_outputs(run_op(args, impl), golden, bench, dtype)


# ---------------------------------------------------------------------------- large chunks


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R, C, S, sub", [(4, 64, 150, 16), (8, 16, 70, 8), (3, 48, 96, 16),
                                          (2, 65, 130, 13)],
                         ids=["R4_C64_tail", "R8_C16_tail", "R3_C48", "R2_C65"])
def test_large_chunks(R, C, S, sub, impl):
    """Chunks beyond the kernels' 64-row tiles (configs.TILE_ROWS) run as sub-chunks of the
    largest divisor of C that fits (bwd_fwd.split_chunks); the outputs, states at the model's
    chunk boundaries included, match the golden computed with the model's own chunks."""
    assert configs.kernel_chunk_size(C, R) == sub
    shape = Shape(1, S, 2, 1, 16, 16, R, C)
    assert configs.preferred(_problem(shape)).describe().endswith(f"; sub-chunks of {sub}")
    args, golden, bench = problem(shape, FP32, True, True)
    check_outputs(run_op(args, impl), golden, bench, FP32)


def test_kernel_chunk_size():
    """Every official shape runs its own chunks (tiles of 32-64 rows); larger tiles are split
    down to 64 rows, and an R whose one-step tile exceeds 64 rows runs one step per tile."""
    for s in official_shapes():
        assert configs.kernel_chunk_size(s.C, s.R) == s.C, s.name
    cases = {(16, 8): 8, (32, 4): 16, (64, 1): 64, (128, 1): 64, (12, 8): 6, (7, 16): 1,
             (16, 72): 1, (5, 128): 1}
    for (C, R), sub in cases.items():
        assert configs.kernel_chunk_size(C, R) == sub, (C, R)


# ---------------------------------------------------------------------------- dtypes of outputs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,output_dtype,trap_dtype", [
    (BF16, BF16, None), (FP16, FP16, FP32), (FP32, BF16, None), (BF16, FP32, FP32),
    (BF16, FP16, None), (FP16, BF16, None)],
    ids=["bf16-out_bf16", "fp16-out_fp16-trap_fp32", "fp32-out_bf16", "bf16-trap_fp32",
         "bf16-out_fp16", "fp16-out_bf16"])
def test_output_and_trap_dtypes(dtype, output_dtype, trap_dtype, impl):
    """output_dtype sets states, qk_dot, dz; trap may come in fp32 or the input dtype."""
    shape = Shape(1, 40, 2, 1, 16, 16, 2, 16)
    args, golden, bench = problem(shape, dtype, True, True, trap_dtype=trap_dtype)
    outs = run_op(args, impl, output_dtype=output_dtype)
    check_outputs(outs, golden, bench, dtype, output_dtype)


# ---------------------------------------------------------------------------- output tiles


@pytest.mark.parametrize("U, C, S", [(2, 16, 75), (3, 16, 75), (8, 4, 19)],
                         ids=["U2", "U3", "U8_one_tile"])
@pytest.mark.parametrize("output_dtype", [FP32, torch.bfloat16], ids=["out_fp32", "out_bf16"])
def test_output_tiles_of_several_chunks(U, C, S, output_dtype):
    """chunk_output with tiles of U chunks over 5 chunks and a tail: the last tile is partial
    (or, for U = 8, the only one; C = 4 keeps that tile at 64 rows), cross-chunk weights come
    from step_terms' LOG_Q / LOG_K, and with a narrower output the fp32 state copy exists only
    at tile starts. configs.tile_chunks follows C and R, so most test shapes would see only its
    own choice."""
    shape = Shape(2, S, 2, 1, 16, 16, 2, C)
    with configs.override(tile_chunks=U):
        assert configs.constants(_problem(shape)).U == U  # the forced U reaches the kernels
        for z_gate in (True, False):
            args, golden, bench = problem(shape, FP32, z_gate, True)
            check_outputs(run_op(args, output_dtype=output_dtype), golden, bench, FP32,
                          output_dtype)


# ---------------------------------------------------------------------------- state forms


@pytest.mark.parametrize("shape, dtype, output_dtype", [
    (Shape(2, 37, 4, 2, 16, 24, 2, 8), FP32, FP32),
    (Shape(1, 50, 2, 1, 32, 16, 4, 4), BF16, BF16),
    (Shape(1, 40, 2, 1, 16, 16, 2, 16), FP16, BF16),
    (Shape(1, 8, 2, 1, 16, 16, 2, 8), FP32, BF16)],
    ids=["gqa_tail_fp32", "U4_bf16", "fp16_keep_fp32", "one_chunk"])
def test_state_forms(shape, dtype, output_dtype):
    """The two state passes, the split increments + state passing and the fused scan (with one
    and two N-pair blocks), each match the golden and repeat bit for bit. (They need not agree
    bitwise with each other: on sm_90 the scan's 8-pair dot runs on mma.sync and the others on
    wgmma, which sum in different orders.) Cases: GQA with a tail and fp32 outputs (states hold
    the fp32 state), output tiles of U = 4 chunks with the rounded states, the fp32 copy at tile
    starts (fp16 inputs, bf16 outputs), and a single chunk (no loop)."""
    args, golden, bench = problem(shape, dtype, True, True)
    for scan, BJ in ((False, 16), (True, 8), (True, 16)):
        with configs.override(state=[StateConfig(scan=scan, BJ=BJ, BP=64)]):
            outs = run_op(args, output_dtype=output_dtype)
            check_outputs(outs, golden, bench, dtype, output_dtype)
            again = run_op(args, output_dtype=output_dtype)
        assert all(torch.equal(x, y) for x, y in zip(outs, again) if x is not None), (scan, BJ)


@pytest.mark.parametrize("dtype, output_dtype", [(FP32, FP32), (FP16, BF16), (BF16, BF16)],
                         ids=["fp32_alias", "fp16_keep_fp32", "bf16"])
def test_state_passing_groups(dtype, output_dtype):
    """state_passing loads DEPTH chunks' increments and decays before chaining them; the chain
    itself is unchanged, so every DEPTH gives the outputs of DEPTH = 1 bit for bit: groups that
    divide the 10 chained chunks or not (3), one group longer than them (16), with the states
    aliasing the increments (fp32 outputs) and with the fp32 copy at tile starts."""
    shape = Shape(1, 85, 2, 1, 16, 16, 2, 8)  # 11 chunks, the last one partial
    args, golden, bench = problem(shape, dtype, True, True)
    first = None
    for depth in (1, 3, 8, 16):
        split = StateConfig(scan=False, BJ=8, BP=64, DEPTH=depth)
        with configs.override(state=[split]):
            assert configs.preferred(_problem(shape, dtype)).state == split
            outs = run_op(args, output_dtype=output_dtype)
        if first is None:
            check_outputs(outs, golden, bench, dtype, output_dtype)
            first = outs
        assert all(torch.equal(x, y) for x, y in zip(outs, first) if x is not None), depth


def test_state_form_rule():
    """The fused scan from N = SCAN_MIN_N and the split form below, on every official shape,
    and the description says which."""
    for s in official_shapes(B=1, S=64, H=2):
        chosen = configs.preferred(_problem(s))
        assert chosen.state.scan == (s.N >= configs.SCAN_MIN_N), s.name
        assert ("state_scan" in chosen.describe()) == chosen.state.scan


def test_output_register_cap_rule():
    """chunk_output's register cap and L2 prefetch on every official shape and in every fallback
    config: 128 registers up to N = OUTPUT_SMALL_N (64) and at N = 128 with R = 4 and C <= 16
    (there without the prefetch), 168 elsewhere and in the config that takes both P blocks of
    P = 128; the prefetch wherever R > 1 and output_maxnreg is 168 or N <= 64
    (docs/performance.md, "Configuration rules")."""
    small = {"N16_P64_R4_C8", "N32_P64_R4_C16", "N64_P64_R4_C16", "N64_P128_R4_C16",
             "N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8"}
    for s in official_shapes(B=1, S=64, H=2):
        pb = _problem(s)
        want = 128 if s.name in small else 168
        assert configs.output_maxnreg(s.N, s.R, s.C) == want, s.name
        cfgs = configs.output_candidates(pb)
        assert configs.preferred(pb).output == cfgs[0], s.name
        paired = s.P == 128
        assert [c.PB for c in cfgs][:2] == ([2, 1] if paired else [1, 1]), s.name
        assert cfgs[0].maxnreg == (168 if paired else want), s.name
        assert all(c.maxnreg == want for c in cfgs[paired:]), s.name
        want_prefetch = s.R > 1 and (s.N <= 64 or want == 168)
        assert configs.output_prefetch(s.N, s.R, s.C) == want_prefetch, s.name
    assert not configs.output_small(128, 4, 32) and configs.output_small(128, 3, 16)


def test_step_terms_steps_rule():
    """step_terms runs 16 steps per program at N = 256 and 32 below, on every official shape."""
    for s in official_shapes(B=1, S=64, H=2):
        assert configs.constants(_problem(s)).STEP_BS == (16 if s.N == 256 else 32), s.name


def test_output_configs_off_hopper():
    """On GPUs whose dots run on mma.sync (configs.measured_arch false: sm_80-89, sm_120)
    chunk_output takes 16-pair N blocks, 32-column P blocks, one P block per program and 168
    registers on every official shape, then 16-column P blocks, where the H200's configs spill
    136-2608 bytes per thread; with it a shape with a partial last chunk and a partial P block
    stays within the thresholds. On the CPU and on the H200 the measured configs apply."""
    assert configs.measured_arch(torch.device(DEVICE))
    with configs.override(measured_arch=False):
        for s in official_shapes(B=1, S=64, H=2):
            pb = _problem(s)
            cfgs = configs.output_candidates(pb)
            portable = OutputConfig(BJ=16, BP=32, PB=1, maxnreg=168)
            assert cfgs == [portable, dataclasses.replace(portable, BP=16)], s.name
            assert configs.preferred(pb).output == cfgs[0], s.name
        shape = Shape(1, 40, 2, 1, 16, 48, 2, 16)  # three chunks, the last partial; P = 32 + 16
        args, golden, bench = problem(shape, FP32, True, True)
        check_outputs(run_op(args, output_dtype=BF16), golden, bench, FP32, BF16)


@pytest.mark.parametrize("P, pb", [(128, 2), (80, 2), (65, 2), (64, 1), (48, 1)])
def test_output_p_blocks_per_program(P, pb):
    """Where P takes two 64-column blocks (65-128), the first chunk_output config has one program
    take both (PB = 2, half the programs along P); the outputs stay within the thresholds with
    PB = 2, where the second block may be partial or all masked but one column, and with the
    one-block-per-program fallback that a smaller shared memory would select. A PB = 2 run
    repeats bit for bit."""
    shape = Shape(1, 40, 2, 1, 16, P, 2, 16)  # three chunks, the last one partial
    assert configs.output_p_blocks(P) == pb
    cfgs = configs.output_candidates(_problem(shape))
    assert cfgs[0].PB == pb and all(c.PB == 1 for c in cfgs[1:])
    assert configs.preferred(_problem(shape)).output.PB == pb
    if pb == 1:
        return
    args, golden, bench = problem(shape, FP32, True, True)
    for first in (0, 1):
        with configs.override(output=cfgs[first:]):
            assert configs.preferred(_problem(shape)).output.PB == (2 if first == 0 else 1)
            outs = run_op(args, output_dtype=BF16)
            check_outputs(outs, golden, bench, FP32, BF16)
            if first == 0:
                again = run_op(args, output_dtype=BF16)
                assert all(torch.equal(x, y) for x, y in zip(outs, again) if x is not None)


@pytest.mark.parametrize("sync", [True, False], ids=["mma_sync", "wgmma"])
def test_scan_dot_forms(sync):
    """The fused scan's increment through common.dot_sync (mma.sync) up to N = SCAN_SYNC_MAX_N and
    through a plain dot above it, on every official shape; each form within the thresholds on a
    scan shape with a partial last chunk."""
    for s in official_shapes(B=1, S=64, H=2):
        assert configs.constants(_problem(s)).SCAN_SYNC == (s.N <= configs.SCAN_SYNC_MAX_N), s.name
    shape = Shape(1, 40, 2, 1, 64, 16, 2, 16)
    with configs.override(scan_sync=sync):
        assert configs.constants(_problem(shape)).SCAN_SYNC == sync
        assert configs.preferred(_problem(shape)).state.scan
        args, golden, bench = problem(shape, BF16, True, True)
        check_outputs(run_op(args, output_dtype=FP32), golden, bench, BF16, FP32)


@pytest.mark.parametrize("N, dtype, scratch", [(64, BF16, False), (64, FP16, True),
                                              (16, BF16, True)],
                         ids=["scan_rounded_states", "scan_fp32_copy", "split"])
def test_state_scratch_only_when_used(monkeypatch, N, dtype, scratch):
    """The fp32 tensor of the states' shape is allocated only when a kernel uses it: the split
    form's increments, or the fp32 state copy that chunk_output reads where it may not read
    the rounded states (fp16 inputs with bf16 outputs); not for the scan with bf16 inputs and
    outputs. The outputs stay within the thresholds either way."""
    shape = Shape(1, 40, 2, 1, N, 16, 2, 16)
    args, golden, bench = problem(shape, dtype, True, True)
    n_states = 1 * 2 * 3 * N * 16  # B * H * nchunks * N * P
    seen = []
    empty = torch.empty

    def recording(*size, **kw):
        t = empty(*size, **kw)
        seen.append((t.numel(), t.dtype))
        return t

    monkeypatch.setattr(torch, "empty", recording)
    outs = run_op(args, output_dtype=BF16)
    monkeypatch.undo()
    assert ((n_states, torch.float32) in seen) == scratch
    check_outputs(outs, golden, bench, dtype, BF16)


# ---------------------------------------------------------------------------- host side


def _problem(s: Shape, dtype: torch.dtype = FP32):
    """The validated Problem of a call on inputs of this shape (Z and D on)."""
    from mamba3_mimo.bench import problem_of
    return problem_of(op_args(make_inputs(s, dtype, True, True, device=DEVICE, seed=0)))


def test_kernel_constants_cached_per_model():
    """The kernels' constants are cached per model, not per call: problems that differ only in
    B and S share one cache entry, equal to a fresh computation, and get their own lengths."""
    configs._model_constants.cache_clear()
    small, large = Shape(1, 40, 2, 1, 16, 32, 2, 16), Shape(3, 1000, 2, 1, 16, 32, 2, 16)
    m1, m2 = configs.constants(_problem(small)), configs.constants(_problem(large))
    assert configs._model_constants.cache_info().currsize == 1
    assert (m1.B, m1.S, m1.nc, m1.S_pad) == (1, 40, 3, 48)
    assert (m2.B, m2.S, m2.nc, m2.S_pad) == (3, 1000, 63, 1008)
    fresh = configs._model_constants.__wrapped__(2, 1, 16, 32, 2, 16, 4, m2.U, FP32, FP32, True,
                                                 True, interpreter_active(), True,
                                                 configs._dependent_launches(torch.device(DEVICE)))
    lengths = dict(B=0, S=0, S_pad=0, nc=0)
    assert dataclasses.replace(m2, **lengths) == fresh == dataclasses.replace(m1, **lengths)
    configs.constants(_problem(large, BF16))  # another dtype is another model
    assert configs._model_constants.cache_info().currsize == 2


def test_out_states_policy():
    """chunk_output reads the rounded `states` output only where its rounding stays well inside
    the threshold of every output (the dtype tests above check the accuracy of each case): bf16
    inputs with 16-bit outputs, fp16 with fp16. fp32 inputs keep fp32 dmimo thresholds, and fp32
    outputs are the fp32 state already."""
    expected = {(BF16, BF16): True, (BF16, FP16): True, (FP16, FP16): True,
                (FP16, BF16): False, (FP32, BF16): False, (FP32, FP16): False,
                (BF16, FP32): False, (FP16, FP32): False, (FP32, FP32): False}
    for (dtype, output_dtype), want in expected.items():
        assert configs.out_states_suffice(dtype, output_dtype) is want, (dtype, output_dtype)
    shape = Shape(1, 40, 2, 1, 16, 32, 2, 16)
    pb = dataclasses.replace(_problem(shape, BF16), output_dtype=BF16)
    assert configs.constants(pb).OUT_STATES
    assert not configs.constants(dataclasses.replace(pb, output_dtype=FP32)).OUT_STATES


def test_input_align():
    """input_align: the largest power of two up to its cap that divides every stride but the
    innermost; for contiguous inputs it depends on the model only, never on the length (which
    would recompile the kernels), also where R*G*N, H*P and chunk_size are not multiples of 4."""
    from mamba3_mimo.kernels import input_align

    def strided(*strides):
        return torch.empty(1 << 22).as_strided((2,) * len(strides), strides)

    for strides, want in [((0, 1), 4), ((6, 2, 1), 2), ((12, 4, 1), 4), ((3, 1), 1),
                          ((24, 8, 2), 4), ((1 << 20, 1), 4)]:
        assert input_align(4, strided(*strides)) == want, strides
    assert input_align(8, strided(24, 1)) == 8 and input_align(1, strided(8, 1)) == 1
    assert input_align(4, strided(8, 1), strided(6, 1)) == 2
    for shape, want in [(Shape(1, 1, 2, 1, 16, 16, 2, 16), 4),
                        (Shape(2, 1, 3, 1, 2, 3, 1, 5, rotary_dim_divisor=2), 1),
                        (Shape(2, 1, 2, 1, 6, 6, 1, 6, rotary_dim_divisor=2), 2)]:
        seen = set()
        for S in (5, 6, 7, 8, 33):
            a = make_inputs(dataclasses.replace(shape, S=S), BF16, True, True, device=DEVICE)
            seen.add(input_align(4, a["q"], a["k"], a["v"], a["segsum"]))
        assert seen == {want}, (shape, seen)


def test_host_integer_helpers():
    """cdiv and next_pow2 (the launchers' replacements for triton.cdiv and
    triton.next_power_of_2) agree with them."""
    import triton
    from mamba3_mimo.kernels import cdiv, next_pow2
    for a in range(1, 300):
        assert next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 2, 3, 16, 64, 512):
            assert cdiv(a, b) == triton.cdiv(a, b)


def test_rank_sums_over_many_tiles():
    """dmimo_o and dmimo_z sum chunk_output's per-tile partial sums over 38 tiles, more than the
    32 that rank_sums_kernel loads at once and not a multiple of them."""
    shape = Shape(1, 300, 2, 1, 16, 16, 8, 8)
    assert configs.tile_chunks(shape.C, shape.R) == 1  # one chunk per tile: 38 tiles
    args, golden, bench = problem(shape, FP32, True, True)
    check_outputs(run_op(args), golden, bench, FP32)


def test_prefetch_policy():
    """chunk_output's L2 prefetch is inline assembly: never under the interpreter, and on a
    compiled build only where it measured faster (R > 1)."""
    for R, interpret, want in ((4, False, 2), (2, False, 2), (1, False, 0), (4, True, 0)):
        m = configs._model_constants.__wrapped__(2, 1, 16, 32, R, 16, 4, 1, BF16, BF16, True,
                                                 True, interpret, True, False)
        assert m.PREFETCH == want, (R, interpret)
    shape = Shape(1, 40, 2, 1, 16, 32, 2, 16)
    assert configs.constants(_problem(shape)).PREFETCH == (0 if interpreter_active() else 2)
