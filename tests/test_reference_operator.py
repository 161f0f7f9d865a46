"""The float64 references of the whole operator (SPEC sections 6 and 7) checked against each other
and against the properties the SPEC states: chunked == per-step (outputs, final states and every
gradient), chunk-size independence, splitting a sequence across calls, packed sequences, a zero
initial state, gradients into initial_state and out of final_state, and the output stage written
out from its formulas. CPU only, small odd shapes."""
import math

import pytest
import torch

from mamba3_mimo.inputs import Shape, operator_inputs
from mamba3_mimo.reference import mamba3_mimo_reference, mamba3_mimo_stepwise

F64 = torch.float64
TOL = 1e-10
STATE_NAMES = ("final_angle", "final_state", "final_k", "final_v")
INPUT_NAMES = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
               "MIMO_Out", "Angles", "D", "Z")


def make_args(B=2, S=13, H=4, G=2, R=3, N=12, P=10, chunk_size=4, rotary_dim_divisor=2, z=True,
              d=True, mimo_out=True, dt_shift=-3.0, seed=0):
    """Arguments of the operator by name, float64 (inputs.operator_inputs)."""
    return operator_inputs(Shape(B, S, H, G, N, P, R, chunk_size, rotary_dim_divisor), F64,
                           z_gate=z, d_skip=d, mimo_out=mimo_out, dt_shift=dt_shift, seed=seed)


def make_state(B, H, R, N, P, RD, seed=1, zero=False):
    """An initial_state tuple (angle [B,H,RD], state [B,H,P,N], k [B,R,H,N], v [B,H,P])."""
    if zero:
        return (torch.zeros(B, H, RD, dtype=F64), torch.zeros(B, H, P, N, dtype=F64),
                torch.zeros(B, R, H, N, dtype=F64), torch.zeros(B, H, P, dtype=F64))
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(B, H, RD, generator=gen, dtype=F64) * 2 * math.pi,
            torch.randn(B, H, P, N, generator=gen, dtype=F64) * 0.5,
            torch.randn(B, R, H, N, generator=gen, dtype=F64),
            torch.randn(B, H, P, generator=gen, dtype=F64))


def state_for(args, seed=1, zero=False):
    B, S, R, G, N = args["Q"].shape
    H, P = args["V"].shape[2:]
    return make_state(B, H, R, N, P, args["Angles"].shape[-1], seed=seed, zero=zero)


