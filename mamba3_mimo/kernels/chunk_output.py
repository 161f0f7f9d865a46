"""Production output pass: raw_y of every tile of U consecutive chunks in parallel, then qk_dot,
dz and the per-rank partial sums of dmimo_o / dmimo_z.

Grid (B*H, tiles, P blocks). For each tile: scores = Qr Kr^T and inter = Qr states[first chunk]
accumulate over N-pair blocks, then raw_y = (scores * causal weights) psi_v + exp(decay since
the tile's start) inter + D psi_v. A tile of U > 1 chunks is the chunked form with chunk U*C:
the same sums, with the state read once per tile; the dispatcher picks U so that a tile has
about 64 (step, rank) rows.

inter and raw_y are computed transposed ([BP, rows]): tf32 wgmma reads shared-memory operands
only K-major, and the state and psi_v tiles arrive P-contiguous, so as B operands they were
copied into shared memory transposed, with 8-way bank conflicts. As A operands they go to the
dot from registers instead (docs/optimisation.md, step 19).
"""
import triton
import triton.language as tl

from . import cdiv, input_align, next_pow2
from .common import (chunk_rows, dot, mac, gate_epilogue_steps, load_cos_sin, load_psi_v_steps,
                     load_rotated, opaque, prefetch, prefetch_steps, store_qk_dot,
                     store_rank_sums, tile_weights)
from .launcher import Launch
from .step_terms import GAMMA, K_DECAY, LOG_K, LOG_Q, Q_DECAY, TRAP_SCALE


@triton.jit
def _pair_block(scores, inter, q_ptr, q_off, k_ptr, k_off, cos_ptr, sin_ptr, cs_off, rows,
                qb_ptr, kb_ptr, bias_off, st, p, pm, j0, HALF, RD, sqn, skn, P, BJ: tl.constexpr,
                ROTATE: tl.constexpr, PREC: tl.constexpr, OPAQUE: tl.constexpr,
                SCORES: tl.constexpr):
    """scores += Qr Kr^T (SCORES) and inter^T += states^T Qr^T over the pair columns
    j0..j0+BJ; pm says which state columns to load."""
    cos, sin = 0.0, 0.0
    if ROTATE:
        cos, sin = load_cos_sin(cos_ptr, sin_ptr, cs_off, rows, j0, BJ, RD)
    q1, q2 = load_rotated(q_ptr, q_off, rows, qb_ptr, bias_off, cos, sin, j0, BJ, HALF, sqn,
                          ROTATE)
    # rotate, then convert once: otherwise Triton moves the conversion to the dot's register
    # layout back onto each of the six loads (q, bias, cos, sin)
    q1, q2 = opaque(q1, OPAQUE), opaque(q2, OPAQUE)
    if SCORES:
        k1, k2 = load_rotated(k_ptr, k_off, rows, kb_ptr, bias_off, cos, sin, j0, BJ, HALF, skn,
                              ROTATE)
        scores = mac(mac(scores, q1, tl.trans(k1), PREC), q2, tl.trans(k2), PREC)
    j = j0 + tl.arange(0, BJ)
    sm = (j < HALF)[:, None] & pm[None, :]
    s_off = j[:, None] * P + p[None, :]
    st1 = tl.load(st + s_off, mask=sm, other=0.0).to(tl.float32)
    st2 = tl.load(st + HALF * P + s_off, mask=sm, other=0.0).to(tl.float32)
    # not straight from a load, the state tiles are A operands in registers, not in shared memory
    st1, st2 = opaque(st1, OPAQUE), opaque(st2, OPAQUE)
    inter = mac(mac(inter, tl.trans(st1), tl.trans(q1), PREC), tl.trans(st2), tl.trans(q2), PREC)
    return scores, inter


@triton.jit(do_not_specialize=["S", "S_pad", "plane", "nc", "n_tiles", "sqb", "skb", "svb",
                               "sgb", "sgh"])
