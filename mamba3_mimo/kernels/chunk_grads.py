"""Phase 2 of the backward (the operator's bwd_bwd): the gradients of raw_y with respect to
everything it is computed from, given dy = d raw_y. Three kernels, in this order:

- `state_grad_kernel`: the reverse of the state recurrence. dstates[c] is the gradient with
  respect to the state entering chunk c: dstates[nc] = d final state (zero when the final state
  is not used), dstates[c] = dstates[c+1] exp(da_cs[end of c]) + sum_{t in c, r}
  exp(da_cs[t]) qr[t, r] (x) dy[t, r]. One program per (b, h, block of the state) walks the
  chunks from the last, loading chunk c - 1's inputs while it adds chunk c.
- `chunk_grads_qk_kernel`: per (block of pairs of N, b*g, chunk c), over the group's heads, with
  dP = dY PsiV^T and the causal weights W (exp(segsum) trap_scale[t'] before the diagonal, gamma
  on it): dQr = (dP * W) Kr + exp(da_cs) dY states[c]^T and dKr = (dP * W)^T Qr + K_DECAY PsiV
  dstates[c+1]^T, rotated back (the gradients of q + q_bias and k + k_bias, summed over the
  heads in registers) and the angles' gradient sum_r (dqr2 qr1 - dqr1 qr2) plus k's; and the
  block's shares of two per-step sums for the next kernel.
- `chunk_grads_v_kernel`: per (b*h, chunk c), with Sc = Qr Kr^T: dPsiV = (Sc * W)^T dY +
  K_DECAY Kr dstates[c+1] + D dY (into dV, dPsi, dD); d gamma and d trap_scale from Sc * dP; the
  gradient of ADT through da_cs, da_cs_rev and segsum (chunk-local, with the state recurrence's
  exp(da_cs[end]) term).

Each chunk kernel holds the chunk's (step, rank) rows (row = t * RP + r, as in chunk_output) and
one pair block or one P block of the rest at a time; splitting the gradients this way keeps the
largest live tiles to about three [rows, rows] or [rows, block] fp32 tiles per program.
"""
import functools
from dataclasses import dataclass
from typing import Tuple

import torch
import triton
import triton.language as tl

from .. import configs
from ..runtime.device import on_device
from ..runtime.launcher import Launch
from ..runtime.plans import placeholder
from . import cdiv, chunk_state, input_align, next_pow2
from .common import (chain, chunk_rows, landed, load_cos_sin, load_pair_columns, mac,
                     psi_v_rows, rotate_pairs)
from .step_terms import Q_DECAY
from .whole_chunk import (chunk_masks, chunk_pointers, chunk_scores, chunk_term_loads,
                          chunk_weights, dy_loads, dy_of, qk_pair_loads, qk_pairs, rotation_inputs,
                          prefetch_state_block, rows_of_steps, state_block, step_sums,
                          steps_of_rows, v_block)


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb"])
def state_grad_kernel(q, q_bias, dy, dout, z, mimo_o, mimo_z, terms, cos, sin, da_cs, dstates,
                      bounds, d_final, finals, S_pad, n_bh, nc, plane, H, HG, R, C, N, P, RD, sqb,
                      sqs, sqr, sqg, sqn, svb, svs, svh, svp,
                      TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                      PREC: tl.constexpr, HAS_Z: tl.constexpr, FAST: tl.constexpr,
                      GATED: tl.constexpr, VARLEN: tl.constexpr, FINALS: tl.constexpr,
                      NO_DY: tl.constexpr):
    """One (b, h), one block of BJ pair rows and one of BP columns of the state per program
    (grid (B*H, pair blocks * P blocks)); dstates [B, H, nc + 1, N, P] fp32 holds d final state
    in entry nc on entry, every entry on exit. dy [B, S_pad, R, H, P] fp32, or with GATED
    recomputed from dout and z [B, S_pad, H, P] (strides svb, svs, svh, svp), mimo_o and
    mimo_z (whole_chunk.dy_loads). VARLEN (packed
    sequences, B = 1): one (sequence j, h) per program over chunks bounds[j] .. bounds[j + 1] - 1
    (bounds int32 [n_seq + 1]), from the last, starting from the sequence's final-state gradient
    d_final[j] ([n_seq, H, N, P] fp32); the sequences run side by side (with B > 1, segments of
    a dense call: per (segment, b*h), bounds the same in every batch entry). FINALS (with
    VARLEN): the gradient entering each chain's first chunk also goes to finals, rows as
    d_final's (chains that are segments, packed.Segments). NO_DY: dy = 0 (only the final
    state's gradient): each chunk's gradient is the next one's decayed, and q and dy are not
    read."""
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
    dy_bh = dy + (b * S_pad * R * H + h) * P  # the (b, h) slices of dy, dout and z
    v_bh = b * svb + h * svh
    gate = (dout + v_bh, z + v_bh, mimo_o + h * R * P, mimo_z + h * R * P)
    b1, b2 = load_pair_columns(q_bias, bias_off, rows, j0, BJ, HALF, 1)
    # Software-pipelined: chunk c - 1's inputs are loaded once chunk c's dots are issued and
    # used an iteration later, so that the walk does not wait for memory at every chunk (the
    # forward's fused scan does the same); loaded before the dots, they were waited for by the
    # proxy fence that precedes a wgmma, which waits for every load in flight.
    if NO_DY:
        log_decay = _chunk_log_decay(da_cs, row, lo + n_ch - 1, C, n_ch > 0)
    else:
        x1, x2, cs, sn, w, y_in, log_decay = _scan_inputs(
            q_h, cos, sin, terms, dy_bh, gate, da_cs, lo + n_ch - 1, n_ch > 0, t, r, rows, p,
            pm, j0, row, plane, y_row, R, H, C, HALF, P, RD, sqs, sqr, sqn, svs, svp, TP, RP, BJ,
            HAS_Z, GATED)
    for i in range(n_ch):
        c = lo + n_ch - 1 - i
        if NO_DY:
            decay = tl.exp(log_decay)
            run1 = run1 * decay
            run2 = run2 * decay
            log_decay = _chunk_log_decay(da_cs, row, c - 1, C, i + 1 < n_ch)
        else:
            q1, q2 = rotate_pairs(x1, x2, b1, b2, cs, sn, True)
            d_y = dy_of(y_in, HAS_Z, FAST, GATED)
            decay = tl.exp(log_decay)
            run1 = mac(run1 * decay, tl.trans(q1 * w[:, None]), d_y, PREC)
            run2 = mac(run2 * decay, tl.trans(q2 * w[:, None]), d_y, PREC)
            x1, x2, cs, sn, w, y_in, log_decay = _scan_inputs(
                q_h, cos, sin, terms, dy_bh, gate, da_cs, c - 1, i + 1 < n_ch, t, r, rows, p,
                pm, j0, row, plane, y_row, R, H, C, HALF, P, RD, sqs, sqr, sqn, svs, svp, TP,
                RP, BJ, HAS_Z, GATED)
        ds_c = ds + c * N * P
        tl.store(ds_c + st_off, run1, mask=jm)
        tl.store(ds_c + HALF * P + st_off, run2, mask=jm)
    if FINALS:
        tl.store(finals + seq_row * N * P + st_off, run1, mask=jm)
        tl.store(finals + seq_row * N * P + HALF * P + st_off, run2, mask=jm)


