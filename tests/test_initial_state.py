"""`mamba3_mimo(..., initial_state=...)` (SPEC section 7) through the production kernels: a call
continues the sequence its initial state ended, against both float64 references, with the
gradients of the four initial-state tensors; two calls split anywhere equal one call, values
and gradients; a zero initial state equals none; a one-step call is a decode step."""
import pytest
import torch

from conftest import DEVICE, requires_gpu
from test_reference_operator import STATE_NAMES, _slice, make_args, state_for
from mamba3_mimo import configs, mamba3_mimo
from mamba3_mimo.configs import StateConfig
from mamba3_mimo.reference import mamba3_mimo_reference, mamba3_mimo_stepwise
from mamba3_mimo.testing import THRESHOLDS, rel_rms

F64 = torch.float64
OUT_NAMES = ("out",) + STATE_NAMES
LIMIT = THRESHOLDS[torch.float32]


def _leaf(x, device=DEVICE, dtype=None):
    if x is None or not isinstance(x, torch.Tensor):
        return x
    return x.detach().to(device=device, dtype=dtype or x.dtype).requires_grad_(True)


def _ours(args, init, device=DEVICE):
    """fp32 leaf copies on the device of the arguments and the initial state."""
    a = {k: _leaf(v, device, torch.float32) for k, v in args.items()}
    a["dtype"] = torch.float32
    i = None if init is None else tuple(_leaf(x, device, torch.float32) for x in init)
    return a, i


def _f64(args, init):
    """float64 CPU leaf copies of what the operator took."""
    a = {k: _leaf(v, "cpu", F64) for k, v in args.items()}
    a["dtype"] = F64
    i = None if init is None else tuple(_leaf(x, "cpu", F64) for x in init)
    return a, i


def _grads(a, i):
    found = {k: x.grad for k, x in a.items() if isinstance(x, torch.Tensor) and x.grad is not None}
    if i is not None:
        found.update({f"initial_{n}": x.grad for n, x in zip(STATE_NAMES, i)})
    return found


def _run(fn, a, i, seed=5, return_state=True, **kw):
    """(outputs, gradients) of a seeded random linear loss on the five outputs (on out alone
    without return_state)."""
    outs = fn(**a, return_state=return_state, initial_state=i, **kw)
    if not return_state:
        outs = (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64).to(o.device)).sum()
               for o in outs)
    loss.backward()
    return dict(zip(OUT_NAMES, [o.detach().cpu() for o in outs])), _grads(a, i)


def _assert_within(got, want, what):
    errors = {n: rel_rms(got[n].cpu(), want[n].cpu()) for n in want}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= LIMIT}
    assert not bad, f"{what}: relative RMS errors above {LIMIT}: {bad}"


CASES = {
    # name: (make_args kwargs, operator kwargs)
    "z_d_gqa": (dict(B=2, S=13, H=4, G=2, R=3, N=12, P=10, chunk_size=4,
                     rotary_dim_divisor=2), {}),
    "noz_nod_per_rank": (dict(B=1, S=9, H=2, G=1, R=2, N=8, P=6, chunk_size=5, z=False,
                              d=False, mimo_out=False), {}),
    "norm_one_chunk": (dict(B=1, S=6, H=2, G=1, R=2, N=8, P=12, chunk_size=8),
                       dict(fuse_pregate_headwise_rms_norm=True)),
    "one_step": (dict(B=2, S=1, H=2, G=1, R=3, N=8, P=6, chunk_size=4), {}),
}


