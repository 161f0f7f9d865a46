"""Stage-0 baseline of bwd_fwd: rotary, qk_dot and a serial scan with one program per (b, h)
(and 32-column slice of P, so that N = 256 still fits in shared memory).

Kept deliberately simple, as the seed's yardstick: rotated q/k go through an fp32 scratch and the
scan walks every chunk in order with the whole [N, P] state in registers.
"""
import torch
import triton
import triton.language as tl

from .common import (chunk_rows, dot, gate_epilogue, head_params, intra_weights, load_psi_v,
                     load_rotated, rotary_cos_sin, store_qk_dot, store_rank_sums, trap_terms)


# Lengths and batch strides are not specialised on, so a new B or S never recompiles.
@triton.jit(do_not_specialize=["S_pad", "sxb", "sab"])
def _rotary_kernel(x, bias, angles, out, S_pad, H, HG, sxb, sxs, sxr, sxg, sxn, sab, sas, sah,
                   san, R, N: tl.constexpr, C, TP: tl.constexpr, RP: tl.constexpr,
                   HALF: tl.constexpr, RD: tl.constexpr, BJ: tl.constexpr):
    """out[b, h, t, r, :] = rot(x[b, t, r, g, :] + bias[h, r, :]) in fp32 for one chunk."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
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


@triton.jit(do_not_specialize=["S", "S_pad"])
def _qk_dot_kernel(qr, kr, qk_dot, S, S_pad, R, N: tl.constexpr, C, TP: tl.constexpr,
                   RP: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """qk_dot of one chunk from the rotated scratch."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
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


def launch(a: dict, out: dict, meta: dict) -> None:
    """Run the three stage-0 kernels. `a`: padded inputs (see dispatch), `out`: output tensors,
    `meta`: shape constants from dispatch (B, S, S_pad, nc, H, G, N, P, R, C, RD, TP, RP, ...)."""
    m = meta
    B, H, S_pad, R, N = m["B"], m["H"], m["S_pad"], m["R"], m["N"]
    half = N // 2
    BJ = max(16, min(64, triton.next_power_of_2(half)))
    scratch = {}
    for name, bias in (("q", "q_bias"), ("k", "k_bias")):
        x = a[name]
        o = torch.empty(B * H, S_pad, R, N, device=x.device, dtype=torch.float32)
        _rotary_kernel[(B * H, m["nc"])](
            x, a[bias], a["angles"], o, S_pad, H, H // m["G"], *x.stride(), *a["angles"].stride(),
            R, N, m["C"], m["TP"], m["RP"], half, m["RD"], BJ)
        scratch[name] = o
    NP = max(16, triton.next_power_of_2(N))
    PP = max(16, min(32, triton.next_power_of_2(m["P"])))  # fits 99 KB of shared memory
    _qk_dot_kernel[(B * H, m["nc"])](scratch["q"], scratch["k"], out["qk_dot"], m["S"], S_pad, R,
                                     N, m["C"], m["TP"], m["RP"], NP, m["PREC"], m["EXACT"])
    v, seg = a["v"], a["segsum"]
    assert a["dout"].stride() == v.stride() and (a["z"] is None or a["z"].stride() == v.stride())
    _scan_kernel[(B * H, triton.cdiv(m["P"], PP))](
        scratch["q"], scratch["k"], v, a["dout"], a["z"], a["mimo_v"], a["mimo_o"], a["mimo_z"],
        a["d"], a["da_cs"], a["da_cs_rev"], a["dt"], a["trap"], seg, out["states"], out["dz"],
        out["dmimo_o"], out["dmimo_z"], m["S"], S_pad, m["nc"], H, *v.stride(), seg.stride(0),
        seg.stride(1), seg.stride(2), R, N, m["P"], m["C"], m["TP"], m["RP"], NP, PP,
        m["HAS_Z"], m["HAS_D"], m["PREC"], m["EXACT"],
        # 8 warps gave wrong dmimo_o on the H200 (Triton 3.6.0) for 32-step chunks with R = 2
        # (test_tail[*-32-stage0]); a pipelined chunk loop multi-buffers the [rows, N] fp32 tiles
        num_warps=4, num_stages=1)
