"""Phase 2 of the backward (the operator's bwd_bwd), first form: the gradients of raw_y with respect
to everything it is computed from, given d raw_y.

Two kernels over whole tiles (one chunk, all N pair columns and all P columns per program; a
form for correctness, not yet tuned):

- `state_grad_kernel`: the reverse of the state recurrence. dstates[c] is the gradient with
  respect to the state entering chunk c: dstates[nc] = d final state (zero when the final state
  is not used), dstates[c] = dstates[c+1] exp(da_cs[end of c]) + sum_{t in c, r}
  exp(da_cs[t]) qr[t, r] (x) dy[t, r].
- `chunk_grads_kernel`: per (b, h, chunk c), with Sc = Qr Kr^T, dP = dY PsiV^T and the causal
  weights W (exp(segsum) trap_scale[t'] before the diagonal, gamma on it):
  dQr = (dP * W) Kr + exp(da_cs) dY states[c]^T, dKr = (dP * W)^T Qr + K_DECAY PsiV
  dstates[c+1]^T, dPsiV = (Sc * W)^T dY + K_DECAY Kr dstates[c+1] + D dY; d gamma and d
  trap_scale from Sc * dP; the gradient of ADT through da_cs, da_cs_rev and segsum (chunk-local,
  with the state recurrence's exp(da_cs[end]) term); then dQr and dKr rotated back (the
  gradients of q + q_bias and k + k_bias) and the angles' gradient sum_r (dqr2 qr1 - dqr1 qr2)
  plus k's.

Rows are (step, rank) pairs as in chunk_output (row = t * RP + r).
"""
import torch
import triton
import triton.language as tl