@triton.jit
def _scan_inputs(q_h, cos, sin, terms, dy_bh, gate, da_cs, c, ok, t, r, rows, p, pm, j0, row,
                 plane, y_row, R, H, C, HALF, P, RD, sqs, sqr, sqn, svs, svp, TP: tl.constexpr,
                 RP: tl.constexpr, BJ: tl.constexpr, HAS_Z: tl.constexpr, GATED: tl.constexpr):
    """What the reverse scan reads of chunk c (nothing, the tiles zero and the decay 1, unless
    ok), loaded and not yet used, so that the walk waits for them a chunk later: q's pair
    columns as stored, cos and sin [rows, BJ], Q_DECAY per row, dy_loads' tiles (from the
    (b, h) slice of the buffer, or with GATED from `gate`: the (b, h) slices of dout and z and
    the head's mimo_o and mimo_z blocks) and the chunk's log decay (da_cs at its last step)."""
    s0 = tl.cast(c, tl.int64) * C
    live = rows & ok
    x1, x2 = load_pair_columns(q_h + s0 * sqs, t * sqs + r * sqr, live, j0, BJ, HALF, sqn)
    cs, sn = load_cos_sin(cos + (row + s0) * RD, sin + (row + s0) * RD, t * RD, live, j0, BJ, RD)
    w = tl.load(terms + Q_DECAY * tl.cast(plane, tl.int64) + row + s0 + t, mask=live,
                other=0.0)
    dout_h, z_h, mo_h, mz_h = gate
    ts = tl.arange(0, TP)
    y_in = dy_loads((dy_bh + s0 * R * H * P, dout_h + s0 * svs, z_h + s0 * svs, mo_h, mz_h),
                    y_row, live, ts, (ts < C) & ok, svs, svp, R, P, p, pm, RP, HAS_Z, GATED)
    return x1, x2, cs, sn, w, y_in, _chunk_log_decay(da_cs, row, c, C, ok)


@triton.jit
def _chunk_log_decay(da_cs, row, c, C, ok):
    """Chunk c's log decay, da_cs at its last step (row: the (b, h) row's first step), or 0
    unless ok."""
    return tl.load(da_cs + row + tl.cast(c, tl.int64) * C + C - 1, mask=ok, other=0.0)


@triton.jit
def _head_chunk(q, k, v, mimo_v, cos, sin, dy_in, t, r, b, h, c, S_pad, H, HG, R, C, N, P, RD,
                sqb, sqs, sqr, sqg, skb, sks, skr, skg, svb, svs, svh, TP: tl.constexpr,
                BA: tl.constexpr):
    """Where chunk c of (b, h) reads (chunk_pointers; the batch strides sqb, skb, svb come
    divided by BA, kernels.input_align, so that the 16-bit loads of q, k and v are wide), which
    of its rows and steps exist, and where its dy comes from: whole_chunk.dy_loads' src at the
    chunk, from dy_in = (dy [B, S_pad, R, H, P], dout, z [B, S_pad, H, P] with v's strides,
    mimo_o, mimo_z), and each row's offset in dy. Nothing is loaded."""
    row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at = chunk_pointers(
        q, k, v, mimo_v, cos, sin, t, r, b, h, c, S_pad, H, HG, R, C, N, P, RD, sqb * BA, sqs,
        sqr, sqg, skb * BA, sks, skr, skg, svb * BA, svs, svh)
    rows, ts, steps = chunk_masks(t, r, R, C, TP)
    dy, dout, z, mimo_o, mimo_z = dy_in
    v_off = b * (svb * BA) + h * svh + c * C * svs  # v_at's, in dout and z
    y_src = (dy + ((b * S_pad + c * C) * R * H + h) * P, dout + v_off, z + v_off,
             mimo_o + h * R * P, mimo_z + h * R * P)
    y_row = (t * R + r) * H * P
    return (row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at, rows, ts,
            steps, y_src, y_row)


