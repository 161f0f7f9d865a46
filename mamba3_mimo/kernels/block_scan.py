"""Production path: blocks of K chunks, each walked by one program that carries its state in
registers, so that no per-chunk fp32 state ever goes through memory.

Three launches. (1) `block_scan_kernel` with OUTPUT=False: each block's increment (its chunks'
k_w^T psi_v, decayed to the block's end) and its total log-decay. (2) `state_passing_kernel`
(chunk_state.py) chains the blocks into each block's entry state. (3) `block_scan_kernel` with
OUTPUT=True: from its entry state, each program walks its block's chunks in order, writing
states[c], qk_dot, dz and the per-rank sums of dmimo_o / dmimo_z, and advancing the state.
Grid of (1) and (3): (B*H, block, P block); the N dimension stays whole in each program because
inter = qr @ states sums over it.
"""
import triton
import triton.language as tl

from .chunk_state import pass_states
from .common import (chunk_rows, dot, mac, gate_epilogue, head_params, intra_weights, load_halves,
                     load_psi_v, load_rotated, rotary_cos_sin, rotate, store_qk_dot,
                     store_rank_sums, trap_terms)


@triton.jit(do_not_specialize=["S", "S_pad", "nc", "n_blk", "K", "zero", "sqb", "skb", "svb",
                               "sab", "sgb", "sgh"])
