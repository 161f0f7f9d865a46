"""The float64 oracle checked against itself: chunked vs per-step, chunk-size independence, and the
SPEC section 3 definitions of states, qk_dot and dmimo_o computed directly."""
import math

import pytest
import torch

from conftest import seed_for
from mamba3_mimo import reference as ref
from mamba3_mimo.inputs import Shape, make_inputs

F64 = torch.float64
FWD_KEYS = ("q", "k", "v", "q_bias", "k_bias", "mimo_v", "angles", "dt", "trap")

# (B, S, H, G, N, P, R, z_gate, d_skip): GQA, partial chunks, R = 1 and R > 1, Z and D on/off
SHAPES = [
    (1, 40, 2, 1, 16, 8, 2, True, True),
    (2, 33, 4, 2, 16, 8, 3, False, True),
    (1, 48, 2, 2, 32, 16, 1, True, False),
]


def _inputs(B, S, H, G, N, P, R, z_gate, d_skip, C=16):
    shape = Shape(B, S, H, G, N, P, R, C)
    return make_inputs(shape, torch.float32, z_gate, d_skip, seed=seed_for("ref", shape))


def _chunked_raw_y(x, C):
    """raw_y, states, qk_dot from chunked_forward with float64 decay pieces rebuilt for C."""
    da_cs, da_cs_rev, segsum = ref.decay_pieces(x["adt"].to(F64), C)
    fwd = {k: x[k] for k in FWD_KEYS}
    return ref.chunked_forward(**fwd, da_cs=da_cs, da_cs_rev=da_cs_rev, segsum=segsum, d=x["d"],
                               chunk_size=C, dtype=F64)


def _rel_max(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("C", [8, 16])
@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "B{}_S{}_H{}_G{}_N{}_P{}_R{}_z{:d}_d{:d}".format(*d))
def test_stepwise_matches_chunked(dims, C):
    x = _inputs(*dims)
    step = ref.stepwise_raw_y(**{k: x[k] for k in FWD_KEYS}, adt=x["adt"], d=x["d"], dtype=F64)
    raw_y, _, _ = _chunked_raw_y(x, C)
    assert raw_y.dtype == F64 and raw_y.shape == step.shape
    err = _rel_max(raw_y, step)
    print(f"\nraw_y chunked(C={C}) vs stepwise: rel max {err:.2e}", end="")
    assert err <= 1e-10


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "B{}_S{}_H{}_G{}_N{}_P{}_R{}_z{:d}_d{:d}".format(*d))
def test_out_independent_of_chunk_size(dims):
    """out = reduce_out(raw_y) is the same for C = 8, 16 and C = 16 not dividing S = 40, and
    C = 13 dividing none of the shapes."""
    x = _inputs(*dims)
    S = x["q"].shape[1]
    outs = {}
    for C in (8, 16, 13):
        raw_y, _, _ = _chunked_raw_y(x, C)
        outs[C] = ref.reduce_out(raw_y, x["mimo_o"].to(F64),
                                 None if x["mimo_z"] is None else x["mimo_z"].to(F64),
                                 None if x["z"] is None else x["z"].to(F64))
        assert outs[C].shape == (x["q"].shape[0], S, x["v"].shape[2], x["v"].shape[3])
    for C in (16, 13):
        assert _rel_max(outs[C], outs[8]) <= 1e-10, f"C={C} vs C=8"


