"""Call plans (bwd_fwd.call_plans): a repeated call of one signature replays the launches of the
first with its own tensors, and gives what a fresh plan gives."""
import pytest
import torch

from conftest import assert_outputs_equal, check_outputs, problem, run_op
from mamba3_mimo import configs
from mamba3_mimo.phases import bwd_fwd
from mamba3_mimo.runtime.plans import placeholder
from mamba3_mimo.inputs import Shape

FP32 = torch.float32

# plain chunks, a tail (pad_tail builds new inputs each call), chunks run as sub-chunks
# (split_chunks), the fused scan, and without Z and D
CASES = [(Shape(1, 32, 2, 1, 16, 16, 2, 16), True, True),
         (Shape(2, 37, 4, 2, 16, 24, 2, 8), True, True),
         (Shape(1, 48, 2, 1, 16, 16, 4, 48), True, True),
         (Shape(1, 40, 2, 1, 64, 16, 2, 16), True, True),
         (Shape(1, 40, 2, 1, 16, 16, 2, 16), False, False)]
IDS = ["plain", "tail", "sub_chunks", "scan", "no_z_no_d"]


@pytest.mark.parametrize("shape, z_gate, d_skip", CASES, ids=IDS)
@pytest.mark.parametrize("output_dtype", [FP32, torch.bfloat16], ids=["out_fp32", "out_bf16"])
def test_replayed_call_matches_a_fresh_plan(shape, z_gate, d_skip, output_dtype):
    """A second call with other inputs of the same signature runs on the first call's plan (one
    plan cached), matches its own golden, and equals bit for bit a call on a fresh plan."""
    first, _, _ = problem(shape, FP32, z_gate, d_skip, seed=1)
    second, golden, bench = problem(shape, FP32, z_gate, d_skip, seed=2)
    run_op(first, output_dtype=output_dtype)
    replayed = run_op(second, output_dtype=output_dtype)
    assert len(bwd_fwd.call_plans) == 1, "the second call did not reuse the first's plan"
    check_outputs(replayed, golden, bench, FP32, output_dtype)
    configs.clear_caches()
    assert_outputs_equal(replayed, run_op(second, output_dtype=output_dtype), "replayed: ")


def test_plan_per_layout():
    """Inputs of the same shapes in another layout (v and dout head-major) get their own plan,
    and both layouts stay right whichever ran first."""
    shape = CASES[0][0]
    args, golden, bench = problem(shape, FP32, True, True)
    moved = dict(args)
    for name in ("v", "dout"):
        moved[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)
    assert moved["v"].stride() != args["v"].stride()
    for a in (args, moved, args, moved):
        check_outputs(run_op(a), golden, bench, FP32)
    assert len(bwd_fwd.call_plans) == 2


def test_one_tensor_given_twice():
    """A plan is not cached from a call that passes one tensor as two inputs (k is q): it would
    bind both from one name. Calls with and without the alias, in either order, stay right."""
    shape = CASES[0][0]
    args, _, _ = problem(shape, FP32, True, True)
    aliased = dict(args, k=args["q"])
    a_golden, a_bench = _references(aliased)
    check_outputs(run_op(aliased), a_golden, a_bench, FP32)
    assert len(bwd_fwd.call_plans) == 0
    args, golden, bench = problem(shape, FP32, True, True)
    check_outputs(run_op(args), golden, bench, FP32)
    assert len(bwd_fwd.call_plans) == 1
    check_outputs(run_op(aliased), a_golden, a_bench, FP32)  # on the plan of distinct inputs


def _references(args: dict):
    from mamba3_mimo.reference import bwd_fwd_reference
    return (bwd_fwd_reference(**args, dtype=torch.float64),
            bwd_fwd_reference(**args, dtype=torch.float32))


def test_plans_hold_no_tensors_of_a_call():
    """A cached plan keeps no input or output of a call alive: its launches' tensor arguments
    are names, except the kept placeholder."""
    shape = CASES[1][0]
    args, _, _ = problem(shape, FP32, True, True)
    run_op(args, output_dtype=torch.bfloat16)
    (plan,) = bwd_fwd.call_plans.entries.values()
    assert plan.templates, "a plan without launches"
    kept = placeholder(args["q"].device)  # the launches' device: cuda:0, not "cuda"
    assert len(plan.group.bounds) == len(plan.templates) == len(plan.slots)
    for bound, template, slots in zip(plan.group.bounds, plan.templates, plan.slots):
        name = bound.fn.__name__
        held = [x for x in template if isinstance(x, torch.Tensor) and x is not kept]
        assert not held, f"{name} holds {len(held)} tensors"
        assert slots and all(template[i] is None for i, _ in slots), name
        bound_held = [x for x in bound.fixed[0] if isinstance(x, torch.Tensor)] if bound.layout \
            else []
        assert not bound_held, f"{name}'s key holds a tensor"