@triton.jit
def _bias_share(part, part_off, val, before, part_mask):
    """val, a head's block of dQ or dK rotated back ([rows, BJ]), returned after storing at
    part[part_off] `before` (what was there, loaded with the head's other inputs: the groups of
    batch entries accumulate there, as common.store_or_add does) plus val's sums over the steps
    ([RP, BJ], the head's share of its bias gradient)."""
    TPR: tl.constexpr = val.shape[0]
    BJ: tl.constexpr = val.shape[1]
    RP: tl.constexpr = part_off.shape[0]
    tl.store(part + part_off, before + tl.sum(tl.reshape(val, (TPR // RP, RP, BJ)), axis=0),
             mask=part_mask)
    return val


@triton.jit(do_not_specialize=["S_pad", "n_bg", "n_bh", "nc", "plane", "sqb", "skb", "svb"])
def chunk_grads_qk_kernel(q, k, v, q_bias, k_bias, mimo_v, terms, cos, sin, segsum, dy, dout, z,
                          mimo_o, mimo_z, states, dstates, dq, dk, part_qb, part_kb, d_angles,
                          part_cs, part_carried, S_pad, n_bg, n_bh, nc, plane, H, G, HG, R, C, N,
                          HALF, P, RD, sqb, sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs,
                          svh, svp, TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr,
                          BP: tl.constexpr, PREC: tl.constexpr, BA: tl.constexpr,
                          HAS_Z: tl.constexpr, FAST: tl.constexpr, GATED: tl.constexpr,
                          OPAQUE: tl.constexpr, PREFETCH: tl.constexpr, NO_DY: tl.constexpr):
    """dQr = (dP W) Kr + Q_DECAY dY states[c]^T and dKr = (dP W)^T Qr + K_DECAY PsiV
    dstates[c + 1]^T on one block of BJ pair columns, rotated back and summed over the heads of a
    group. One (block of pairs, b*g, chunk) per program (the pair blocks fastest, so that the
    programs that read the same dy run together); the group's heads in turn, each with its own
    dP = dY PsiV^T over P in blocks of BP columns. Writes dq, dk [B, S_pad, R, G, N], adds each
    head's share of the bias gradients to part_qb, part_kb [B, nc, H, R, N] (_bias_share),
    writes d_angles [B, S_pad, H, RD]
    on the block's pairs, and for chunk_grads_v_kernel the block's shares of sum_n Qr dQr's
    inter-chunk term per step (part_cs [n_jb, B*H, S_pad]) and of <dstates[c + 1], states[c]>
    (part_carried [n_jb, B*H, nc]); all fp32. NO_DY: dy = 0 (only the final state's
    gradient): dQr = 0 and dKr = K_DECAY PsiV dstates[c + 1]^T, dy not read."""
    pid = tl.program_id(0)
    n_jb = tl.cdiv(HALF, BJ)
    jb = pid % n_jb
    rest = pid // n_jb
    bg, c = (rest % n_bg).to(tl.int64), (rest // n_bg).to(tl.int64)
    b, g = bg // G, bg % G
    ROWS: tl.constexpr = TP * RP
    t, r = chunk_rows(TP, RP)
    rk = tl.arange(0, RP)
    j0 = jb * BJ
    j = j0 + tl.arange(0, BJ)
    s0 = c * C
    # the rows of dq and dk [B, S_pad, R, G, N] on the block's pairs
    n_off = ((b * S_pad + s0) * R * G + g) * N + (t * R + r) * G * N
    sum_q1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
    sum_q2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
    sum_k1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
    sum_k2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
    bm = (rk < R)[:, None] & (j < HALF)[None, :]
    for hh in range(0, HG):
        h = g * HG + hh
        bh = b * H + h
        (row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at, rows, ts,
         steps, y_src, y_row) = _head_chunk(
            q, k, v, mimo_v, cos, sin, (dy, dout, z, mimo_o, mimo_z), t, r, b, h, c, S_pad, H,
            HG, R, C, N, P, RD, sqb, sqs, sqr, sqg, skb, sks, skr, skg, svb, svs, svh, TP, BA)
        st_at = states + (bh * nc + c) * N * P
        ds_at = dstates + (bh * (nc + 1) + c + 1) * N * P
        # the next head's blocks of the two states, read from memory once, asked into L2 while
        # this head computes (a hint: no registers, no wait); the last head asks for its own,
        # so that no address leaves the tensors
        more = (hh + 1 < HG).to(tl.int64)
        prefetch_state_block(st_at + more * nc * N * P, j0, 0, HALF, P, True, BJ, BP, PREFETCH)
        prefetch_state_block(ds_at + more * (nc + 1) * N * P, j0, 0, HALF, P, True, BJ, BP,
                             PREFETCH)
        # one walk over P: dP = dY PsiV^T, dY states^T and PsiV dstates^T on the block's pairs;
        # each block's loads are issued before any of its math, so that it waits for memory once
        dp = tl.zeros([ROWS, ROWS], dtype=tl.float32)
        dq1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        dq2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        dk1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        dk2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        carried = 0.0
        for p0 in range(0, P, BP):
            p, pm, xv, mv = v_block(v_at, ts, steps, svs, svp, mv_at, R, P, p0, BP, RP)
            if not NO_DY:
                y_in = dy_loads(y_src, y_row, rows, ts, steps, svs, svp, R, P, p, pm, RP, HAS_Z,
                                GATED)
            st1, st2 = state_block(st_at, j0, p0, HALF, P, BJ, BP)
            ds1, ds2 = state_block(ds_at, j0, p0, HALF, P, BJ, BP)
            psiv = psi_v_rows(landed(xv, OPAQUE), landed(mv, OPAQUE))
            if not NO_DY:
                d_y = dy_of(y_in, HAS_Z, FAST, GATED, OPAQUE)
                dp = mac(dp, d_y, tl.trans(psiv), PREC)
                dq1 = mac(dq1, d_y, tl.trans(st1), PREC)
                dq2 = mac(dq2, d_y, tl.trans(st2), PREC)
            dk1 = mac(dk1, psiv, tl.trans(ds1), PREC)
            dk2 = mac(dk2, psiv, tl.trans(ds2), PREC)
            carried += tl.sum(tl.sum(ds1 * st1 + ds2 * st2, axis=1), axis=0)
        # the rest of the head's loads together: its per-step terms, q and k on the block's
        # pairs with their biases and angles, and the bias gradients' sums so far
        term_in = chunk_term_loads(terms, segsum, t, r, bh, c, S_pad, nc, plane, R, C, TP)
        pairs_in = qk_pair_loads(q_at, qrow, k_at, krow, rows, q_bias, k_bias, bias_off, cos_at,
                                 sin_at, cs_off, j0, HALF, RD, sqn, skn, BJ)
        bias_at = ((b * nc + c) * H + h) * R * N + rk[:, None] * N + j[None, :]
        sq1 = tl.load(part_qb + bias_at, mask=bm, other=0.0)
        sq2 = tl.load(part_qb + bias_at + HALF, mask=bm, other=0.0)
        sk1 = tl.load(part_kb + bias_at, mask=bm, other=0.0)
        sk2 = tl.load(part_kb + bias_at + HALF, mask=bm, other=0.0)
        gamma, trap_scale, k_decay, q_decay, seg = term_in
        k_decay, q_decay = landed(k_decay, OPAQUE), landed(q_decay, OPAQUE)
        _, w = chunk_weights(gamma, trap_scale, seg, C, TP, OPAQUE)
        cs, sn, q1, q2, k1, k2 = qk_pairs(pairs_in, OPAQUE, False)
        sq1, sq2 = landed(sq1, OPAQUE), landed(sq2, OPAQUE)
        sk1, sk2 = landed(sk1, OPAQUE), landed(sk2, OPAQUE)
        dq1 = q_decay[:, None] * dq1
        dq2 = q_decay[:, None] * dq2
        tl.store(part_cs + (jb * n_bh + bh) * S_pad + s0 + ts,
                 step_sums(tl.sum(q1 * dq1 + q2 * dq2, axis=1), RP), mask=steps)
        tl.store(part_carried + (jb * n_bh + bh) * nc + c, carried)
        if NO_DY:
            dk1 = k_decay[:, None] * dk1
            dk2 = k_decay[:, None] * dk2
        else:
            m = dp * rows_of_steps(w, RP)
            dq1 = mac(dq1, m, k1, PREC)
            dq2 = mac(dq2, m, k2, PREC)
            dk1 = mac(k_decay[:, None] * dk1, tl.trans(m), q1, PREC)
            dk2 = mac(k_decay[:, None] * dk2, tl.trans(m), q2, PREC)
        d_ang = tl.sum(tl.reshape(dq2 * q1 - dq1 * q2 + dk2 * k1 - dk1 * k2, (TP, RP, BJ)), 1)
        a_at = ((b * S_pad + s0) * H + h) * RD + ts * H * RD  # a step's d_angles
        tl.store(d_angles + a_at[:, None] + j[None, :], d_ang,
                 mask=steps[:, None] & (j < RD)[None, :])
        # rotated back (the gradients of x + bias), with the head's shares of the bias gradients
        sum_q1 += _bias_share(part_qb, bias_at, cs * dq1 + sn * dq2, sq1, bm)
        sum_q2 += _bias_share(part_qb, bias_at + HALF, cs * dq2 - sn * dq1, sq2, bm)
        sum_k1 += _bias_share(part_kb, bias_at, cs * dk1 + sn * dk2, sk1, bm)
        sum_k2 += _bias_share(part_kb, bias_at + HALF, cs * dk2 - sn * dk1, sk2, bm)
    hm = ((t < C) & (r < R))[:, None] & (j < HALF)[None, :]
    off = n_off[:, None] + j[None, :]
    tl.store(dq + off, sum_q1.to(dq.dtype.element_ty), mask=hm)
    tl.store(dq + off + HALF, sum_q2.to(dq.dtype.element_ty), mask=hm)
    tl.store(dk + off, sum_k1.to(dk.dtype.element_ty), mask=hm)
    tl.store(dk + off + HALF, sum_k2.to(dk.dtype.element_ty), mask=hm)


@triton.jit(do_not_specialize=["S_pad", "n_bh", "nc", "plane", "sqb", "skb", "svb"])
def chunk_grads_v_kernel(q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                         segsum, dy, dout, z, mimo_o, mimo_z, dstates, part_cs, part_carried, dv,
                         part_psi, part_d, d_gamma, d_trap_scale, d_adt, S_pad, n_bh, n_jb, nc,
                         plane, H, HG, R, C, N, HALF, P, RD, sqb, sqs, sqr, sqg, sqn, skb, sks,
                         skr, skg, skn, svb, svs, svh, svp, TP: tl.constexpr, RP: tl.constexpr,
                         BJ: tl.constexpr, BP: tl.constexpr, NJB: tl.constexpr,
                         HAS_D: tl.constexpr, PREC: tl.constexpr, BA: tl.constexpr,
                         HAS_Z: tl.constexpr, FAST: tl.constexpr, GATED: tl.constexpr,
                         OPAQUE: tl.constexpr, PREFETCH: tl.constexpr, NO_DY: tl.constexpr):
    """dPsiV = (Sc W)^T dY + K_DECAY Kr dstates[c + 1] + D dY with Sc = Qr Kr^T, and the per-step
    gradients, per (b*h, chunk) (b*h fastest: a group's heads read the same q and k together).
    Sc in one walk over N in blocks of BJ pairs; then per block of BP columns of P, Kr
    dstates[c + 1] in a second walk over N, dP = dY PsiV^T and dPsiV, which gives dv
    [B, S_pad, H, P] and the chunk's shares of dPsi (part_psi [B*H, nc, R, P]) and dD (part_d
    [B*H, nc], HAS_D), these two added to what is there (loaded with the block's other
    inputs). Then d_gamma, d_trap_scale and d_adt [B, H, S_pad] from Sc dP summed over
    the ranks and chunk_grads_qk_kernel's shares part_cs, part_carried (summed over its n_jb
    blocks, NJB = next_pow2(n_jb), in a fixed order); all fp32. NO_DY: dy = 0 (only the final
    state's gradient): dPsiV = K_DECAY Kr dstates[c + 1], no scores, dy not read."""
    pid = tl.program_id(0)
    bh, c = (pid % n_bh).to(tl.int64), (pid // n_bh).to(tl.int64)
    b, h = bh // H, bh % H
    ROWS: tl.constexpr = TP * RP
    t, r = chunk_rows(TP, RP)
    rk = tl.arange(0, RP)
    s0 = c * C
    (row, q_at, qrow, k_at, krow, cos_at, sin_at, cs_off, bias_off, v_at, mv_at, rows, ts, steps,
     y_src, y_row) = _head_chunk(
        q, k, v, mimo_v, cos, sin, (dy, dout, z, mimo_o, mimo_z), t, r, b, h, c, S_pad, H, HG,
        R, C, N, P, RD, sqb, sqs, sqr, sqg, skb, sks, skr, skg, svb, svs, svh, TP, BA)
    ds_at = dstates + (bh * (nc + 1) + c + 1) * N * P
    # the state's gradient, read from memory by the walks over N, asked into L2 while the scores
    # are computed (a hint: no registers, no wait)
    for p0 in range(0, P, BP):
        for j0 in range(0, HALF, BJ):
            prefetch_state_block(ds_at, j0, p0, HALF, P, True, BJ, BP, PREFETCH)
    # what the per-step gradients read at the end, loaded with the per-step terms, first
    jbs = tl.arange(0, NJB)
    jb_ok = jbs < n_jb
    cs_parts = tl.load(part_cs + (jbs[:, None] * n_bh + bh) * S_pad + s0 + ts[None, :],
                       mask=jb_ok[:, None] & steps[None, :], other=0.0)
    carried_parts = tl.load(part_carried + (jbs * n_bh + bh) * nc + c, mask=jb_ok, other=0.0)
    rev = tl.load(da_cs_rev + row + ts, mask=steps, other=0.0)
    log_end = tl.load(da_cs + row + C - 1)
    if HAS_D:
        d_h = tl.load(d + h)
        d_before = tl.load(part_d + bh * nc + c)  # what the groups of batch entries left there
    gamma, trap_scale, k_decay, q_decay, seg = chunk_term_loads(
        terms, segsum, t, r, bh, c, S_pad, nc, plane, R, C, TP)
    if not NO_DY:
        sc = chunk_scores(q_at, qrow, k_at, krow, rows, q_bias, k_bias, bias_off, cos_at, sin_at,
                          cs_off, HALF, RD, sqn, skn, BJ, PREC, OPAQUE)
    e, w = chunk_weights(gamma, trap_scale, seg, C, TP)
    sdp = tl.zeros([TP, TP], dtype=tl.float32)  # Sc dP summed over the ranks, per pair of steps
    inter_k_rows = tl.zeros([ROWS], dtype=tl.float32)  # Kr . dstates[c + 1] PsiV per row
    v_base = ((b * S_pad + s0) * H + h) * P  # the chunk's first step of dv
    psi_at = (bh * nc + c) * R * P + rk[:, None] * P  # the chunk's share of dPsi
    d_sum = 0.0  # sum dY . PsiV: the chunk's share of dD
    for p0 in range(0, P, BP):
        # the block's loads outside the walk over N, issued before it
        p, pm, xv, mv = v_block(v_at, ts, steps, svs, svp, mv_at, R, P, p0, BP, RP)
        if not NO_DY:
            y_in = dy_loads(y_src, y_row, rows, ts, steps, svs, svp, R, P, p, pm, RP, HAS_Z,
                            GATED)
        psi_ok = (rk < R)[:, None] & pm[None, :]
        psi_before = tl.load(part_psi + psi_at + p[None, :], mask=psi_ok, other=0.0)
        kd = tl.zeros([ROWS, BP], dtype=tl.float32)  # Kr dstates[c + 1]
        for j0 in range(0, HALF, BJ):
            ds1, ds2 = state_block(ds_at, j0, p0, HALF, P, BJ, BP)
            cs, sn, y1, y2, yb1, yb2 = rotation_inputs(k_at, krow, rows, k_bias, bias_off, cos_at,
                                                       sin_at, cs_off, j0, HALF, RD, skn, BJ)
            cs, sn = landed(cs, OPAQUE), landed(sn, OPAQUE)
            k1, k2 = rotate_pairs(y1, y2, yb1, yb2, cs, sn, True, OPAQUE)
            kd = mac(mac(kd, k1, ds1, PREC), k2, ds2, PREC)
        xv, mv = landed(xv, OPAQUE), landed(mv, OPAQUE)
        psiv = psi_v_rows(xv, mv)
        if not NO_DY:
            d_y = dy_of(y_in, HAS_Z, FAST, GATED, OPAQUE)
        psi_before = landed(psi_before, OPAQUE)
        if NO_DY:
            inter_k_rows += tl.sum(psiv * kd, axis=1)
            dpv = k_decay[:, None] * kd
        else:
            sdp += steps_of_rows(sc * tl.dot(d_y, tl.trans(psiv), input_precision=PREC), RP)
            inter_k_rows += tl.sum(psiv * kd, axis=1)
            dpv = mac(k_decay[:, None] * kd, tl.trans(sc * rows_of_steps(w, RP)), d_y, PREC)
            if HAS_D:
                dpv += d_h * d_y
                d_sum += tl.sum(tl.sum(d_y * psiv, axis=1), axis=0)
        # PsiV = v Psi: dV sums dPsiV Psi over the ranks, dPsi dPsiV v over the chunk's steps
        dpv3 = tl.reshape(dpv, (TP, RP, BP))
        tl.store(dv + v_base + ts[:, None] * H * P + p[None, :],
                 tl.sum(dpv3 * mv[None], axis=1).to(dv.dtype.element_ty),
                 mask=steps[:, None] & pm[None, :])
        # added to what the groups of batch entries before left there
        tl.store(part_psi + psi_at + p[None, :],
                 psi_before + tl.sum(dpv3 * xv[:, None, :], axis=0), mask=psi_ok)
    if HAS_D:
        tl.store(part_d + bh * nc + c, d_before + d_sum)
    # chunk_grads_qk_kernel's shares, summed over its pair blocks (a fixed order)
    d_cs = tl.sum(cs_parts, axis=0)  # sum_n Qr dQr's inter-chunk term per step
    carried = tl.sum(carried_parts, axis=0)  # <dstates[c + 1], states[c]>
    # per-step gradients: gamma, trap_scale and ADT through the decay pieces
    diag = (ts[None, :] == ts[:, None]) & steps[:, None]
    d_gam = tl.sum(tl.where(diag, sdp, 0.0), axis=1)
    inter_k = step_sums(inter_k_rows, RP)
    d_ts = tl.sum(e * sdp, axis=0) + tl.exp(rev) * inter_k
    d_rev = trap_scale * tl.exp(rev) * inter_k
    # the state recurrence's decay of the entering state over the chunk, exp(da_cs[end])
    d_cs += tl.where(ts == C - 1, carried * tl.exp(log_end), 0.0)
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


@dataclass(frozen=True)
class GradsConfig:
    """Phase 2's blocks: chunk_grads_qk's BJ pairs of N per program and BP columns of P per step
    of its walk over P; chunk_grads_v's V_BJ pairs per step of its walks over N and V_BP columns
    of P per block; the reverse scan's STATE_BJ pairs and STATE_BP columns per program; the
    warps of each of the two chunk kernels."""
    BJ: int = 16
    BP: int = 32
    V_BJ: int = 16
    V_BP: int = 64
    STATE_BJ: int = 64
    STATE_BP: int = 32
    QK_WARPS: int = 4
    V_WARPS: int = 4


# The reverse scan's blocks, measured on the H200 (2026-12-03, 9488e56): 1.80 -> 1.22 ms at
# N256_P64_R4_C8 and 1.29 -> 0.82 at N64_P128_R4_C16 with 64 columns rather than 32, 0.63 ->
# 0.75 at N128_P64_R4_C16.
STATE_OPTIONS = dict(num_warps=8, num_stages=1)


# chunk_grads_qk's blocks, measured on the H200 (2026-12-04, kernel time per forward+backward,
# docs/performance-operator.md): 32 pairs x 64 columns at 8 warps took it 1.71 -> 1.39 ms at
# N128_P64_R4_C16, 3.36 -> 2.77 at N256_P64_R4_C8, 1.36 -> 0.96 at N64_P128_R4_C16 (32 x 32 at
# 8 warps 1.52, 3.00, 1.15; 32 x 32 at 4 warps 2.12, 4.13, 1.38) and 0.50 -> 0.57 at
# N16_P64_R4_C8, whose 8 pairs fill no 32-pair block. chunk_grads_v's walks over N in 32-pair
# blocks: 1.14 -> 0.97 ms at N128_P64_R4_C16 and 1.90 -> 1.51 at N256_P64_R4_C8 (2026-12-04;
# not measured at N = 64). Without Hopper's wgmma (sm_80-89, sm_120)
# every warp holds a dot's whole second operand, and that block spilled 5.6 KB per thread
# offline (sm_89): there the 16 x 32 blocks at 4 warps. With dy recomputed where it is read
# (`gated`), chunk_grads_v over 32-column P blocks: offline (sm_90, 2026-12-04) 240-584 bytes of
# stack per thread on the official shapes, against 1,000-1,424 at 64 columns (and 672-1,056
# reading the dy buffer at 64); not yet timed. Below N = 64 chunk_grads_qk's 16 x 32 blocks at
# 8 warps rather than 4 (2026-12-05, dde08bc): 0.730 -> 0.521 ms at N16_P64_R4_C8 (offline 1,008
# -> 40 bytes of stack per thread; at N32_P64_R4_C16 736 -> 8, not timed there); chunk_grads_v at
# 8 warps took 1.58x, 1.51x and 1.01x as long at N16, N128_P64_R4_C16 and N128_P64_R1_C64.
def config(N: int, P: int, measured: bool = True, gated: bool = False) -> GradsConfig:
    """The blocks of phase 2's kernels for state size N and head dimension P, on a GPU whose
    configs were measured (configs.measured_arch) or not, with dy read from its buffer or
    recomputed where it is read (gated)."""
    state_bp = 64 if N >= 256 or P >= 128 else 32
    v_bp = 32 if gated else 64
    if N >= 64 and measured:
        return GradsConfig(BJ=32, BP=64, QK_WARPS=8, V_BJ=32 if N >= 128 else 16, V_BP=v_bp,
                           STATE_BP=state_bp)
    return GradsConfig(V_BP=v_bp, STATE_BP=state_bp, QK_WARPS=8 if measured else 4)


def raw_y_grads(*, q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev,
                segsum, dy, states, d_final_state=None, consts, precision: str,
                bounds=None, d_ends=None, gate=None) -> dict:
    """The gradients of raw_y given dy = d raw_y [B, S_pad, R, H, P] fp32, for padded inputs
    (whole chunks of C steps, U = 1) and step_terms' tables: a dict of fp32 tensors dq, dk
    [B, S_pad, R, G, N], the per-chunk shares of the bias gradients part_qb, part_kb
    [B, nc, H, R, N], dv [B, S_pad, H, P], d_angles
    [B, S_pad, H, RD], d_gamma, d_trap_scale, d_adt [B, H, S_pad], the per-chunk shares of dPsi
    (part_psi [B*H, nc, R, P]) and dD (part_d [B*H, nc]; d given), and dstates
    [B, H, nc + 1, N, P] (and the scratch part_cs, part_carried). states: the fp32 states
    entering each chunk [B, H, nc, N, P]; d_final_state [B, H, N, P] or None. Packed sequences
    (B = 1): bounds, int32 [n_seq + 1], sequence j covering chunks bounds[j] .. bounds[j + 1] - 1
    (chunk_state.launches'), and d_ends [n_seq, H, N, P] fp32 the sequences' final-state
    gradients (d_final_state is then the last one's). consts: the kernels' constants of the
    padded call with U = 1 (step_terms' Q_DECAY is then exp(da_cs)); `precision` the dots' input
    precision. gate: dy recomputed from it where it is read (dy None; `launches`)."""
    out = buffers(consts, q.device, d_final_state)
    with on_device(q.device):
        for launch in launches(q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, d=d,
                               terms=terms, cos=cos, sin=sin, da_cs=da_cs, da_cs_rev=da_cs_rev,
                               segsum=segsum, dy=dy, states=states, consts=consts,
                               precision=precision, bounds=bounds, d_ends=d_ends, gate=gate,
                               **out):
            launch.run()
    return out


def _blocks(consts, device, gated: bool = False) -> Tuple[GradsConfig, int]:
    """(the config with its blocks clamped to N and P, every dot dimension at least 16; the
    count of chunk_grads_qk's pair blocks, which `gated` does not change)."""
    return _clamped(consts.N, consts.P, configs.measured_arch(device), gated)


@functools.lru_cache(maxsize=None)
def _clamped(N: int, P: int, measured: bool, gated: bool) -> Tuple[GradsConfig, int]:
    cfg = config(N, P, measured, gated)
    pairs = lambda want: max(16, min(want, next_pow2(N // 2)))  # noqa: E731
    columns = lambda want: max(16, min(want, next_pow2(P)))  # noqa: E731
    cfg = GradsConfig(BJ=pairs(cfg.BJ), BP=columns(cfg.BP), V_BJ=pairs(cfg.V_BJ),
                      V_BP=columns(cfg.V_BP), STATE_BJ=pairs(cfg.STATE_BJ),
                      STATE_BP=columns(cfg.STATE_BP), QK_WARPS=cfg.QK_WARPS,
                      V_WARPS=cfg.V_WARPS)
    return cfg, cdiv(N // 2, cfg.BJ)


configs.register_cache(_clamped.cache_clear)


def buffers(consts, device, d_final_state=None) -> dict:
    """The outputs of `launches` (raw_y_grads' dict) and their scratch, allocated: step_buffers'
    and chunk_buffers'."""
    return dict(step_buffers(consts, device), **chunk_buffers(consts, device, d_final_state))


def step_buffers(consts, device, dq_dtype: torch.dtype = torch.float32,
                 dk_dtype: torch.dtype = torch.float32,
                 dv_dtype: torch.dtype = torch.float32) -> dict:
    """The outputs of `launches` with a step axis, allocated: dq, dk [B, S_pad, R, G, N] and dv
    [B, S_pad, H, P] in the dtypes given (the kernels round each element once), d_angles
    [B, S_pad, H, RD], d_gamma, d_trap_scale, d_adt [B, H, S_pad] fp32. Each batch entry's rows
    are written by the launches of that entry alone, so that a call may run on views of a group
    of batch entries."""
    m = consts
    B, S_pad, R, G, N, H, P = m.B, m.S_pad, m.R, m.G, m.N, m.H, m.P
    f32 = dict(device=device, dtype=torch.float32)
    return dict(dq=torch.empty(B, S_pad, R, G, N, device=device, dtype=dq_dtype),
                dk=torch.empty(B, S_pad, R, G, N, device=device, dtype=dk_dtype),
                dv=torch.empty(B, S_pad, H, P, device=device, dtype=dv_dtype),
                d_angles=torch.empty(B, S_pad, H, m.RD, **f32),
                d_gamma=torch.empty(B, H, S_pad, **f32),
                d_trap_scale=torch.empty(B, H, S_pad, **f32),
                d_adt=torch.empty(B, H, S_pad, **f32))


def chunk_buffers(consts, device, d_final_state=None) -> dict:
    """The per-chunk outputs of `launches` and their scratch, allocated: the shares of the bias
    gradients part_qb, part_kb [B, nc, H, R, N], of dPsi (part_psi [B*H, nc, R, P]) and dD
    (part_d [B*H, nc]), zero, which the launches add to (groups of batch entries run on the
    same buffers accumulate), dstates
    [B, H, nc + 1, N, P] whose last entry holds d_final_state [B, H, N, P] (zero when None),
    which the reverse scan reads and does not write, and chunk_grads_qk's shares for
    chunk_grads_v; fp32."""
    m = consts
    B, R, N, H, P, nc = m.B, m.R, m.N, m.H, m.P, m.nc
    f32 = dict(device=device, dtype=torch.float32)
    n_jb = _blocks(m, device)[1]
    # the reverse scan writes every entry but the last: filling the whole tensor took 0.23 ms at
    # N256_P64_R4_C8 (H200)
    dstates = torch.empty(B, H, nc + 1, N, P, **f32)
    if d_final_state is None:
        dstates[:, :, nc].zero_()
    else:
        dstates[:, :, nc] = d_final_state
    return dict(part_qb=torch.zeros(B, nc, H, R, N, **f32),
                part_kb=torch.zeros(B, nc, H, R, N, **f32),
                part_psi=torch.zeros(B * H, nc, R, P, **f32),
                part_d=torch.zeros(B * H, nc, **f32), dstates=dstates,
                part_cs=torch.empty(n_jb, B * H, m.S_pad, **f32),
                part_carried=torch.empty(n_jb, B * H, nc, **f32))


def launches(*, q, k, v, q_bias, k_bias, mimo_v, d, terms, cos, sin, da_cs, da_cs_rev, segsum,
             dy, states, consts, precision: str, bounds=None, d_ends=None, segments=None,
             finals=None, gate=None, no_dy: bool = False, dq, dk, part_qb, part_kb, dv,
             part_psi, part_d, d_angles, d_gamma, d_trap_scale, d_adt, dstates, part_cs,
             part_carried) -> list:
    """raw_y_grads' three launches (the reverse scan, chunk_grads_qk, chunk_grads_v) into the
    tensors of `buffers`. dy: d raw_y [B, S_pad, R, H, P] fp32; or None with gate = (dout, z,
    mimo_o, mimo_z): dy recomputed where it is read from dout and z [B, S_pad, H, P] (with v's
    strides; z None without the gate) and MIMO_Out, MIMO_Z [H, R, P] (None without the gate),
    the output stage's gradient of a reduced output without the norm (whole_chunk.dy_loads).
    Packed sequences give bounds and d_ends. Chains cut in `segments` (packed.Segments: long
    packed sequences, or a dense call's chunks at B < 4) take d_ends [n_segs, B, H, N, P] (zero
    but in each sequence's last segment) and write the gradients entering them into finals of
    the same shape (fp32), joined by a fourth launch after the reverse scan
    (chunk_state.join_launch). no_dy: dy = 0 (dy and gate None), the gradients from the final
    states' alone, which the kernels compute without dy's terms (NO_DY)."""
    m = consts
    B, S_pad, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    C, nc = m.C, m.nc
    cfg, n_jb = _blocks(m, q.device, gate is not None)
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    stand = placeholder(q.device)
    opt = lambda x: stand if x is None else x  # noqa: E731
    if gate is None:
        gated = dict(dy=stand if no_dy else dy, dout=stand, z=stand, mimo_o=stand, mimo_z=stand,
                     HAS_Z=False, GATED=False)
    else:
        dout, z, mimo_o, mimo_z = gate
        if any(x is not None and x.stride() != vs for x in (dout, z)):
            raise ValueError("gate: dout and z must have v's strides "
                             f"{tuple(vs)}, got {dout.stride()}, "
                             f"{None if z is None else z.stride()}")
        gated = dict(dy=stand, dout=dout, z=opt(z), mimo_o=mimo_o, mimo_z=opt(mimo_z),
                     HAS_Z=z is not None, GATED=True)
    common = dict(S_pad=S_pad, nc=nc, plane=B * H * S_pad, H=H, HG=H // G, R=R, C=C,
                  N=N, P=P, RD=m.RD, sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4], svs=vs[1],
                  svh=vs[2], svp=vs[3], TP=m.TP, RP=m.RP, PREC=precision,
                  FAST=2 if m.OPAQUE else 1, NO_DY=no_dy, **gated)
    BA = input_align(m.ALIGN, q, k, v)  # dout and z: v's strides
    inputs = dict(q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, terms=terms,
                  cos=cos, sin=sin, segsum=segsum, dstates=dstates, BA=BA,
                  sqb=qs[0] // BA, skb=ks[0] // BA, sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4],
                  svb=vs[0] // BA, n_bh=B * H, part_cs=part_cs,
                  part_carried=part_carried, HALF=N // 2, OPAQUE=m.OPAQUE, **common)
    if segments is not None:
        bounds = segments.bounds
    chains = B * H if bounds is None else (bounds.numel() - 1) * B * H
    blocks = cdiv(N // 2, cfg.STATE_BJ) * cdiv(P, cfg.STATE_BP)
    join = [] if segments is None else [chunk_state.join_launch(
        states=dstates, finals=finals, da_cs=da_cs, segments=segments, consts=m, reverse=True)]
    return [
        Launch(state_grad_kernel, (chains, blocks), dict(
            q=q, q_bias=q_bias, da_cs=da_cs, dstates=dstates, terms=terms, cos=cos,
            sin=sin, bounds=dstates if bounds is None else bounds,
            d_final=dstates if bounds is None else d_ends, VARLEN=bounds is not None,
            finals=dstates if finals is None else finals, FINALS=segments is not None,
            n_bh=B * H, BJ=cfg.STATE_BJ, BP=cfg.STATE_BP, sqb=qs[0], svb=vs[0], **common),
            STATE_OPTIONS),
        *join,
        Launch(chunk_grads_qk_kernel, (n_jb * B * G * nc,), dict(
            states=states, dq=dq, dk=dk, part_qb=part_qb, part_kb=part_kb, d_angles=d_angles,
            n_bg=B * G, G=G, BJ=cfg.BJ, BP=cfg.BP, PREFETCH=2 if m.OPAQUE else 0, **inputs),
            dict(num_warps=cfg.QK_WARPS, num_stages=1)),
        Launch(chunk_grads_v_kernel, (B * H * nc,), dict(
            d=d, da_cs=da_cs, da_cs_rev=da_cs_rev, dv=dv, part_psi=part_psi, part_d=part_d,
            d_gamma=d_gamma, d_trap_scale=d_trap_scale, d_adt=d_adt, n_jb=n_jb,
            NJB=next_pow2(n_jb), PREFETCH=2 if m.OPAQUE else 0, HAS_D=m.HAS_D, BJ=cfg.V_BJ,
            BP=cfg.V_BP, **inputs),
            dict(num_warps=cfg.V_WARPS, num_stages=1))]
