"""Upstream's decode entry points on our kernels (mamba3_mimo/upstream.py), called as
flash-linear-attention's Mamba3 layer calls them for each generated token: the rotation
(`apply_rotary_qk_inference_fwd`, q and k expanded over the heads), then the step
(`mamba3_step_fn`, trap given as sigmoid(Trap), A rather than ADT), then the caller's copies of
the angle, k and v states. A prefill by the operator followed by such steps gives the operator's
outputs over the whole sequence; the rotation's other forms match upstream's definition."""
import math

import pytest
import torch

from conftest import DEVICE
from test_decode import _fp32, _steps
from test_reference_operator import make_args
from mamba3_mimo import compat, mamba3_mimo
from mamba3_mimo.testing import THRESHOLDS, rel_rms

LIMIT = THRESHOLDS[torch.float32]


def _layer_step(a, t, state, per_rank):
    """One token t through the two functions as the layer's `step` calls them; the states
    (angle, ssm, k, v) updated as the layer updates them. Returns the token's output."""
    from mamba_ssm.ops.cute.mamba3.mamba3_step_fn import mamba3_step_fn
    from mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step import (
        apply_rotary_qk_inference_fwd)
    angle_state, ssm_state, k_state, v_state = state
    H = a["V"].shape[2]
    G = a["Q"].shape[3]
    heads = lambda x: x[:, t].repeat_interleave(H // G, dim=2)  # noqa: E731 - [B, R, H, N]
    DT, ADT = a["DT"][:, :, t], a["ADT"][:, :, t]
    C, B, nxt_angle = apply_rotary_qk_inference_fwd(
        q=heads(a["Q"]), k=heads(a["K"]), angle_state=angle_state,
        angle_proj=a["Angles"][:, t], dt=DT, bias_q=a["Q_bias"].transpose(0, 1),
        bias_k=a["K_bias"].transpose(0, 1), conjugate=False, inplace=False,
        rotate_pairwise=False)
    x = a["V"][:, t]
    xpj = a["MIMO_V"].transpose(0, 1).contiguous()
    trap = torch.sigmoid(a["Trap"][:, :, t])
    if per_rank:
        y = torch.empty(x.shape[0], xpj.shape[0], H, x.shape[-1], dtype=x.dtype, device=DEVICE)
        mamba3_step_fn(ssm_state, k_state, v_state, ADT / DT, B, C, a["D"], x, DT, trap, xpj,
                       outproj=None, state_out=None, out=y, z=None, zproj=None, tile_D=64,
                       num_warps=4)
    else:
        y = torch.empty_like(x)
        mamba3_step_fn(ssm_state, k_state, v_state, ADT / DT, B, C, a["D"], x, DT, trap, xpj,
                       outproj=a["MIMO_Out"].transpose(0, 1).contiguous(), state_out=None,
                       out=y, z=a["Z"][:, t],
                       zproj=a["MIMO_Z"].transpose(0, 1).contiguous(), tile_D=64, num_warps=4)
    angle_state.copy_(nxt_angle)
    k_state.copy_(B)
    v_state.copy_(x)
    return y


@pytest.fixture
def switched():
    compat.uninstall()
    assert compat.install()
    yield
    compat.uninstall()


@pytest.mark.parametrize("per_rank", [False, True], ids=["z_gate_out_proj", "per_rank"])
def test_layer_decode_equals_forward(switched, per_rank):
    """Prefill 6 tokens with the operator, then 4 tokens through upstream's two decode functions
    (GQA: q and k repeated over the heads of their group): the outputs are the operator's over
    the 10 tokens, and so are the states the caller kept."""
    S, T = 6, 4
    a = _fp32(make_args(B=2, S=S + T, H=4, G=2, R=3, N=12, P=10, chunk_size=4,
                        rotary_dim_divisor=2, z=not per_rank, mimo_out=not per_rank, seed=111))
    whole = mamba3_mimo(**a, return_state=True)
    state = tuple(x.clone() for x in mamba3_mimo(**_steps(a, 0, S), return_state=True)[1:])
    outs = [_layer_step(a, t, state, per_rank) for t in range(S, S + T)]
    err = rel_rms(torch.stack(outs, 1).cpu(), whole[0][:, S:].cpu())
    assert err <= LIMIT, f"decoded outputs: {err:.2e}"
    for name, got, want in zip(("angle", "state", "k", "v"), state, whole[1:]):
        err = rel_rms(got.cpu(), want.cpu())
        assert err <= LIMIT, f"state {name} after decoding: {err:.2e}"


def test_step_into_state_out(switched):
    """With state_out the new state goes there and the given state is left as it was."""
    from mamba_ssm.ops.cute.mamba3.mamba3_step_fn import mamba3_step_fn
    g = torch.Generator().manual_seed(7)
    Bsz, R, H, N, P = 2, 2, 3, 8, 6
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    args = (rnd(Bsz, R, H, N), rnd(Bsz, H, P), -rnd(Bsz, H).abs(), rnd(Bsz, R, H, N),
            rnd(Bsz, R, H, N), rnd(H), rnd(Bsz, H, P), rnd(Bsz, H).abs(),
            torch.rand(Bsz, H, generator=g).to(DEVICE), rnd(R, H, P))
    state = rnd(Bsz, H, P, N)
    before, in_place = state.clone(), state.clone()
    out_a, out_b = torch.empty(Bsz, R, H, P, device=DEVICE), torch.empty(Bsz, R, H, P,
                                                                           device=DEVICE)
    state_out = torch.full_like(state, float("nan"))
    mamba3_step_fn(state, *args, state_out=state_out, out=out_a)
    mamba3_step_fn(in_place, *args, out=out_b)
    assert torch.equal(state, before)
    assert torch.equal(state_out, in_place) and torch.equal(out_a, out_b)
    with pytest.raises(NotImplementedError, match="state_batch_indices"):
        mamba3_step_fn(state, *args, out=out_a,
                       state_batch_indices=torch.zeros(Bsz, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="Bstate"):
        mamba3_step_fn(state, args[0][:, :1], *args[1:], out=out_a)


@pytest.mark.parametrize("pairwise", [False, True], ids=["halves", "pairwise"])
@pytest.mark.parametrize("conjugate", [False, True], ids=["plain", "conjugate"])
def test_rotation_forms(switched, pairwise, conjugate):
    """The rotation against upstream's definition written out (float64): pairs (i, N/2 + i) or
    (2i, 2i + 1) on the first RD pairs, the rest passed through; minus the angle with
    conjugate; inplace writes the results into q, k and the angle state."""
    from mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step import (
        apply_rotary_qk_inference_fwd)
    g = torch.Generator().manual_seed(8)
    Bsz, R, H, N, RD = 2, 3, 4, 12, 4
    q = torch.randn(Bsz, R, 1, N, generator=g).expand(Bsz, R, H, N)  # expanded over the heads
    k = torch.randn(Bsz, R, H, N, generator=g)
    angle, proj = torch.rand(Bsz, H, RD, generator=g) * 6, torch.randn(Bsz, H, RD, generator=g)
    dt, bq, bk = (torch.rand(Bsz, H, generator=g), torch.randn(R, H, N, generator=g),
                  torch.randn(R, H, N, generator=g))
    new = angle.double() + torch.tanh(proj.double()) * dt.double()[..., None] * math.pi
    sign = -1.0 if conjugate else 1.0
    cos, sin = torch.cos(new)[:, None], sign * torch.sin(new)[:, None]

    def want(x, b):
        x = x.double() + b.double()
        i = torch.arange(RD)
        a_i, b_i = (2 * i, 2 * i + 1) if pairwise else (i, N // 2 + i)
        out = x.clone()
        out[..., a_i] = cos * x[..., a_i] - sin * x[..., b_i]
        out[..., b_i] = sin * x[..., a_i] + cos * x[..., b_i]
        return out

    dev = [t.to(DEVICE) for t in (q, k, angle, proj, dt, bq, bk)]
    q_out, k_out, nxt = apply_rotary_qk_inference_fwd(*dev, conjugate=conjugate,
                                                       rotate_pairwise=pairwise)
    assert rel_rms(q_out.cpu(), want(q, bq)) <= LIMIT and rel_rms(k_out.cpu(), want(k, bk)) <= LIMIT
    wrapped = torch.remainder(nxt.cpu().double() - new + math.pi, 2 * math.pi) - math.pi
    assert wrapped.abs().max() <= 1e-5 and nxt.min() >= 0 and nxt.max() < 2 * math.pi
    qi, ki, ai = dev[0].contiguous(), dev[1].clone(), dev[2].clone()
    res = apply_rotary_qk_inference_fwd(qi, ki, ai, *dev[3:], inplace=True, conjugate=conjugate,
                                        rotate_pairwise=pairwise)
    assert res[0] is qi and res[1] is ki and res[2] is ai
    assert torch.equal(qi, q_out) and torch.equal(ki, k_out) and torch.equal(ai, nxt)


def test_bad_arguments(switched):
    """Shapes that upstream's functions would refuse raise errors naming the argument."""
    from mamba3_mimo.upstream import apply_rotary_qk_inference_fwd, mamba3_step_fn
    q = torch.zeros(2, 3, 4, 8, device=DEVICE)
    angle, dt = torch.zeros(2, 4, 2, device=DEVICE), torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="q and k"):
        apply_rotary_qk_inference_fwd(q, q[:1], angle, angle, dt)
    with pytest.raises(ValueError, match="dt"):
        apply_rotary_qk_inference_fwd(q, q, angle, angle, dt[:, :2])
    with pytest.raises(ValueError, match="bias_k"):
        apply_rotary_qk_inference_fwd(q, q, angle, angle, dt, bias_k=torch.zeros(3, 4, 6))
    with pytest.raises(ValueError, match="angle_state"):
        apply_rotary_qk_inference_fwd(q, q, torch.zeros(2, 4, 5, device=DEVICE),
                                      torch.zeros(2, 4, 5, device=DEVICE), dt)
    x = torch.zeros(2, 4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="z needs zproj"):
        mamba3_step_fn(torch.zeros(2, 4, 6, 8, device=DEVICE), q, x, dt, q, q,
                       torch.zeros(4, device=DEVICE), x, dt, dt, torch.zeros(3, 4, 6, device=DEVICE),
                       z=x)
