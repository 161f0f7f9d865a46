"""GPU-only checks: determinism at full size, no recompilation across batch and sequence length,
one compilation per kernel on a model's first call, a small shared-memory budget, index
arithmetic past 2**31 elements, the production path's direct launches, and the sigmoid's
inline-assembly form."""
import importlib
import pkgutil

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import mamba3_mimo.baseline
import mamba3_mimo.kernels
from conftest import (IMPLS, assert_outputs_equal, check_outputs, op_args, problem,
                      record_launches, requires_gpu, run_op, seed_for)
from mamba3_mimo import configs
from mamba3_mimo.bench import problem_of
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes
from mamba3_mimo.kernels.common import sigmoid
from mamba3_mimo.reference import bwd_fwd_reference
from mamba3_mimo.runtime import launcher

pytestmark = requires_gpu

BF16 = torch.bfloat16


KERNEL_PACKAGES = (mamba3_mimo.kernels, mamba3_mimo.baseline)


def kernel_functions() -> list:
    """Every triton.JITFunction defined in the modules of mamba3_mimo.kernels (the production
    kernels) and mamba3_mimo.baseline (stage 0), unwrapping autotuners and heuristics, each
    once."""
    found = {}
    for package in KERNEL_PACKAGES:
        in_package = 0
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for obj in vars(module).values():
                for _ in range(4):  # Autotuner / Heuristics keep the wrapped kernel in .fn
                    if isinstance(obj, JITFunction) or not hasattr(obj, "fn"):
                        break
                    obj = obj.fn
                if isinstance(obj, JITFunction):
                    in_package += id(obj) not in found
                    found[id(obj)] = obj
        assert in_package, f"no triton.JITFunction found in {package.__name__}"
    return list(found.values())


def compiled_counts() -> dict:
    """Compiled kernels in the JIT caches per kernel function (triton 3.6:
    device_caches[device][0] maps the specialization key to the compiled kernel)."""
    return {fn: sum(len(cache[0]) for cache in fn.device_caches.values())
            for fn in kernel_functions()}


def compiled_count() -> int:
    """Compiled kernels in the JIT caches, all kernel functions together."""
    return sum(compiled_counts().values())


@pytest.fixture
def launches(monkeypatch):
    """The compiled kernels actually launched during the test (not compile-only warmups).
    Every launch goes through Triton's fn.run, which the direct launches would bypass."""
    monkeypatch.setattr(launcher, "DIRECT", False)
    log = []
    for fn in kernel_functions():
        def run(*args, _orig=fn.run, _fn=fn, grid, warmup, **kwargs):
            kernel = _orig(*args, grid=grid, warmup=warmup, **kwargs)
            if not warmup:
                log.append((_fn, kernel.result() if hasattr(kernel, "result") else kernel))
            return kernel
        monkeypatch.setattr(fn, "run", run)
    return log


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_full_size(impl):
    shape = Shape(B=4, S=2048, H=16, G=1, N=128, P=64, R=4, C=16)
    args = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=seed_for(shape)))
    first = run_op(args, impl)
    for i in range(3):
        assert_outputs_equal(run_op(args, impl), first, f"run {i + 2}: ")


@pytest.mark.parametrize("impl", IMPLS)
def test_no_recompile_across_batch_and_length(impl):
    """After the first call, other B and S (tails included) with the same model dims reuse the
    compiled kernels."""
    shape = Shape(1, 256, 4, 1, 64, 64, 4, 16)
    sizes = [(B, S) for B in (1, 2, 3) for S in (256, 512, 1000)]
    counts = []
    for B, S in sizes:
        s = Shape(B, S, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C)
        args = op_args(make_inputs(s, BF16, True, True, device="cuda", seed=seed_for(s)))
        run_op(args, impl)
        torch.cuda.synchronize()
        counts.append(compiled_count())
    assert counts[0] > 0, "no compiled kernel found in the caches"
    new = [(size, c - counts[0]) for size, c in zip(sizes, counts) if c != counts[0]]
    assert not new, f"recompiled after the first call (B, S): new kernels {new}"


@pytest.mark.parametrize("shape", [Shape(2, 300, 4, 1, 96, 48, 2, 16),
                                   Shape(2, 300, 4, 1, 48, 48, 2, 16)], ids=["scan", "split"])
def test_first_call_compiles_each_kernel_once(shape, launches):
    """A model's first call compiles each kernel it launches once: the shared-memory probe of
    the configs (runtime.resources.choose, a warmup with the call's own arguments) compiles the
    specialization that the launch then finds cached. Model dimensions (N 96 or 48, P 48) that
    no other test uses, so that the state and output kernels are compiled here for the first
    time."""
    before = compiled_counts()
    args = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=seed_for(shape)))
    run_op(args)
    torch.cuda.synchronize()
    grew = {fn.__name__: n - before[fn] for fn, n in compiled_counts().items()
            if n != before[fn]}
    launched = {fn.__name__ for fn, _ in launches}
    # chunk_output twice: its fast form and its rerun of tiles with non-finite values
    want = {name: 2 if name == "chunk_output_kernel" else 1 for name in grew}
    assert grew == want, f"compiled more than once: {grew}"
    assert "chunk_output_kernel" in grew and set(grew) <= launched, (grew, launched)


