"""The whole operator's own kernels (chunk_forward, phase 2's chunk_grads_qk and chunk_grads_v)
work on whole chunks: one program holds a chunk's (step, rank) rows (row = t * RP + r) and walks
N in blocks of BJ pair columns and P in blocks of BP columns, so that its tiles stay within the
registers and shared memory of one program. Here: what such a program loads, each load apart
from the math that uses it (a program issues a step's loads together and waits for memory
once, common.landed), and the reshapes between rows and steps."""
import triton
import triton.language as tl

from .common import (landed, load_cos_sin, load_mimo_v, load_pair_columns, mac, opaque,
                     prefetch_steps, rotate_pairs, sigmoid)
from .step_terms import GAMMA, K_DECAY, Q_DECAY, TRAP_SCALE


@triton.jit
def rows_of_steps(x, RP: tl.constexpr):
    """[TP, TP] per pair of steps -> [TP * RP, TP * RP] per pair of rows."""
    TP: tl.constexpr = x.shape[0]
    x = tl.broadcast_to(x[:, None, :, None], (TP, RP, TP, RP))
    return tl.reshape(x, (TP * RP, TP * RP))


@triton.jit
def steps_of_rows(x, RP: tl.constexpr):
    """[TP * RP, TP * RP] per pair of rows -> [TP, TP], summed over the ranks."""
    TPR: tl.constexpr = x.shape[0]
    TP: tl.constexpr = TPR // RP
    return tl.sum(tl.sum(tl.reshape(x, (TP, RP, TP, RP)), axis=3), axis=1)