def block_scan_kernel(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, angles,
                      da_cs, da_cs_rev, dt, trap, segsum, entry, blk_decay, states, qk_dot, dz,
                      part_o, part_z, S, S_pad, nc, n_blk, K, zero, H, HG, sqb, sqs, sqr, sqg, sqn,
                      skb, sks, skr, skg, skn, svb, svs, svh, svp, sab, sas, sah, san,
                      sgb, sgh, sgc, R, N: tl.constexpr, P: tl.constexpr, C,
                      TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
                      RD, BP: tl.constexpr, OUTPUT: tl.constexpr, HAS_Z: tl.constexpr,
                      HAS_D: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """Walk chunks blk*K .. min(blk*K + K, nc) - 1 of (b, h) for the P columns of this program.

    The state is kept as its two halves st1 = rows 0..HALF-1 and st2 = rows HALF..N-1 ([HP, BP]
    fp32, HP = HALF rounded up to a power of two), matching the pair columns of rotate-half.
    OUTPUT=False starts from 0 and stores the block's end state into entry[blk + 1] and its total
    log-decay into blk_decay[blk]; OUTPUT=True starts from entry[blk] and writes the outputs.
    """
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    pid_p = tl.program_id(2)
    b, h = bh // H, bh % H
    g = h // HG
    t, r0 = chunk_rows(TP, RP)
    RS: tl.constexpr = 16 if RP < 16 else RP
    TS: tl.constexpr = 16 if TP < 16 else TP
    tt = tl.arange(0, TS)
    p0 = pid_p * BP + tl.arange(0, BP)
    j = tl.arange(0, HP)
    row = bh * S_pad
    vb = v + b * svb + h * svh
    blk_state = entry + (bh * n_blk + blk) * N * P
    s_off = j[:, None] * P + p0[None, :]
    s_mask = (j < HALF)[:, None] & (p0 < P)[None, :]
    if OUTPUT:
        st1 = tl.load(blk_state + s_off, mask=s_mask, other=0.0)
        st2 = tl.load(blk_state + HALF * P + s_off, mask=s_mask, other=0.0)
    else:
        st1 = tl.zeros([HP, BP], dtype=tl.float32)
        st2 = tl.zeros([HP, BP], dtype=tl.float32)
    acc_o = tl.zeros([RS, BP], dtype=tl.float32)
    acc_z = tl.zeros([RS, BP], dtype=tl.float32)
    log_decay = tl.zeros([1], dtype=tl.float32)
    if OUTPUT:
        d_h = 0.0
        if HAS_D:
            d_h = tl.load(d + h)
    for c in range(blk * K, tl.minimum(blk * K + K, nc)):
        # `zero` is 0 at run time: it makes the rank and column vectors, and every address and
        # mask tile built from them, depend on the loop, so the compiler rebuilds those tiles
        # per chunk instead of hoisting them out of the loop, where they would hold registers
        # (a 64-bit address tile costs twice its data) through the whole block.
        r = r0 + c * zero
        p = p0 + c * zero
        rows = (t < C) & (r < R)
        pm = p < P
        tg = c * C + t
        ang = angles + b * sab + h * sah
        # k is used as [HP, rows] tiles (k^T), loaded so rather than transposed in registers:
        # the state update's left operand and the right one of the scores
        cos, sin = rotary_cos_sin(ang, tg * sas, rows, 0, HP, RD, san, True)
        k1, k2 = load_halves(k + b * skb + g * skg, tg * sks + r * skr, rows, 0, HP, HALF, skn,
                             True)
        kb1, kb2 = load_halves(k_bias + h * R * N, r * N, rows, 0, HP, HALF, 1, True)
        k1, k2 = rotate(k1 + kb1, k2 + kb2, cos, sin)
        gamma, trap_scale = trap_terms(dt + row, trap + row, tg, rows, S_pad)
        psi_v = load_psi_v(vb, tg * svs, rows, mimo_v + h * R * P, r, R, p, pm, P, svp)
        rev = tl.load(da_cs_rev + row + tg, mask=rows, other=0.0)
        k_w = tl.where(rows, trap_scale * tl.exp(rev), 0.0)[None, :]
        a_end = tl.load(da_cs + row + c * C + C - 1)
        log_decay += a_end
        if OUTPUT:
            cos, sin = rotary_cos_sin(ang, tg * sas, rows, 0, HP, RD, san)
            q1, q2 = load_rotated(q + b * sqb + g * sqg, tg * sqs + r * sqr, rows,
                                  q_bias + h * R * N, r * N, cos, sin, 0, HP, HALF, sqn, True)
            st_out = states + (bh * nc + c) * N * P
            c_off = j[:, None] * P + p[None, :]
            c_mask = (j < HALF)[:, None] & pm[None, :]
            tl.store(st_out + c_off, st1.to(states.dtype.element_ty), mask=c_mask)
            tl.store(st_out + HALF * P + c_off, st2.to(states.dtype.element_ty), mask=c_mask)
            scores = mac(dot(q1, k1, PREC), q2, k2, PREC)
            inter = mac(dot(q1, st1, PREC), q2, st2, PREC)
        # states[c + 1] = states[c] exp(da_cs[end of c]) + k_w^T psi_v over the chunk's rows;
        # before the output epilogue, so that k is dead by then
        decay = tl.exp(a_end)
        st1 = mac(st1 * decay, k1 * k_w, psi_v, PREC)
        st2 = mac(st2 * decay, k2 * k_w, psi_v, PREC)
        if OUTPUT:
            store_qk_dot(qk_dot + (bh * S + c * C) * R * R, scores, t, r,
                         rows & (tg < S) & (pid_p == 0), R, RP, TP * RP, EXACT)
            w = intra_weights(segsum + b * sgb + h * sgh + c * sgc, t, t, rows, rows, C, gamma,
                              trap_scale)
            a_t = tl.load(da_cs + row + tg, mask=rows, other=0.0)
            raw = dot(scores * w, psi_v, PREC) + tl.exp(a_t)[:, None] * inter
            if HAS_D:
                raw += d_h * psi_v
            phi, zeta, _ = head_params(mimo_o, mimo_z, d, h, r, rows, p, pm, R, P, HAS_Z, False)
            part_o_c, part_z_c = gate_epilogue(raw, dout + b * svb + h * svh,
                                               z + b * svb + h * svh, tg * svs, rows, phi, zeta,
                                               p, pm, svp, dz + (b * S * H + h) * P,
                                               (c * C + tt) * H * P, (tt < C) & (c * C + tt < S),
                                               TP, RP, HAS_Z, EXACT)
            acc_o += part_o_c
            acc_z += part_z_c
    if OUTPUT:
        part = (bh * n_blk + blk) * R * P
        pm0 = p0 < P
        store_rank_sums(part_o + part, part_z + part, acc_o, acc_z, R, p0, pm0, P, RS, HAS_Z)
    else:
        tl.store(blk_state + N * P + s_off, st1, mask=s_mask)
        tl.store(blk_state + N * P + HALF * P + s_off, st2, mask=s_mask)
        tl.store(blk_decay + bh * n_blk + blk + tl.arange(0, 1), log_decay, mask=pid_p == 0)


def n_blocks(nc: int, cfg: dict) -> int:
    """Blocks of cfg["K"] chunks over nc chunks (the last may be partial)."""
    return triton.cdiv(nc, cfg["K"])


def launch(a: dict, out: dict, meta: dict, cfg: dict, warmup: bool = False):
    """Write states, qk_dot, dz and the dmimo partial sums; cfg holds K (chunks per block), BP,
    num_warps, num_stages.

    out["entry"]: [B*H, n_blk, N, P] fp32 scratch; out["blk_decay"]: [B*H, n_blk] fp32;
    out["part_o"], out["part_z"]: [B*H, n_blk, R, P] fp32 (n_blk = n_blocks(nc, cfg)).
    With warmup=True, compiles both variants without running them and returns them.
    """
    m = meta
    B, H, N, P = m["B"], m["H"], m["N"], m["P"]
    n_blk = n_blocks(m["nc"], cfg)
    half = N // 2
    hp = max(16, triton.next_power_of_2(half))
    seg = a["segsum"]
    args = (a["q"], a["k"], a["v"], a["dout"], a["z"], a["q_bias"], a["k_bias"], a["mimo_v"],
            a["mimo_o"], a["mimo_z"], a["d"], a["angles"], a["da_cs"], a["da_cs_rev"], a["dt"],
            a["trap"], seg, out["entry"], out["blk_decay"], out["states"], out["qk_dot"],
            out["dz"], out["part_o"], out["part_z"], m["S"], m["S_pad"], m["nc"], n_blk,
            cfg["K"], 0, H, H // m["G"], *a["q"].stride(), *a["k"].stride(), *a["v"].stride(),
            *a["angles"].stride(), seg.stride(0), seg.stride(1), seg.stride(2), m["R"], N, P,
            m["C"], m["TP"], m["RP"], half, hp, m["RD"], cfg["BP"])
    flags = (m["HAS_Z"], m["HAS_D"], m["PREC"], m["EXACT"])
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    n_pb = triton.cdiv(P, cfg["BP"])
    if warmup:
        return [block_scan_kernel.warmup(*args, output, *flags, grid=(B * H, n_blk, n_pb), **opts)
                for output in (False, True)]
    if n_blk > 1:
        block_scan_kernel[(B * H, n_blk - 1, n_pb)](*args, False, *flags, **opts)
    pass_states(out["entry"], out["blk_decay"], out["entry"], B * H, n_blk, n_blk, 1, N * P)
    block_scan_kernel[(B * H, n_blk, n_pb)](*args, True, *flags, **opts)