def chunk_output_kernel(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms, cos,
                        sin, segsum, states, qk_dot, dz, part_o, part_z,
                        S, S_pad, plane, nc, n_tiles, H, HG, sqb, sqs, sqr, sqg, sqn,
                        skb, sks, skr, skg, skn, svb, svs, svh, svp, sgb, sgh, sgc, R,
                        N: tl.constexpr, P: tl.constexpr, C,
                        TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr,
                        RD: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                        U: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
                        PREC: tl.constexpr, EXACT: tl.constexpr, OPAQUE: tl.constexpr,
                        BA: tl.constexpr, PREFETCH: tl.constexpr, PB: tl.constexpr):
    """Tile o of one (b, h) and PB consecutive P blocks: chunks o*U .. o*U + U - 1 (those < nc),
    TP >= U*C steps. The scores are computed once for the PB blocks. sqb, skb, svb, sgb, sgh
    come divided by BA (kernels.input_align)."""
    bh = tl.program_id(0).to(tl.int64)
    # the last tiles first: the state pass wrote their states last, so those are the ones
    # still in L2 when this kernel starts (docs/optimisation.md, step 53)
    o = (n_tiles - 1 - tl.program_id(1)).to(tl.int64)
    pid_p = tl.program_id(2)
    b, h = bh // H, bh % H
    g = h // HG
    t, r = chunk_rows(TP, RP)
    tt = tl.arange(0, TP)
    t0 = o * U * C  # the tile's first step
    steps = tl.minimum(U * C, S_pad - t0)  # steps of the tile that exist
    rows = (t < steps) & (r < R)
    tg = t0 + t
    p0 = pid_p * PB * BP  # the program's first column
    p = p0 + tl.arange(0, BP)  # the columns of its first block
    pm = p < P
    row = bh * S_pad
    st = states + (bh * nc + o * U) * N * P
    qx, q_off = q + b * (sqb * BA) + g * sqg, tg * sqs + r * sqr
    kx, k_off = k + b * (skb * BA) + g * skg, tg * sks + r * skr
    vh = b * (svb * BA) + h * svh  # the (b, h) slice of v, dout and z
    # The inputs of the weights, psi_v and the epilogue are read only after the dots: asked for
    # now, their misses overlap the pair blocks' loads and dots (docs/optimisation.md, step 46).
    ts_ok = tt < steps
    seg = segsum + b * (sgb * BA) + h * (sgh * BA) + o * U * sgc
    prefetch(seg, tt * C, ts_ok, PREFETCH)
    for kind in tl.static_range(GAMMA, LOG_K + 1):
        if kind != K_DECAY and (U > 1 or kind < LOG_Q):
            prefetch(terms + kind * plane + row + t0, tt, ts_ok, PREFETCH)
    out_ok = ts_ok & (t0 + tt < S)  # steps with a dout, z and dz row
    for pp in tl.static_range(PB):
        blk_ok = p0 + pp * BP < P
        prefetch_steps(v + vh, (t0 + tt) * svs, ts_ok & blk_ok, p0 + pp * BP, svp, BP, PREFETCH)
        prefetch_steps(dout + vh, (t0 + tt) * svs, out_ok & blk_ok, p0 + pp * BP, svp, BP,
                       PREFETCH)
        if HAS_Z:
            prefetch_steps(z + vh, (t0 + tt) * svs, out_ok & blk_ok, p0 + pp * BP, svp, BP,
                           PREFETCH)
    scores = tl.zeros([TP * RP, TP * RP], dtype=tl.float32)
    for pp in tl.static_range(PB):
        if pp > 0:
            p += BP
            pm = p < P
        inter = tl.zeros([BP, TP * RP], dtype=tl.float32)  # transposed
        # Unrolled: the loads of every pair block are issued together, so the program waits
        # for memory about once instead of once per block (docs/optimisation.md, step 3). The
        # scores come with the first P block; later ones read q again, not k.
        for j0 in tl.static_range(0, HALF, BJ):
            scores, inter = _pair_block(scores, inter, qx, q_off, kx, k_off, cos + row * RD,
                                        sin + row * RD, tg * RD, rows, q_bias + h * R * N,
                                        k_bias + h * R * N, r * N, st, p, pm, j0, HALF, RD,
                                        sqn, skn, P, BJ, j0 < RD, PREC, OPAQUE, pp == 0)
        if pp == 0:
            store_qk_dot(qk_dot + (bh * S + t0) * R * R, scores, t, r,
                         rows & (tg < S) & (pid_p == 0), R, RP, TP * RP, EXACT, True)
            gamma = tl.load(terms + GAMMA * plane + row + t0 + tt, mask=ts_ok, other=0.0)
            trap_scale = tl.load(terms + TRAP_SCALE * plane + row + t0 + tt, mask=ts_ok,
                                 other=0.0)
            log_q, log_k = 0.0, 0.0
            if U > 1:
                log_q = tl.load(terms + LOG_Q * plane + row + t0 + tt, mask=ts_ok, other=0.0)
                log_k = tl.load(terms + LOG_K * plane + row + t0 + tt, mask=ts_ok, other=0.0)
            w = tile_weights(seg, log_q, log_k, tt, ts_ok, C, gamma, trap_scale, RP, U)
            # The order of these statements (the columns before the loop, the weighted scores
            # before the psi_v loads, q_decay after them) is, of those tried, the one that spills
            # least at 128 registers (docs/optimisation.md, steps 61 and 63).
            sw_t = tl.trans(scores * w)
        psi_v = load_psi_v_steps(v + vh, (t0 + tt) * svs, ts_ok,
                                 mimo_v + h * R * P, R, p, pm, P, svp, RP)
        if pp == 0:
            q_decay = tl.load(terms + Q_DECAY * plane + row + tg, mask=rows, other=0.0)
        psi_t = tl.trans(psi_v)
        raw_t = dot(psi_t, sw_t, PREC) + q_decay[None, :] * inter
        if HAS_D:
            raw_t += tl.load(d + h) * psi_t
        # [BP, TP * RP] -> [TP, RP, BP]: a relabelling of the dot's layout, no data movement
        raw = tl.permute(tl.reshape(raw_t, (BP, TP, RP)), (1, 2, 0))
        sum_o, sum_z = gate_epilogue_steps(raw, dout + vh, z + vh,
                                           (t0 + tt) * svs, out_ok,
                                           mimo_o + h * R * P, mimo_z + h * R * P, R, p, pm, P,
                                           svp, dz + (b * S * H + h) * P, (t0 + tt) * H * P,
                                           HAS_Z, 2 if OPAQUE else 1)  # the sigmoid: inline asm
        part = (bh * n_tiles + o) * R * P
        store_rank_sums(part_o + part, part_z + part, sum_o, sum_z, R, p, pm, P, RP, HAS_Z)