@pytest.mark.parametrize("scan", [False, True], ids=["split_pass", "fused_scan"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_references(case, scan):
    """Every output and gradient (the initial state's included) against both float64
    references, fp32 inputs, with either form of the state pass starting from the given
    state."""
    make_kw, op_kw = CASES[case]
    args = make_args(**make_kw, seed=41)
    init = state_for(args, seed=42)
    a, i = _ours(args, init)
    with configs.override(state=[StateConfig(scan=scan, BJ=16, BP=16)]):
        got_out, got_grads = _run(mamba3_mimo, a, i, **op_kw)
    assert set(f"initial_{n}" for n in STATE_NAMES) <= set(got_grads)
    for ref in (mamba3_mimo_reference, mamba3_mimo_stepwise):
        ra, ri = _f64(a, i)
        want_out, want_grads = _run(ref, ra, ri, **op_kw)
        assert set(got_grads) == set(want_grads)
        _assert_within(got_out, want_out, f"{ref.__name__} outputs")
        _assert_within(got_grads, want_grads, f"{ref.__name__} gradients")


def test_training_call_from_a_state():
    """Without return_state (the output stage on chunk_output's tiles, here three tiles of
    four chunks) from a given state: out and every gradient, the initial state's included,
    against the float64 reference."""
    args = make_args(B=2, S=37, H=4, G=2, R=3, N=12, P=10, chunk_size=4, seed=45)
    a, i = _ours(args, state_for(args, seed=46))
    got_out, got_grads = _run(mamba3_mimo, a, i, return_state=False)
    ra, ri = _f64(a, i)
    want_out, want_grads = _run(mamba3_mimo_reference, ra, ri, return_state=False)
    assert set(got_grads) == set(want_grads)
    _assert_within(got_out, want_out, "outputs")
    _assert_within(got_grads, want_grads, "gradients")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
def test_split_equals_whole(with_state):
    """out(x[:s]) ++ out(x[s:], initial_state=state(x[:s])) equals out(x), and so do the final
    states and the gradients of every input (the chain's initial state too), for s = 1, inside
    a chunk, at a chunk boundary and s = S - 1 (the second call then a decode step)."""
    args = make_args(B=1, S=13, H=2, G=1, R=3, N=12, P=10, chunk_size=4, seed=51)
    init = state_for(args, seed=52) if with_state else None
    S = args["Q"].shape[1]

    def run(split):
        a, i = _ours(args, init)
        if split is None:
            outs = mamba3_mimo(**a, return_state=True, initial_state=i)
        else:
            first = mamba3_mimo(**_slice(a, 0, split), return_state=True, initial_state=i)
            second = mamba3_mimo(**_slice(a, split, S), return_state=True,
                                 initial_state=tuple(first[1:]))
            outs = (torch.cat([first[0], second[0]], 1),) + tuple(second[1:])
        gen = torch.Generator().manual_seed(53)
        loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64).to(o.device))
                   .sum() for o in outs)
        loss.backward()
        return dict(zip(OUT_NAMES, [o.detach().cpu() for o in outs])), _grads(a, i)

    whole_out, whole_grads = run(None)
    # every split point from a given state; from a zero state (the same second calls) two
    for s in (1, 6, 8, S - 1) if with_state else (6, S - 1):
        out, grads = run(s)
        _assert_within(out, whole_out, f"split at {s}: outputs")
        assert set(grads) == set(whole_grads)
        _assert_within(grads, whole_grads, f"split at {s}: gradients")


def test_zero_initial_state_is_no_initial_state():
    """A zero initial state gives the outputs and input gradients of no initial state, bit for
    bit."""
    args = make_args(B=1, S=9, H=2, G=1, R=2, N=8, P=6, chunk_size=4, seed=61)
    zero = state_for(args, zero=True)
    a, _ = _ours(args, None)
    none_out, none_grads = _run(mamba3_mimo, a, None)
    a, i = _ours(args, zero)
    zero_out, zero_grads = _run(mamba3_mimo, a, i)
    for name in OUT_NAMES:
        assert torch.equal(zero_out[name], none_out[name]), name
    for name, g in none_grads.items():
        assert torch.equal(zero_grads[name], g), name


