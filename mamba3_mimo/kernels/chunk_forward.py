"""The whole operator's output per chunk, first form (whole chunks, all N and P columns per
program; not yet tuned): raw_y = (Qr Kr^T * W) PsiV + exp(da_cs) Qr states[c] + D PsiV, then
the output stage of SPEC section 6: the optional pre-gate headwise RMSNorm
y = raw_y rsqrt(mean_p raw_y^2 + eps) w[h], the gate silu(z Zeta) (1 without Z), and the
reduction over ranks with MIMO_Out (none without it: a per-rank output).

GRAD runs the same program in the backward, given d out: instead of the output it writes
dy = d raw_y (fp32, for chunk_grads), d z, and per-chunk partial sums of the gradients of
MIMO_Out, MIMO_Z and the norm's weight, reduced on the host over batch and chunks (a fixed
order: deterministic). Without GRAD, the last chunk's program also writes the final state."""
import torch
import triton
import triton.language as tl

from ..runtime.device import on_device
from . import next_pow2
from .common import dot
from .whole_chunk import chunk_operands, rows_of_steps


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


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb", "skb", "svb"])
def chunk_forward_kernel(q, k, v, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, norm_w, terms,
                         cos, sin, da_cs, segsum, states, dout, out, dy, dz, part_o, part_z,
                         part_w, final_state, S_pad, n_bh, nc, plane, H, HG, R, C, N, P, RD, eps,
                         sqb, sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
                         TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr,
                         PP: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
                         HAS_OUT: tl.constexpr, NORM: tl.constexpr, GRAD: tl.constexpr,
                         PREC: tl.constexpr):
    """One (b*h, chunk) per program (b*h fastest on grid axis 0). z, dout, out, dy, dz are
    contiguous over [B, S_pad, ...]: z, dz [.., H, P]; out and dout [.., H, P] with MIMO_Out,
    [.., R, H, P] without; dy [.., R, H, P] fp32. part_o, part_z [B*H, nc, R, P] and part_w
    [B*H, nc, P] fp32; final_state [B, H, P, N] fp32; states [B, H, nc, N, P] fp32 (entering
    each chunk)."""
    pid = tl.program_id(0)
    bh, c = (pid % n_bh).to(tl.int64), (pid // n_bh).to(tl.int64)
    b, h = bh // H, bh % H
    HALF = N // 2
    s0 = c * C
    (t, r, rows, ts, steps, p, pm, cs, sn, q1, q2, k1, k2, psiv, gamma, trap_scale, k_decay,
     q_decay, e, w) = chunk_operands(q, k, v, q_bias, k_bias, mimo_v, terms, cos, sin, segsum,
                                     bh, c, S_pad, nc, plane, H, HG, R, C, N, P, RD, sqb, sqs,
                                     sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
                                     TP, RP, BJ, PP)
    j = tl.arange(0, BJ)
    jm = (j < HALF)[:, None] & pm[None, :]
    st_off = j[:, None] * P + p[None, :]
    st = states + (bh * nc + c) * N * P
    st1 = tl.load(st + st_off, mask=jm, other=0.0)
    st2 = tl.load(st + HALF * P + st_off, mask=jm, other=0.0)
    sc = dot(q1, tl.trans(k1), PREC) + dot(q2, tl.trans(k2), PREC)
    raw = (dot(sc * rows_of_steps(w, RP), psiv, PREC)
           + q_decay[:, None] * (dot(q1, st1, PREC) + dot(q2, st2, PREC)))
    if HAS_D:
        raw += tl.load(d + h) * psiv
    rp_ok = rows[:, None] & pm[None, :]
    tp_ok = steps[:, None] & pm[None, :]
    row_off = (((b * S_pad + s0 + t) * R + r) * H + h)[:, None] * P + p[None, :]
    step_off = ((b * S_pad + s0 + ts) * H + h)[:, None] * P + p[None, :]
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=1) / P + eps)
        nw = tl.load(norm_w + h * P + p, mask=pm, other=0.0)
        y = raw * rstd[:, None] * nw[None, :]
    else:
        y = raw
    rk = tl.arange(0, RP)
    rank_off = (h * R + rk)[:, None] * P + p[None, :]
    rank_ok = (rk < R)[:, None] & pm[None, :]
    gate = 1.0
    if HAS_Z:
        zr = _per_row(tl.load(z + step_off, mask=tp_ok, other=0.0).to(tl.float32), RP)
        zeta = _per_rank(tl.load(mimo_z + rank_off, mask=rank_ok, other=0.0), TP)
        u = zr * zeta
        sig = tl.sigmoid(u)
        gate = u * sig
    if HAS_OUT:
        phi = _per_rank(tl.load(mimo_o + rank_off, mask=rank_ok, other=0.0), TP)
    if not GRAD:
        if HAS_OUT:
            o = _rank_sums(phi * gate * y, RP)
            tl.store(out + step_off, o.to(out.dtype.element_ty), mask=tp_ok)
        else:
            tl.store(out + row_off, (gate * y).to(out.dtype.element_ty), mask=rp_ok)
        if c == nc - 1:
            # the state after the chunk's last step: past S the inputs are zero-padded (dt = 0,
            # no decay), so this is the state after step S - 1
            decay = tl.exp(tl.load(da_cs + bh * S_pad + s0 + C - 1))
            kw1 = tl.trans(k1 * k_decay[:, None])
            kw2 = tl.trans(k2 * k_decay[:, None])
            fs = final_state + bh * P * N + p[None, :] * N + j[:, None]
            tl.store(fs, st1 * decay + dot(kw1, psiv, PREC), mask=jm)
            tl.store(fs + HALF, st2 * decay + dot(kw2, psiv, PREC), mask=jm)
    else:
        part = (bh * nc + c) * R * P
        rp_off = rk[:, None] * P + p[None, :]
        if HAS_OUT:
            do = _per_row(tl.load(dout + step_off, mask=tp_ok, other=0.0).to(tl.float32), RP)
            g_y = do * phi * gate
            tl.store(part_o + part + rp_off, _step_sums(do * gate * y, RP), mask=rank_ok)
            d_gate = do * phi * y
        else:
            do = tl.load(dout + row_off, mask=rp_ok, other=0.0).to(tl.float32)
            g_y = do * gate
            d_gate = do * y
        if HAS_Z:
            du = d_gate * sig * (1.0 + u * (1.0 - sig))  # silu'(u) = sig (1 + u (1 - sig))
            tl.store(part_z + part + rp_off, _step_sums(du * zr, RP), mask=rank_ok)
            tl.store(dz + step_off, _rank_sums(du * zeta, RP), mask=tp_ok)
        if NORM:
            tl.store(part_w + (bh * nc + c) * P + p,
                     tl.sum(g_y * raw * rstd[:, None], axis=0), mask=pm)
            gw = g_y * nw[None, :]
            d_raw = (rstd[:, None] * gw
                     - raw * (rstd * rstd * rstd * tl.sum(gw * raw, axis=1) / P)[:, None])
        else:
            d_raw = g_y
        tl.store(dy + row_off, d_raw, mask=rp_ok)


