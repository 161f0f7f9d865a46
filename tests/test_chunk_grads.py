"""Phase 2's first form (kernels/chunk_grads.py): the gradients of raw_y against float64 autograd
through the reference's chunked forward, on small odd shapes (GQA, R = 3, N = 12, P = 10, S not
a multiple of C, D on and off, a final-state gradient). Inputs are padded to whole chunks as
bwd_fwd pads them; the states entering each chunk come from bwd_fwd itself."""
import dataclasses

import pytest
import torch

from conftest import DEVICE
from mamba3_mimo import configs, reference
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo.kernels import chunk_grads, preprocess, step_terms
from mamba3_mimo.phases import bwd_fwd
from mamba3_mimo.problem import Problem
from mamba3_mimo.runtime.plans import placeholder
from mamba3_mimo.testing import THRESHOLDS, rel_rms

F64 = torch.float64


def _case(shape: Shape, d_skip: bool, seed: int):
    a = make_inputs(shape, torch.float32, z_gate=False, d_skip=d_skip, device=DEVICE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, S, H, R, P = shape.B, shape.S, shape.H, shape.R, shape.P
    dy = torch.randn(B, S, H, R, P, generator=gen).to(DEVICE)  # d raw_y, as chunked_forward's
    d_final = torch.randn(B, H, shape.N, P, generator=gen).to(DEVICE)
    return a, dy, d_final


def _golden(a, dy, d_final, shape):
    """Autograd of raw_y . dy + final_state . d_final in float64 through the reference, with
    da_cs, da_cs_rev and segsum built from ADT (reference.decay_pieces) and the final state as
    reference._chunked_scan defines it."""
    names = ("q", "k", "v", "q_bias", "k_bias", "mimo_v", "angles", "dt", "trap", "adt", "d")
    x = {n: (a[n].detach().cpu().to(F64).requires_grad_(True) if a.get(n) is not None else None)
         for n in names}
    da_cs, da_cs_rev, segsum = reference.decay_pieces(x["adt"], shape.C)
    raw_y, _, _ = reference.chunked_forward(x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"],
                                            x["mimo_v"], x["angles"], da_cs, da_cs_rev, x["dt"],
                                            x["trap"], segsum, x["d"], shape.C, F64)
    _, _, _, kr, psi_v, _, trap_scale = reference._prepare(
        x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["angles"], x["dt"],
        x["trap"], F64)
    A = x["adt"].cumsum(-1)
    final = torch.einsum("bsrhn,bhs,bsrhp->bhnp", kr, (A[..., -1:] - A).exp() * trap_scale, psi_v)
    loss = (raw_y * dy.cpu().to(F64)).sum() + (final * d_final.cpu().to(F64)).sum()
    loss.backward()
    return {n: t.grad for n, t in x.items() if t is not None}


def _ours(a, dy, d_final, shape, d_skip, gate=None):
    """The kernels' gradients, reduced to the inputs' as the operator reduces them; with gate =
    (dout, z, mimo_o, mimo_z) (dout and z [B, S, H, P], z and mimo_z None without the gate)
    instead of dy, dy recomputed from them in the kernels."""
    pb = Problem(B=shape.B, S=shape.S, H=shape.H, G=shape.G, N=shape.N, P=shape.P, R=shape.R,
                 C=shape.C, rotary_dim_divisor=shape.rotary_dim_divisor, dtype=torch.float32,
                 has_z=False, has_d=d_skip, output_dtype=torch.float32,
                 device=torch.device(DEVICE))
    args = {n: a.get(n) for n in bwd_fwd.ARG_NAMES}
    args["dout"] = torch.zeros_like(a["v"])
    args["mimo_o"] = a["mimo_o"]
    states = bwd_fwd.mamba3_mimo_bwd_fwd(**args, chunk_size=shape.C,
                                         rotary_dim_divisor=shape.rotary_dim_divisor)[0]
    padded = bwd_fwd.pad_tail(args, shape.C)
    m = dataclasses.replace(configs.constants(pb), U=1)
    numel, views = step_terms.table_views(m)
    buf = torch.empty(numel, device=DEVICE, dtype=torch.float32)
    t = {name: buf.as_strided(size, stride, off) for name, size, stride, off in views}
    step_terms.launch(angles=padded["angles"], da_cs=padded["da_cs"],
                      da_cs_rev=padded["da_cs_rev"], dt=padded["dt"], trap=padded["trap"],
                      consts=m, **t).run()
    S, S_pad = shape.S, m.S_pad
    if gate is None:
        dy_pad = torch.zeros(shape.B, S_pad, shape.R, shape.H, shape.P, device=DEVICE)
        dy_pad[:, :S] = dy.transpose(2, 3)
    else:
        dy_pad = None
        pad = lambda x: None if x is None else torch.nn.functional.pad(  # noqa: E731
            x, (0, 0, 0, 0, 0, S_pad - S))
        gate = (pad(gate[0]), pad(gate[1]), *gate[2:])
    g = chunk_grads.raw_y_grads(
        q=padded["q"], k=padded["k"], v=padded["v"], q_bias=a["q_bias"], k_bias=a["k_bias"],
        mimo_v=a["mimo_v"], d=a["d"] if d_skip else placeholder(torch.device(DEVICE)),
        da_cs=padded["da_cs"], da_cs_rev=padded["da_cs_rev"], segsum=padded["segsum"],
        dy=dy_pad, states=states.float().contiguous(), d_final_state=d_final, consts=m,
        precision=m.PREC, gate=gate, **t)
    B, H, R = shape.B, shape.H, shape.R
    d_dt, d_trap = _trap_grads(g, padded["dt"], padded["trap"], S)
    out = dict(
        q=g["dq"][:, :S], k=g["dk"][:, :S], q_bias=g["part_qb"].sum((0, 1)),
        k_bias=g["part_kb"].sum((0, 1)),
        v=g["dv"][:, :S], mimo_v=g["part_psi"].view(B, H, -1, R, shape.P).sum((0, 2)),
        angles=g["d_angles"][:, :S],
        dt=d_dt, trap=d_trap,
        adt=g["d_adt"][..., :S])
    if d_skip:
        out["d"] = g["part_d"].view(B, H, -1).sum((0, 2))
    return out


def _trap_grads(g: dict, dt, trap, S: int):
    """(d DT, d Trap) [B, H, S] from phase 2's d_gamma and d_trap_scale, through the angles'
    backward kernel's fused trap terms (the operator's path) with a zero angle gradient, whose
    share of d DT is then zero."""
    B, H, S_pad = g["d_gamma"].shape
    f32 = dict(device=DEVICE, dtype=torch.float32)
    zeros = torch.zeros(B, S, H, 1, **f32)
    out = dict(d_raw=torch.empty(B, S, H, 1, **f32), d_dt=torch.empty(B, H, S_pad, **f32),
               d_angle0=torch.empty(B, H, 1, **f32), d_trap=torch.empty(B, H, S_pad, **f32))
    preprocess.angle_sum_backward_launch(
        d_angles=zeros, angles_raw=zeros, dt=dt.contiguous(), trap=trap.contiguous(),
        d_gamma=g["d_gamma"], d_trap_scale=g["d_trap_scale"], **out).run()
    return out["d_dt"][..., :S], out["d_trap"][..., :S]


@pytest.mark.parametrize("shape,d_skip", [
    (Shape(2, 13, 4, 2, 12, 10, 3, 4, rotary_dim_divisor=2), True),
    (Shape(1, 16, 2, 1, 16, 8, 2, 8), False),
    (Shape(2, 7, 2, 2, 8, 24, 1, 3, rotary_dim_divisor=4), True),
], ids=lambda x: x.name if isinstance(x, Shape) else ("D" if x else "noD"))
def test_raw_y_grads(shape, d_skip):
    """Every gradient within the fp32 threshold of float64 autograd."""
    _check_against_autograd(shape, d_skip, seed=3)


def _check_against_autograd(shape: Shape, d_skip: bool, seed: int) -> None:
    a, dy, d_final = _case(shape, d_skip, seed=seed)
    want = _golden(a, dy, d_final, shape)
    got = _ours(a, dy, d_final, shape, d_skip)
    errors = {n: rel_rms(got[n].cpu(), want[n]) for n in got}
    bad = {n: e for n, e in errors.items() if not e <= THRESHOLDS[torch.float32]}
    assert not bad, f"relative RMS errors above {THRESHOLDS[torch.float32]}: {bad}"


@pytest.mark.parametrize("pairs,N,divisor", [(16, 48, 2), (32, 80, 4)],
                         ids=["16_pairs_N48", "32_pairs_N80"])
def test_blocks(monkeypatch, pairs, N, divisor):
    """Several pair blocks of N (24 pairs in blocks of 16; 40 pairs in blocks of 32, the last
    one partial and only 20 pairs rotated) and P blocks (40 columns in blocks of 16) in both
    kernels, groups of three heads: every gradient within the fp32 threshold of float64 autograd
    (the pair blocks' shares of the per-step sums added by chunk_grads_v)."""
    monkeypatch.setattr(chunk_grads, "config", lambda *shape: chunk_grads.GradsConfig(
        BJ=pairs, BP=16, V_BJ=pairs, V_BP=16, STATE_BJ=16, STATE_BP=16))
    _check_against_autograd(Shape(1, 9, 6, 2, N, 40, 2, 4, rotary_dim_divisor=divisor), True,
                            seed=5)


def test_blocks_do_not_depend_on_batch_or_length():
    """Phase 2's blocks (constexpr tile shapes) are a function of the model alone: calls that
    differ in B and S get the same blocks, so that a new B or S compiles nothing
    (test_operator.py::test_new_batch_or_length_never_recompiles checks the whole operator on a
    GPU)."""
    def blocks(B, S):
        pb = Problem(B=B, S=S, H=16, G=1, N=128, P=64, R=1, C=64, rotary_dim_divisor=2,
                     dtype=torch.bfloat16, has_z=True, has_d=True,
                     output_dtype=torch.bfloat16, device=torch.device(DEVICE))
        return chunk_grads._blocks(configs.constants(pb), pb.device)
    want = blocks(1, 64)
    for B, S in ((1, 2048), (4, 2048), (3, 100_000)):
        assert blocks(B, S) == want, (B, S)


@pytest.mark.parametrize("z_gate", [True, False], ids=["z", "no_z"])
def test_dy_recomputed_from_dout(z_gate):
    """dy recomputed from dout and z where phase 2 reads it (the operator's path after
    chunk_output's tiles) gives the gradients of the same dy read from the buffer, to fp32
    rounding: dy = dout MIMO_Out silu(z MIMO_Z) (dout MIMO_Out without the gate)."""
    shape = Shape(2, 13, 4, 2, 12, 10, 3, 4, rotary_dim_divisor=2)
    a, _, d_final = _case(shape, True, seed=7)
    gen = torch.Generator().manual_seed(8)
    B, S, H, R, P = shape.B, shape.S, shape.H, shape.R, shape.P
    dout = torch.randn(B, S, H, P, generator=gen)
    mimo_o = torch.randn(H, R, P, generator=gen) / R
    dy = dout[:, :, :, None, :] * mimo_o  # [B, S, H, R, P]
    z = mimo_z = None
    if z_gate:
        z, mimo_z = torch.randn(B, S, H, P, generator=gen), torch.randn(H, R, P, generator=gen)
        dy = dy * torch.nn.functional.silu(z[:, :, :, None, :] * mimo_z)
    on = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    want = _ours(a, dy.to(DEVICE), d_final, shape, True)
    got = _ours(a, None, d_final, shape, True, gate=tuple(map(on, (dout, z, mimo_o, mimo_z))))
    errors = {n: rel_rms(got[n].cpu(), want[n].cpu()) for n in want}
    bad = {n: e for n, e in errors.items() if not e <= 1e-6}
    assert not bad, f"relative RMS differences above 1e-6: {bad}"