def test_compiled_with_initial_state():
    """torch.compile(fullgraph=True) with an initial state: the eager results bit for bit."""
    args = make_args(B=1, S=7, H=2, G=1, R=2, N=8, P=6, chunk_size=4, seed=71)
    init = state_for(args, seed=72)
    a, i = _ours(args, init)
    want_out, want_grads = _run(mamba3_mimo, a, i)
    compiled = torch.compile(mamba3_mimo, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    a, i = _ours(args, init)
    got_out, got_grads = _run(compiled, a, i)
    for name in OUT_NAMES:
        assert torch.equal(got_out[name], want_out[name]), name
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert torch.equal(got_grads[name], g), name


@pytest.mark.parametrize("bad,match", [
    (lambda i: i[:3], "initial_state must be a tuple"),
    (lambda i: (i[0], i[1].transpose(-1, -2), i[2], i[3]), r"initial_state\[1\] \(state\)"),
    (lambda i: (i[0].double(), i[1], i[2], i[3]), r"initial_state\[0\] \(angle\)"),
    (lambda i: (i[0], i[1], i[2][:, :1], i[3]), r"initial_state\[2\] \(k\)"),
])
def test_bad_initial_state(bad, match):
    args = make_args(B=1, S=5, H=2, G=1, R=2, N=8, P=4, chunk_size=2, seed=81)
    a, i = _ours(args, state_for(args, seed=82))
    with pytest.raises((TypeError, ValueError), match=match):
        mamba3_mimo(**a, initial_state=bad(i))


def _split_training_against_whole(args, split, dtype, seed):
    """A sequence trained across two calls in `dtype` (Q, K, V, Z, Trap and the initial v in
    dtype, the rest fp32): from a given initial state, the first call's final state handed to
    the second as its initial state, a seeded random linear loss on the joined output and the
    second call's final state. Its outputs and the gradients of every input and of the four
    initial-state tensors within dtype's threshold of the float64 reference over the whole
    sequence on the same (rounded) values, run on the same device."""
    init = state_for(args, seed=seed)
    low = ("Q", "K", "V", "Z", "Trap")
    a = {k: _leaf(v, DEVICE, dtype if k in low else torch.float32) for k, v in args.items()}
    a["dtype"] = dtype
    i = tuple(_leaf(x, DEVICE, dtype if n == "v" else torch.float32)
              for n, x in zip(STATE_NAMES, init))
    ra = {k: _leaf(v, DEVICE, F64) for k, v in a.items()}
    ra["dtype"] = F64
    ri = tuple(_leaf(x, DEVICE, F64) for x in i)
    S = args["Q"].shape[1]
    first = mamba3_mimo(**_slice(a, 0, split), return_state=True, initial_state=i)
    second = mamba3_mimo(**_slice(a, split, S), return_state=True,
                         initial_state=tuple(first[1:]))
    got = (torch.cat([first[0], second[0]], 1),) + tuple(second[1:])
    want = mamba3_mimo_reference(**ra, return_state=True, initial_state=ri)
    # the loss's weights rounded to each output's dtype: the cotangents the operator is handed
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype).to(F64) for o in got]
    for outs in (got, want):
        sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, weights)).backward()
    errors = {n: rel_rms(g.detach().cpu(), w.detach().cpu())
              for n, g, w in zip(OUT_NAMES, got, want)}
    got_grads, want_grads = _grads(a, i), _grads(ra, ri)
    assert set(got_grads) == set(want_grads)
    errors.update({f"d{n}": rel_rms(g.cpu(), want_grads[n].cpu()) for n, g in got_grads.items()})
    print("\nsplit training " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= THRESHOLDS[dtype]}
    assert not bad, bad


def test_split_training_in_bf16():
    """_split_training_against_whole on a small odd shape (GQA, R = 3, split inside a chunk)
    through the production kernels."""
    _split_training_against_whole(make_args(B=2, S=21, H=4, G=2, R=3, N=12, P=10, chunk_size=4,
                                            seed=133), 10, torch.bfloat16, seed=134)


