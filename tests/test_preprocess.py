"""The preprocessing kernels (kernels/preprocess.py) against the float64 reference's own
preprocessing (reference._running_angles, reference.decay_pieces) and its autograd, on small odd
shapes, several blocks of steps, non-contiguous inputs (Angles expanded over the heads, as
flash-linear-attention passes it) and a partial last chunk."""
import math

import pytest
import torch

from conftest import DEVICE
from mamba3_mimo import reference
from mamba3_mimo.kernels import preprocess
from mamba3_mimo.testing import THRESHOLDS, rel_rms



def _wrapped(x: torch.Tensor) -> torch.Tensor:
    """x as an angle difference in [-pi, pi): angles near 0 and 2*pi are close."""
    return torch.remainder(x + math.pi, 2 * math.pi) - math.pi


def _inputs(device=DEVICE, B=2, S=37, H=3, RD=5, expand=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(B, S, 1 if expand else H, RD, generator=g)
    raw = raw.expand(B, S, H, RD) if expand else raw
    # DT as the transpose of a [B, S, H] tensor: non-contiguous along S
    dt = (torch.rand(B, S, H, generator=g) + 0.05).transpose(1, 2)
    adt = -torch.rand(B, S, H, generator=g).transpose(1, 2) * 0.5
    return raw.to(device), dt.to(device), adt.to(device)


@pytest.mark.parametrize("parts", [1, 2, 7])
@pytest.mark.parametrize("expand", [False, True], ids=["dense", "expanded"])
@pytest.mark.parametrize("block_steps", [8, 64])
def test_angle_sum(expand, block_steps, parts):
    """angles against float64, the walk in 1, 2 and 7 parts (7 > the 5 blocks of 8 steps: some
    parts empty); the bound: S additions and two mods per block, each rounding by at most half
    an ulp of 2*pi in fp32, and tanh's ulp of 1 times pi * DT per step."""
    raw, dt, _ = _inputs(expand=expand)
    out = preprocess.angle_sum(raw, dt, block_steps=block_steps, parts=parts)
    ref = reference._running_angles(raw.cpu().double(), dt.cpu().double(), None, torch.float64)
    S = raw.shape[1]
    bound = (S + 2 * math.ceil(S / block_steps)) * 2 * math.pi * 2.0 ** -24 \
        + S * math.pi * dt.abs().max().item() * 2.0 ** -23
    err = _wrapped(out.cpu().double() - ref).abs().max().item()
    assert err <= bound, f"angles off by {err:.3g} rad (bound {bound:.3g})"
    assert out.min() >= 0 and out.max() < 2 * math.pi


def test_angle_parts_from_the_rules():
    """The walk's parts are PARTS unless given, or configs.override's angle_parts (which the
    A/B runs use): one program per (row, part); the running sum equal to the given parts'."""
    from mamba3_mimo import configs
    raw, dt, _ = _inputs()
    angles = torch.empty(raw.shape, device=DEVICE)
    rows = raw.shape[0] * raw.shape[2]
    launch = preprocess.angle_sum_launch(angles_raw=raw, dt=dt, angles=angles)
    assert launch.grid == (rows * preprocess.PARTS,)
    with configs.override(angle_parts=3):
        launch = preprocess.angle_sum_launch(angles_raw=raw, dt=dt, angles=angles)
        assert launch.grid == (rows * 3,)
        out = preprocess.angle_sum(raw, dt, block_steps=8)
    assert torch.equal(out, preprocess.angle_sum(raw, dt, block_steps=8, parts=3))


@pytest.mark.parametrize("parts", [1, 2, 7])
@pytest.mark.parametrize("expand", [False, True], ids=["dense", "expanded"])
def test_angle_sum_backward(expand, parts):
    """d Angles and the angles' share of d DT against float64 autograd of the reference's angles
    (the fp32 threshold), the walk in 1, 2 and 7 parts."""
    raw, dt, _ = _inputs(expand=expand, seed=1)
    g = torch.randn(raw.shape, generator=torch.Generator().manual_seed(2))
    d_raw, d_dt, d_angle0 = preprocess.angle_sum_backward(g.to(DEVICE), raw, dt, block_steps=8,
                                                          parts=parts)
    raw64 = raw.cpu().double().clone().requires_grad_(True)
    dt64 = dt.cpu().double().clone().requires_grad_(True)
    angle0 = torch.zeros(raw.shape[0], raw.shape[2], raw.shape[3], dtype=torch.float64,
                         requires_grad=True)
    reference._running_angles(raw64, dt64, angle0, torch.float64).backward(g.double())
    assert rel_rms(d_raw.cpu(), raw64.grad) <= THRESHOLDS[torch.float32]
    assert rel_rms(d_dt.cpu(), dt64.grad) <= THRESHOLDS[torch.float32]
    assert rel_rms(d_angle0.cpu(), angle0.grad) <= THRESHOLDS[torch.float32]


@pytest.mark.parametrize("with_angle0", [False, True], ids=["zero", "angle0"])
def test_angle_sum_packed(with_angle0):
    """With `bounds` (packed sequences: steps 0-4, 5, 6-20, 21-36 of one row), every sequence's
    angles and gradients are those of the sequence summed alone, bit for bit."""
    raw, dt, _ = _inputs(B=1, S=37, seed=3)
    cuts = [0, 5, 6, 21, 37]
    bounds = torch.tensor(cuts, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    angle0 = (torch.rand(len(cuts) - 1, raw.shape[2], raw.shape[3], generator=gen) * 6
              ).to(DEVICE) if with_angle0 else None
    g = torch.randn(raw.shape, generator=gen).to(DEVICE)
    out = preprocess.angle_sum(raw, dt, angle0, bounds=bounds, block_steps=8)
    d_raw, d_dt, d_angle0 = preprocess.angle_sum_backward(g, raw, dt, bounds=bounds,
                                                          block_steps=8)
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        alone = preprocess.angle_sum(raw[:, a:b], dt[..., a:b],
                                     None if angle0 is None else angle0[j:j + 1], block_steps=8)
        assert torch.equal(out[:, a:b], alone), f"angles of sequence {j}"
        want = preprocess.angle_sum_backward(g[:, a:b], raw[:, a:b], dt[..., a:b], block_steps=8)
        for name, got, w in zip(("d Angles", "d DT", "d angle0"),
                                (d_raw[:, a:b], d_dt[..., a:b], d_angle0[j:j + 1]), want):
            assert torch.equal(got, w), f"{name} of sequence {j}"


@pytest.mark.parametrize("C", [1, 5, 8, 16])
def test_decay_pieces(C):
    """da_cs, da_cs_rev and segsum against reference.decay_pieces in float64 (S = 37: a partial
    last chunk but for C = 1); the bound: C additions, each rounding by half an ulp of the
    largest partial sum."""
    _, _, adt = _inputs()
    got = preprocess.decay_pieces(adt, C)
    want = reference.decay_pieces(adt.cpu().double(), C)
    for name, x, ref in zip(("da_cs", "da_cs_rev", "segsum"), got, want):
        assert x.shape == ref.shape, name
        bound = 2 * C * ref.abs().max().item() * 2.0 ** -24 + 1e-30
        err = (x.cpu().double() - ref).abs().max().item()
        assert err <= bound, f"{name} off by {err:.3g} (bound {bound:.3g})"


def test_decay_pieces_bad_arguments():
    _, _, adt = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        preprocess.decay_pieces(adt, preprocess.MAX_CHUNK + 1)
    with pytest.raises(ValueError, match="adt"):
        preprocess.decay_pieces(adt.double(), 8)


def test_far_batches():
    """Angles and ADT whose batch stride is 2**32 elements (a view of a buffer of 2**32 + one
    batch, virtual memory barely touched) give what the contiguous inputs give: the batch
    offsets are 64-bit."""
    from test_hardening import _far_batches
    raw, dt, adt = _inputs(B=2, S=9, H=2, RD=3)
    far_raw, far_adt = _far_batches(raw), _far_batches(adt)
    assert torch.equal(preprocess.angle_sum(far_raw, dt), preprocess.angle_sum(raw, dt))
    for a, b in zip(preprocess.decay_pieces(far_adt, 4), preprocess.decay_pieces(adt, 4)):
        assert torch.equal(a, b)
