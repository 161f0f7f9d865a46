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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..runtime.device import on_device
from ..runtime.launcher import Launch
from . import next_pow2
from .common import chain, chunk_rows, load_cos_sin, load_mimo_v, load_rotated, mac, psi_v_rows
from .step_terms import Q_DECAY
from .whole_chunk import (chunk_pointers, chunk_scores, chunk_terms, pair_block, psiv_block,
                          rows_of_steps, state_block, step_sums, steps_of_rows)


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb"])
def state_grad_kernel(q, q_bias, dy, terms, cos, sin, da_cs, dstates, bounds, d_final, S_pad,
                      n_bh, nc, plane, H, HG, R, C, N, P, RD, sqb, sqs, sqr, sqg, sqn,
                      TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                      PREC: tl.constexpr, VARLEN: tl.constexpr):
    """One (b, h), one block of BJ pair rows and one of BP columns of the state per program
    (grid (B*H, pair blocks * P blocks)); dstates [B, H, nc + 1, N, P] fp32 holds d final state
    in entry nc on entry, every entry on exit. dy [B, S_pad, R, H, P] fp32. VARLEN (packed
    sequences, B = 1): one (sequence j, h) per program over chunks bounds[j] .. bounds[j + 1] - 1
    (bounds int32 [n_seq + 1]), from the last, starting from the sequence's final-state gradient
    d_final[j] ([n_seq, H, N, P] fp32); the sequences run side by side."""
    bh, lo, n_ch, seq_row = chain(tl.program_id(0), n_bh, nc, bounds, VARLEN)
    b, h = bh // H, bh % H
    HALF = N // 2
    n_pb = tl.cdiv(P, BP)
    j0 = (tl.program_id(1) // n_pb) * BJ
    p0 = (tl.program_id(1) % n_pb) * BP
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    j = j0 + tl.arange(0, BJ)
    p = p0 + tl.arange(0, BP)
    pm = p < P
    jm = (j < HALF)[:, None] & pm[None, :]
    st_off = j[:, None] * P + p[None, :]
    ds = dstates + bh * (nc + 1) * N * P
    if VARLEN:
        run1, run2 = state_block(d_final + seq_row * N * P, j0, p0, HALF, P, BJ, BP)
    else:
        run1, run2 = state_block(ds + nc * N * P, j0, p0, HALF, P, BJ, BP)
    q_h = q + b * sqb + (h // HG) * sqg
    bias_off = (h * R + r) * N
    row = bh * S_pad
    y_row = (t * R + r) * H * P  # a row's dy inside the chunk's steps
    for i in range(n_ch):
        c = lo + n_ch - 1 - i
        s0 = tl.cast(c, tl.int64) * C
        cs, sn, q1, q2 = pair_block(q_h + s0 * sqs, t * sqs + r * sqr, rows, q_bias, bias_off,
                                    cos + (row + s0) * RD, sin + (row + s0) * RD, t * RD, j0,
                                    HALF, RD, sqn, BJ)
        w = tl.load(terms + Q_DECAY * plane + row + s0 + t, mask=rows, other=0.0)
        d_y = tl.load(dy + ((b * S_pad + s0) * R * H + h) * P + y_row[:, None] + p[None, :],
                      mask=rows[:, None] & pm[None, :], other=0.0)
        decay = tl.exp(tl.load(da_cs + row + s0 + C - 1))
        run1 = mac(run1 * decay, tl.trans(q1 * w[:, None]), d_y, PREC)
        run2 = mac(run2 * decay, tl.trans(q2 * w[:, None]), d_y, PREC)
        ds_c = ds + c * N * P
        tl.store(ds_c + st_off, run1, mask=jm)
        tl.store(ds_c + HALF * P + st_off, run2, mask=jm)


@triton.jit
def _add_block(x, part, off, part_off, val, mask, part_mask, ADD):
    """x[off] = val, or x[off] + val where ADD (a later head of the group), and the block's sums
    over the steps ([rows, BJ] -> [RP, BJ], the head's share of its bias gradient) at
    part[part_off]."""
    TPR: tl.constexpr = val.shape[0]
    BJ: tl.constexpr = val.shape[1]
    RP: tl.constexpr = part_off.shape[0]
    tl.store(part + part_off, tl.sum(tl.reshape(val, (TPR // RP, RP, BJ)), axis=0),
             mask=part_mask)
    if ADD:
        val += tl.load(x + off, mask=mask, other=0.0)
    tl.store(x + off, val, mask=mask)


@triton.jit(do_not_specialize=["S_pad", "n_bg", "nc", "plane", "sqb", "skb", "svb",
                               "head_plane"])
def chunk_grads_kernel(q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                       segsum, dy, states, dstates, dq, dk, part_qb, part_kb, dv, part_psi,
                       part_d, d_angles, d_gamma, d_trap_scale, d_adt, S_pad, n_bg, nc, plane, H,
                       G, HG, HPB, n_hb, head_plane, R, C, N, P, RD, sqb, sqs, sqr, sqg, sqn, skb,
                       sks, skr, skg, skn, svb, svs, svh, svp,
                       TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                       HAS_D: tl.constexpr, PREC: tl.constexpr):
    """One (b*g, block of HPB heads, chunk) per program (b*g fastest on grid axis 0, then the
    n_hb head blocks), for the heads of its block of group g in turn; N in blocks of BJ pairs
    and P in blocks of BP columns. Writes dq, dk [n_hb, B, S_pad, R, G, N] (of q and k, summed
    over the block's heads; head block i at i * head_plane, whose sum over the blocks is the
    gradient) with each head's share of the bias gradients
    (part_qb, part_kb [B, nc, H, R, N]), dv [B, S_pad, H, P], d_angles
    [B, S_pad, H, RD], d_gamma, d_trap_scale, d_adt [B, H, S_pad] and the chunk's shares of
    dPsi (part_psi [B*H, nc, R, P]) and dD (part_d [B*H, nc], HAS_D), all fp32; reads dy
    [B, S_pad, R, H, P], states [B, H, nc, N, P] and dstates [B, H, nc + 1, N, P] (fp32)."""
    pid = tl.program_id(0)
    bg, rest = (pid % n_bg).to(tl.int64), pid // n_bg
    hb, c = rest % n_hb, (rest // n_hb).to(tl.int64)
    b, g = bg // G, bg % G
    dq += hb.to(tl.int64) * head_plane
    dk += hb.to(tl.int64) * head_plane
    HALF = N // 2
    ROWS: tl.constexpr = TP * RP
    t, r = chunk_rows(TP, RP)
    rk = tl.arange(0, RP)
    s0 = c * C
    # the block's heads in order, each adding its dQ and dK to the previous heads' sum
    h_lo = hb * HPB
    for hh in range(h_lo, tl.minimum(h_lo + HPB, HG)):
        h = g * HG + hh
        bh = b * H + h
        row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at = chunk_pointers(
            q, k, v, mimo_v, cos, sin, t, r, b, h, c, S_pad, H, HG, R, C, N, P, RD, sqb, sqs, sqr,
            sqg, skb, sks, skr, skg, svb, svs, svh)
        rows, ts, steps, gamma, trap_scale, k_decay, q_decay, e, w = chunk_terms(
            terms, segsum, t, r, bh, c, S_pad, nc, plane, R, C, TP)
        y_base = ((b * S_pad + s0) * R * H + h) * P  # the chunk's first row of dy
        y_at = dy + y_base
        y_row = (t * R + r) * H * P
        st_at = states + (bh * nc + c) * N * P
        ds_at = dstates + (bh * (nc + 1) + c + 1) * N * P
        sc = chunk_scores(q_at, qrow, k_at, krow, rows, q_bias, k_bias, bias_off, cos_at, sin_at,
                          cs_off, HALF, RD, sqn, skn, BJ, PREC)
        dp = tl.zeros([ROWS, ROWS], dtype=tl.float32)  # dY PsiV^T
        for p0 in range(0, P, BP):
            p, pm, psiv = psiv_block(v_at, ts, steps, svs, svp, mv_at, R, P, p0, BP, RP)
            d_y = tl.load(y_at + y_row[:, None] + p[None, :], mask=rows[:, None] & pm[None, :],
                          other=0.0)
            dp = mac(dp, d_y, tl.trans(psiv), PREC)
        sdp = steps_of_rows(sc * dp, RP)  # sum over the ranks of Sc * dP, per pair of steps
        w_rows = rows_of_steps(w, RP)
        sw = sc * w_rows
        # P blocks: dPsiV = (Sc W)^T dY + K_DECAY Kr dstates[c + 1] + D dY, into dV, dPsi and dD
        v_base = ((b * S_pad + s0) * H + h) * P  # the chunk's first step of dv
        d_sum = 0.0  # sum dY . PsiV: the chunk's share of dD
        for p0 in range(0, P, BP):
            p = p0 + tl.arange(0, BP)
            pm = p < P
            d_y = tl.load(y_at + y_row[:, None] + p[None, :], mask=rows[:, None] & pm[None, :],
                          other=0.0)
            acc = tl.zeros([ROWS, BP], dtype=tl.float32)
            for j0 in range(0, HALF, BJ):
                cs, sn = load_cos_sin(cos_at, sin_at, cs_off, rows, j0, BJ, RD)
                k1, k2 = load_rotated(k_at, krow, rows, k_bias, bias_off, cs, sn, j0, BJ, HALF, skn,
                                      True)
                ds1, ds2 = state_block(ds_at, j0, p0, HALF, P, BJ, BP)
                acc = mac(mac(acc, k1, ds1, PREC), k2, ds2, PREC)
            dpv = mac(k_decay[:, None] * acc, tl.trans(sw), d_y, PREC)
            if HAS_D:
                dpv += tl.load(d + h) * d_y
            # PsiV = v Psi: dV sums dPsiV Psi over the ranks, dPsi dPsiV v over the chunk's steps
            mv = load_mimo_v(mv_at, R, p, pm, P, RP)
            xv = tl.load(v_at + ts[:, None] * svs + p[None, :] * svp,
                         mask=steps[:, None] & pm[None, :], other=0.0).to(tl.float32)
            dpv3 = tl.reshape(dpv, (TP, RP, BP))
            tl.store(dv + v_base + ts[:, None] * H * P + p[None, :], tl.sum(dpv3 * mv[None], axis=1),
                     mask=steps[:, None] & pm[None, :])
            rk = tl.arange(0, RP)
            tl.store(part_psi + (bh * nc + c) * R * P + rk[:, None] * P + p[None, :],
                     tl.sum(dpv3 * xv[:, None, :], axis=0), mask=(rk < R)[:, None] & pm[None, :])
            if HAS_D:
                d_sum += tl.sum(tl.sum(d_y * psi_v_rows(xv, mv), axis=1), axis=0)
        if HAS_D:
            tl.store(part_d + bh * nc + c, d_sum)
        m = dp * w_rows
        # N blocks (after the P blocks, so that Sc W is dead and only dP W is held across
        # them): dQr, dKr (rotated back) and the angles' gradient; the inter-chunk sums
        d_cs_rows = tl.zeros([ROWS], dtype=tl.float32)
        inter_k_rows = tl.zeros([ROWS], dtype=tl.float32)
        carried = 0.0  # <dstates[c + 1], states[c]>
        bias_at = ((b * nc + c) * H + h) * R * N + rk[:, None] * N
        # a row's dQ and dK [B, S_pad, R, G, N]; a block of a head's bias shares [B, nc, H, R, N]
        n_row = ((b * S_pad + s0) * R * G + g) * N + (t * R + r) * G * N
        a_at = ((b * S_pad + s0) * H + h) * RD + ts * H * RD  # a step's d_angles
        for j0 in range(0, HALF, BJ):
            cs, sn, q1, q2 = pair_block(q_at, qrow, rows, q_bias, bias_off, cos_at, sin_at, cs_off,
                                        j0, HALF, RD, sqn, BJ)
            k1, k2 = load_rotated(k_at, krow, rows, k_bias, bias_off, cs, sn, j0, BJ, HALF, skn,
                                  True)
            dqi1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
            dqi2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
            pk1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
            pk2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
            for p0 in range(0, P, BP):
                p, pm, psiv = psiv_block(v_at, ts, steps, svs, svp, mv_at, R, P, p0, BP, RP)
                d_y = tl.load(y_at + y_row[:, None] + p[None, :], mask=rows[:, None] & pm[None, :],
                              other=0.0)
                st1, st2 = state_block(st_at, j0, p0, HALF, P, BJ, BP)
                ds1, ds2 = state_block(ds_at, j0, p0, HALF, P, BJ, BP)
                dqi1 = mac(dqi1, d_y, tl.trans(st1), PREC)
                dqi2 = mac(dqi2, d_y, tl.trans(st2), PREC)
                pk1 = mac(pk1, psiv, tl.trans(ds1), PREC)
                pk2 = mac(pk2, psiv, tl.trans(ds2), PREC)
                carried += tl.sum(tl.sum(ds1 * st1 + ds2 * st2, axis=1), axis=0)
            dqi1 = q_decay[:, None] * dqi1
            dqi2 = q_decay[:, None] * dqi2
            d_cs_rows += tl.sum(q1 * dqi1 + q2 * dqi2, axis=1)
            inter_k_rows += tl.sum(k1 * pk1 + k2 * pk2, axis=1)
            dq1 = mac(dqi1, m, k1, PREC)
            dq2 = mac(dqi2, m, k2, PREC)
            dk1 = mac(k_decay[:, None] * pk1, tl.trans(m), q1, PREC)
            dk2 = mac(k_decay[:, None] * pk2, tl.trans(m), q2, PREC)
            j = j0 + tl.arange(0, BJ)
            hm = rows[:, None] & (j < HALF)[None, :]
            off = n_row[:, None] + j[None, :]
            bm = (rk < R)[:, None] & (j < HALF)[None, :]
            _add_block(dq, part_qb, off, bias_at + j[None, :], cs * dq1 + sn * dq2, hm, bm, hh > h_lo)
            _add_block(dq, part_qb, off + HALF, bias_at + HALF + j[None, :], cs * dq2 - sn * dq1, hm,
                       bm, hh > h_lo)
            _add_block(dk, part_kb, off, bias_at + j[None, :], cs * dk1 + sn * dk2, hm, bm, hh > h_lo)
            _add_block(dk, part_kb, off + HALF, bias_at + HALF + j[None, :], cs * dk2 - sn * dk1, hm,
                       bm, hh > h_lo)
            d_ang = tl.sum(tl.reshape(dq2 * q1 - dq1 * q2 + dk2 * k1 - dk1 * k2, (TP, RP, BJ)), 1)
            tl.store(d_angles + a_at[:, None] + j[None, :], d_ang,
                     mask=steps[:, None] & (j < RD)[None, :])
        # per-step gradients: gamma, trap_scale and ADT through the decay pieces
        rev = tl.load(da_cs_rev + row + ts, mask=steps, other=0.0)
        diag = (ts[None, :] == ts[:, None]) & steps[:, None]
        d_gam = tl.sum(tl.where(diag, sdp, 0.0), axis=1)
        inter_k = step_sums(inter_k_rows, RP)  # Kr . dstates[c + 1] PsiV per step
        d_ts = tl.sum(e * sdp, axis=0) + tl.exp(rev) * inter_k
        d_rev = trap_scale * tl.exp(rev) * inter_k
        d_cs = step_sums(d_cs_rows, RP)
        # the state recurrence's decay of the entering state over the chunk, exp(da_cs[end])
        end_decay = tl.exp(tl.load(da_cs + row + C - 1))
        d_cs += tl.where(ts == C - 1, carried * end_decay, 0.0)
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
        # the next head reads this head's dQ and dK sums: the barrier orders them
        tl.debug_barrier()


@dataclass(frozen=True)
class GradsConfig:
    """chunk_grads' blocks of BJ pairs of N and BP columns of P and its pipeline stages; the
    reverse scan's blocks of STATE_BJ pairs and STATE_BP columns."""
    BJ: int
    BP: int
    num_stages: int
    STATE_BJ: int = 64
    STATE_BP: int = 32


# Measured on the H200 (2026-12-03, commit 9488e56, kernel time per forward+backward,
# docs/performance.md "The whole operator"), ms: chunk_grads at N16_P64_R4_C8 1.53 with 16 pairs
# x 32 columns and two stages, 1.32 with 64 columns; at N128_P64_R4_C16 4.13, 3.90 with 32 pairs
# and one stage (4.50 with 64 columns); at N64_P128_R4_C16 3.44, 3.15 with 32 pairs and one
# stage; at N256_P64_R4_C8 10.16, 9.05 with 64 columns (11.77 with 32 pairs and one stage). The
# reverse scan took 1.80 -> 1.22 ms at N256 and 1.29 -> 0.82 at P = 128 with 64 columns, 0.63 ->
# 0.75 at N128_P64. 4 warps throughout (8 warps took 1.3-2x as long); register caps of 128 and
# 168 took 1.3-1.6x as long (spills).
OPTIONS = dict(num_warps=4)
STATE_OPTIONS = dict(num_warps=8, num_stages=1)


def config(N: int, P: int) -> GradsConfig:
    """The blocks and stages of phase 2's kernels for state size N and head dimension P."""
    state_bp = 64 if N >= 256 or P >= 128 else 32
    if 64 <= N <= 128:
        return GradsConfig(BJ=32, BP=32, num_stages=1, STATE_BP=state_bp)
    return GradsConfig(BJ=16, BP=64, num_stages=2, STATE_BP=state_bp)


# Heads of a group per chunk_grads program (None: the whole group, one program per (b*g,
# chunk) that walks its heads in turn). Fewer heads per program run the blocks side by side,
# each into its own plane of dq and dk, which a fixed-order sum then adds. Measured on the H200
# (2026-12-03, G = 1, 16 heads): 4, 2 and 1 head per program took chunk_grads 1.10x, 1.07x and
# 1.02x as long at N128_P64_R4_C16 and 0.97x, 0.93x, 0.84x at N256_P64_R4_C8, for 63-447 MiB
# (N128) and 95-863 MiB (N256) more peak memory: the whole group is kept.
HEADS_PER_PROGRAM = None


def raw_y_grads(*, q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                segsum, dy, states, d_final_state=None, consts, precision: str,
                bounds=None, d_ends=None) -> dict:
    """The gradients of raw_y given dy = d raw_y [B, S_pad, R, H, P] fp32, for padded inputs
    (whole chunks of C steps, U = 1) and step_terms' tables: a dict of fp32 tensors dq, dk
    [B, S_pad, R, G, N], the per-chunk shares of the bias gradients part_qb, part_kb
    [B, nc, H, R, N], dv [B, S_pad, H, P], d_angles
    [B, S_pad, H, RD], d_gamma, d_trap_scale, d_adt [B, H, S_pad], the per-chunk shares of dPsi
    (part_psi [B*H, nc, R, P]) and dD (part_d [B*H, nc]; d given), and dstates
    [B, H, nc + 1, N, P]. states: the fp32 states entering each chunk [B, H, nc, N, P];
    d_final_state [B, H, N, P] or None. Packed sequences (B = 1): bounds, int32 [n_seq + 1],
    sequence j covering chunks bounds[j] .. bounds[j + 1] - 1 (chunk_state.launches'), and
    d_ends [n_seq, H, N, P] fp32 the sequences' final-state gradients (d_final_state is then
    the last one's). consts: the
    kernels' constants of the padded call with
    U = 1 (step_terms' Q_DECAY is then exp(da_cs)); `precision` the dots' input precision."""
    m = consts
    B, S_pad, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    C, nc = m.C, m.nc
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    # the reverse scan writes every entry but the last (d final state, or zero): filling the
    # whole tensor took 0.23 ms at N256_P64_R4_C8 (H200)
    dstates = torch.empty(B, H, nc + 1, N, P, **f32)
    if d_final_state is None:
        dstates[:, :, nc].zero_()
    else:
        dstates[:, :, nc] = d_final_state
    HG = H // G
    HPB = HG if HEADS_PER_PROGRAM is None else max(1, min(HEADS_PER_PROGRAM, HG))
    n_hb = -(-HG // HPB)
    planes = dict(dq=torch.empty(n_hb, B, S_pad, R, G, N, **f32),
                  dk=torch.empty(n_hb, B, S_pad, R, G, N, **f32))
    out = dict(dq=planes["dq"][0], dk=planes["dk"][0],
               part_qb=torch.empty(B, nc, H, R, N, **f32),
               part_kb=torch.empty(B, nc, H, R, N, **f32),
               dv=torch.empty(B, S_pad, H, P, **f32), part_psi=torch.empty(B * H, nc, R, P, **f32),
               part_d=torch.empty(B * H, nc, **f32),
               d_angles=torch.empty(B, S_pad, H, m.RD, **f32),
               d_gamma=torch.empty(B, H, S_pad, **f32), d_trap_scale=torch.empty(B, H, S_pad, **f32),
               d_adt=torch.empty(B, H, S_pad, **f32), dstates=dstates)
    # every dot dimension at least 16 (m.TP * m.RP already is)
    TP, RP = m.TP, m.RP
    cfg = config(N, P)
    pairs = lambda want: max(16, min(want, next_pow2(N // 2)))  # noqa: E731
    columns = lambda want: max(16, min(want, next_pow2(P)))  # noqa: E731
    BJ, BP, SBJ, SBP = pairs(cfg.BJ), columns(cfg.BP), pairs(cfg.STATE_BJ), columns(cfg.STATE_BP)
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    common = dict(S_pad=S_pad, nc=nc, plane=B * H * S_pad, H=H, HG=H // G, R=R, C=C,
                  N=N, P=P, RD=m.RD, sqb=qs[0], sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4],
                  TP=TP, RP=RP, PREC=precision)
    tables = dict(terms=terms, cos=cos, sin=sin)
    with on_device(dev):
        chains = B * H if bounds is None else (bounds.numel() - 1) * H
        blocks = triton.cdiv(N // 2, SBJ) * triton.cdiv(P, SBP)
        Launch(state_grad_kernel, (chains, blocks), dict(
            q=q, q_bias=q_bias, dy=dy, da_cs=da_cs, dstates=dstates, **tables,
            bounds=dstates if bounds is None else bounds,
            d_final=dstates if bounds is None else d_ends,
            VARLEN=bounds is not None,
            n_bh=B * H, BJ=SBJ, BP=SBP, **common), STATE_OPTIONS).run()
        Launch(chunk_grads_kernel, (B * G * n_hb * nc,), dict(
            q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, d=d, da_cs=da_cs,
            da_cs_rev=da_cs_rev, segsum=segsum, dy=dy, states=states, dstates=dstates,
            dq=planes["dq"], dk=planes["dk"], HPB=HPB, n_hb=n_hb,
            head_plane=planes["dq"][0].numel(), part_qb=out["part_qb"], part_kb=out["part_kb"],
            dv=out["dv"], part_psi=out["part_psi"], part_d=out["part_d"], d_angles=out["d_angles"],
            d_gamma=out["d_gamma"], d_trap_scale=out["d_trap_scale"], d_adt=out["d_adt"],
            skb=ks[0], sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4], svb=vs[0], svs=vs[1],
            svh=vs[2], svp=vs[3], n_bg=B * G, G=G, HAS_D=m.HAS_D, BJ=BJ, BP=BP, **tables,
            **common), dict(OPTIONS, num_stages=cfg.num_stages)).run()
    if n_hb > 1:  # the head blocks' planes added in a fixed order: deterministic
        out["dq"], out["dk"] = planes["dq"].sum(0), planes["dk"].sum(0)
    return out
