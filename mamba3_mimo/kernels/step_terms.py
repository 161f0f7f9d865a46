"""Production per-step terms: what chunk_increment and chunk_output would otherwise recompute in
every program, once per (b, h, step): gamma, trap_scale, the decay weights and the rotary cos/sin.

Inside a chunk tile these per-step values live in layouts that repeat them over a tile's other
dimension, and Triton recomputes them there: in-kernel cos/sin took a third of both kernels'
issue slots on the H200. Here each value is computed once.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ..runtime.launcher import Launch
from . import aligned_numel, cdiv, dependent_launch
from .common import after_previous_kernel, rotary_cos_sin, trap_terms

# planes of the `terms` scratch [6, B*H, S_pad]
GAMMA = tl.constexpr(0)
TRAP_SCALE = tl.constexpr(1)
K_DECAY = tl.constexpr(2)
Q_DECAY = tl.constexpr(3)
LOG_Q = tl.constexpr(4)  # only with U > 1
LOG_K = tl.constexpr(5)  # only with U > 1
N_PLANES = 6


@triton.jit(do_not_specialize=["S_pad", "n_bh", "sab"])
def step_terms_kernel(angles, da_cs, da_cs_rev, dt, trap, terms, cos, sin, S_pad, n_bh, H, C,
                      sab, sas, sah, san, RD, BS: tl.constexpr, RDP: tl.constexpr,
                      U: tl.constexpr, PDL: tl.constexpr):
    """For steps s of one (b, h): terms[GAMMA] = gamma, terms[TRAP_SCALE] = trap_scale,
    terms[K_DECAY] = trap_scale * exp(da_cs_rev), terms[Q_DECAY] = exp(LOG_Q); cos/sin
    [S_pad, RD] of the angles.

    chunk_output works on tiles of U chunks. Its decays are relative to the start of the tile:
    LOG_Q[s] = da_cs[s] + D(chunks of the tile before s's chunk), and across chunks of a tile
    the exponent A[t] - A[t'] = LOG_Q[t] + LOG_K[t'] with
    LOG_K[t'] = da_cs_rev[t'] - D(chunks of the tile up to t''s chunk), D(...) the sum of those
    chunks' da_cs at their last step. With U = 1, LOG_Q = da_cs and LOG_K is not needed."""
    # The state pass starts when this kernel ends: its programs resident beside this one's
    # slowed bwd_fwd by 6 % at N128_P64_R8_C8 (H200, GPU span per call; docs/performance.md)
    after_previous_kernel(PDL, START_NEXT=False)
    # (b*h, block of steps) flattened on grid axis 0, b*h fastest: axis 1 would cap the
    # length at 65,535 blocks
    pid = tl.program_id(0)  # < 2**31: 32-bit division, then 64-bit offsets
    bh = (pid % n_bh).to(tl.int64)
    s0 = (pid // n_bh).to(tl.int64) * BS  # the block's first step
    # the block's steps as 32-bit offsets from s0, which moves the pointers as one 64-bit scalar
    sl = tl.arange(0, BS)
    left = tl.minimum(S_pad - s0, BS + U * C).to(tl.int32)  # steps from s0 on (capped)
    m = sl < left
    at = bh * S_pad + s0  # the block's first step in the [B*H, S_pad] rows
    gamma, trap_scale = trap_terms(dt + at, trap + at, sl, m, left)
    rev = tl.load(da_cs_rev + at + sl, mask=m, other=0.0)
    log_q = tl.load(da_cs + at + sl, mask=m, other=0.0)
    plane = n_bh.to(tl.int64) * S_pad  # six planes of B*H*S_pad steps can pass 2**31
    if U > 1:
        first = (s0 % C).to(tl.int32)  # s0's place in its chunk
        c = (first + sl) // C  # chunk of each step, counted from s0's chunk
        sub = (((s0 // C) % U).to(tl.int32) + c) % U  # ... and its place in its tile
        before = tl.zeros_like(log_q)  # D of the tile's chunks before s's chunk
        upto = tl.zeros_like(log_q)  # ... and up to it
        for i in tl.static_range(U):
            end = (c - sub + i) * C - first + C - 1  # the last step of the tile's chunk i
            d_i = tl.load(da_cs + at + end, mask=m & (end < left), other=0.0)
            before += tl.where(i < sub, d_i, 0.0)
            upto += tl.where(i <= sub, d_i, 0.0)
        log_q += before
        tl.store(terms + LOG_Q * plane + at + sl, log_q, mask=m)
        tl.store(terms + LOG_K * plane + at + sl, rev - upto, mask=m)
    tl.store(terms + GAMMA * plane + at + sl, gamma, mask=m)
    tl.store(terms + TRAP_SCALE * plane + at + sl, trap_scale, mask=m)
    tl.store(terms + K_DECAY * plane + at + sl, trap_scale * tl.exp(rev), mask=m)
    tl.store(terms + Q_DECAY * plane + at + sl, tl.exp(log_q), mask=m)
    b, h = bh // H, bh % H
    cs, sn = rotary_cos_sin(angles + b * sab + h * sah + s0 * sas, sl * sas, m, 0, RDP, RD, san)
    j = tl.arange(0, RDP)
    off = sl[:, None] * RD + j[None, :]
    jm = m[:, None] & (j < RD)[None, :]
    tl.store(cos + at * RD + off, cs, mask=jm)
    tl.store(sin + at * RD + off, sn, mask=jm)


def table_views(consts) -> Tuple[int, list]:
    """Where the kernel's outputs lie in one fp32 buffer: its length in elements, and
    (name, size, stride, offset) of "terms" [N_PLANES, B*H, S_pad] and "cos", "sin"
    [B*H, S_pad, RD], each at a 16-byte aligned offset."""
    m = consts
    n_bh, S_pad, RD = m.B * m.H, m.S_pad, m.RD
    n_terms, n_table = aligned_numel(N_PLANES * n_bh * S_pad), aligned_numel(n_bh * S_pad * RD)
    table = (n_bh, S_pad, RD), (S_pad * RD, RD, 1)
    return n_terms + 2 * n_table, [
        ("terms", (N_PLANES, n_bh, S_pad), (n_bh * S_pad, S_pad, 1), 0),
        ("cos", *table, n_terms), ("sin", *table, n_terms + n_table)]


def launch(*, angles: torch.Tensor, da_cs: torch.Tensor, da_cs_rev: torch.Tensor,
           dt: torch.Tensor, trap: torch.Tensor, terms: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, consts) -> Launch:
    """The launch that fills terms [N_PLANES, B*H, S_pad], cos and sin [B*H, S_pad, RD] (from
    `tables`) from angles [B, S_pad, H, RD], da_cs, da_cs_rev, dt, trap [B, H, S_pad], for
    chunk_output tiles of consts.U chunks; consts.STEP_BS steps per program."""
    m = consts
    n_bh = m.B * m.H
    return Launch(step_terms_kernel, (n_bh * cdiv(m.S_pad, m.STEP_BS),), dict(
        angles=angles, da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt, trap=trap, terms=terms, cos=cos,
        sin=sin, S_pad=m.S_pad, n_bh=n_bh, H=m.H, C=m.C, sab=angles.stride(0),
        sas=angles.stride(1), sah=angles.stride(2), san=angles.stride(3), RD=m.RD, BS=m.STEP_BS,
        RDP=m.RDP, U=m.U, PDL=m.PDL), dependent_launch(m))