SMEM_LIMIT = 99 * 1024  # e.g. RTX 4090 / sm_89 per-block opt-in limit


@pytest.mark.parametrize("shape", [Shape(1, 500, 4, 1, s.N, s.P, s.R, s.C)
                                   for s in official_shapes()], ids=lambda s: s.name)
def test_small_shared_memory(shape, launches):
    """Under a 99 KB shared-memory budget every launched kernel fits and results stay correct.
    (The shared-memory probe may compile larger configs; only launched ones must fit.)"""
    args, golden, bench = problem(shape, BF16, True, True)
    with configs.override(smem_limit=SMEM_LIMIT):
        outs = run_op(args)
        torch.cuda.synchronize()
    assert launches, "no kernel launch recorded"
    for fn, kernel in launches:
        assert kernel.metadata.shared <= SMEM_LIMIT, (
            f"{fn.__name__} launched with {kernel.metadata.shared} bytes of shared memory")
    check_outputs(outs, golden, bench, BF16)


def test_states_beyond_2_31_elements():
    """states has more than 2**31 elements: the last batch equals its own B=1 golden."""
    B, s1 = 33, Shape(1, 2048, 16, 1, 256, 64, 2, 8)
    assert B * s1.H * (s1.S // s1.C) * s1.N * s1.P > 2 ** 31
    one = op_args(make_inputs(s1, BF16, True, True, device="cuda", seed=seed_for(s1, "big")))
    batch_dims = {"dout": 0, "q": 0, "k": 0, "v": 0, "z": 0, "angles": 0, "da_cs": 0,
                  "da_cs_rev": 0, "dt": 0, "trap": 0, "segsum": 0}
    big = {k: v.expand(B, *v.shape[1:]) if k in batch_dims else v for k, v in one.items()}
    outs = run_op(big, output_dtype=torch.bfloat16)
    last = tuple(None if o is None else o[-1:] for o in outs)
    del outs
    golden = bwd_fwd_reference(**one, dtype=torch.float64)
    bench = bwd_fwd_reference(**one, dtype=torch.float32)
    check_outputs(last, golden, bench, BF16, output_dtype=torch.bfloat16)


# two chunks at least (C <= 64): with one chunk no increment is needed and none is launched
@pytest.mark.parametrize("shape", [Shape(1, 128, 2, 1, s.N, s.P, s.R, s.C)
                                   for s in official_shapes()], ids=lambda s: s.name)
def test_launched_kernel_resources(shape, launches):
    """The resources that the measured speed depends on, on every official model shape.
    The state pass the rules name (the fused scan from N = configs.SCAN_MIN_N, else
    chunk_increment) is launched. Its dot has BP rows in M; below 64 Triton falls back from
    wgmma to mma.sync, which in chunk_increment at P = 32 took 255 registers, 528 bytes of spill
    and twice the time (docs/performance.md, "Configuration rules"): the launched kernel uses
    wgmma (sm_90) and spills nothing; but up to N = configs.SCAN_SYNC_MAX_N the scan's dot is on
    mma.sync by design (common.dot_sync, faster there), still without spills. chunk_output stays
    within the register cap of its preferred config (configs.output_maxnreg(N, R, C)): 128 up to
    N = 64 and at N = 128 with R = 4 and C <= 16, four programs per SM, 168 elsewhere, three;
    and within 168 where one program takes both P blocks of P = 128
    (configs.output_p_blocks)."""
    args = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=seed_for(shape)))
    run_op(args)
    torch.cuda.synchronize()
    outs = [k for fn, k in launches if fn.__name__ == "chunk_output_kernel"]
    assert len(outs) == 2, "chunk_output_kernel was not launched as its fast form and its rerun"
    # the preferred config's cap; test_bwd_fwd.test_output_register_cap_rule checks its rule
    cap = configs.preferred(problem_of(args)).output.maxnreg
    for k in outs:
        assert k.n_regs <= cap, f"chunk_output uses {k.n_regs} registers (cap {cap})"
    # the fast form (launched first) spills at most 64 bytes on the official shapes (sm_90);
    # with the rerun's code compiled into it, it spilled 584-592 bytes and ran 1.4x slower
    if torch.cuda.get_device_capability()[0] == 9:
        assert 4 * outs[0].n_spills <= 128, (
            f"chunk_output spills {4 * outs[0].n_spills} bytes ({outs[0].n_regs} registers)")
    name = "state_scan_kernel" if shape.N >= configs.SCAN_MIN_N else "chunk_increment_kernel"
    inc = [k for fn, k in launches if fn.__name__ == name]
    assert inc, f"{name} was not launched"
    for k in inc:
        assert k.n_spills == 0, f"{name} spills {4 * k.n_spills} bytes ({k.n_regs} registers)"
        if torch.cuda.get_device_capability()[0] != 9:
            continue
        if name == "state_scan_kernel" and shape.N <= configs.SCAN_SYNC_MAX_N:
            assert "warp_group_dot" not in k.asm["ttgir"], f"{name}'s dot is on wgmma"
            assert "versionMajor = 2" in k.asm["ttgir"], f"{name}'s dot is not on mma.sync"
        else:
            assert "warp_group_dot" in k.asm["ttgir"], f"{name}'s dot is not on wgmma"