def launch(*, q, k, v, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, norm_w, terms, cos, sin,
           da_cs, segsum, states, dout, out, dy, dz, part_o, part_z, part_w, final_state, eps,
           has_z: bool, has_d: bool, has_out: bool, norm: bool, grad: bool, consts) -> None:
    """Launch chunk_forward_kernel over every (b*h, chunk) of padded inputs (whole chunks of C
    steps; consts with U = 1). Absent tensors are stand-ins that the flags keep unread."""
    m = consts
    B, S_pad, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    with on_device(q.device):
        chunk_forward_kernel[(B * H * m.nc,)](
            q=q, k=k, v=v, z=z, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, mimo_o=mimo_o,
            mimo_z=mimo_z, d=d, norm_w=norm_w, terms=terms, cos=cos, sin=sin, da_cs=da_cs,
            segsum=segsum, states=states, dout=dout, out=out, dy=dy, dz=dz, part_o=part_o,
            part_z=part_z, part_w=part_w, final_state=final_state, S_pad=S_pad, n_bh=B * H,
            nc=m.nc, plane=B * H * S_pad, H=H, HG=H // G, R=R, C=m.C, N=N, P=P, RD=m.RD,
            eps=float(eps), sqb=qs[0], sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4], skb=ks[0],
            sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4], svb=vs[0], svs=vs[1], svh=vs[2],
            svp=vs[3], TP=m.TP, RP=m.RP, BJ=max(16, next_pow2(N // 2)),
            PP=max(16, next_pow2(P)), HAS_Z=has_z, HAS_D=has_d, HAS_OUT=has_out, NORM=norm,
            GRAD=grad, PREC=m.PREC)