@triton.jit
def step_sums(x, RP: tl.constexpr):
    """[TP * RP] per row -> [TP] per step, summed over the ranks."""
    TPR: tl.constexpr = x.shape[0]
    return tl.sum(tl.reshape(x, (TPR // RP, RP)), axis=1)


@triton.jit
def chunk_masks(t, r, R, C, TP: tl.constexpr):
    """Which of a chunk tile's (step, rank) rows exist, its steps ts = 0..TP-1 and which of
    them exist."""
    ts = tl.arange(0, TP)
    return (t < C) & (r < R), ts, ts < C


@triton.jit
def chunk_term_loads(terms, segsum, t, r, bh, c, S_pad, nc, plane, R, C, TP: tl.constexpr):
    """The per-step terms of chunk c of (b*h) bh (both 64-bit) for the rows (t, r) of
    chunk_rows, as stored (chunk_weights' input): gamma, trap_scale [TP], K_DECAY, Q_DECAY per
    row and segsum [TP, TP] (zero where a step does not exist and on and above the diagonal)."""
    row = bh * S_pad + c * C  # the chunk's first step in the [B*H, S_pad] planes
    plane = tl.cast(plane, tl.int64)  # six planes of B*H*S_pad steps can pass 2**31
    rows, ts, steps = chunk_masks(t, r, R, C, TP)
    gamma = tl.load(terms + GAMMA * plane + row + ts, mask=steps, other=0.0)
    trap_scale = tl.load(terms + TRAP_SCALE * plane + row + ts, mask=steps, other=0.0)
    k_decay = tl.load(terms + K_DECAY * plane + row + t, mask=rows, other=0.0)
    q_decay = tl.load(terms + Q_DECAY * plane + row + t, mask=rows, other=0.0)
    before = (ts[None, :] < ts[:, None]) & steps[:, None] & steps[None, :]
    seg = tl.load(segsum + (bh * nc + c) * C * C + ts[:, None] * C + ts[None, :], mask=before,
                  other=0.0)
    return gamma, trap_scale, k_decay, q_decay, seg


@triton.jit
def chunk_weights(gamma, trap_scale, seg, C, TP: tl.constexpr, LAND: tl.constexpr = False):
    """The causal weights per pair of steps from chunk_term_loads' (each landed first with
    LAND, common.landed): E = exp(segsum) before the diagonal (else 0) and
    W = E trap_scale[t'] + gamma on the diagonal ([TP, TP])."""
    gamma, trap_scale, seg = landed(gamma, LAND), landed(trap_scale, LAND), landed(seg, LAND)
    ts = tl.arange(0, TP)
    steps = ts < C
    before = (ts[None, :] < ts[:, None]) & steps[:, None] & steps[None, :]
    e = tl.where(before, tl.exp(seg), 0.0)
    diag = (ts[None, :] == ts[:, None]) & steps[:, None]
    w = e * trap_scale[None, :] + tl.where(diag, gamma[:, None], 0.0)
    return e, w


@triton.jit
def rotation_inputs(x_at, row_off, rows, bias_at, bias_off, cos_at, sin_at, cs_off, j0, HALF, RD,
                    stride_n, BJ: tl.constexpr):
    """cos, sin [rows, BJ] of the pair columns j0..j0+BJ of the rows and those columns of x
    and of its bias as stored (x_at, cos_at, sin_at at the chunk's first step)."""
    cs, sn = load_cos_sin(cos_at, sin_at, cs_off, rows, j0, BJ, RD)
    x1, x2 = load_pair_columns(x_at, row_off, rows, j0, BJ, HALF, stride_n)
    b1, b2 = load_pair_columns(bias_at, bias_off, rows, j0, BJ, HALF, 1)
    return cs, sn, x1, x2, b1, b2


@triton.jit
def v_block(v_at, ts, steps, svs, svp, mimo_v_at, R, P, p0, BP: tl.constexpr, RP: tl.constexpr):
    """(p, p mask, v [TP, BP] as stored, the head's mimo_v rows [RP, BP]) of the columns
    p0..p0+BP (v_at at the chunk's first step, mimo_v_at at the head's [R, P] block): PsiV's
    inputs (common.psi_v_rows)."""
    p = p0 + tl.arange(0, BP)
    pm = p < P
    xv = tl.load(v_at + ts[:, None] * svs + p[None, :] * svp,
                 mask=steps[:, None] & pm[None, :], other=0.0)
    return p, pm, xv, load_mimo_v(mimo_v_at, R, p, pm, P, RP)


@triton.jit
def dy_loads(src, y_row, rows, ts, steps, svs, svp, R, P, p, pm, RP: tl.constexpr,
             HAS_Z: tl.constexpr, GATED: tl.constexpr):
    """What dy = d raw_y [rows, BP] of a chunk on the columns p (mask pm) is made of, loaded
    apart from its math (dy_of) so that a kernel issues these loads with its others and waits
    for memory once. src = (dy, dout, z, mimo_o, mimo_z) at the chunk: the fp32 buffer's dy
    (at the chunk's first row, y_row the rows' offsets) in all four places; or with GATED, dy
    recomputed as dout[t, p] MIMO_Out[r, p] silu(z[t, p] MIMO_Z[r, p]) (no silu without Z), the
    gradient through the reduce-O gate, which reads a quarter of the buffer's bytes at R = 4 and
    needs no buffer: dout and z [TP, BP] as stored (at the chunk's first step; v's strides svs,
    svp) and the head's MIMO_Out and MIMO_Z rows [RP, BP] (without HAS_Z dout and MIMO_Out in
    z's and MIMO_Z's places)."""
    dy_at, dout_at, z_at, mo_at, mz_at = src
    if GATED:
        m = steps[:, None] & pm[None, :]
        off = ts[:, None] * svs + p[None, :] * svp
        d_out = tl.load(dout_at + off, mask=m, other=0.0)
        mo = load_mimo_v(mo_at, R, p, pm, P, RP)
        if HAS_Z:
            return (d_out, tl.load(z_at + off, mask=m, other=0.0), mo,
                    load_mimo_v(mz_at, R, p, pm, P, RP))
        return d_out, d_out, mo, mo
    else:
        dy = tl.load(dy_at + y_row[:, None] + p[None, :], mask=rows[:, None] & pm[None, :],
                     other=0.0)
        return dy, dy, dy, dy


@triton.jit
def dy_of(loaded, HAS_Z: tl.constexpr, FAST: tl.constexpr, GATED: tl.constexpr,
          LAND: tl.constexpr = False):
    """dy [rows, BP] fp32 from dy_loads' tiles, each landed first (common.landed, LAND, which
    also converts them to fp32); FAST: common.sigmoid's."""
    d_out, zz, mo, mz = loaded
    if GATED:
        g = landed(d_out, LAND)[:, None, :] * landed(mo, LAND)[None, :, :]
        if HAS_Z:
            u = landed(zz, LAND)[:, None, :] * landed(mz, LAND)[None, :, :]
            g = g * (u * sigmoid(u, FAST))
        return tl.reshape(g, (g.shape[0] * g.shape[1], g.shape[2]))
    else:
        return landed(d_out, LAND)


@triton.jit
def qk_pair_loads(q_at, qrow, k_at, krow, rows, qb_at, kb_at, bias_off, cos_at, sin_at, cs_off,
                  j0, HALF, RD, sqn, skn, BJ: tl.constexpr):
    """The loads of Qr and Kr on the pair columns j0..j0+BJ, issued together: cos, sin
    [rows, BJ] and the pair columns of q, q_bias, k and k_bias as stored (qk_pairs' input)."""
    cs, sn, x1, x2, xb1, xb2 = rotation_inputs(q_at, qrow, rows, qb_at, bias_off, cos_at,
                                               sin_at, cs_off, j0, HALF, RD, sqn, BJ)
    y1, y2 = load_pair_columns(k_at, krow, rows, j0, BJ, HALF, skn)
    yb1, yb2 = load_pair_columns(kb_at, bias_off, rows, j0, BJ, HALF, 1)
    return cs, sn, x1, x2, xb1, xb2, y1, y2, yb1, yb2


@triton.jit
def qk_pairs(loaded, LAND: tl.constexpr, AFTER: tl.constexpr):
    """(cos, sin, Qr's two halves, Kr's two halves) [rows, BJ] fp32 from qk_pair_loads'. With
    LAND the layout passes are kept from the loads (common.landed): each loaded tile landed
    before the rotation, or with AFTER the rotation done on the tiles as loaded, in their
    layout, and the six results behind `opaque`, whose conversions are then six rather than
    ten (offline, sm_90: chunk_forward spilled 8-32 bytes per thread instead of 120-192 at
    N128_P64_R4_C16 and N256_P64_R4_C8; chunk_grads_qk 16-40 more)."""
    cs, sn, x1, x2, xb1, xb2, y1, y2, yb1, yb2 = loaded
    if AFTER:
        q1, q2 = rotate_pairs(x1, x2, xb1, xb2, cs, sn, True)
        k1, k2 = rotate_pairs(y1, y2, yb1, yb2, cs, sn, True)
        return (opaque(cs, LAND), opaque(sn, LAND), opaque(q1, LAND), opaque(q2, LAND),
                opaque(k1, LAND), opaque(k2, LAND))
    cs, sn = landed(cs, LAND), landed(sn, LAND)
    q1, q2 = rotate_pairs(x1, x2, xb1, xb2, cs, sn, True, LAND)
    k1, k2 = rotate_pairs(y1, y2, yb1, yb2, cs, sn, True, LAND)
    return cs, sn, q1, q2, k1, k2


@triton.jit
def chunk_scores(q_at, qrow, k_at, krow, rows, qb_at, kb_at, bias_off, cos_at, sin_at, cs_off,
                 HALF, RD, sqn, skn, BJ: tl.constexpr, PREC: tl.constexpr, LAND: tl.constexpr):
    """Qr Kr^T [rows, rows] over the pair blocks, each block's loads issued before its math
    (qk_pairs' LAND)."""
    ROWS: tl.constexpr = rows.shape[0]
    sc = tl.zeros([ROWS, ROWS], dtype=tl.float32)
    for j0 in range(0, HALF, BJ):
        _, _, q1, q2, k1, k2 = qk_pairs(qk_pair_loads(
            q_at, qrow, k_at, krow, rows, qb_at, kb_at, bias_off, cos_at, sin_at, cs_off, j0,
            HALF, RD, sqn, skn, BJ), LAND, True)
        sc = mac(mac(sc, q1, tl.trans(k1), PREC), q2, tl.trans(k2), PREC)
    return sc


@triton.jit
def state_block(at, j0, p0, HALF, P, BJ: tl.constexpr, BP: tl.constexpr):
    """The two halves [BJ, BP] of a [N, P] state at `at`: rows j0..j0+BJ and HALF + those,
    columns p0..p0+BP."""
    j = j0 + tl.arange(0, BJ)
    p = p0 + tl.arange(0, BP)
    m = (j < HALF)[:, None] & (p < P)[None, :]
    off = j[:, None] * P + p[None, :]
    return (tl.load(at + off, mask=m, other=0.0).to(tl.float32),
            tl.load(at + HALF * P + off, mask=m, other=0.0).to(tl.float32))


@triton.jit
def prefetch_state_block(at, j0, p0, HALF, P, ok, BJ: tl.constexpr, BP: tl.constexpr,
                         LEVEL: tl.constexpr):
    """common.prefetch of state_block's two halves at `at` (rows j0..j0+BJ and HALF + those,
    columns p0..p0+BP), where ok."""
    j = j0 + tl.arange(0, BJ)
    rows_ok = (j < HALF) & ok
    prefetch_steps(at, j * P, rows_ok, p0, 1, BP, LEVEL)
    prefetch_steps(at + HALF * P, j * P, rows_ok, p0, 1, BP, LEVEL)


@triton.jit
def chunk_pointers(q, k, v, mimo_v, cos, sin, t, r, b, h, c, S_pad, H, HG, R, C, N, P, RD, sqb,
                   sqs, sqr, sqg, skb, sks, skr, skg, svb, svs, svh):
    """Where the program of chunk c of (b, h) (64-bit) reads: the chunk's first step `row` in
    the [B*H, S_pad] planes, q and k at the chunk's first step with the rows' offsets, cos/sin
    at that step with theirs, the rows' bias offsets, v at the chunk's first step and the
    head's mimo_v block."""
    s0 = c * C
    row = (b * H + h) * S_pad + s0
    g = h // HG
    q_at, qrow = q + b * sqb + g * sqg + s0 * sqs, t * sqs + r * sqr
    k_at, krow = k + b * skb + g * skg + s0 * sks, t * sks + r * skr
    cos_at, sin_at, cs_off = cos + row * RD, sin + row * RD, t * RD
    v_at, mv_at = v + b * svb + h * svh + s0 * svs, mimo_v + h * R * P
    return (row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, (h * R + r) * N, v_at, mv_at)
