"""The whole operator's preprocessing (SPEC section 6): from the raw per-step inputs, the
rotation angles (the running sum of tanh(Angles) * pi * DT, mod 2*pi) and the chunked decay
pieces (da_cs, da_cs_rev, segsum of A = running sum of ADT), in the form bwd_fwd's kernels read
them; and the angles' backward, from the gradient of the rotation angles to those of Angles
and DT.

The decay pieces are chunk-local (A[t] - A[c*C - 1] and its differences inside chunk c), so one
program per (b*h, chunk) computes them with no carry between chunks. The angle sum runs over
the whole sequence: one program per (b, h) walks it in blocks of steps, all RD angles at once,
with the running angle kept mod 2*pi between blocks so that its fp32 rounding does not grow with
the length.
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import configs
from ..runtime.device import on_device
from ..runtime.launcher import Launch
from . import cdiv, next_pow2
from .common import tanh

TWO_PI = 2 * math.pi
# decay pieces: the [C, C] segsum block of a chunk is one register tile
MAX_CHUNK = 128
# The angles' running sum walks the steps in blocks of at most BLOCK_STEPS, one program of 8
# warps per (b, h), loading a block while it sums the one before (so fewer, larger blocks: at 4
# warps 64-step blocks took 0.17 ms per call at N128_P64_R4_C16, B = 4, H200 2026-12-03), and of
# at most BLOCK_ELEMENTS angles: two blocks in flight at RD = 64 and 128 steps spilled 1.5 KB
# per thread (ptxas, sm_90).
BLOCK_STEPS = 128
BLOCK_ELEMENTS = 4096
# Each row's walk in PARTS parts of near-equal whole blocks, side by side: one (b, h) per
# program was 16-64 programs on the official grid, each a chain of 16 dependent blocks (41-46 us
# per launch, H200 2026-12-05). A fixed count, not one from the rows, so that a sequence's
# angles do not depend on what it is batched or packed with (bit for bit); each part re-reads
# the inputs of the parts before it, at most (PARTS - 1) / 2 more reads of them in all.
PARTS = 8


@triton.jit
def _angle_block(raw_at, dt_at, g_at, trap_at, d_gamma_at, d_ts_at, raw_off, out_off, i, rm,
                 blk, end, n_steps, first, BS: tl.constexpr, sas, sds, sos,
                 REVERSE: tl.constexpr, TRAP: tl.constexpr, n_blocks,
                 SUMS: tl.constexpr = False):
    """The inputs of the walk's block blk of n_blocks (all masked once blk reaches end): the raw
    angles [BS, BR], dt [BS] and, REVERSE, the angles' gradient [BS, BR] (else 0); with TRAP,
    the block's d_gamma + d_trap_scale, d_trap_scale of the step before (0 before the row's
    first step, `first` steps into the row) and Trap, each [BS] (else 0). The walk goes from the
    first block forward, or from the last backward (REVERSE). SUMS: only what the sum of the
    parts before a part reads (in REVERSE the gradient alone; the rest 0)."""
    if REVERSE:
        s0 = tl.cast(n_blocks - 1 - blk, tl.int64) * BS
    else:
        s0 = tl.cast(blk, tl.int64) * BS
    sm = (i < n_steps - s0) & (blk < end)
    m = sm[:, None] & rm[None, :]
    step = s0 * sds + i * sds
    x, d = 0.0, 0.0
    if not (REVERSE and SUMS):
        x = tl.load(raw_at + s0 * sas + raw_off, mask=m, other=0.0)
        d = tl.load(dt_at + step, mask=sm, other=0.0)
    g = 0.0
    if REVERSE:
        g = tl.load(g_at + s0 * sos + out_off, mask=m, other=0.0)
    d_g, d_shift, trap = 0.0, 0.0, 0.0
    if TRAP:
        d_g = (tl.load(d_gamma_at + step, mask=sm, other=0.0)
               + tl.load(d_ts_at + step, mask=sm, other=0.0))
        d_shift = tl.load(d_ts_at + step - sds, mask=sm & (first + s0 + i > 0), other=0.0)
        trap = tl.load(trap_at + step, mask=sm, other=0.0).to(tl.float32)
    return x, d, g, d_g, d_shift, trap


@triton.jit(do_not_specialize=["S", "sab", "sdb", "sdh", "sob"])
def angle_sum_kernel(angles_raw, dt, angle0, angles, d_angles, d_angles_raw, d_dt, d_angle0,
                     bounds, trap, d_gamma, d_trap_scale, d_trap, S, H, RD, parts, sab, sas, sah,
                     sar, sdb, sdh, sds, sob, sos, soh, BS: tl.constexpr, BR: tl.constexpr,
                     TWO_PI: tl.constexpr, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr,
                     VARLEN: tl.constexpr, TRAP: tl.constexpr):
    """One (b, h) and one of `parts` parts of its walk per program (grid rows * H * parts, the
    parts fastest), the steps in blocks of BS, the RD angles in one BR block; VARLEN (packed
    sequences, B = 1): one (sequence j, h) per program over the steps bounds[j] ..
    bounds[j + 1] - 1 (bounds int32 [n_seq + 1]), so that every sequence starts afresh. A part
    walks cdiv(blocks, parts) blocks from where the parts before it end, starting from their
    sum, which it adds up first from their inputs (a reduction per block, no running sum and no
    stores), so that the walk's chain is a part long rather than the whole row.

    Forward: angles[b, t, h, :] = (angle0[b, h, :] + sum_{u<=t} tanh(angles_raw[b, u, h, :]) pi
    dt[b, h, u]) mod 2*pi, angle0 [B or n_seq, H, RD] contiguous with HAS_INIT, else 0.
    REVERSE (the backward): with g[u] = sum_{t>=u} d_angles[b, t, h, :] (the mod has
    gradient 1), d_angles_raw[b, u, h, :] = g[u] pi dt[u] (1 - tanh^2), d_dt[b, h, u] =
    sum_r g[u] pi tanh, and d_angle0 [B or n_seq, H, RD] = g at the first step; the steps are
    walked from the last block to the first. TRAP (REVERSE only) adds the gradients through
    gamma[t] = dt[t] sigmoid(trap[t]) and trap_scale[t] = gamma[t] + dt[t+1] sigmoid(-trap[t+1])
    given theirs, d_gamma and d_trap_scale: to d_dt, and into d_trap. angles_raw and
    d_angles_raw share strides (sab, sas, sah, sar); angles and d_angles too (sob, ...); dt,
    d_dt, trap, d_gamma, d_trap_scale and d_trap too (sdb, sdh, sds)."""
    pid = tl.program_id(0)
    part, row = pid % parts, pid // parts
    seq, h = row // H, (row % H).to(tl.int64)  # seq: the batch entry, or the sequence
    if VARLEN:
        lo = tl.load(bounds + seq)
        n_steps = tl.load(bounds + seq + 1) - lo
        b = 0
        first = lo.to(tl.int64)
    else:
        n_steps = S
        b = seq.to(tl.int64)
        first = 0
    i = tl.arange(0, BS)
    r = tl.arange(0, BR)
    rm = r < RD
    # the slices' bases as 64-bit scalars; a block's first step moves them, and the offsets
    # inside a block stay 32-bit
    raw_at = b * sab + h * sah + first * sas
    dt_at = b * sdb + h * sdh + first * sds
    out_at = b * sob + h * soh + first * sos
    raw_off = i[:, None] * sas + r[None, :] * sar
    out_off = i[:, None] * sos + r[None, :]
    pi = TWO_PI / 2
    init_at = (seq.to(tl.int64) * H + h) * RD + r
    if HAS_INIT:
        carry = tl.load(angle0 + init_at, mask=rm, other=0.0)
    else:
        carry = tl.zeros([BR], dtype=tl.float32)
    n_blocks = tl.cdiv(n_steps, BS)
    # the part's blocks, counted in walk order (from the last block in REVERSE)
    per_part = tl.cdiv(n_blocks, parts)
    # a part past the last block (more parts than blocks) walks nothing; its start clamped, so
    # that the sum of the parts before it reads no block past the row's (in REVERSE, before it)
    start = tl.minimum(part * per_part, n_blocks)
    stop = tl.minimum(start + per_part, n_blocks)
    # the parts before this one: their sum, block by block (mod 2*pi forward), loading a block
    # while the one before it is added
    x, d, g_out, _, _, _ = _angle_block(
        angles_raw + raw_at, dt + dt_at, d_angles + out_at, trap + dt_at, d_gamma + dt_at,
        d_trap_scale + dt_at, raw_off, out_off, i, rm, 0, start, n_steps, first, BS, sas, sds, sos,
        REVERSE, False, n_blocks, True)
    for blk in range(start):
        x_next, d_next, g_next, _, _, _ = _angle_block(
            angles_raw + raw_at, dt + dt_at, d_angles + out_at, trap + dt_at, d_gamma + dt_at,
            d_trap_scale + dt_at, raw_off, out_off, i, rm, blk + 1, start, n_steps, first, BS, sas,
            sds, sos, REVERSE, False, n_blocks, True)
        if REVERSE:
            carry = carry + tl.sum(g_out, axis=0)
        else:
            carry = carry + tl.sum(tanh(x) * pi * d[:, None], axis=0)
            carry = carry - TWO_PI * tl.floor(carry / TWO_PI)
        x, d, g_out = x_next, d_next, g_next
    # Software-pipelined: a block's inputs are loaded while the block before it is summed, so
    # that the walk waits for memory about once rather than once per block.
    x, d, g_out, d_g, d_shift, tr = _angle_block(
        angles_raw + raw_at, dt + dt_at, d_angles + out_at, trap + dt_at, d_gamma + dt_at,
        d_trap_scale + dt_at, raw_off, out_off, i, rm, start, stop, n_steps, first, BS, sas,
        sds, sos, REVERSE, TRAP, n_blocks)
    for blk in range(start, stop):
        if REVERSE:
            s0 = tl.cast(n_blocks - 1 - blk, tl.int64) * BS
        else:
            s0 = tl.cast(blk, tl.int64) * BS
        sm = i < n_steps - s0
        m = sm[:, None] & rm[None, :]
        x_next, d_next, g_next, d_g_next, d_shift_next, tr_next = _angle_block(
            angles_raw + raw_at, dt + dt_at, d_angles + out_at, trap + dt_at, d_gamma + dt_at,
            d_trap_scale + dt_at, raw_off, out_off, i, rm, blk + 1, stop, n_steps, first,
            BS, sas, sds, sos, REVERSE, TRAP, n_blocks)
        th = tanh(x)
        if REVERSE:
            # g[u] = carry + sum_{t>=u in the block} g_out[t]: the block's total minus the
            # inclusive running sum, plus the row itself
            run = tl.cumsum(g_out, axis=0)
            g = carry[None, :] + tl.sum(g_out, axis=0)[None, :] - run + g_out
            carry = carry + tl.sum(g_out, axis=0)
            tl.store(d_angles_raw + raw_at + s0 * sas + raw_off,
                     g * pi * d[:, None] * (1 - th * th), mask=m)
            d_dt_block = tl.sum(g * th, axis=1) * pi
            if TRAP:
                sig = tl.sigmoid(tr)
                d_dt_block += d_g * sig + d_shift * (1 - sig)
                tl.store(d_trap + dt_at + s0 * sds + i * sds,
                         (d_g - d_shift) * d * sig * (1 - sig), mask=sm)
            tl.store(d_dt + dt_at + s0 * sds + i * sds, d_dt_block, mask=sm)
        else:
            total = carry[None, :] + tl.cumsum(th * pi * d[:, None], axis=0)
            total = total - TWO_PI * tl.floor(total / TWO_PI)
            tl.store(angles + out_at + s0 * sos + out_off, total, mask=m)
            # masked steps add nothing, so the block's last row is its last valid step's
            carry = tl.sum(tl.where((i == BS - 1)[:, None], total, 0.0), axis=0)
        x, d, g_out, d_g, d_shift, tr = x_next, d_next, g_next, d_g_next, d_shift_next, tr_next
    if REVERSE:
        # the part whose walk ends at the row's first step
        tl.store(d_angle0 + init_at, carry, mask=rm & (start < n_blocks) & (stop == n_blocks))


@triton.jit(do_not_specialize=["S", "n_bh", "nc", "sab", "sah"])
def decay_pieces_kernel(adt, da_cs, da_cs_rev, segsum, S, n_bh, nc, C, sab, sah, sas, H,
                        CP: tl.constexpr):
    """One (b*h, chunk) per program (b*h fastest on grid axis 0): with x the chunk's ADT (zero
    past S), da_cs = cumsum(x), da_cs_rev = sum(x) - da_cs and segsum[i, j] = da_cs[i] -
    da_cs[j] for i > j, else 0, over the whole [C, C] block (SPEC section 2, as
    reference.decay_pieces). da_cs, da_cs_rev: [B, H, S] contiguous; segsum [B, H, nc, C, C]
    contiguous."""
    pid = tl.program_id(0)
    bh, c = pid % n_bh, pid // n_bh
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    s0 = tl.cast(c, tl.int64) * C
    i = tl.arange(0, CP)
    valid = (i < C) & (i < S - s0)
    x = tl.load(adt + b * sab + h * sah + s0 * sas + i * sas, mask=valid, other=0.0)
    cs = tl.cumsum(x, axis=0)
    row = tl.cast(bh, tl.int64) * S + s0
    tl.store(da_cs + row + i, cs, mask=valid)
    tl.store(da_cs_rev + row + i, tl.sum(x, axis=0) - cs, mask=valid)
    j = tl.arange(0, CP)
    seg = tl.where(i[:, None] > j[None, :], cs[:, None] - cs[None, :], 0.0)
    block = segsum + (tl.cast(bh, tl.int64) * nc + c) * C * C
    tl.store(block + i[:, None] * C + j[None, :], seg, mask=(i < C)[:, None] & (j < C)[None, :])


def _check_steps(name: str, x: torch.Tensor, shape: tuple) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 of shape {list(shape)}, got {x.dtype} "
                         f"{list(x.shape)}")


def angle_sum(angles_raw: torch.Tensor, dt: torch.Tensor, angle0: Optional[torch.Tensor] = None,
              bounds: Optional[torch.Tensor] = None, block_steps: Optional[int] = None,
              parts: Optional[int] = None) -> torch.Tensor:
    """The rotation angles [B, S, H, RD] fp32 (contiguous) from Angles [B, S, H, RD] and DT
    [B, H, S], both fp32 of any strides, and the angle before the first step, angle0
    [B, H, RD] fp32 or None for zero: (angle0 + sum_{u<=t} tanh(Angles[u]) pi DT[u]) mod 2*pi.
    bounds (packed sequences, B = 1): int32 [n_seq + 1], sequence j covering steps bounds[j] ..
    bounds[j + 1] - 1 (bounds[n_seq] = S), each summed from its own angle0[j] ([n_seq, H, RD])
    or 0. parts: the parts of each row's walk (by default PARTS, or configs.override's
    angle_parts)."""
    B, S, H, RD = angles_raw.shape
    _check_steps("angles_raw", angles_raw, (B, S, H, RD))
    _check_steps("dt", dt, (B, H, S))
    if angle0 is not None:
        _check_steps("angle0", angle0, (_rows(B, bounds), H, RD))
        angle0 = angle0.contiguous()
    out = torch.empty(B, S, H, RD, device=angles_raw.device, dtype=torch.float32)
    with on_device(angles_raw.device):
        angle_sum_launch(angles_raw=angles_raw, dt=dt, angles=out, angle0=angle0, bounds=bounds,
                         block_steps=block_steps, parts=parts).run()
    return out


def angle_sum_launch(*, angles_raw: torch.Tensor, dt: torch.Tensor, angles: torch.Tensor,
                     angle0: Optional[torch.Tensor] = None, bounds: Optional[torch.Tensor] = None,
                     block_steps: Optional[int] = None, parts: Optional[int] = None) -> Launch:
    """angle_sum's launch, unchecked: into angles [B, S, H, RD] fp32 of any strides but a
    contiguous RD; dt may hold more than S steps (those past S are not read); angle0
    contiguous."""
    return _angle_launch(angles_raw, dt, angles, angles, angles_raw, dt, angles, block_steps,
                         False, angle0, bounds, False, dict.fromkeys(_TRAP_ARGS, dt), parts)


def angle_sum_backward(d_angles: torch.Tensor, angles_raw: torch.Tensor, dt: torch.Tensor,
                       bounds: Optional[torch.Tensor] = None, block_steps: Optional[int] = None,
                       parts: Optional[int] = None):
    """(d Angles [B, S, H, RD], the angles' share of d DT [B, H, S], d angle0 [B or n_seq, H,
    RD]), all fp32, from the gradient d_angles [B, S, H, RD] of angle_sum's output and its
    inputs (bounds as angle_sum's)."""
    B, S, H, RD = angles_raw.shape
    _check_steps("d_angles", d_angles, (B, S, H, RD))
    _check_steps("angles_raw", angles_raw, (B, S, H, RD))
    _check_steps("dt", dt, (B, H, S))
    f32 = dict(device=angles_raw.device, dtype=torch.float32)
    out = dict(d_raw=torch.empty(B, S, H, RD, **f32), d_dt=torch.empty(B, H, S, **f32),
               d_angle0=torch.empty(_rows(B, bounds), H, RD, **f32))
    with on_device(angles_raw.device):
        angle_sum_backward_launch(d_angles=d_angles.contiguous(),
                                  angles_raw=angles_raw.contiguous(), dt=dt.contiguous(),
                                  bounds=bounds, block_steps=block_steps, parts=parts,
                                  **out).run()
    return out["d_raw"], out["d_dt"], out["d_angle0"]


def angle_sum_backward_launch(*, d_angles: torch.Tensor, angles_raw: torch.Tensor,
                              dt: torch.Tensor, d_raw: torch.Tensor, d_dt: torch.Tensor,
                              d_angle0: torch.Tensor, bounds: Optional[torch.Tensor] = None,
                              trap: Optional[torch.Tensor] = None,
                              d_gamma: Optional[torch.Tensor] = None,
                              d_trap_scale: Optional[torch.Tensor] = None,
                              d_trap: Optional[torch.Tensor] = None,
                              block_steps: Optional[int] = None,
                              parts: Optional[int] = None) -> Launch:
    """angle_sum_backward's launch, unchecked: angles_raw and d_raw [B, S, H, RD] with one set of
    strides, d_angles with a second one, dt and d_dt [B, H, S] with a third. With trap (given
    with d_gamma, d_trap_scale and d_trap, all [B, H, S] with dt's strides, trap fp32 or 16-bit,
    the others fp32), d_dt also gets the shares of DT's gradient through gamma and trap_scale
    (SPEC section 2) and d_trap is written: Trap's gradient. The steps before S in each row of
    dt hold the previous step for a sequence's first step (packed sequences)."""
    fused = dict(zip(_TRAP_ARGS, (trap, d_gamma, d_trap_scale, d_trap)))
    if trap is None:
        fused = dict.fromkeys(_TRAP_ARGS, dt)  # unread stand-ins
    return _angle_launch(angles_raw, dt, d_angles, d_angles, d_raw, d_dt, d_angle0, block_steps,
                         True, None, bounds, trap is not None, fused, parts)


def _rows(B: int, bounds: Optional[torch.Tensor]) -> int:
    """The rows of angle0: one per batch entry, or per packed sequence."""
    if bounds is None:
        return B
    if B != 1 or bounds.dim() != 1 or bounds.dtype != torch.int32:
        raise ValueError("bounds (packed sequences) must be int32 [n_seq + 1], with B = 1")
    return bounds.numel() - 1


_TRAP_ARGS = ("trap", "d_gamma", "d_trap_scale", "d_trap")


def _angle_launch(angles_raw, dt, angles, d_angles, d_raw, d_dt, d_angle0,
                  block_steps: Optional[int], reverse: bool, angle0: Optional[torch.Tensor],
                  bounds: Optional[torch.Tensor], fuse_trap: bool, trap_args: dict,
                  parts: Optional[int] = None) -> Launch:
    B, S, H, RD = angles_raw.shape
    BR = next_pow2(RD)
    if block_steps is None:
        block_steps = max(16, min(BLOCK_STEPS, BLOCK_ELEMENTS // BR))
    rows = _rows(B, bounds) * H
    if parts is None:
        parts = configs.active().angle_parts or PARTS
    ar, ds, ao = angles_raw.stride(), dt.stride(), angles.stride()
    assert ao[3] == 1, "the angles' output is contiguous in RD"
    return Launch(angle_sum_kernel, (rows * parts,), dict(
        angles_raw=angles_raw, dt=dt, angle0=angles if angle0 is None else angle0,
        angles=angles, d_angles=d_angles, d_angles_raw=d_raw, d_dt=d_dt, d_angle0=d_angle0,
        bounds=angles if bounds is None else bounds, S=S, H=H, RD=RD, parts=parts, sab=ar[0],
        sas=ar[1], sah=ar[2], sar=ar[3], sdb=ds[0], sdh=ds[1], sds=ds[2], sob=ao[0],
        sos=ao[1], soh=ao[2], BS=block_steps, BR=BR, TWO_PI=TWO_PI,
        REVERSE=reverse, HAS_INIT=angle0 is not None, VARLEN=bounds is not None,
        TRAP=fuse_trap, **trap_args), dict(num_warps=8))


def decay_pieces(adt: torch.Tensor, chunk_size: int):
    """(da_cs [B, H, S], da_cs_rev [B, H, S], segsum [B, H, ceil(S / C), C, C]), fp32 and
    contiguous, from ADT [B, H, S] fp32 of any strides and C = chunk_size <= MAX_CHUNK: the
    chunked pieces of A = running sum of ADT that bwd_fwd's kernels read (SPEC section 2)."""
    B, H, S = adt.shape
    _check_steps("adt", adt, (B, H, S))
    if not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK}, got {chunk_size}")
    nc = cdiv(S, chunk_size)
    f32 = dict(device=adt.device, dtype=torch.float32)
    da_cs, da_cs_rev = torch.empty(B, H, S, **f32), torch.empty(B, H, S, **f32)
    segsum = torch.empty(B, H, nc, chunk_size, chunk_size, **f32)
    with on_device(adt.device):
        decay_pieces_launch(adt=adt, da_cs=da_cs, da_cs_rev=da_cs_rev, segsum=segsum,
                            chunk_size=chunk_size).run()
    return da_cs, da_cs_rev, segsum


def decay_pieces_launch(*, adt: torch.Tensor, da_cs: torch.Tensor, da_cs_rev: torch.Tensor,
                        segsum: torch.Tensor, chunk_size: int) -> Launch:
    """decay_pieces' launch, unchecked: into contiguous fp32 da_cs, da_cs_rev [B, H, S] and
    segsum [B, H, ceil(S / C), C, C]."""
    B, H, S = adt.shape
    nc = cdiv(S, chunk_size)
    st = adt.stride()
    return Launch(decay_pieces_kernel, (B * H * nc,), dict(
        adt=adt, da_cs=da_cs, da_cs_rev=da_cs_rev, segsum=segsum, S=S, n_bh=B * H, nc=nc,
        C=chunk_size, sab=st[0], sah=st[1], sas=st[2], H=H, CP=next_pow2(chunk_size)), {})