from ..runtime.device import on_device
from . import next_pow2
from .common import chunk_rows, dot, load_cos_sin
from .step_terms import Q_DECAY
from .whole_chunk import chunk_operands, rotated_rows, rows_of_steps, step_sums, steps_of_rows


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb"])
def state_grad_kernel(q, q_bias, dy, terms, cos, sin, da_cs, dstates, S_pad, n_bh, nc, plane, H,
                      HG, R, C, N, P, RD, sqb, sqs, sqr, sqg, sqn, TP: tl.constexpr,
                      RP: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                      PREC: tl.constexpr):
    """One (b, h) and one block of BP state columns per program; dstates [B, H, nc + 1, N, P]
    fp32 holds d final state in entry nc on entry, every entry on exit. dy [B, S_pad, R, H, P]
    fp32."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    HALF = N // 2
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    pm = p < P
    j = tl.arange(0, BJ)
    jm = (j < HALF)[:, None] & pm[None, :]
    st_off = j[:, None] * P + p[None, :]
    ds = dstates + bh * (nc + 1) * N * P
    ds_c = ds + nc * N * P
    run1 = tl.load(ds_c + st_off, mask=jm, other=0.0)
    run2 = tl.load(ds_c + HALF * P + st_off, mask=jm, other=0.0)
    q_h = q + b * sqb + (h // HG) * sqg
    bias_off = (h * R + r) * N
    row = bh * S_pad
    for i in range(nc):
        c = nc - 1 - i
        s0 = tl.cast(c, tl.int64) * C
        cs, sn = load_cos_sin(cos + (row + s0) * RD, sin + (row + s0) * RD, t * RD, rows, 0, BJ,
                              RD)
        q1, q2 = rotated_rows(q_h + s0 * sqs, t * sqs + r * sqr, rows, q_bias, bias_off, cs, sn,
                               HALF, sqn, BJ)
        w = tl.load(terms + Q_DECAY * plane + row + s0 + t, mask=rows, other=0.0)
        d_y = tl.load(dy + (((b * S_pad + s0 + t) * R + r) * H + h)[:, None] * P + p[None, :],
                      mask=rows[:, None] & pm[None, :], other=0.0)
        decay = tl.exp(tl.load(da_cs + row + s0 + C - 1))
        run1 = run1 * decay + dot(tl.trans(q1 * w[:, None]), d_y, PREC)
        run2 = run2 * decay + dot(tl.trans(q2 * w[:, None]), d_y, PREC)
        ds_c = ds + c * N * P
        tl.store(ds_c + st_off, run1, mask=jm)
        tl.store(ds_c + HALF * P + st_off, run2, mask=jm)


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb", "skb", "svb"])
def chunk_grads_kernel(q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                       segsum, dy, states, dstates, dqb, dkb, dpsiv, d_angles, d_gamma,
                       d_trap_scale, d_adt, S_pad, n_bh, nc, plane, H, HG, R, C, N, P, RD, sqb,
                       sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
                       TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr, PP: tl.constexpr,
                       HAS_D: tl.constexpr, PREC: tl.constexpr):
    """One (b*h, chunk) per program (b*h fastest on grid axis 0). Writes dqb, dkb
    [B, S_pad, R, H, N], dpsiv [B, S_pad, R, H, P], d_angles [B, S_pad, H, RD] and d_gamma,
    d_trap_scale, d_adt [B, H, S_pad], all fp32; reads dy [B, S_pad, R, H, P], states
    [B, H, nc, N, P] and dstates [B, H, nc + 1, N, P] (fp32)."""
    pid = tl.program_id(0)
    bh, c = (pid % n_bh).to(tl.int64), (pid // n_bh).to(tl.int64)
    b, h = bh // H, bh % H
    HALF = N // 2
    s0 = c * C
    row = bh * S_pad + s0  # the chunk's first step in the [B*H, S_pad] planes
    (t, r, rows, ts, steps, p, pm, cs, sn, q1, q2, k1, k2, psiv, gamma, trap_scale, k_decay,
     q_decay, e, w) = chunk_operands(q, k, v, q_bias, k_bias, mimo_v, terms, cos, sin, segsum,
                                     bh, c, S_pad, nc, plane, H, HG, R, C, N, P, RD, sqb, sqs,
                                     sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
                                     TP, RP, BJ, PP)
    j = tl.arange(0, BJ)
    rp_ok = rows[:, None] & pm[None, :]
    y_off = (((b * S_pad + s0 + t) * R + r) * H + h)[:, None] * P + p[None, :]
    d_y = tl.load(dy + y_off, mask=rp_ok, other=0.0)
    rev = tl.load(da_cs_rev + row + ts, mask=steps, other=0.0)
    diag = (ts[None, :] == ts[:, None]) & steps[:, None]
    w_rows = rows_of_steps(w, RP)
    # the states entering the chunk and the gradient of the one leaving it, in pair halves
    jm = (j < HALF)[:, None] & pm[None, :]
    st_off = j[:, None] * P + p[None, :]
    st = states + (bh * nc + c) * N * P
    st1 = tl.load(st + st_off, mask=jm, other=0.0)
    st2 = tl.load(st + HALF * P + st_off, mask=jm, other=0.0)
    ds = dstates + (bh * (nc + 1) + c + 1) * N * P
    ds1 = tl.load(ds + st_off, mask=jm, other=0.0)
    ds2 = tl.load(ds + HALF * P + st_off, mask=jm, other=0.0)
    # scores and their gradient
    sc = dot(q1, tl.trans(k1), PREC) + dot(q2, tl.trans(k2), PREC)
    dp = dot(d_y, tl.trans(psiv), PREC)
    m = dp * w_rows
    dq_inter1 = q_decay[:, None] * dot(d_y, tl.trans(st1), PREC)
    dq_inter2 = q_decay[:, None] * dot(d_y, tl.trans(st2), PREC)
    dq1 = dot(m, k1, PREC) + dq_inter1
    dq2 = dot(m, k2, PREC) + dq_inter2
    pk1 = dot(psiv, tl.trans(ds1), PREC)  # dstates psi_v, [rows, BJ] per half
    pk2 = dot(psiv, tl.trans(ds2), PREC)
    dk1 = dot(tl.trans(m), q1, PREC) + k_decay[:, None] * pk1
    dk2 = dot(tl.trans(m), q2, PREC) + k_decay[:, None] * pk2
    dpv = (dot(tl.trans(sc * w_rows), d_y, PREC)
           + k_decay[:, None] * (dot(k1, ds1, PREC) + dot(k2, ds2, PREC)))
    if HAS_D:
        dpv += tl.load(d + h) * d_y
    # per-step gradients: gamma, trap_scale and the decay pieces
    sdp = steps_of_rows(sc * dp, RP)
    d_gam = tl.sum(tl.where(diag, sdp, 0.0), axis=1)
    inter_k = step_sums(tl.sum(k1 * pk1 + k2 * pk2, axis=1), RP)  # kr . dstates psi_v
    d_ts = tl.sum(e * sdp, axis=0) + tl.exp(rev) * inter_k
    d_rev = trap_scale * tl.exp(rev) * inter_k
    d_cs = step_sums(tl.sum(q1 * dq_inter1 + q2 * dq_inter2, axis=1), RP)
    # the state recurrence's decay of the entering state over the chunk, exp(da_cs[end])
    end_decay = tl.exp(tl.load(da_cs + row + C - 1))
    carried = tl.sum(tl.sum(ds1 * st1 + ds2 * st2, axis=1), axis=0) * end_decay
    d_cs += tl.where(ts == C - 1, carried, 0.0)
    d_seg = sdp * e * trap_scale[None, :]  # [i, j], zero unless j < i
    # ADT[u] enters da_cs[t] for t >= u, da_cs_rev[t] for t < u, segsum[i, j] for j < u <= i
    u = ts
    d_x = tl.sum(tl.where(ts[None, :] >= u[:, None], d_cs[None, :], 0.0), axis=1)
    d_x += tl.sum(tl.where(ts[None, :] < u[:, None], d_rev[None, :], 0.0), axis=1)
    below = tl.cumsum(d_seg, axis=1) - d_seg  # [i, u]: sum over j < u
    d_x += tl.sum(tl.where(ts[:, None] >= u[None, :], below, 0.0), axis=0)
    tl.store(d_gamma + row + ts, d_gam, mask=steps)
    tl.store(d_trap_scale + row + ts, d_ts, mask=steps)
    tl.store(d_adt + row + ts, d_x, mask=steps)
    # rotated back: the gradients of q + q_bias and k + k_bias; the angles' gradient
    n_off = (((b * S_pad + s0 + t) * R + r) * H + h)[:, None] * N + j[None, :]
    hm = rows[:, None] & (j < HALF)[None, :]
    tl.store(dqb + n_off, cs * dq1 + sn * dq2, mask=hm)
    tl.store(dqb + n_off + HALF, cs * dq2 - sn * dq1, mask=hm)
    tl.store(dkb + n_off, cs * dk1 + sn * dk2, mask=hm)
    tl.store(dkb + n_off + HALF, cs * dk2 - sn * dk1, mask=hm)
    tl.store(dpsiv + y_off, dpv, mask=rp_ok)
    d_ang = dq2 * q1 - dq1 * q2 + dk2 * k1 - dk1 * k2  # [rows, BJ]
    d_ang = tl.sum(tl.reshape(d_ang, (TP, RP, BJ)), axis=1)
    a_off = ((b * S_pad + s0 + ts) * H + h)[:, None] * RD + j[None, :]
    tl.store(d_angles + a_off, d_ang, mask=steps[:, None] & (j < RD)[None, :])


def raw_y_grads(*, q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                segsum, dy, states, d_final_state=None, consts, precision: str) -> dict:
    """The gradients of raw_y given dy = d raw_y [B, S_pad, R, H, P] fp32, for padded inputs
    (whole chunks of C steps, U = 1) and step_terms' tables: a dict of fp32 tensors dqb, dkb
    [B, S_pad, R, H, N] (of q + q_bias, k + k_bias per value head), dpsiv [B, S_pad, R, H, P],
    d_angles [B, S_pad, H, RD], d_gamma, d_trap_scale, d_adt [B, H, S_pad], and dstates
    [B, H, nc + 1, N, P]. states: the fp32 states entering each chunk [B, H, nc, N, P];
    d_final_state [B, H, N, P] or None. consts: the kernels' constants of the padded call with
    U = 1 (step_terms' Q_DECAY is then exp(da_cs)); `precision` the dots' input precision."""
    m = consts
    B, S_pad, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    C, nc = m.C, m.nc
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    dstates = torch.zeros(B, H, nc + 1, N, P, **f32)
    if d_final_state is not None:
        dstates[:, :, nc] = d_final_state
    out = dict(dqb=torch.empty(B, S_pad, R, H, N, **f32), dkb=torch.empty(B, S_pad, R, H, N, **f32),
               dpsiv=torch.empty(B, S_pad, R, H, P, **f32),
               d_angles=torch.empty(B, S_pad, H, m.RD, **f32),
               d_gamma=torch.empty(B, H, S_pad, **f32), d_trap_scale=torch.empty(B, H, S_pad, **f32),
               d_adt=torch.empty(B, H, S_pad, **f32), dstates=dstates)
    # every dot dimension at least 16 (m.TP * m.RP already is)
    TP, RP, BJ = m.TP, m.RP, max(16, next_pow2(N // 2))
    BP, PP = max(16, min(64, next_pow2(P))), max(16, next_pow2(P))
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    common = dict(S_pad=S_pad, n_bh=B * H, nc=nc, plane=B * H * S_pad, H=H, HG=H // G, R=R, C=C,
                  N=N, P=P, RD=m.RD, sqb=qs[0], sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4],
                  TP=TP, RP=RP, BJ=BJ, PREC=precision)
    tables = dict(terms=terms, cos=cos, sin=sin)
    with on_device(dev):
        state_grad_kernel[(B * H, triton.cdiv(P, BP))](
            q=q, q_bias=q_bias, dy=dy, da_cs=da_cs, dstates=dstates, BP=BP, **tables, **common)
        chunk_grads_kernel[(B * H * nc,)](
            q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, d=d, da_cs=da_cs,
            da_cs_rev=da_cs_rev, segsum=segsum, dy=dy, states=states, dstates=dstates,
            dqb=out["dqb"], dkb=out["dkb"], dpsiv=out["dpsiv"], d_angles=out["d_angles"],
            d_gamma=out["d_gamma"], d_trap_scale=out["d_trap_scale"], d_adt=out["d_adt"],
            skb=ks[0], sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4], svb=vs[0], svs=vs[1],
            svh=vs[2], svp=vs[3], PP=PP, HAS_D=m.HAS_D, **tables, **common)
    return out
