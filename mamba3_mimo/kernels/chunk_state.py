"""Production state pass: states[c] = the state entering chunk c, for every chunk.

Two forms, picked by the dispatcher. Split, as in mamba's ssd_chunk_state / ssd_state_passing:
`chunk_increment_kernel` computes every chunk's increment k_w^T psi_v in parallel over (b*h,
chunk, N-pair block, P block) into fp32 scratch, and `state_passing_kernel` chains them,
states[c] = states[c-1] exp(da_cs[end of c-1]) + inc[c-1], a serial loop of multiply-adds over
[BLOCK] slices. Fused: `state_scan_kernel` walks the chunks of one (b*h, N-pair block, P block)
with the running state in registers and each chunk's increment computed in the loop, so that no
increment goes through memory; the next chunk's inputs are loaded before the present chunk's math.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..runtime.launcher import Launch
from ..runtime.plans import placeholder
from . import cdiv, dependent_launch, input_align
from .common import (after_previous_kernel, chain, chunk_rows, dot, dot_sync, load_cos_sin,
                     load_mimo_v, load_pair_columns, load_v_steps, psi_v_rows, rotate_pairs)
from .step_terms import K_DECAY


@triton.jit
def _block(bh, blk, n_jb, H, R, C, P, TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr,
           BP: tl.constexpr):
    """Head (b, h), first pair column j0 and columns p (with mask) of the program's (b*h, N-pair
    block, P block); the (step, rank) rows of a chunk tile and which exist."""
    b, h = bh // H, bh % H
    j0 = (blk % n_jb) * BJ
    p = (blk // n_jb) * BP + tl.arange(0, BP)
    t, r = chunk_rows(TP, RP)
    return b, h, j0, p, p < P, t, r, (t < C) & (r < R)


@triton.jit
def _chunk_inputs(kc, vc, cos_c, sin_c, w_c, C, t, r, rows, tt, live, p, pm, sks, skr, skn,
                  svs, svp, j0, HALF, RD, BJ: tl.constexpr):
    """What a chunk's increment reads, as loaded (nothing where `live` is false): k's pair
    columns, cos/sin and the k decay weights (K_DECAY row) of the rows, and v of the steps;
    kc, vc, cos_c, sin_c, w_c point at the chunk's first step of the (b, h) slices (a chunk's
    first step times a step stride can pass 2**31: the callers move these 64-bit pointers, and
    the offsets inside the chunk stay 32-bit)."""
    x1, x2 = load_pair_columns(kc, t * sks + r * skr, rows & live, j0, BJ, HALF, skn)
    cs, sn = load_cos_sin(cos_c, sin_c, t * RD, rows & live, j0, BJ, RD)
    w = tl.load(w_c + t, mask=rows & live, other=0.0)
    xv = load_v_steps(vc, tt * svs, (tt < C) & live, p, pm, svp)
    return x1, x2, cs, sn, w, xv


@triton.jit
def _increment_operands(x1, x2, b1, b2, cs, sn, xv, mv):
    """The operands of a chunk's increment k_w^T psi_v = psi_v^T (k_w1, k_w2) from
    _chunk_inputs: the two halves of rot(k + k_bias) ([rows, BJ] each; k_w is them times the
    decay weights w) and psi_v^T ([BP, rows], psi_v = v * mimo_v, mv [RP, BP]). The callers
    weight each half and issue its dot next to its use (a store, or the running state's
    update), so that the second half is built only after the first dot."""
    k1, k2 = rotate_pairs(x1, x2, b1, b2, cs, sn, True)
    # psi_v^T (k_w) rather than k_w^T psi_v: k_w, built by elementwise ops, is then the B
    # operand, which always goes through shared memory; as the transposed A operand Triton
    # moved its whole computation into the dot-operand layout (255 registers and spills).
    return k1, k2, tl.trans(psi_v_rows(xv, mv))


@triton.jit
def _increment(x1, x2, b1, b2, cs, sn, w, xv, mv, PREC: tl.constexpr, SYNC: tl.constexpr,
               OPAQUE: tl.constexpr):
    """A chunk's increment k_w^T psi_v as its two halves, transposed ([BP, BJ] each), from
    _chunk_inputs (the scan's running state takes both at once); SYNC: on mma.sync
    (common.dot_sync)."""
    k1, k2, psi_t = _increment_operands(x1, x2, b1, b2, cs, sn, xv, mv)
    return (dot_sync(psi_t, k1 * w[:, None], PREC, SYNC, OPAQUE),
            dot_sync(psi_t, k2 * w[:, None], PREC, SYNC, OPAQUE))


@triton.jit(do_not_specialize=["S_pad", "plane", "nc", "skb", "svb", "n_bh"])
def chunk_increment_kernel(k, v, k_bias, mimo_v, terms, cos, sin, inc,
                           S_pad, plane, nc, n_bh, H, HG, n_jb, skb, sks, skr, skg, skn, svb, svs,
                           svh,
                           svp, R, N: tl.constexpr, P: tl.constexpr, C,
                           TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, RD: tl.constexpr,
                           BJ: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
                           BA: tl.constexpr, PDL: tl.constexpr):
    """inc[b, h, c + 1] = sum_{t in chunk c} k_w[t]^T psi_v[t] with
    k_w = rot(k + k_bias) * trap_scale * exp(da_cs_rev), for c < nc - 1. skb and svb come
    divided by BA (kernels.input_align)."""
    after_previous_kernel(PDL, START_NEXT=True)
    # (b*h, chunk) flattened on grid axis 0, b*h fastest: axis 1 would cap nc at 65,535
    pid = tl.program_id(0)  # < 2**31: 32-bit division, then 64-bit offsets
    bh = (pid % n_bh).to(tl.int64)
    c = (pid // n_bh).to(tl.int64)
    b, h, j0, p, pm, t, r, rows = _block(bh, tl.program_id(1), n_jb, H, R, C, P, TP, RP, BJ, BP)
    row = bh * S_pad
    b1, b2 = load_pair_columns(k_bias + h * R * N, r * N, rows, j0, BJ, HALF, 1)
    c0 = c * C  # the chunk's first step, 64-bit
    x1, x2, cs, sn, w, xv = _chunk_inputs(
        k + b * skb * BA + (h // HG) * skg + c0 * sks, v + b * svb * BA + h * svh + c0 * svs,
        cos + (row + c0) * RD, sin + (row + c0) * RD,
        terms + K_DECAY * tl.cast(plane, tl.int64) + row + c0, C, t, r, rows, tl.arange(0, TP),
        True, p, pm, sks, skr, skn, svs, svp, j0, HALF, RD, BJ)
    k1, k2, psi_t = _increment_operands(x1, x2, b1, b2, cs, sn, xv,
                                        load_mimo_v(mimo_v + h * R * P, R, p, pm, P, RP))
    j = j0 + tl.arange(0, BJ)
    off = (bh * nc + c + 1) * N * P + j[None, :] * P + p[:, None]
    m = (j < HALF)[None, :] & pm[:, None]
    tl.store(inc + off, dot(psi_t, k1 * w[:, None], PREC), mask=m)
    tl.store(inc + off + HALF * P, dot(psi_t, k2 * w[:, None], PREC), mask=m)


@triton.jit(do_not_specialize=["S_pad", "nc", "n_bh"])
def state_passing_kernel(inc, da_cs, states, init, bounds, S_pad, nc, C, U, n_bh,
                         NP_SIZE: tl.constexpr, BLOCK: tl.constexpr, DEPTH: tl.constexpr,
                         KEEP_FP32: tl.constexpr, HAS_INIT: tl.constexpr,
                         VARLEN: tl.constexpr, PDL: tl.constexpr):
    """states[c] = states[c-1] * exp(da_cs[c*C - 1]) + inc[c], on [BLOCK] slices; states[0] = 0,
    or with HAS_INIT the given state entering the first chunk, init [B*H, N, P] fp32. VARLEN
    (packed sequences, B = 1): sequence j's chunks bounds[j] .. bounds[j + 1] - 1 (bounds int32
    [n_seq + 1]) start from init[j * H + h] ([n_seq * H, N, P]) or zero, one program per
    (sequence, h, slice).

    The chunks go in groups of DEPTH, each group's increments and decays loaded before its
    first update: the serial chain then waits for memory once per group instead of once per
    chunk. Its length, not the bandwidth, bounds this kernel where the grid is about one
    program per SM.

    inc may alias states (fp32 outputs): each slice is read before it is overwritten. With
    KEEP_FP32 (narrower outputs that chunk_output may not read, configs.out_states_suffice) the
    fp32 state also replaces inc[c] for the chunks that start a chunk_output tile (c % U == 0),
    the only ones it reads, at full precision."""
    after_previous_kernel(PDL, START_NEXT=True)
    bh, lo, n_ch, init_row = chain(tl.program_id(0), n_bh, nc, bounds, VARLEN)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < NP_SIZE
    base = (bh * nc + lo) * NP_SIZE + e
    da_row = da_cs + bh * S_pad + lo * C
    if HAS_INIT:
        running = tl.load(init + init_row * NP_SIZE + e, mask=m, other=0.0)
    else:
        running = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(states + base, running.to(states.dtype.element_ty), mask=m)
    if KEEP_FP32:
        tl.store(inc + base, running, mask=m & (lo % U == 0))
    for c0 in range(1, n_ch, DEPTH):
        xs = ()
        log_decays = ()
        for i in tl.static_range(DEPTH):
            live = c0 + i < n_ch  # past the last chunk: x = 0 and decay 1, nothing stored
            at = tl.cast(c0 + i, tl.int64) * NP_SIZE  # chunks x N*P can pass 2**31
            xs += (tl.load(inc + base + at, mask=m & live, other=0.0),)
            log_decays += (tl.load(da_row + (c0 + i) * C - 1, mask=live, other=0.0),)
        for i in tl.static_range(DEPTH):
            c = c0 + i
            at = tl.cast(c, tl.int64) * NP_SIZE
            running = running * tl.exp(log_decays[i]) + xs[i]
            live = m & (c < n_ch)
            tl.store(states + base + at, running.to(states.dtype.element_ty), mask=live)
            if KEEP_FP32:  # the chunks that start a tile, counted from the layout's first
                tl.store(inc + base + at, running, mask=live & ((lo + c) % U == 0))


@triton.jit(do_not_specialize=["S_pad", "plane", "nc", "skb", "svb"])
def state_scan_kernel(k, v, k_bias, mimo_v, terms, cos, sin, da_cs, states, keep, init, bounds,
                      finals, S_pad, plane, nc, n_bh, H, HG, n_jb, skb, sks, skr, skg, skn, svb,
                      svs, svh, svp, R, N: tl.constexpr, P: tl.constexpr, C, U,
                      TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, RD: tl.constexpr,
                      BJ: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr, BA: tl.constexpr,
                      KEEP_FP32: tl.constexpr, SYNC: tl.constexpr, OPAQUE: tl.constexpr,
                      HAS_INIT: tl.constexpr, VARLEN: tl.constexpr, FINALS: tl.constexpr,
                      PDL: tl.constexpr):
    """states[b, h, c + 1] = states[b, h, c] exp(da_cs[end of c]) + k_w^T psi_v of chunk c, the
    increment computed as chunk_increment_kernel does, for every chunk in order; states[0] = 0,
    or with HAS_INIT the given state entering the first chunk, init [B*H, N, P] fp32. VARLEN as
    state_passing_kernel's (one program per (sequence, h, block)), or with B > 1 (segments of a
    dense call) per (segment, b*h, block), bounds the same in every batch entry.
    With KEEP_FP32 the fp32 state of every chunk that starts a chunk_output tile (c % U == 0)
    also goes to keep. FINALS (with VARLEN): the state after the chain's last chunk also goes
    to finals [chains, N, P] fp32, the chains' rows as init's (chains that are segments,
    packed.Segments). skb and svb come divided by BA (kernels.input_align)."""
    after_previous_kernel(PDL, START_NEXT=True)
    bh, lo, n_ch, init_row = chain(tl.program_id(0), n_bh, nc, bounds, VARLEN)
    b, h, j0, p, pm, t, r, rows = _block(bh, tl.program_id(1), n_jb, H, R, C, P, TP, RP, BJ, BP)
    tt = tl.arange(0, TP)
    row = bh * S_pad + lo * C  # the chain's first step
    # pointers at a chunk's first step, moved by one chunk's strides (64-bit scalars) per chunk
    kc = k + b * skb * BA + (h // HG) * skg + lo * C * sks
    vc = v + b * svb * BA + h * svh + lo * C * svs
    cos_c, sin_c = cos + row * RD, sin + row * RD
    w_c = terms + K_DECAY * tl.cast(plane, tl.int64) + row
    k_step, v_step = tl.cast(C, tl.int64) * sks, tl.cast(C, tl.int64) * svs
    b1, b2 = load_pair_columns(k_bias + h * R * N, r * N, rows, j0, BJ, HALF, 1)
    mv = load_mimo_v(mimo_v + h * R * P, R, p, pm, P, RP)
    j = j0 + tl.arange(0, BJ)
    # the (b, h) slice's base as a 64-bit scalar, the offsets inside one chunk's state 32-bit:
    # a 64-bit offset tensor took 8 more registers
    states += (bh * nc + lo) * N * P
    keep += (bh * nc + lo) * N * P
    off = j[None, :] * P + p[:, None]  # [BP, BJ], as chunk_increment's
    m = (j < HALF)[None, :] & pm[:, None]
    if HAS_INIT:
        run1 = tl.load(init + init_row * N * P + off, mask=m, other=0.0)
        run2 = tl.load(init + init_row * N * P + off + HALF * P, mask=m, other=0.0)
    else:
        run1 = tl.zeros([BP, BJ], dtype=tl.float32)
        run2 = tl.zeros([BP, BJ], dtype=tl.float32)
    tl.store(states + off, run1.to(states.dtype.element_ty), mask=m)
    tl.store(states + off + HALF * P, run2.to(states.dtype.element_ty), mask=m)
    if KEEP_FP32:
        tl.store(keep + off, run1, mask=m & (lo % U == 0))
        tl.store(keep + off + HALF * P, run2, mask=m & (lo % U == 0))
    # the chunks whose increments are read: all but the last, whose state is not stored, unless
    # FINALS stores the state after it
    n_inc = n_ch - 1
    if FINALS:
        n_inc = n_ch
    # chunk 0's inputs; in the loop, chunk c + 2's are loaded before chunk c's math, so that the
    # serial loop waits for memory only when the math is shorter than a load
    x1, x2, cs, sn, w, xv = _chunk_inputs(kc, vc, cos_c, sin_c, w_c, C, t, r, rows, tt, n_inc > 0,
                                          p, pm, sks, skr, skn, svs, svp, j0, HALF, RD, BJ)
    # chunk 0's increment, and chunk 1's inputs: in the loop, chunk c + 1's increment is computed
    # after chunk c's state is stored, so that the running state's update never waits for a dot
    inc1, inc2 = _increment(x1, x2, b1, b2, cs, sn, w, xv, mv, PREC, SYNC, OPAQUE)
    kc, vc, cos_c, sin_c, w_c = kc + k_step, vc + v_step, cos_c + C * RD, sin_c + C * RD, w_c + C
    x1, x2, cs, sn, w, xv = _chunk_inputs(kc, vc, cos_c, sin_c, w_c, C, t, r, rows, tt, n_inc > 1,
                                          p, pm, sks, skr, skn, svs, svp, j0, HALF, RD, BJ)
    # da_cs at the end of each chunk, loaded a chunk ahead of its use: loaded where it is used,
    # this scalar held up every step of the chain (18 % of the scan's stall samples)
    log_decay = tl.load(da_cs + row + C - 1)
    log_decay1 = tl.load(da_cs + row + 2 * C - 1, mask=n_ch > 1, other=0.0)
    for c in range(0, n_ch - 1):
        # chunk c + 2's inputs, a whole iteration ahead of their use where the increment's dot is
        # a warp-level mma (SYNC); a wgmma is preceded by a proxy fence that waits for every
        # load in flight, so there they are loaded after the dot (below)
        kc, vc = kc + k_step, vc + v_step
        cos_c, sin_c, w_c = cos_c + C * RD, sin_c + C * RD, w_c + C
        if SYNC:
            nx1, nx2, ncs, nsn, nw, nxv = _chunk_inputs(
                kc, vc, cos_c, sin_c, w_c, C, t, r, rows, tt, c + 2 < n_inc, p, pm, sks, skr,
                skn, svs, svp, j0, HALF, RD, BJ)
        decay = tl.exp(log_decay)
        run1 = run1 * decay + inc1
        run2 = run2 * decay + inc2
        so = tl.cast(c + 1, tl.int64) * (N * P)  # chunks x N*P can pass 2**31
        tl.store(states + so + off, run1.to(states.dtype.element_ty), mask=m)
        tl.store(states + so + off + HALF * P, run2.to(states.dtype.element_ty), mask=m)
        if KEEP_FP32:
            tile_start = (lo + c + 1) % U == 0
            tl.store(keep + so + off, run1, mask=m & tile_start)
            tl.store(keep + so + off + HALF * P, run2, mask=m & tile_start)
        # chunk c + 1's increment (zero past the last chunk that has one: its inputs are masked)
        inc1, inc2 = _increment(x1, x2, b1, b2, cs, sn, w, xv, mv, PREC, SYNC, OPAQUE)
        if not SYNC:
            nx1, nx2, ncs, nsn, nw, nxv = _chunk_inputs(
                kc, vc, cos_c, sin_c, w_c, C, t, r, rows, tt, c + 2 < n_inc, p, pm, sks, skr,
                skn, svs, svp, j0, HALF, RD, BJ)
        x1, x2, cs, sn, w, xv = nx1, nx2, ncs, nsn, nw, nxv
        # chunk c + 2's decay (within the chain where c + 2 < n_ch)
        log_decay, log_decay1 = log_decay1, tl.load(da_cs + row + (c + 3) * C - 1,
                                                    mask=c + 2 < n_ch, other=0.0)
    if FINALS:  # the last chunk's update: its increment and decay are the loop's last
        decay = tl.exp(log_decay)
        fo = init_row * N * P + off
        tl.store(finals + fo, run1 * decay + inc1, mask=m)
        tl.store(finals + fo + HALF * P, run2 * decay + inc2, mask=m)


@triton.jit
def _segment_decay(ends, seg_bounds, j, C, CHUNKS: tl.constexpr):
    """The log decay over segment j's chunks (ends + c * C: the decay over chunk c), summed
    CHUNKS chunks at a time so that the loads are not one dependent wait per chunk."""
    lo = tl.load(seg_bounds + j)
    hi = tl.load(seg_bounds + j + 1)
    decay = tl.zeros([CHUNKS], dtype=tl.float32)
    for c0 in range(lo, hi, CHUNKS):
        c = c0 + tl.arange(0, CHUNKS)
        decay += tl.load(ends + c * C, mask=c < hi, other=0.0)
    return tl.sum(decay, 0)


@triton.jit(do_not_specialize=["S_pad", "slots"])
def segment_join_kernel(states, finals, init, da_cs, seg_bounds, seg_seq, seg_first, seg_last,
                        S_pad, slots, n_bh, C, NP_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNKS: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr,
                        PDL: tl.constexpr):
    """A serial pass run in segments (packed.Segments: long packed sequences, or a dense call's
    chunks at B < 4, the same segments in every batch entry), each from zero, joined: the
    states (or their gradients, REVERSE) of the whole sequences.

    Forward: for segment k, E_k, the state entering it, is chained over the sequence's segments
    before it (E = init of the sequence, or zero; then E = E * exp(their decay) + the state
    after them, finals [n_segs * H, N, P]), and states[c] += exp(the decay of the segment's
    chunks before c) * E_k for each of its chunks c. REVERSE: the gradient of the state
    leaving segment k, G_k, is chained over the segments after it, from the sequence's last
    (whose walk started from the sequence's final-state gradient: G = their gradient entering,
    finals, + exp(their decay) * G), and states[c] += exp(the decay of chunks c .. the
    segment's last) * G_k. states: [H, slots, N, P] fp32 (slots: nc, or nc + 1 for the
    gradients). One program per (segment, h, slice of BLOCK state elements); the chunks of a
    segment are independent here, so they are updated CHUNKS at a time, their weights the
    exponentials of running sums of the chunks' log decays."""
    after_previous_kernel(PDL, START_NEXT=True)
    k = tl.program_id(0) // n_bh
    bh = tl.cast(tl.program_id(0) % n_bh, tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < NP_SIZE
    ends = da_cs + bh * S_pad + C - 1  # + c * C: da_cs at the end of chunk c
    row = states + bh * slots * NP_SIZE
    lo = tl.load(seg_bounds + k)
    n = tl.load(seg_bounds + k + 1) - lo
    if REVERSE:
        last = tl.load(seg_last + k)
        carried = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, last - k):
            j = last - i
            entering = tl.load(finals + (tl.cast(j, tl.int64) * n_bh + bh) * NP_SIZE + e,
                               mask=m, other=0.0)
            carried = entering + tl.exp(_segment_decay(ends, seg_bounds, j, C, CHUNKS)) * carried
        todo = k < last
        # chunk c's weight: the decay of chunks c .. the segment's last
        total = _segment_decay(ends, seg_bounds, k, C, CHUNKS)
    else:
        first = tl.load(seg_first + k)
        if HAS_INIT:
            seq = tl.cast(tl.load(seg_seq + k), tl.int64)
            carried = tl.load(init + (seq * n_bh + bh) * NP_SIZE + e, mask=m, other=0.0)
        else:
            carried = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(first, k):
            final = tl.load(finals + (tl.cast(j, tl.int64) * n_bh + bh) * NP_SIZE + e, mask=m,
                            other=0.0)
            carried = carried * tl.exp(_segment_decay(ends, seg_bounds, j, C, CHUNKS)) + final
        # without an initial state, a sequence's first segment is right as it is (from zero)
        todo = k > first
        if HAS_INIT:
            todo = k >= first
        total = 0.0
    if todo:
        before = 0.0  # the log decay of the segment's chunks before this block
        for i0 in range(0, n, CHUNKS):
            at_chunk = i0 + tl.arange(0, CHUNKS)
            c = lo + at_chunk
            # both loads before the math, so that the block waits for memory once
            at = tl.cast(c, tl.int64)[:, None] * NP_SIZE + e[None, :]
            mm = (at_chunk < n)[:, None] & m[None, :]
            x = tl.load(row + at, mask=mm)
            decay = tl.load(ends + c * C, mask=at_chunk < n, other=0.0)
            prior = before + tl.cumsum(decay, 0) - decay  # chunks before c in the segment
            if REVERSE:
                log_weight = total - prior
            else:
                log_weight = prior
            tl.store(row + at, x + tl.exp(log_weight)[:, None] * carried[None, :], mask=mm)
            before += tl.sum(decay, 0)