@requires_gpu
def test_split_full_size_on_the_gpu():
    """_split_training_against_whole at N128_P64_R4_C16 (H = 16), B = 2, S = 2048, bf16, split
    at step 1000 (inside a chunk)."""
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo.problem import Shape
    _split_training_against_whole(operator_inputs(Shape(2, 2048, 16, 1, 128, 64, 4, 16), F64,
                                                  seed=131), 1000, torch.bfloat16, seed=132)


@pytest.mark.parametrize("scan", [True, False], ids=["fused_scan", "split_pass"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
@pytest.mark.parametrize("B", [1, 2])
def test_dense_chains_in_segments(monkeypatch, B, with_state, scan):
    """A dense call with fewer than packed.TARGET_CHAINS batch entries runs its serial passes
    over segments of its chunks (here of a kernel chunk or two: MIN_SEGMENT_CHUNKS = 1) in
    every batch entry, joined: every output and gradient, the initial state's included,
    against the float64 reference (with the split state pass only the reverse scan runs in
    segments)."""
    from mamba3_mimo.phases import packed
    monkeypatch.setattr(packed, "MIN_SEGMENT_CHUNKS", 1)
    packed.segments.cache_clear()
    made = []
    segments = packed.segments
    monkeypatch.setattr(packed, "segments", lambda *a: made.append(segments(*a)) or made[-1])
    args = make_args(B=B, S=45, H=2, G=1, R=3, N=12, P=10, chunk_size=4, seed=57)
    a, i = _ours(args, state_for(args, seed=58) if with_state else None)
    with configs.override(state=[StateConfig(scan=scan, BJ=16, BP=16)]):
        got_out, got_grads = _run(mamba3_mimo, a, i)
    assert made and made[0] is not None and made[0].n_segs > 1, made
    ra, ri = _f64(a, i)
    want_out, want_grads = _run(mamba3_mimo_reference, ra, ri)
    _assert_within(got_out, want_out, "outputs")
    _assert_within(got_grads, want_grads, "gradients")
    segments.cache_clear()


BATCH_GROUP_CASES = {
    # name: (make_args kwargs, operator kwargs, return_state)
    "tiles": (dict(B=3, S=13, H=4, G=2, R=3, N=12, P=10, chunk_size=4, rotary_dim_divisor=2),
              {}, False),
    "final_states": (dict(B=3, S=13, H=4, G=2, R=3, N=12, P=10, chunk_size=4), {}, True),
    "per_rank": (dict(B=3, S=9, H=2, G=1, R=2, N=8, P=6, chunk_size=5, z=False, d=False,
                      mimo_out=False), {}, True),
    "norm": (dict(B=3, S=10, H=2, G=1, R=2, N=8, P=12, chunk_size=3),
             dict(fuse_pregate_headwise_rms_norm=True), True),
}


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("case", list(BATCH_GROUP_CASES))
def test_backward_in_batch_groups(case, group):
    """The backward's output-stage gradient and phase 2 run per group of batch entries
    (configs.backward_group; here 3 entries in groups of 1 or 2): every gradient, the initial
    state's included, within the threshold of the float64 reference, and the gradients with a
    batch axis bit for bit those of one group (each entry's rows are computed from that entry
    alone; the parameters' sums over the entries are added group by group)."""
    make_kw, op_kw, return_state = BATCH_GROUP_CASES[case]
    args = make_args(**make_kw, seed=61)
    init = state_for(args, seed=62)
    results = []
    for entries in (3, group):
        a, i = _ours(args, init)
        with configs.override(backward_group=entries):
            results.append(_run(mamba3_mimo, a, i, return_state=return_state, **op_kw))
    (whole_out, whole), (got_out, got) = results
    ra, ri = _f64(a, i)
    want_out, want = _run(mamba3_mimo_reference, ra, ri, return_state=return_state, **op_kw)
    assert set(got) == set(want)
    _assert_within(got, want, "gradients")
    per_entry = ("Q", "K", "V", "Z", "ADT", "DT", "Trap", "Angles") + tuple(
        f"initial_{n}" for n in STATE_NAMES)
    for name in set(per_entry) & set(got):
        assert torch.equal(got[name], whole[name]), name