def _prepared(x):
    """qb, kb [B,S,R,H,N] (bias added, per head), qr, kr rotated, psi_v [B,S,R,H,P], gamma and
    trap_scale [B,H,S], straight from the SPEC formulas."""
    q, k, v = x["q"].to(F64), x["k"].to(F64), x["v"].to(F64)
    H = v.shape[2]
    G = q.shape[3]
    g_of_h = torch.arange(H) // (H // G)
    qb = q[:, :, :, g_of_h] + x["q_bias"].to(F64).transpose(0, 1)
    kb = k[:, :, :, g_of_h] + x["k_bias"].to(F64).transpose(0, 1)
    ang = x["angles"].to(F64)[:, :, None]  # [B,S,1,H,RD]
    N, RD = q.shape[-1], ang.shape[-1]

    def rot(t):
        out = t.clone()
        a, b = t[..., :RD], t[..., N // 2:N // 2 + RD]
        out[..., :RD] = ang.cos() * a - ang.sin() * b
        out[..., N // 2:N // 2 + RD] = ang.sin() * a + ang.cos() * b
        return out

    dt, trap = x["dt"].to(F64), x["trap"].to(F64)
    gamma = dt * torch.sigmoid(trap)
    trap_scale = gamma.clone()
    trap_scale[..., :-1] += dt[..., 1:] * torch.sigmoid(-trap[..., 1:])
    psi_v = v[:, :, None] * x["mimo_v"].to(F64).transpose(0, 1)
    return qb, kb, rot(qb), rot(kb), psi_v, gamma, trap_scale


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "B{}_S{}_H{}_G{}_N{}_P{}_R{}_z{:d}_d{:d}".format(*d))
def test_reference_matches_spec_definitions(dims):
    """states (SPEC 3: the state entering chunk c), qk_dot and dmimo_o, dmimo_z, dz by their
    closed forms, against bwd_fwd_reference in float64."""
    C = 16
    x = _inputs(*dims, C=C)
    B, S, R, G, N = x["q"].shape
    H = x["v"].shape[2]
    nc = math.ceil(S / C)
    kwargs = {k: v for k, v in x.items() if k != "adt"}
    kwargs.update(zip(("da_cs", "da_cs_rev", "segsum"), ref.decay_pieces(x["adt"].to(F64), C)))
    states, qk_dot, dmimo_o, dmimo_z, dz = ref.bwd_fwd_reference(**kwargs, dtype=F64)

    qb, kb, qr, kr, psi_v, gamma, trap_scale = _prepared(x)
    A = x["adt"].to(F64).cumsum(-1)  # [B,H,S]
    want = torch.zeros(B, H, nc, N, x["v"].shape[3], dtype=F64)
    for c in range(1, nc):
        end = c * C  # steps t' < end contribute, decayed to A[end - 1]
        w = trap_scale[..., :end] * (A[..., end - 1:end] - A[..., :end]).exp()  # [B,H,end]
        want[:, :, c] = torch.einsum("bsrhn,bhs,bsrhp->bhnp", kr[:, :end], w, psi_v[:, :end])
    assert _rel_max(states, want) <= 1e-10
    assert torch.equal(states[:, :, 0], torch.zeros_like(states[:, :, 0]))

    want_qk = torch.einsum("bsrhn,bsuhn->bhsru", qr, kr)  # rotation is orthogonal: = qb . kb
    assert _rel_max(qk_dot, want_qk) <= 1e-12

    raw_y, _, _ = _chunked_raw_y(x, C)
    dout = x["dout"].to(F64)[:, :, :, None]  # [B,S,H,1,P]
    phi = x["mimo_o"].to(F64)
    if x["z"] is None:
        gate, dgate = torch.ones_like(raw_y), None
    else:
        u = x["z"].to(F64)[:, :, :, None] * x["mimo_z"].to(F64)
        gate = torch.nn.functional.silu(u)
        sig = torch.sigmoid(u)
        dgate = sig * (1 + u * (1 - sig))  # silu'(u)
    assert _rel_max(dmimo_o, torch.einsum("bshrp->bhrp", dout * gate * raw_y)) <= 1e-12
    if dgate is None:
        assert dmimo_z is None and dz is None
    else:
        common = dout * phi * raw_y * dgate
        assert _rel_max(dmimo_z, torch.einsum("bshrp,bshp->bhrp", common,
                                              x["z"].to(F64))) <= 1e-12
        assert _rel_max(dz, (common * x["mimo_z"].to(F64)).sum(3)) <= 1e-12


def test_decay_pieces_partial_chunk():
    """da_cs, da_cs_rev and segsum of SPEC section 2, including a partial last chunk."""
    adt = -torch.rand(2, 3, 37, dtype=F64, generator=torch.Generator().manual_seed(seed_for("dp")))
    C = 16
    da_cs, da_cs_rev, segsum = ref.decay_pieces(adt, C)
    A = adt.cumsum(-1)
    nc = math.ceil(37 / C)
    assert segsum.shape == (2, 3, nc, C, C)
    for t in range(37):
        c = t // C
        start = A[..., c * C - 1] if c else torch.zeros_like(A[..., 0])
        end = A[..., min(c * C + C, 37) - 1]
        torch.testing.assert_close(da_cs[..., t], A[..., t] - start, rtol=0, atol=1e-12)
        torch.testing.assert_close(da_cs_rev[..., t], end - A[..., t], rtol=0, atol=1e-12)
    for c in range(nc):
        for i in range(min(C, 37 - c * C)):
            for j in range(i):
                torch.testing.assert_close(segsum[:, :, c, i, j], A[..., c * C + i] - A[..., c * C + j],
                                           rtol=0, atol=1e-12)
    assert torch.equal(segsum.triu(), torch.zeros_like(segsum))