def launches(*, k: torch.Tensor, v: torch.Tensor, k_bias: torch.Tensor, mimo_v: torch.Tensor,
             da_cs: torch.Tensor, terms: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             states: torch.Tensor, inc: torch.Tensor, consts, cfg,
             init: Optional[torch.Tensor] = None,
             bounds: Optional[torch.Tensor] = None,
             finals: Optional[torch.Tensor] = None) -> list:
    """The launches that write states [B, H, nc, N, P] from k [B, S_pad, R, G, N], v
    [B, S_pad, H, P], k_bias [H, R, N], mimo_v [H, R, P], da_cs [B, H, S_pad] and step_terms'
    terms, cos, sin. `inc` is fp32 of the states' shape, or `states` itself for fp32 outputs,
    or a one-element stand-in where consts.OUT_STATES lets chunk_output read `states` and the
    scan runs (never written then); otherwise it ends holding the fp32 states of the chunks
    that start an output tile. init: the state entering the first chunk [B, H, N, P] fp32
    contiguous, or None for zero. bounds: int32 [n_chains + 1], chain j covering chunks
    bounds[j] .. bounds[j + 1] - 1 of every batch entry and starting from init[j] (packed
    sequences, B = 1: init then [n_seq, H, N, P] or None) or zero (segments); the state pass
    then runs one program per (chain, b*h, block). finals (with bounds, the fused scan only):
    [n_chains, B, H, N, P] fp32, receives the state after each chain's last chunk (chains that
    are segments, packed.Segments, joined by `join_launch`).

    cfg (configs.StateConfig): scan picks the fused state_scan_kernel over chunk_increment with
    state_passing, which use `inc` as their fp32 scratch. The first launch is the one whose
    resources decide the config; chunk_increment's grid is empty for a single chunk."""
    m = consts
    B, H, N, P = m.B, m.H, m.N, m.P
    half = N // 2
    n_jb = cdiv(half, cfg.BJ)
    BA = input_align(m.ALIGN, k, v)
    keep_fp32 = inc is not states and not m.OUT_STATES
    ks, vs = k.stride(), v.stride()
    common = dict(
        k=k, v=v, k_bias=k_bias, mimo_v=mimo_v, terms=terms, cos=cos, sin=sin, S_pad=m.S_pad,
        plane=B * H * m.S_pad, nc=m.nc, H=H, HG=H // m.G, n_jb=n_jb, skb=ks[0] // BA, sks=ks[1],
        skr=ks[2], skg=ks[3], skn=ks[4], svb=vs[0] // BA, svs=vs[1], svh=vs[2], svp=vs[3], R=m.R,
        N=N, P=P, C=m.C, TP=m.TP, RP=m.RP, HALF=half, RD=m.RD, BJ=cfg.BJ, BP=cfg.BP, PREC=m.PREC,
        BA=BA, PDL=m.PDL)
    p_blocks = n_jb * cdiv(P, cfg.BP)
    stand = placeholder(k.device)
    first = dict(init=stand if init is None else init, HAS_INIT=init is not None,
                 bounds=stand if bounds is None else bounds, VARLEN=bounds is not None)
    if finals is not None and not (cfg.scan and bounds is not None):
        raise ValueError("finals: the fused scan over chains (cfg.scan, bounds given) only")
    chains = B * H if bounds is None else (bounds.numel() - 1) * B * H
    if cfg.scan:
        return [Launch(state_scan_kernel, (chains, p_blocks), dict(
            common, da_cs=da_cs, states=states, keep=inc, U=m.U, KEEP_FP32=keep_fp32, n_bh=B * H,
            SYNC=m.SCAN_SYNC, OPAQUE=m.OPAQUE, finals=stand if finals is None else finals,
            FINALS=finals is not None, **first),
            dict(num_warps=cfg.num_warps, num_stages=1, **dependent_launch(m)))]
    return [Launch(chunk_increment_kernel, (B * H * max(m.nc - 1, 0), p_blocks),
                   dict(common, inc=inc, n_bh=B * H),
                   dict(num_warps=cfg.num_warps, **dependent_launch(m))),
            Launch(state_passing_kernel, (chains, cdiv(N * P, cfg.BLOCK)), dict(
                inc=inc, da_cs=da_cs, states=states, S_pad=m.S_pad, nc=m.nc, C=m.C, U=m.U,
                n_bh=B * H, NP_SIZE=N * P, BLOCK=cfg.BLOCK, DEPTH=cfg.DEPTH,
                KEEP_FP32=keep_fp32, PDL=m.PDL, **first),
                dict(num_warps=4, **dependent_launch(m)))]