def leaves(args, initial_state=None, norm_weight=None):
    """Fresh leaf copies that require grad, of every tensor input (None kept)."""
    def leaf(x):
        return None if x is None else x.detach().clone().requires_grad_(True)

    new = {k: (leaf(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    init = None if initial_state is None else tuple(leaf(x) for x in initial_state)
    return new, init, leaf(norm_weight)


def run_with_grads(fn, args, initial_state=None, norm_weight=None, seed=7, **kw):
    """Outputs (out + the 4 states) and the gradients of a random linear loss on all five."""
    a, init, w = leaves(args, initial_state, norm_weight)
    if w is not None:
        kw["outproj_norm_weight"] = w
    outs = fn(**a, return_state=True, initial_state=init, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outs)
    loss.backward()
    grads = {k: a[k].grad for k in INPUT_NAMES if a[k] is not None}
    if init is not None:
        grads.update({f"initial_{n}": x.grad for n, x in zip(STATE_NAMES, init)})
    if w is not None:
        grads["outproj_norm_weight"] = w.grad
    return [o.detach() for o in outs], grads


def assert_close(a, b, what, tol=TOL):
    assert a.shape == b.shape, f"{what}: shape {list(a.shape)} vs {list(b.shape)}"
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= tol * max(scale, 1e-300) or err == 0.0, (
        f"{what}: max |diff| {err:.3e}, max |ref| {scale:.3e}")


def assert_outputs_close(a, b, what, tol=TOL):
    for name, x, y in zip(("out",) + STATE_NAMES, a, b):
        assert_close(x, y, f"{what}{name}", tol)


# ------------------------------------------------------------ (a) chunked == stepwise

CASES = {
    # name: (make_args kwargs, operator kwargs, initial state?, norm weight shape)
    "z_d": (dict(chunk_size=4, rotary_dim_divisor=2), {}, False, None),
    "noz_nod": (dict(chunk_size=5, rotary_dim_divisor=4, z=False, d=False), {}, False, None),
    "z_nod_rd4": (dict(chunk_size=4, rotary_dim_divisor=4, d=False), {}, False, None),
    "per_rank": (dict(chunk_size=5, mimo_out=False), {}, False, None),
    "per_rank_noz": (dict(chunk_size=4, mimo_out=False, z=False), {}, False, None),
    "norm_w": (dict(chunk_size=5), dict(fuse_pregate_headwise_rms_norm=True), False, "HP"),
    "norm_none": (dict(chunk_size=4, rotary_dim_divisor=4),
                  dict(fuse_pregate_headwise_rms_norm=True), False, None),
    "norm_flat": (dict(chunk_size=4), dict(fuse_pregate_headwise_rms_norm=True), False, "H*P"),
    "init_state": (dict(chunk_size=5), {}, True, None),
    "init_state_norm": (dict(chunk_size=4, rotary_dim_divisor=4),
                        dict(fuse_pregate_headwise_rms_norm=True), True, "HP"),
    "gqa1_r1": (dict(chunk_size=4, G=1, R=1), {}, True, None),
    "varlen": (dict(B=1, chunk_size=4), dict(cu_seqlens=torch.tensor([0, 1, 6, 13])), True, None),
}


def _norm_weight(kind, H=4, P=10, seed=3):
    if kind is None:
        return None
    w = 1 + 0.3 * torch.randn(H, P, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return w if kind == "HP" else w.reshape(H * P)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_stepwise(case):
    make_kw, op_kw, with_state, weight_kind = CASES[case]
    args = make_args(**make_kw)
    rows = 3 if "cu_seqlens" in op_kw else args["Q"].shape[0]
    init = None
    if with_state:
        init = make_state(rows, args["V"].shape[2], args["Q"].shape[2], args["Q"].shape[4],
                          args["V"].shape[3], args["Angles"].shape[-1])
    w = _norm_weight(weight_kind)
    outs_c, grads_c = run_with_grads(mamba3_mimo_reference, args, init, w, **op_kw)
    outs_s, grads_s = run_with_grads(mamba3_mimo_stepwise, args, init, w, **op_kw)
    B, S, R, G, N = args["Q"].shape
    H, P = args["V"].shape[2:]
    out_shape = (B, S, H, P) if args["MIMO_Out"] is not None else (B, S, R, H, P)
    assert tuple(outs_c[0].shape) == out_shape and outs_c[0].dtype == F64
    assert [tuple(o.shape) for o in outs_c[1:]] == [
        (rows, H, args["Angles"].shape[-1]), (rows, H, P, N), (rows, R, H, N), (rows, H, P)]
    assert_outputs_close(outs_c, outs_s, f"{case}: ")
    assert grads_c.keys() == grads_s.keys()
    expected = {k for k in INPUT_NAMES if args[k] is not None}
    assert expected <= grads_c.keys()
    for name in grads_c:
        assert grads_c[name] is not None, f"{case}: no gradient for {name}"
        assert torch.isfinite(grads_c[name]).all()
        assert_close(grads_c[name], grads_s[name], f"{case}: d{name}")
    assert grads_c["ADT"].abs().max() > 0 and grads_c["Angles"].abs().max() > 0


# ------------------------------------------------------------ (b) chunk size


@pytest.mark.parametrize("rdd", [2, 4])
def test_independent_of_chunk_size(rdd):
    args = make_args(rotary_dim_divisor=rdd, seed=11)
    init = state_for(args, seed=12)
    base = mamba3_mimo_reference(**{**args, "chunk_size": 4}, return_state=True,
                                 initial_state=init)
    for C in (1, 3, 5, 13, 16):
        other = mamba3_mimo_reference(**{**args, "chunk_size": C}, return_state=True,
                                      initial_state=init)
        assert_outputs_close(other, base, f"C={C} vs C=4: ")


# ------------------------------------------------------------ (c) split across calls


def _slice(args, lo, hi):
    """The operator's arguments restricted to steps lo..hi-1 (differentiable slices)."""
    seq = dict(args)
    for k in ("Q", "K", "V", "Angles", "Z"):
        if seq[k] is not None:
            seq[k] = seq[k][:, lo:hi]
    for k in ("ADT", "DT", "Trap"):
        seq[k] = seq[k][..., lo:hi]
    return seq


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
@pytest.mark.parametrize("dt_shift", [-3.0, 1.5], ids=["small_dt", "large_dt"])
def test_split_matches_whole(dt_shift, with_state):
    """out(x[:s]) ++ out(x[s:], initial_state=state(x[:s])) == out(x), same final states, for s = 1,
    s inside a chunk, s at a chunk boundary and s = S-1 (chunk_size 4, S = 13). large_dt makes the
    running angle wrap around 2*pi."""
    args = make_args(dt_shift=dt_shift, seed=21)
    init = state_for(args, seed=22) if with_state else None
    whole = mamba3_mimo_reference(**args, return_state=True, initial_state=init)
    if dt_shift > 0:
        raw = (torch.tanh(args["Angles"]) * math.pi * args["DT"].transpose(1, 2)[..., None]).sum(1)
        assert raw.max() > 2 * math.pi
    assert (whole[1] >= 0).all() and (whole[1] < 2 * math.pi).all(), "final_angle not mod 2*pi"
    S = args["Q"].shape[1]
    for s in (1, 4, 6, 8, S - 1):
        first = mamba3_mimo_reference(**_slice(args, 0, s), return_state=True, initial_state=init)
        second = mamba3_mimo_reference(**_slice(args, s, S), return_state=True,
                                       initial_state=tuple(first[1:]))
        out = torch.cat([first[0], second[0]], 1)
        assert_outputs_close((out, *second[1:]), whole, f"split at {s}: ")


@pytest.mark.parametrize("ref", [mamba3_mimo_reference, mamba3_mimo_stepwise],
                         ids=["chunked", "stepwise"])
def test_split_gradients(ref):
    """Chaining two calls through a differentiable state gives the gradients of the whole call:
    gradients leave the first call's final state and enter the second call's initial_state. The
    loss also reads the final state of the chain."""
    args = make_args(seed=31, chunk_size=5)
    init = state_for(args, seed=32)
    gen = torch.Generator().manual_seed(33)
    g_out = torch.randn(args["V"].shape, generator=gen, dtype=F64)
    g_state = torch.randn(init[1].shape, generator=gen, dtype=F64)

    def grads(split):
        a, i, _ = leaves(args, init)
        if split is None:
            out, _, state, _, _ = ref(**a, return_state=True, initial_state=i)
        else:
            first = ref(**_slice(a, 0, split), return_state=True, initial_state=i)
            second = ref(**_slice(a, split, a["Q"].shape[1]), return_state=True,
                         initial_state=tuple(first[1:]))
            out, state = torch.cat([first[0], second[0]], 1), second[2]
        ((out * g_out).sum() + (state * g_state).sum()).backward()
        found = {k: a[k].grad for k in INPUT_NAMES if a[k] is not None}
        found.update({f"initial_{n}": x.grad for n, x in zip(STATE_NAMES, i)})
        return found

    whole = grads(None)
    for s in (1, 5, 7):
        for name, g in grads(s).items():
            assert_close(g, whole[name], f"split at {s}: d{name}")


# ------------------------------------------------------------ (d) packed sequences


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
@pytest.mark.parametrize("ref", [mamba3_mimo_reference, mamba3_mimo_stepwise],
                         ids=["chunked", "stepwise"])
def test_cu_seqlens_matches_separate_runs(ref, with_state):
    args = make_args(B=1, seed=41, chunk_size=4)
    lengths = [1, 5, 7]
    cu = torch.tensor([0, 1, 6, 13], dtype=torch.int32)
    B, S, R, G, N = args["Q"].shape
    H, P = args["V"].shape[2:]
    init = make_state(len(lengths), H, R, N, P, args["Angles"].shape[-1], seed=42) \
        if with_state else None
    packed = ref(**args, return_state=True, cu_seqlens=cu, initial_state=init)
    assert packed[0].shape[:2] == (1, sum(lengths))
    assert all(x.shape[0] == len(lengths) for x in packed[1:])
    lo = 0
    for i, n in enumerate(lengths):
        one_init = None if init is None else tuple(x[i:i + 1] for x in init)
        alone = ref(**_slice(args, lo, lo + n), return_state=True, initial_state=one_init)
        assert_close(packed[0][:, lo:lo + n], alone[0], f"sequence {i}: out")
        for name, x, y in zip(STATE_NAMES, packed[1:], alone[1:]):
            assert_close(x[i:i + 1], y, f"sequence {i}: {name}")
        lo += n


# ------------------------------------------------------------ (e) zero initial state


@pytest.mark.parametrize("ref", [mamba3_mimo_reference, mamba3_mimo_stepwise],
                         ids=["chunked", "stepwise"])
def test_zero_initial_state_is_no_initial_state(ref):
    args = make_args(seed=51, chunk_size=5, rotary_dim_divisor=4)
    outs_none, grads_none = run_with_grads(ref, args, None)
    outs_zero, grads_zero = run_with_grads(ref, args, state_for(args, zero=True))
    assert_outputs_close(outs_zero, outs_none, "zero vs none: ")
    for name, g in grads_none.items():
        assert_close(grads_zero[name], g, f"zero vs none: d{name}")


# ------------------------------------------------------------ (f) finite differences


def test_initial_state_gradients_by_finite_differences():
    """d loss / d initial_state (angle, state, k, v) on a few elements against central differences,
    with a loss reading out and all four final states."""
    args = make_args(seed=61, chunk_size=4)
    init = state_for(args, seed=62)
    gen = torch.Generator().manual_seed(63)
    outs0 = mamba3_mimo_reference(**args, return_state=True, initial_state=init)
    weights = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs0]

    def loss(state):
        outs = mamba3_mimo_reference(**args, return_state=True, initial_state=state)
        return sum((o * w).sum() for o, w in zip(outs, weights))

    _, i, _ = leaves({}, init)
    loss(i).backward()
    eps = 1e-6
    picks = [(0, (1, 2, 3)), (1, (0, 3, 4, 5)), (1, (1, 0, 9, 11)), (2, (1, 2, 3, 7)),
             (3, (0, 1, 8))]
    for which, index in picks:
        plus = [x.clone() for x in init]
        minus = [x.clone() for x in init]
        plus[which][index] += eps
        minus[which][index] -= eps
        fd = (loss(tuple(plus)) - loss(tuple(minus))).item() / (2 * eps)
        ad = i[which].grad[index].item()
        assert abs(fd - ad) <= 1e-6 * max(1.0, abs(ad)), (
            f"initial_{STATE_NAMES[which]}{list(index)}: autograd {ad:.9e}, finite diff {fd:.9e}")
        assert ad != 0.0


# ------------------------------------------------------------ output stage, dtypes


@pytest.mark.parametrize("weight_kind", [None, "HP", "H*P"])
def test_output_stage_formulas(weight_kind):
    """The reduced and normalized outputs written out from SPEC section 6, from the per-rank raw_y
    (MIMO_Out, Z and MIMO_Z None: no gate, no reduction)."""
    args = make_args(seed=71)
    raw_y = mamba3_mimo_reference(**{**args, "MIMO_Out": None, "Z": None, "MIMO_Z": None})
    gate = torch.nn.functional.silu(args["Z"][:, :, None] * args["MIMO_Z"].transpose(0, 1))
    phi = args["MIMO_Out"].transpose(0, 1)  # [R, H, P]
    per_rank = mamba3_mimo_reference(**{**args, "MIMO_Out": None})
    assert_close(per_rank, gate * raw_y, "per-rank output")
    out = mamba3_mimo_reference(**args)
    assert_close(out, (phi * gate * raw_y).sum(2), "reduced output")
    eps = 1e-3
    w = _norm_weight(weight_kind)
    w_hp = torch.ones(4, 10, dtype=F64) if w is None else w.reshape(4, 10)
    y = raw_y / torch.sqrt(raw_y.pow(2).mean(-1, keepdim=True) + eps) * w_hp
    normed = mamba3_mimo_reference(**args, fuse_pregate_headwise_rms_norm=True,
                                   outproj_norm_weight=w, outproj_norm_eps=eps)
    assert_close(normed, (phi * gate * y).sum(2), "fused pre-gate RMSNorm output")


def test_dtypes_and_errors():
    args = make_args(seed=81)
    outs = mamba3_mimo_reference(**{**args, "dtype": torch.float32}, return_state=True)
    assert outs[0].dtype == torch.float32
    assert all(o.dtype == F64 for o in outs[1:])
    single = {**args, "dtype": torch.float32}
    for k in ("Q", "K", "V", "Z"):
        single[k] = single[k].to(torch.bfloat16)
    for k in ("ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z", "MIMO_Out", "Angles",
              "D"):
        single[k] = single[k].float()
    out32 = mamba3_mimo_reference(**single, compute_dtype=torch.float32)
    assert out32.dtype == torch.float32
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba3_mimo_reference(**args, cu_seqlens=torch.tensor([0, 13]))
    with pytest.raises(ValueError, match="MIMO_Z"):
        mamba3_mimo_reference(**{**args, "MIMO_Z": None})
    # MIMO_Z without Z is unused (flash-linear-attention's layer passes it so)
    assert torch.equal(mamba3_mimo_reference(**{**args, "Z": None}),
                       mamba3_mimo_reference(**{**args, "Z": None, "MIMO_Z": None}))
    with pytest.raises(ValueError, match="fuse_pregate"):
        mamba3_mimo_reference(**{**args, "MIMO_Out": None}, fuse_pregate_headwise_rms_norm=True)
    with pytest.raises(ValueError, match="rotary_dim_divisor"):
        mamba3_mimo_reference(**{**args, "rotary_dim_divisor": 4})


def test_state_outputs_formulas():
    """final_angle, final_k and final_v written out from SPEC section 6 with explicit loops (the
    preprocessing both references share): the running angle sum mod 2*pi after each prefix, kr of
    the last step (head h reads q/k group h // (H // G), bias per value head, rotate-half on the
    first RD pairs) and V of the last step."""
    args = make_args(seed=91, rotary_dim_divisor=4, dt_shift=1.0)
    B, S, R, G, N = args["Q"].shape
    H = args["V"].shape[2]
    RD = args["Angles"].shape[-1]
    for s in (1, 2, 7, S):
        _, angle, _, k_last, v_last = mamba3_mimo_reference(**_slice(args, 0, s),
                                                            return_state=True)
        for b in range(B):
            for h in range(H):
                total = torch.zeros(RD, dtype=F64)
                for u in range(s):
                    total += torch.tanh(args["Angles"][b, u, h]) * math.pi * args["DT"][b, h, u]
                assert_close(angle[b, h], torch.remainder(total, 2 * math.pi), f"angle s={s}")
                for r in range(R):
                    kb = args["K"][b, s - 1, r, h // (H // G)] + args["K_bias"][h, r]
                    kr = kb.clone()
                    for n in range(RD):
                        c, sn = torch.cos(total[n]), torch.sin(total[n])
                        kr[n] = c * kb[n] - sn * kb[N // 2 + n]
                        kr[N // 2 + n] = sn * kb[n] + c * kb[N // 2 + n]
                    assert_close(k_last[b, r, h], kr, f"final_k s={s}")
        assert torch.equal(v_last, args["V"][:, s - 1])
