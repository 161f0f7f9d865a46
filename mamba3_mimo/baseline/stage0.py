"""Stage-0 baseline of bwd_fwd, the yardstick of the production path: rotary, qk_dot and a
serial scan with one program per (b, h) (and 32-column slice of P, so that N = 256 still fits in
shared memory). `run` allocates the outputs and launches it (`bwd_fwd(..., impl="stage0")`).

Kept deliberately simple, as the seed's: rotated q/k go through an fp32 scratch and the scan
walks every chunk in order with the whole [N, P] state in registers. Its own helpers (per-row
loads, selection-dot reductions) are the plain forms of the production kernels' ones. It makes
no promise about non-finite inputs (docs/api.md, "NaN and Inf").
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..kernels.common import (causal_mix, chunk_rows, dot, gate_grads, load_rotated,
                              rotary_cos_sin, selection_matrix, store_qk_dot, store_rank_sums,
                              trap_terms)


@triton.jit
def head_params(mimo_o, mimo_z, d, h, r, row_ok, p, p_mask, R, P, HAS_Z: tl.constexpr,
                HAS_D: tl.constexpr):
    """Phi and Zeta of head h as [rows, BP] tiles (rank of each row; Zeta = 0 without Z) and D[h]
    (0 without D)."""
    off = h * R * P + r[:, None] * P + p[None, :]
    m = row_ok[:, None] & p_mask[None, :]
    phi = tl.load(mimo_o + off, mask=m, other=0.0)
    zeta = tl.zeros_like(phi)
    if HAS_Z:
        zeta = tl.load(mimo_z + off, mask=m, other=0.0)
    d_h = 0.0
    if HAS_D:
        d_h = tl.load(d + h)
    return phi, zeta, d_h


@triton.jit
def intra_weights(seg_ptr, t_row, t_col, mask_row, mask_col, C, gamma_row, trap_scale_col):
    """Causal weight of row (t, r) on column (t', r'): exp(segsum[t, t']) trap_scale[t'] for t' < t,
    gamma[t] on the same step, 0 after. seg_ptr points at the chunk's [C, C] segsum block."""
    before = (t_col[None, :] < t_row[:, None]) & mask_row[:, None] & mask_col[None, :]
    seg = tl.load(seg_ptr + t_row[:, None] * C + t_col[None, :], mask=before, other=0.0)
    same = (t_col[None, :] == t_row[:, None]) & mask_row[:, None] & mask_col[None, :]
    return causal_mix(seg, before, same, gamma_row, trap_scale_col)


@triton.jit
def load_psi_v(v_ptr, t_off, row_mask, mimo_v_ptr, r, R, p, p_mask, P, stride_vp):
    """psi_v[(t, r), p] = v[t, p] * mimo_v[r, p] as an fp32 [rows, BP] tile.

    v_ptr points at the (b, h) slice of v; t_off are the time offsets of the rows;
    mimo_v_ptr at the head's [R, P] block (contiguous).
    """
    m = row_mask[:, None] & p_mask[None, :]
    x = tl.load(v_ptr + t_off[:, None] + p[None, :] * stride_vp, mask=m, other=0.0)
    psi = tl.load(mimo_v_ptr + r[:, None] * P + p[None, :], mask=m, other=0.0)
    return x.to(tl.float32) * psi


@triton.jit
def gate_epilogue(raw, dout_ptr, z_ptr, t_off, row_mask, phi, zeta, p, p_mask, stride_p,
                  dz_ptr, t_time_off, t_time_mask, TP: tl.constexpr, RP: tl.constexpr,
                  HAS_Z: tl.constexpr, EXACT: tl.constexpr):
    """Stage 0's reduce-O gradients of one chunk tile: stores dz and returns the per-rank sums.

    raw/phi/zeta: [TP * RP, BP] fp32. dout_ptr, z_ptr, dz_ptr point at the (b, h) slices of
    [B, S, H, P] tensors (t_off: the rows' step offsets in dout/z; t_time_off [TS]: the chunk's
    step offsets in the contiguous dz). Returns (sum_t dout*gate*raw,
    sum_t dout*Phi*raw*silu'(u)*z), each [RS, BP] with rank on the rows, reduced by 0/1
    selection dots (TS = max(TP, 16), RS = max(RP, 16)).
    """
    ROWS: tl.constexpr = TP * RP
    m = row_mask[:, None] & p_mask[None, :]
    off = t_off[:, None] + p[None, :] * stride_p
    dout = tl.load(dout_ptr + off, mask=m, other=0.0).to(tl.float32)
    z = tl.zeros_like(raw)
    if HAS_Z:
        z = tl.load(z_ptr + off, mask=m, other=0.0).to(tl.float32)
    g_o, h = gate_grads(raw, dout, z, zeta, HAS_Z, 0)
    g = h * phi
    if HAS_Z:
        TS: tl.constexpr = 16 if TP < 16 else TP
        dz = tl.dot(selection_matrix(ROWS, TS, RP, False), g * zeta, input_precision=EXACT)
        dm = t_time_mask[:, None] & p_mask[None, :]
        tl.store(dz_ptr + t_time_off[:, None] + p[None, :], dz.to(dz_ptr.dtype.element_ty),
                 mask=dm)
    RS: tl.constexpr = 16 if RP < 16 else RP
    by_rank = selection_matrix(ROWS, RS, RP, True)
    part_o = tl.dot(by_rank, g_o, input_precision=EXACT)
    part_z = tl.dot(by_rank, g * z, input_precision=EXACT)
    return part_o, part_z



# Lengths and batch strides are not specialised on, so a new B or S never recompiles.
@triton.jit(do_not_specialize=["S_pad", "sxb", "sab", "n_bh"])
def _rotary_kernel(x, bias, angles, out, S_pad, n_bh, H, HG, sxb, sxs, sxr, sxg, sxn, sab, sas,
                   sah, san, R, N: tl.constexpr, C, TP: tl.constexpr, RP: tl.constexpr,
                   HALF: tl.constexpr, RD: tl.constexpr, BJ: tl.constexpr):
    """out[b, h, t, r, :] = rot(x[b, t, r, g, :] + bias[h, r, :]) in fp32 for one chunk."""
    pid = tl.program_id(0)  # (b*h, chunk), b*h fastest
    bh = (pid % n_bh).to(tl.int64)
    c = (pid // n_bh).to(tl.int64)
    b, h = bh // H, bh % H
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    tg = c * C + t
    for j0 in tl.static_range(0, HALF, BJ):
        cos, sin = rotary_cos_sin(angles + b * sab + h * sah, tg * sas, rows, j0, BJ, RD, san)
        x1, x2 = load_rotated(x + b * sxb + (h // HG) * sxg, tg * sxs + r * sxr, rows,
                              bias + h * R * N, r * N, cos, sin, j0, BJ, HALF, sxn, True)
        j = j0 + tl.arange(0, BJ)
        o = ((bh * S_pad + tg) * R + r) * N
        m = rows[:, None] & (j < HALF)[None, :]
        tl.store(out + o[:, None] + j[None, :], x1, mask=m)
        tl.store(out + o[:, None] + (HALF + j)[None, :], x2, mask=m)


@triton.jit
def _load_rotated_scratch(ptr, bh, tg, r, rows, S_pad, R, N: tl.constexpr, NP: tl.constexpr):
    n = tl.arange(0, NP)
    o = ((bh * S_pad + tg) * R + r) * N
    return tl.load(ptr + o[:, None] + n[None, :], mask=rows[:, None] & (n < N)[None, :], other=0.0)


@triton.jit(do_not_specialize=["S", "S_pad", "n_bh"])
def _qk_dot_kernel(qr, kr, qk_dot, S, S_pad, n_bh, R, N: tl.constexpr, C, TP: tl.constexpr,
                   RP: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """qk_dot of one chunk from the rotated scratch."""
    pid = tl.program_id(0)  # (b*h, chunk), b*h fastest
    bh = (pid % n_bh).to(tl.int64)
    c = (pid // n_bh).to(tl.int64)
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    q = _load_rotated_scratch(qr, bh, c * C + t, r, rows, S_pad, R, N, NP)
    k = _load_rotated_scratch(kr, bh, c * C + t, r, rows, S_pad, R, N, NP)
    store_qk_dot(qk_dot + (bh * S + c * C) * R * R, dot(q, tl.trans(k), PREC), t, r,
                 rows & (c * C + t < S), R, RP, TP * RP, EXACT, False)


@triton.jit(do_not_specialize=["S", "S_pad", "nc", "svb", "sgb", "sgh"])
def _scan_kernel(qr, kr, v, dout, z, mimo_v, mimo_o, mimo_z, d, da_cs, da_cs_rev, dt, trap,
                 segsum, states, dz, dmimo_o, dmimo_z, S, S_pad, nc, H, svb, svs, svh, svp,
                 sgb, sgh, sgc, R, N: tl.constexpr, P: tl.constexpr, C, TP: tl.constexpr,
                 RP: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr, HAS_Z: tl.constexpr,
                 HAS_D: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """One (b, h) and PP columns of P: walk the chunks in order, holding the [N, PP] state in
    registers (the columns of the state never interact)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    RS: tl.constexpr = 16 if RP < 16 else RP
    TS: tl.constexpr = 16 if TP < 16 else TP
    p = tl.program_id(1) * PP + tl.arange(0, PP)
    pm = p < P
    n = tl.arange(0, NP)
    phi, zeta, d_h = head_params(mimo_o, mimo_z, d, h, r, rows, p, pm, R, P, HAS_Z, HAS_D)
    state = tl.zeros([NP, PP], dtype=tl.float32)
    acc_o = tl.zeros([RS, PP], dtype=tl.float32)
    acc_z = tl.zeros([RS, PP], dtype=tl.float32)
    tt = tl.arange(0, TS)
    vb = v + b * svb + h * svh
    for c in range(0, nc):
        c = tl.cast(c, tl.int64)  # steps times strides can pass 2**31
        tg = c * C + t
        sm = (n < N)[:, None] & pm[None, :]
        tl.store(states + ((bh * nc + c) * N + n[:, None]) * P + p[None, :],
                 state.to(states.dtype.element_ty), mask=sm)
        q = _load_rotated_scratch(qr, bh, tg, r, rows, S_pad, R, N, NP)
        k = _load_rotated_scratch(kr, bh, tg, r, rows, S_pad, R, N, NP)
        psi_v = load_psi_v(vb, tg * svs, rows, mimo_v + h * R * P, r, R, p, pm, P, svp)
        gamma, trap_scale = trap_terms(dt + bh * S_pad, trap + bh * S_pad, tg, rows, S_pad)
        w = intra_weights(segsum + b * sgb + h * sgh + c * sgc, t, t, rows, rows, C, gamma,
                          trap_scale)
        a_t = tl.load(da_cs + bh * S_pad + tg, mask=rows, other=0.0)
        raw = dot(dot(q, tl.trans(k), PREC) * w, psi_v, PREC)
        raw += tl.exp(a_t)[:, None] * dot(q, state, PREC)
        if HAS_D:
            raw += d_h * psi_v
        tgt = c * C + tt
        part_o, part_z = gate_epilogue(raw, dout + b * svb + h * svh, z + b * svb + h * svh,
                                       tg * svs, rows, phi, zeta, p, pm, svp,
                                       dz + (b * S * H + h) * P, tgt * H * P,
                                       (tt < C) & (tgt < S), TP, RP, HAS_Z, EXACT)
        acc_o += part_o
        acc_z += part_z
        rev = tl.load(da_cs_rev + bh * S_pad + tg, mask=rows, other=0.0)
        kw = k * tl.where(rows, trap_scale * tl.exp(rev), 0.0)[:, None]
        decay = tl.exp(tl.load(da_cs + bh * S_pad + c * C + C - 1))
        state = state * decay + dot(tl.trans(kw), psi_v, PREC)
    store_rank_sums(dmimo_o + bh * R * P, dmimo_z + bh * R * P, acc_o, acc_z, R, p, pm, P, RS,
                    HAS_Z)


def run(a: dict, consts, output_dtype: torch.dtype
        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                   Optional[torch.Tensor]]:
    """bwd_fwd's outputs (states, qk_dot, dmimo_o, dmimo_z, dz) by the three stage-0 kernels,
    allocated per call (states, qk_dot, dz in output_dtype), from the padded inputs `a` (by
    name; absent optional ones are placeholders and z is v) and configs.Constants `consts`."""
    m = consts
    B, H, S_pad, R, N, P = m.B, m.H, m.S_pad, m.R, m.N, m.P
    dev = a["q"].device
    states = torch.empty(B, H, m.nc, N, P, device=dev, dtype=output_dtype)
    qk_dot = torch.empty(B, H, m.S, R, R, device=dev, dtype=output_dtype)
    dz = torch.empty(B, m.S, H, P, device=dev, dtype=output_dtype) if m.HAS_Z else a["d"]
    dmimo_o = torch.empty(B, H, R, P, device=dev, dtype=torch.float32)
    dmimo_z = torch.empty(B, H, R, P, device=dev, dtype=torch.float32) if m.HAS_Z else dmimo_o
    half = N // 2
    BJ = max(16, min(64, triton.next_power_of_2(half)))
    n_bh = B * H
    scratch = {}
    ang = a["angles"]
    for name, bias in (("q", "q_bias"), ("k", "k_bias")):
        x = a[name]
        o = torch.empty(n_bh, S_pad, R, N, device=dev, dtype=torch.float32)
        _rotary_kernel[(n_bh * m.nc,)](
            x=x, bias=a[bias], angles=ang, out=o, S_pad=S_pad, n_bh=n_bh, H=H, HG=H // m.G,
            sxb=x.stride(0), sxs=x.stride(1), sxr=x.stride(2), sxg=x.stride(3), sxn=x.stride(4),
            sab=ang.stride(0), sas=ang.stride(1), sah=ang.stride(2), san=ang.stride(3), R=R, N=N,
            C=m.C, TP=m.TP, RP=m.RP, HALF=half, RD=m.RD, BJ=BJ)
        scratch[name] = o
    NP = max(16, triton.next_power_of_2(N))
    PP = max(16, min(32, triton.next_power_of_2(P)))  # fits 99 KB of shared memory
    _qk_dot_kernel[(n_bh * m.nc,)](
        qr=scratch["q"], kr=scratch["k"], qk_dot=qk_dot, S=m.S, S_pad=S_pad, n_bh=n_bh, R=R, N=N,
        C=m.C, TP=m.TP, RP=m.RP, NP=NP, PREC=m.PREC, EXACT=m.EXACT)
    v, seg = a["v"], a["segsum"]
    assert a["dout"].stride() == v.stride() and a["z"].stride() == v.stride()
    _scan_kernel[(n_bh, triton.cdiv(P, PP))](
        qr=scratch["q"], kr=scratch["k"], v=v, dout=a["dout"], z=a["z"], mimo_v=a["mimo_v"],
        mimo_o=a["mimo_o"], mimo_z=a["mimo_z"], d=a["d"], da_cs=a["da_cs"],
        da_cs_rev=a["da_cs_rev"], dt=a["dt"], trap=a["trap"], segsum=seg, states=states, dz=dz,
        dmimo_o=dmimo_o, dmimo_z=dmimo_z, S=m.S, S_pad=S_pad, nc=m.nc, H=H, svb=v.stride(0),
        svs=v.stride(1), svh=v.stride(2), svp=v.stride(3), sgb=seg.stride(0), sgh=seg.stride(1),
        sgc=seg.stride(2), R=R, N=N, P=P, C=m.C, TP=m.TP, RP=m.RP, NP=NP, PP=PP, HAS_Z=m.HAS_Z,
        HAS_D=m.HAS_D, PREC=m.PREC, EXACT=m.EXACT,
        # 8 warps gave wrong dmimo_o on the H200 (Triton 3.6.0) for 32-step chunks with R = 2;
        # a pipelined chunk loop multi-buffers the [rows, N] fp32 tiles
        num_warps=4, num_stages=1)
    return (states, qk_dot, dmimo_o, dmimo_z if m.HAS_Z else None, dz if m.HAS_Z else None)