# the join's slice of a state per program, and its chunks per step ([8, 512] fp32: 32 values per
# thread at 4 warps)
JOIN_BLOCK = 512
JOIN_CHUNKS = 8


def join_launch(*, states: torch.Tensor, finals: torch.Tensor, da_cs: torch.Tensor,
                segments, consts, init: Optional[torch.Tensor] = None,
                reverse: bool = False) -> Launch:
    """segment_join_kernel's launch, for a serial pass run over `segments` (packed.Segments)
    from zero, with `finals` [n_segs, B, H, N, P] fp32 from it: states [B, H, nc, N, P] fp32
    made the states of the whole sequences, each from init ([n_seq, H, N, P] packed, B = 1;
    [B, H, N, P] dense) fp32 or zero; with `reverse`, dstates [B, H, nc + 1, N, P] the
    gradients of the whole sequences (the reverse scan's)."""
    m = consts
    NP = m.N * m.P
    n_bh = m.B * m.H
    return Launch(segment_join_kernel, (segments.n_segs * n_bh, cdiv(NP, JOIN_BLOCK)), dict(
        states=states, finals=finals, init=placeholder(states.device) if init is None else init,
        da_cs=da_cs, seg_bounds=segments.bounds, seg_seq=segments.seq, seg_first=segments.first,
        seg_last=segments.last, S_pad=m.S_pad, slots=states.shape[2], n_bh=n_bh, C=m.C, NP_SIZE=NP,
        BLOCK=JOIN_BLOCK, CHUNKS=JOIN_CHUNKS, HAS_INIT=init is not None, REVERSE=reverse,
        PDL=m.PDL),
        dict(num_warps=4, **dependent_launch(m)))