def test_direct_launch_runs_tritons_kernel(monkeypatch):
    """The production launcher's direct launches (runtime.launcher) run the kernel Triton itself
    picks for the same arguments, for aligned inputs and for a q misaligned by two elements
    (Triton compiles chunk_output without q's 16-byte alignment then): the second call of the
    operator launches no kernel through Triton, the kept kernel of every launch is the one
    fn.warmup returns for its arguments, and the outputs equal Triton's path bit for bit."""
    monkeypatch.setattr(launcher, "DIRECT", True)
    monkeypatch.setattr(launcher, "_kept", {})
    through_triton = []
    for fn in kernel_functions():
        def run(*args, _orig=fn.run, _fn=fn, grid, warmup, **kwargs):
            if not warmup:
                through_triton.append(_fn.__name__)
            return _orig(*args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(fn, "run", run)
    log = record_launches(monkeypatch)
    shape = official_shapes()[0]
    args = op_args(make_inputs(shape, BF16, True, True, device="cuda", seed=seed_for(shape)))
    q = args["q"]
    buf = torch.empty(q.numel() + 2, device=q.device, dtype=q.dtype)
    shifted = buf[2:].view(q.shape).copy_(q)
    assert shifted.data_ptr() % 16 != 0
    output_kernels = []
    kernels = ["step_terms_kernel", "chunk_increment_kernel", "state_passing_kernel",
               "chunk_output_kernel", "chunk_output_kernel", "rank_sums_kernel"]
    # first calls: every kernel through Triton, then only chunk_output's two forms (the others'
    # arguments keep their keys); second calls: none
    for what, a, first in (("aligned", args, kernels),
                           ("q misaligned", dict(args, q=shifted), ["chunk_output_kernel"] * 2)):
        monkeypatch.setattr(launcher, "DIRECT", False)
        want = run_op(a)
        monkeypatch.setattr(launcher, "DIRECT", True)
        log.clear()
        outs = []
        for call in (1, 2):
            through_triton.clear()
            outs.append(run_op(a))
            assert through_triton == (first if call == 1 else []), (
                f"{what}, call {call}: launched through Triton: {through_triton}")
        torch.cuda.synchronize()
        assert len(log) == 2 * len(kernels), (
            f"{what}: {len(log)} launches, expected {len(kernels)} per call")
        for fn, grid, kargs, options in log:
            kept = launcher.kept_kernel(fn, kargs, **options)
            assert kept is not None, f"{what}: nothing kept for {fn.__name__}"
            assert kept is fn.warmup(*kargs, grid=grid, **options), (
                f"{what}: {fn.__name__}: the kept kernel is not Triton's for these arguments")
            if fn.__name__ == "chunk_output_kernel":
                output_kernels.append(kept)
        for i, o in enumerate(outs):
            assert_outputs_equal(o, want, f"{what}, call {i + 1} against Triton's path: ")
    assert output_kernels[0] is not output_kernels[-1], (
        "misaligned q launched the chunk_output kernel compiled for an aligned q")


@triton.jit
def _sigmoid_kernel(x_ptr, y_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, sigmoid(x, FAST), mask=i < n)


def test_sigmoid_forms():
    """common.sigmoid's three forms against float64 on the H200, over the range the gate sees
    and past the points where exp(-x) leaves fp32 (|x| > 88): at most 1e-6 off absolutely, and
    5e-6 relatively wherever the value is above 1e-37, clear of the denormals that the
    inline-assembly form (FAST 2, chunk_output's) flushes to zero; the rounding of
    x * log2(e) alone moves exp by up to about 3e-6 at |x| = 88. Both ends saturate exactly:
    0 below -104, 1 above 17."""
    x = torch.cat([torch.linspace(-120, 120, 200001, device="cuda", dtype=torch.float64),
                   torch.tensor([0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf")],
                                device="cuda", dtype=torch.float64)]).float()
    want = torch.sigmoid(x.double())
    for fast in (0, 1, 2):
        y = torch.full_like(x, float("nan"))
        _sigmoid_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), fast, 1024)
        err = (y.double() - want).abs()
        assert err.max().item() <= 1e-6, (fast, x[err.argmax()].item())
        normal = want > 1e-37
        rel = (err / want)[normal]
        assert rel.max().item() <= 5e-6, (fast, x[normal][rel.argmax()].item())
        assert torch.all(y[x < -104] == 0) and torch.all(y[x > 17] == 1), fast
