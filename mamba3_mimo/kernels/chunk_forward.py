"""The whole operator's output per chunk (one program per chunk, all P columns at once, N in
blocks of pairs): raw_y = (Qr Kr^T * W) PsiV + exp(da_cs) Qr states[c] + D PsiV, then
the output stage of SPEC section 6: the optional pre-gate headwise RMSNorm
y = raw_y rsqrt(mean_p raw_y^2 + eps) w[h], the gate silu(z Zeta) (1 without Z), and the
reduction over ranks with MIMO_Out (none without it: a per-rank output).

GRAD runs the same program in the backward, given d out: instead of the output it writes
dy = d raw_y (fp32, for chunk_grads), d z, and per-chunk partial sums of the gradients of
MIMO_Out, MIMO_Z and the norm's weight, reduced on the host over batch and chunks (a fixed
order: deterministic). The final state is not written here: the operator reads it as the state
entering a zero chunk after the steps (the state pass's), so that its code does not weigh on
every program's registers."""
import triton
import triton.language as tl

from ..runtime.launcher import Launch
from . import next_pow2
from .common import chunk_rows, landed, mac, psi_v_rows
from .whole_chunk import (chunk_masks, chunk_pointers, chunk_term_loads, chunk_weights,
                          qk_pair_loads, qk_pairs, rows_of_steps, state_block, v_block)


@triton.jit
def _per_row(x, RP: tl.constexpr):
    """[TP, PP] per step -> [TP * RP, PP] per (step, rank) row."""
    TP: tl.constexpr = x.shape[0]
    PP: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, None, :], (TP, RP, PP)), (TP * RP, PP))


@triton.jit
def _per_rank(x, TP: tl.constexpr):
    """[RP, PP] per rank -> [TP * RP, PP] per (step, rank) row."""
    RP: tl.constexpr = x.shape[0]
    PP: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[None, :, :], (TP, RP, PP)), (TP * RP, PP))