def test_cache_is_bounded(monkeypatch):
    """Past its limit (MAX_CALL_PLANS) the cache starts afresh, and every call stays right."""
    monkeypatch.setattr(bwd_fwd.call_plans, "limit", 2)
    for S in (16, 32, 48):
        shape = Shape(1, S, 2, 1, 16, 16, 2, 16)
        args, golden, bench = problem(shape, FP32, True, True)
        check_outputs(run_op(args), golden, bench, FP32)
        assert 1 <= len(bwd_fwd.call_plans) <= 2


# ---------------------------------------------------------------------------- entry signatures


def test_repeated_call_skips_the_checks():
    """A second call of one public-entry signature finds the validated Problem and the plan
    (bwd_fwd.entry_calls) and equals bit for bit the same call made afresh."""
    shape = CASES[0][0]
    first, _, _ = problem(shape, FP32, True, True, seed=1)
    second, golden, bench = problem(shape, FP32, True, True, seed=2)
    run_op(first, output_dtype=torch.bfloat16)
    assert len(bwd_fwd.entry_calls) == 1
    (pb, plan), = bwd_fwd.entry_calls.entries.values()
    assert next(iter(bwd_fwd.call_plans.entries.values())) is plan
    replayed = run_op(second, output_dtype=torch.bfloat16)
    assert len(bwd_fwd.entry_calls) == 1 and len(bwd_fwd.call_plans) == 1
    check_outputs(replayed, golden, bench, FP32, torch.bfloat16)
    configs.clear_caches()
    assert not len(bwd_fwd.entry_calls)
    assert_outputs_equal(replayed, run_op(second, output_dtype=torch.bfloat16), "replayed: ")


@pytest.mark.parametrize("bad, error, match", [
    (dict(mimo_v=lambda t: t.half()), TypeError, "mimo_v"),
    (dict(angles=lambda t: t[:, :, :, :-1]), ValueError, "angles"),
    (dict(k=lambda t: t.tolist()), TypeError, r"\bk\b"),
    (dict(chunk_size=lambda c: True), TypeError, "chunk_size"),
    (dict(output_dtype=lambda o: torch.int32), ValueError, "output_dtype"),
], ids=["dtype", "shape", "not_a_tensor", "bool_chunk_size", "output_dtype"])
def test_bad_call_after_a_cached_one_still_raises(bad, error, match):
    """A cached signature never lets a wrong argument through: a call that differs from a cached
    one in a checked property has another signature (or none) and is checked."""
    shape = CASES[0][0]
    args, _, _ = problem(shape, FP32, True, True)
    good = dict(args, chunk_size=shape.C, output_dtype=FP32)
    run_op(good)
    run_op(good)
    (name, change), = bad.items()
    with pytest.raises(error, match=match):
        run_op(dict(good, **{name: change(good[name])}))


@pytest.mark.parametrize("case", ["tail", "sub_chunks", "aliased", "stage0"])
def test_calls_not_remembered(case):
    """Calls that do not run on their own tensors as given (a tail padded, chunks split), that
    build no cached plan (one tensor given twice) or run stage 0 leave no entry signature, and
    repeat right."""
    shape = {"tail": CASES[1][0], "sub_chunks": CASES[2][0]}.get(case, CASES[0][0])
    args, golden, bench = problem(shape, FP32, True, True)
    impl = "dispatch"
    if case == "aliased":
        args = dict(args, k=args["q"])
        golden, bench = _references(args)
    elif case == "stage0":
        impl = "stage0"
    for _ in range(2):
        check_outputs(run_op(args, impl), golden, bench, FP32)
    assert not len(bwd_fwd.entry_calls)


def test_signatures_sharing_a_plan():
    """Two entry signatures that differ only where the plan's key does not look (trap in fp32 or
    in the inputs' fp16) share one plan and are both remembered; each repeat matches its golden."""
    shape = CASES[0][0]
    for _ in range(2):
        for trap_dtype in (torch.float32, torch.float16):
            args, golden, bench = problem(shape, torch.float16, True, True,
                                          trap_dtype=trap_dtype)
            check_outputs(run_op(args), golden, bench, torch.float16)
    assert len(bwd_fwd.call_plans) == 1 and len(bwd_fwd.entry_calls) == 2
