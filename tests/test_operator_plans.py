"""The whole operator's call plans (phases/operator.py `launch_all`): a repeated call with the
same Problem, flags and strides replays the launch groups of the first with its own tensors and
gives bit for bit what a fresh plan gives; a tensor given as two arguments never leaves a plan
that binds both from one name."""
import pytest
import torch

from conftest import DEVICE
from test_operator import CASES, _leaves, _run
from test_reference_operator import make_args
from mamba3_mimo import configs, mamba3_mimo
from mamba3_mimo.phases import operator
from mamba3_mimo.runtime.plans import CallPlan, placeholder

FP32 = torch.float32


def _call(case: str, seed: int, return_state: bool, **changes):
    """(outputs, gradients) of the operator on fresh fp32 leaves of CASES[case] (`changes`
    replaces arguments by name, each a function of the leaves)."""
    make_kw, op_kw, w_shape = CASES[case]
    args = make_args(**make_kw, seed=seed)
    w64 = None if w_shape is None else 1 + 0.3 * torch.randn(
        w_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    leaves, w = _leaves(args, FP32, DEVICE, w64)
    for name, change in changes.items():
        leaves[name] = change(leaves)
    return _run(mamba3_mimo, leaves, w, op_kw, return_state=return_state)


@pytest.mark.parametrize("return_state", [False, True], ids=["out_only", "states"])
@pytest.mark.parametrize("case", ["z_d_gqa", "per_rank", "norm_w"])
def test_replayed_call_matches_a_fresh_plan(case, return_state):
    """A second call with other inputs of the same shapes runs on the first call's plans (none
    added) and equals bit for bit the same call on fresh plans: chunk_output's tiles (out only),
    chunk_forward (the states, the per-rank output, the norm), S not a multiple of the chunk."""
    _call(case, 1, return_state)
    n_plans = len(operator._plans)
    assert n_plans >= 3, "forward, the backward's group and the angles' backward"
    replayed = _call(case, 2, return_state)
    assert len(operator._plans) == n_plans, "the second call built plans of its own"
    configs.clear_caches()
    _assert_identical(replayed, _call(case, 2, return_state))


def _assert_identical(got, want) -> None:
    """Outputs and gradients of two _call's equal bit for bit."""
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for name in w:
            assert torch.equal(g[name], w[name]), name


def _same_tensor(leaves):
    """K_bias given as the very tensor Q_bias is (both [H, R, N] fp32)."""
    return leaves["Q_bias"]


def _equal_copy(leaves):
    """K_bias a separate leaf equal to Q_bias."""
    return leaves["Q_bias"].detach().clone().requires_grad_(True)


@pytest.mark.parametrize("aliased_first", [True, False], ids=["aliased_first", "plain_first"])
def test_one_tensor_given_twice(aliased_first):
    """No plan is kept from a call that passes one tensor as two arguments (it would bind both
    from one name); calls with and without the alias, in either order, equal a call on two
    equal tensors. The alias's gradient is the sum of both arguments' gradients."""
    plain = _call("z_d_gqa", 3, False, K_bias=_equal_copy)
    configs.clear_caches()
    order = [_same_tensor, _equal_copy] if aliased_first else [_equal_copy, _same_tensor]
    for change in order:
        outs, grads = _call("z_d_gqa", 3, False, K_bias=change)
        assert torch.equal(outs["out"], plain[0]["out"])
        if change is _same_tensor:
            assert len(operator._plans) == (0 if aliased_first else 3)
            torch.testing.assert_close(grads["Q_bias"],
                                       plain[1]["Q_bias"] + plain[1]["K_bias"])
        else:
            for name, g in plain[1].items():
                assert torch.equal(grads[name], g), name


def test_output_gradient_given_as_an_input():
    """out.backward(V) with V itself the output's gradient (same shape and dtype): the backward
    keeps no plan that binds dout from V's name, and a later call with a separate dout of equal
    values gives the same gradients."""
    make_kw = CASES["z_d_gqa"][0]
    grads = []
    for separate in (False, True):
        leaves, _ = _leaves(make_args(**make_kw, seed=4), FP32, DEVICE, None)
        out = mamba3_mimo(**leaves)
        v = leaves["V"]
        out.backward(v.detach().clone() if separate else v)
        if not separate:
            assert all(key[0] != "backward" for key in operator._plans.entries)
        grads.append({n: leaves[n].grad.clone() for n in ("Q", "K", "Z", "MIMO_V")})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_plans_hold_no_tensors_of_a_call():
    """A cached plan keeps no input, output or buffer of a call alive: its launches' tensor
    arguments are names, except the kept placeholder."""
    _call("z_d_gqa", 1, False)
    kept = placeholder(torch.empty(0, device=DEVICE).device)
    assert len(operator._plans) >= 3
    for plan in operator._plans.entries.values():
        for bound, template in zip(plan.group.bounds, plan.templates):
            held = [x for x in template if isinstance(x, torch.Tensor) and x is not kept]
            assert not held, f"{bound.fn.__name__} holds {len(held)} tensors"


def test_optional_input_given_then_absent():
    """MIMO_Z given with Z None, then absent: the second call cannot replay the first call's
    plans, which bind MIMO_Z by name (on the GPU the replay would meet None in its place)."""
    args = make_args(B=1, S=6, H=2, G=1, R=2, N=8, P=4, chunk_size=4, z=False, mimo_out=False)
    mimo_z = torch.randn(2, 2, 4, dtype=torch.float64)
    counts = []
    for given in (mimo_z, None):
        leaves, _ = _leaves(dict(args, MIMO_Z=given), FP32, DEVICE, None)
        mamba3_mimo(**leaves).sum().backward()
        counts.append(len(operator._plans))
    assert counts[1] > counts[0], "the call without MIMO_Z replayed plans that bind it"


@pytest.mark.parametrize("states_first", [False, True], ids=["out_first", "states_first"])
def test_calls_with_and_without_final_states(states_first):
    """A forward that returns the final states lays the steps out with a zero chunk after them
    (the state entering it is the final state): calls of one problem with and without the
    final states (on chunk_forward: the fused norm), in either order, never replay each
    other's forward and equal calls on fresh plans."""
    order = [True, False] if states_first else [False, True]
    got = [_call("norm_w", 4, return_state) for return_state in order]
    configs.clear_caches()
    for g, return_state in zip(got, order):
        _assert_identical(g, _call("norm_w", 4, return_state))


def _packed_call(lengths, seed: int):
    """(outputs, gradients) of a packed call (cu_seqlens for `lengths`) with final states, on
    fresh fp32 leaves."""
    args = make_args(B=1, S=sum(lengths), H=4, G=2, R=3, N=12, P=10, chunk_size=4,
                     rotary_dim_divisor=2, seed=seed)
    leaves, _ = _leaves(args, FP32, DEVICE, None)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    return _run(mamba3_mimo, leaves, None, {}, return_state=True, cu_seqlens=cu)


def test_packed_calls_replay_per_boundaries():
    """Packed calls keep plans per boundaries (apart from the dense calls'): a second call with
    the same boundaries adds none and equals bit for bit the same call on fresh plans; other
    boundaries of the same total build their own."""
    configs.clear_caches()
    _packed_call([3, 9, 1, 5], 1)
    n_plans = len(operator._packed_plans)
    assert n_plans >= 3 and len(operator._plans) == 0
    replayed = _packed_call([3, 9, 1, 5], 2)
    assert len(operator._packed_plans) == n_plans, "the second call built plans of its own"
    _packed_call([9, 3, 5, 1], 2)
    assert len(operator._packed_plans) > n_plans
    configs.clear_caches()
    _assert_identical(replayed, _packed_call([3, 9, 1, 5], 2))


def _signature(plan) -> tuple:
    """What a plan fixes beyond its named tensors: each launch's kernel, grid, options and
    non-tensor arguments (the kept placeholder compared by identity), and the names it binds."""
    return tuple((b.fn, b.grid, tuple(sorted(b.options.items())), template, slot)
                 for b, template, slot in zip(plan.group.bounds, plan.templates, plan.slots))


def _whole_chunks_call(seed: int, **changes):
    """(outputs, gradients) with final states of a call whose S is a multiple of the kernels'
    chunk (16 here), so that the inputs reach the kernels unpadded, with their own strides."""
    args = make_args(B=2, S=32, H=4, G=2, R=3, N=12, P=10, chunk_size=4, seed=seed)
    leaves, _ = _leaves(args, FP32, DEVICE, None)
    for name, change in changes.items():
        leaves[name] = change(leaves)
    return _run(mamba3_mimo, leaves, None, {}, return_state=True)


def test_equal_keys_build_equal_plans(monkeypatch):
    """Every launch group of calls whose plan keys are equal builds the same plan afresh: the
    key holds everything a plan fixes. The calls vary in values, in Q's and Angles' strides, in
    an optional input given or absent (MIMO_Z without Z), and in packed boundaries."""
    built = {}

    def spy(key, env, build, device):
        plan = CallPlan.build(None, build(), env, placeholder(device))
        if key is not None:
            built.setdefault(key, []).append(_signature(plan))
        plan.launch(env)

    monkeypatch.setattr(operator, "launch_all", spy)
    variants = {
        "plain": {},
        # Q's steps two apart
        "strided_q": dict(Q=lambda leaves: torch.repeat_interleave(
            leaves["Q"].detach(), 2, dim=1)[:, ::2].requires_grad_(True)),
        # one head's angles for all, head stride 0 (as flash-linear-attention passes them)
        "shared_angles": dict(Angles=lambda leaves: leaves["Angles"].detach()[:, :, :1]
                              .requires_grad_(True).expand_as(leaves["Angles"])),
        "mimo_z_without_z": dict(Z=lambda leaves: None),
        "neither": dict(Z=lambda leaves: None, MIMO_Z=lambda leaves: None),
    }
    for seed in (1, 2):
        for changes in variants.values():
            _whole_chunks_call(seed, **changes)
        _packed_call([3, 9, 1, 5], seed)
        _packed_call([9, 3, 5, 1], seed)
    assert min(len(plans) for plans in built.values()) >= 2, "a key met only once"
    for key, plans in built.items():
        assert all(p == plans[0] for p in plans[1:]), f"one key, two plans: {key[0]}"