@triton.jit
def _rank_sums(x, RP: tl.constexpr):
    """[TP * RP, PP] per row -> [TP, PP] per step, summed over the ranks."""
    TPR: tl.constexpr = x.shape[0]
    PP: tl.constexpr = x.shape[1]
    return tl.sum(tl.reshape(x, (TPR // RP, RP, PP)), axis=1)


@triton.jit
def _step_sums(x, RP: tl.constexpr):
    """[TP * RP, PP] per row -> [RP, PP] per rank, summed over the steps."""
    TPR: tl.constexpr = x.shape[0]
    PP: tl.constexpr = x.shape[1]
    return tl.sum(tl.reshape(x, (TPR // RP, RP, PP)), axis=0)


@triton.jit
def _stage_loads(z, mimo_z, mimo_o, dout, s_at, s_row, r_at, r_row, h, R, P, p, pm, steps, rows,
                 RP: tl.constexpr, HAS_Z: tl.constexpr, HAS_OUT: tl.constexpr,
                 GRAD: tl.constexpr):
    """The output stage's inputs on the columns p, as stored (_stage_inputs' input): z [TP, PP]
    and Zeta [RP, PP] (HAS_Z), Phi [RP, PP] (HAS_OUT), dout (GRAD; [TP, PP] with Phi, per row
    without). Absent ones are 0."""
    rk = tl.arange(0, RP)
    rank_off = (h * R + rk)[:, None] * P + p[None, :]
    rank_ok = (rk < R)[:, None] & pm[None, :]
    tp_ok = steps[:, None] & pm[None, :]
    zr, zeta, phi, do = 0.0, 0.0, 0.0, 0.0
    if HAS_Z:
        zr = tl.load(z + s_at + s_row[:, None] + p[None, :], mask=tp_ok, other=0.0)
        zeta = tl.load(mimo_z + rank_off, mask=rank_ok, other=0.0)
    if HAS_OUT:
        phi = tl.load(mimo_o + rank_off, mask=rank_ok, other=0.0)
    if GRAD:
        if HAS_OUT:
            do = tl.load(dout + s_at + s_row[:, None] + p[None, :], mask=tp_ok, other=0.0)
        else:
            do = tl.load(dout + r_at + r_row[:, None] + p[None, :],
                         mask=rows[:, None] & pm[None, :], other=0.0)
    return zr, zeta, phi, do


@triton.jit
def _stage_inputs(loaded, TP: tl.constexpr, RP: tl.constexpr, HAS_Z: tl.constexpr,
                  HAS_OUT: tl.constexpr, GRAD: tl.constexpr, LAND: tl.constexpr):
    """_stage_loads' tiles per row, in fp32 and landed (common.landed, LAND): z, Zeta, Phi and
    dout; absent ones are 1 (0 for z)."""
    zr, zeta, phi, do = loaded
    if HAS_Z:
        zr = _per_row(landed(zr, LAND), RP)
        zeta = _per_rank(landed(zeta, LAND), TP)
    else:
        zeta = 1.0
    if HAS_OUT:
        phi = _per_rank(landed(phi, LAND), TP)
    else:
        phi = 1.0
    if GRAD:
        if HAS_OUT:
            do = _per_row(landed(do, LAND), RP)
        else:
            do = landed(do, LAND)
    else:
        do = 1.0
    return zr, zeta, phi, do


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb", "skb", "svb"])
def chunk_forward_kernel(q, k, v, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, norm_w, terms,
                         cos, sin, segsum, states, dout, out, dy, dz, part_o, part_z,
                         part_w, S_pad, n_bh, nc, plane, H, HG, R, C, N, P, RD, eps,
                         sqb, sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
                         TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr,
                         BP: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
                         HAS_OUT: tl.constexpr, NORM: tl.constexpr, GRAD: tl.constexpr,
                         PREC: tl.constexpr, OPAQUE: tl.constexpr):
    """One (b*h, chunk) per program (b*h fastest on grid axis 0), N in blocks of BJ pairs and
    all P columns at once (BP >= P). z, dout, out, dy, dz are contiguous over [B, S_pad, ...]:
    z, dz [.., H, P] (dz in any float dtype, each element rounded once); out and dout
    [.., H, P] with MIMO_Out, [.., R, H, P] without; dy [.., R, H, P] fp32. part_o, part_z
    [B*H, nc, R, P] and part_w [B*H, nc, P] fp32, which GRAD adds its partial sums to
    (common.store_or_add); states [B, H, nc, N, P] fp32 (entering each
    chunk)."""
    pid = tl.program_id(0)
    bh, c = (pid % n_bh).to(tl.int64), (pid // n_bh).to(tl.int64)
    b, h = bh // H, bh % H
    HALF = N // 2
    t, r = chunk_rows(TP, RP)
    _, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at = chunk_pointers(
        q, k, v, mimo_v, cos, sin, t, r, b, h, c, S_pad, H, HG, R, C, N, P, RD, sqb, sqs, sqr,
        sqg, skb, sks, skr, skg, svb, svs, svh)
    s0 = c * C
    rows, ts, steps = chunk_masks(t, r, R, C, TP)
    st_at = states + (bh * nc + c) * N * P
    # [B, S_pad, H, P] per step and [B, S_pad, R, H, P] per row: the chunk's first element
    s_at, s_row = ((b * S_pad + s0) * H + h) * P, ts * H * P
    r_at, r_row = ((b * S_pad + s0) * R * H + h) * P, (t * R + r) * H * P
    # all P columns at once, so that one walk over N in blocks of BJ pairs gives both the scores
    # Sc = Qr Kr^T and Qr states[c], and the norm's sums need no second pass; each step's loads
    # are issued before its math, so that the program waits for memory once per step
    gamma, trap_scale, k_decay, q_decay, seg = chunk_term_loads(
        terms, segsum, t, r, bh, c, S_pad, nc, plane, R, C, TP)
    p, pm, xv, mv = v_block(v_at, ts, steps, svs, svp, mv_at, R, P, 0, BP, RP)
    ROWS: tl.constexpr = TP * RP
    sc = tl.zeros([ROWS, ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BP], dtype=tl.float32)
    for j0 in range(0, HALF, BJ):
        pairs_in = qk_pair_loads(q_at, qrow, k_at, krow, rows, q_bias, k_bias, bias_off, cos_at,
                                 sin_at, cs_off, j0, HALF, RD, sqn, skn, BJ)
        cs, sn, q1, q2, k1, k2 = qk_pairs(pairs_in, OPAQUE, True)
        # the state's block after the rotation: loaded before it, the block and the pair
        # tiles together spilled 384 bytes per thread instead of 120 (N128_P64_R4_C16, sm_90)
        st1, st2 = state_block(st_at, j0, 0, HALF, P, BJ, BP)
        sc = mac(mac(sc, q1, tl.trans(k1), PREC), q2, tl.trans(k2), PREC)
        acc = mac(mac(acc, q1, st1, PREC), q2, st2, PREC)
    # raw_y = (Sc W) PsiV + Q_DECAY Qr states[c] + D PsiV
    _, w = chunk_weights(gamma, trap_scale, seg, C, TP, OPAQUE)
    psiv = psi_v_rows(landed(xv, OPAQUE), landed(mv, OPAQUE))
    raw = mac(landed(q_decay, OPAQUE)[:, None] * acc, sc * rows_of_steps(w, RP), psiv, PREC)
    if HAS_D:
        raw += tl.load(d + h) * psiv
    # the output stage's loads together (and what GRAD's partial sums add to)
    stage_in = _stage_loads(z, mimo_z, mimo_o, dout, s_at, s_row, r_at, r_row, h, R, P, p, pm,
                            steps, rows, RP, HAS_Z, HAS_OUT, GRAD)
    if NORM:
        nw = landed(tl.load(norm_w + h * P + p, mask=pm, other=0.0), OPAQUE)
    rk = tl.arange(0, RP)
    part = (bh * nc + c) * R * P + rk[:, None] * P + p[None, :]
    rank_ok = (rk < R)[:, None] & pm[None, :]
    if GRAD:
        if HAS_OUT:
            o_before = tl.load(part_o + part, mask=rank_ok, other=0.0)
        if HAS_Z:
            z_before = tl.load(part_z + part, mask=rank_ok, other=0.0)
        if NORM:
            w_before = tl.load(part_w + (bh * nc + c) * P + p, mask=pm, other=0.0)
    zr, zeta, phi, do = _stage_inputs(stage_in, TP, RP, HAS_Z, HAS_OUT, GRAD, OPAQUE)
    gate = 1.0
    if HAS_Z:
        u = zr * zeta
        sig = tl.sigmoid(u)
        gate = u * sig
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=1) / P + eps)
        y = raw * rstd[:, None] * nw[None, :]
    else:
        y = raw
    tp_ok = steps[:, None] & pm[None, :]
    rp_ok = rows[:, None] & pm[None, :]
    if not GRAD:
        if HAS_OUT:
            tl.store(out + s_at + s_row[:, None] + p[None, :],
                     _rank_sums(phi * gate * y, RP).to(out.dtype.element_ty), mask=tp_ok)
        else:
            tl.store(out + r_at + r_row[:, None] + p[None, :],
                     (gate * y).to(out.dtype.element_ty), mask=rp_ok)
    else:
        g_y = do * phi * gate  # d loss / d y
        # added to what the groups of batch entries before left there (common.store_or_add)
        if HAS_OUT:
            tl.store(part_o + part, landed(o_before, OPAQUE) + _step_sums(do * gate * y, RP),
                     mask=rank_ok)
        if HAS_Z:
            # silu'(u) = sig (1 + u (1 - sig))
            du = do * phi * y * sig * (1.0 + u * (1.0 - sig))
            tl.store(part_z + part, landed(z_before, OPAQUE) + _step_sums(du * zr, RP),
                     mask=rank_ok)
            tl.store(dz + s_at + s_row[:, None] + p[None, :],
                     _rank_sums(du * zeta, RP).to(dz.dtype.element_ty), mask=tp_ok)
        if NORM:
            tl.store(part_w + (bh * nc + c) * P + p,
                     landed(w_before, OPAQUE) + tl.sum(g_y * raw * rstd[:, None], axis=0),
                     mask=pm)
            g_raw = tl.sum(g_y * nw[None, :] * raw, axis=1)  # sum_p w g_y raw_y
            d_raw = (rstd[:, None] * nw[None, :] * g_y
                     - raw * (rstd * rstd * rstd * g_raw / P)[:, None])
        else:
            d_raw = g_y
        tl.store(dy + r_at + r_row[:, None] + p[None, :], d_raw, mask=rp_ok)


# Launch options, measured on the H200 (2026-12-03, forward+backward,
# docs/performance-operator.md): 4 warps and one stage (8 warps took 1.1-2.5x as long); blocks
# of 32 pairs of N at P <= 64 (N128_P64_R4_C16: 1.37 ms for both calls, 16 pairs 1.54) and 16
# above (N64_P128_R4_C16: 2.03 ms, 32 pairs 2.84).
OPTIONS = dict(num_warps=4, num_stages=1)


def block_pairs(P: int) -> int:
    """Pairs of N per block for head dimension P (the whole P is one block)."""
    return 32 if P <= 64 else 16


def launch(*, q, k, v, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, norm_w, terms, cos, sin,
           segsum, states, dout, out, dy, dz, part_o, part_z, part_w, eps,
           has_z: bool, has_d: bool, has_out: bool, norm: bool, grad: bool, consts) -> Launch:
    """chunk_forward_kernel's launch over every (b*h, chunk) of padded inputs (whole chunks of C
    steps; consts with U = 1). Absent tensors are stand-ins that the flags keep unread."""
    m = consts
    B, S_pad, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    return Launch(chunk_forward_kernel, (B * H * m.nc,), dict(
        q=q, k=k, v=v, z=z, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, mimo_o=mimo_o,
        mimo_z=mimo_z, d=d, norm_w=norm_w, terms=terms, cos=cos, sin=sin,
        segsum=segsum, states=states, dout=dout, out=out, dy=dy, dz=dz, part_o=part_o,
        part_z=part_z, part_w=part_w, S_pad=S_pad, n_bh=B * H,
        nc=m.nc, plane=B * H * S_pad, H=H, HG=H // G, R=R, C=m.C, N=N, P=P, RD=m.RD,
        eps=float(eps), sqb=qs[0], sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4], skb=ks[0],
        sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4], svb=vs[0], svs=vs[1], svh=vs[2],
        svp=vs[3], TP=m.TP, RP=m.RP, BJ=max(16, min(block_pairs(P), next_pow2(N // 2))),
        BP=max(16, next_pow2(P)), HAS_Z=has_z, HAS_D=has_d, HAS_OUT=has_out,
        NORM=norm, GRAD=grad, PREC=m.PREC, OPAQUE=m.OPAQUE), OPTIONS)