@triton.jit(do_not_specialize=["n_bh", "n_tiles", "s_part"])
def rank_sums_kernel(parts, sums, n_bh, n_tiles, s_part, RP_SIZE: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """sums[i] = the sum over tiles of parts[i // n_bh, i % n_bh, tile], [RP_SIZE] = R*P per
    (partial sum, b*h) row i: the dmimo_o / dmimo_z of one (b, h) from chunk_output's per-tile
    sums. ROWS tiles are loaded at once and reduced, then added in tile order: a fixed order, so
    the result is the same on every run. parts: [n_sums, B*H, n_tiles, R*P] with stride s_part
    between its n_sums blocks; sums: [n_sums * B*H, R*P], contiguous."""
    i = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = col < RP_SIZE
    src = parts + (i // n_bh) * s_part + (i % n_bh) * n_tiles * RP_SIZE
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t0 in range(0, n_tiles, ROWS):
        t = t0 + tl.arange(0, ROWS)
        x = tl.load(src + t[:, None] * RP_SIZE + col[None, :],
                    mask=(t < n_tiles)[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(x, axis=0)
    tl.store(sums + i * RP_SIZE + col, acc, mask=cm)


def launches(a: dict, out: dict, meta: dict, cfg: dict) -> list:
    """The launch that writes qk_dot, dz and the dmimo partial sums, reading chunk_state's
    states (the `states` output with meta["OUT_STATES"], else the fp32 copy in out["inc"]) and
    step_terms' out["terms"], out["cos"], out["sin"]; cfg holds BJ, BP, PB (P blocks per
    program), num_warps, num_stages, maxnreg; meta["U"] the chunks per tile, meta["TPO"] its
    padded steps.

    out["part_o"], out["part_z"]: [B*H, n_tiles, R, P] fp32 scratch, n_tiles = cdiv(nc, U),
    views of out["parts"] ([n_sums, B, H, n_tiles, R, P]); then the launch that reduces them over
    the tiles into out["dmimo"] ([n_sums, B, H, R, P] fp32: dmimo_o, and dmimo_z with Z).
    """
    m = meta
    B, H = m["B"], m["H"]
    n_tiles = cdiv(m["nc"], m["U"])
    grid = (B * H, n_tiles, cdiv(m["P"], cfg["BP"] * cfg["PB"]))
    seg = a["segsum"]
    qs, ks, vs, gs = a["q"].stride(), a["k"].stride(), a["v"].stride(), seg.stride()
    BA = input_align(m["ALIGN"], a["q"], a["k"], a["v"], seg)
    args = (
        a["q"], a["k"], a["v"], a["dout"], a["z"], a["q_bias"], a["k_bias"], a["mimo_v"],
        a["mimo_o"], a["mimo_z"], a["d"], out["terms"], out["cos"], out["sin"], seg,
        out["states"] if m["OUT_STATES"] else out["inc"], out["qk_dot"], out["dz"], out["part_o"],
        out["part_z"],
        m["S"], m["S_pad"], B * H * m["S_pad"], m["nc"], n_tiles, H, H // m["G"],
        qs[0] // BA, *qs[1:], ks[0] // BA, *ks[1:], vs[0] // BA, *vs[1:], gs[0] // BA,
        gs[1] // BA, gs[2], m["R"], m["N"], m["P"], m["C"], m["TPO"], m["RP"], m["N"] // 2,
        m["RD"], cfg["BJ"], cfg["BP"], m["U"], m["HAS_Z"], m["HAS_D"], m["PREC"], m["EXACT"],
        m["OPAQUE"], BA, m["PREFETCH"], cfg["PB"])
    parts, sums, RP = out["parts"], out["dmimo"], m["R"] * m["P"]
    BLOCK = min(128, next_pow2(RP))
    return [Launch(chunk_output_kernel, grid, args, dict(
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"])),
            Launch(rank_sums_kernel, (parts.shape[0] * B * H, cdiv(RP, BLOCK)),
                   (parts, sums, B * H, n_tiles, parts.stride(0), RP, BLOCK, 32),
                   dict(num_warps=4))]
