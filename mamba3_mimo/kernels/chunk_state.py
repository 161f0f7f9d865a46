"""Production state pass: states[c] = the state entering chunk c, for every chunk.

Two kernels, as in mamba's ssd_chunk_state / ssd_state_passing: `chunk_increment_kernel` computes
every chunk's increment k_w^T psi_v in parallel over (b*h, chunk, N-pair block, P block), and
`state_passing_kernel` chains them, states[c] = states[c-1] exp(da_cs[end of c-1]) + inc[c-1],
a serial loop of multiply-adds over [BLOCK] slices whose loads do not depend on the state.
"""
import triton
import triton.language as tl

from . import cdiv, input_align
from .common import chunk_rows, dot, load_cos_sin, load_psi_v_steps, load_rotated
from .launcher import launch_kernel
from .step_terms import K_DECAY


@triton.jit(do_not_specialize=["S_pad", "plane", "nc", "skb", "svb"])
def chunk_increment_kernel(k, v, k_bias, mimo_v, terms, cos, sin, inc,
                           S_pad, plane, nc, H, HG, n_jb, skb, sks, skr, skg, skn, svb, svs, svh,
                           svp, R, N: tl.constexpr, P: tl.constexpr, C,
                           TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, RD: tl.constexpr,
                           BJ: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
                           BA: tl.constexpr):
    """inc[b, h, c + 1] = sum_{t in chunk c} k_w[t]^T psi_v[t] with
    k_w = rot(k + k_bias) * trap_scale * exp(da_cs_rev), for c < nc - 1. skb and svb come
    divided by BA (kernels.input_align)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    j0 = (tl.program_id(2) % n_jb) * BJ
    p = (tl.program_id(2) // n_jb) * BP + tl.arange(0, BP)
    b, h = bh // H, bh % H
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    tg = c * C + t
    pm = p < P
    row = bh * S_pad
    cs, sn = load_cos_sin(cos + row * RD, sin + row * RD, tg * RD, rows, j0, BJ, RD)
    k1, k2 = load_rotated(k + b * (skb * BA) + (h // HG) * skg, tg * sks + r * skr, rows,
                          k_bias + h * R * N, r * N, cs, sn, j0, BJ, HALF, skn, True)
    w = tl.load(terms + K_DECAY * plane + row + tg, mask=rows, other=0.0)[:, None]
    tt = tl.arange(0, TP)
    psi_v = load_psi_v_steps(v + b * (svb * BA) + h * svh, (c * C + tt) * svs, tt < C,
                             mimo_v + h * R * P, R, p, pm, P, svp, RP)
    # psi_v^T (k_w) rather than k_w^T psi_v: k_w, built by elementwise ops, is then the B
    # operand, which always goes through shared memory; as the transposed A operand Triton
    # moved its whole computation into the dot-operand layout (255 registers and spills).
    psi_t = tl.trans(psi_v)
    j = j0 + tl.arange(0, BJ)
    off = (bh * nc + c + 1) * N * P + j[None, :] * P + p[:, None]
    m = (j < HALF)[None, :] & pm[:, None]
    tl.store(inc + off, dot(psi_t, k1 * w, PREC), mask=m)
    tl.store(inc + off + HALF * P, dot(psi_t, k2 * w, PREC), mask=m)


@triton.jit(do_not_specialize=["S_pad", "nc"])
def state_passing_kernel(inc, da_cs, states, S_pad, nc, C, U, NP_SIZE: tl.constexpr,
                         BLOCK: tl.constexpr, KEEP_FP32: tl.constexpr):
    """states[c] = states[c-1] * exp(da_cs[c*C - 1]) + inc[c], states[0] = 0, on [BLOCK] slices.

    inc may alias states (fp32 outputs): each slice is read before it is overwritten. With
    KEEP_FP32 (narrower outputs that chunk_output may not read, dispatch.out_states_suffice) the
    fp32 state also replaces inc[c] for the chunks that start a chunk_output tile (c % U == 0),
    the only ones it reads, at full precision."""
    bh = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < NP_SIZE
    base = bh * nc * NP_SIZE + e
    running = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(states + base, running.to(states.dtype.element_ty), mask=m)
    if KEEP_FP32:
        tl.store(inc + base, running, mask=m)
    for c in range(1, nc):
        x = tl.load(inc + base + c * NP_SIZE, mask=m, other=0.0)
        decay = tl.exp(tl.load(da_cs + bh * S_pad + c * C - 1))
        running = running * decay + x
        tl.store(states + base + c * NP_SIZE, running.to(states.dtype.element_ty), mask=m)
        if KEEP_FP32:
            tl.store(inc + base + c * NP_SIZE, running, mask=m & (c % U == 0))


def launch(a: dict, out: dict, meta: dict, cfg: dict, warmup: bool = False):
    """Write out["states"] through the fp32 increments out["inc"] (may be out["states"]); after
    it, out["inc"] holds the fp32 states of the chunks that start an output tile, unless
    meta["OUT_STATES"] says that chunk_output reads out["states"].

    cfg: BJ, BP, num_warps for the increments; BLOCK for the state passing.
    """
    m = meta
    B, H, N, P = m["B"], m["H"], m["N"], m["P"]
    half = N // 2
    n_jb = cdiv(half, cfg["BJ"])
    grid = (B * H, max(m["nc"] - 1, 0), n_jb * cdiv(P, cfg["BP"]))
    ks, vs = a["k"].stride(), a["v"].stride()
    BA = input_align(m["ALIGN"], a["k"], a["v"])
    args = (a["k"], a["v"], a["k_bias"], a["mimo_v"], out["terms"], out["cos"], out["sin"],
            out["inc"], m["S_pad"], B * H * m["S_pad"], m["nc"], H, H // m["G"], n_jb,
            ks[0] // BA, *ks[1:], vs[0] // BA, *vs[1:], m["R"], N, P, m["C"], m["TP"], m["RP"],
            half, m["RD"], cfg["BJ"], cfg["BP"], m["PREC"], BA)
    if warmup:
        return chunk_increment_kernel.warmup(*args, grid=grid, num_warps=cfg["num_warps"])
    if grid[1] > 0:
        launch_kernel(chunk_increment_kernel, grid, args, num_warps=cfg["num_warps"])
    pgrid = (B * H, cdiv(N * P, cfg["BLOCK"]))
    launch_kernel(state_passing_kernel, pgrid,
                  (out["inc"], a["da_cs"], out["states"], m["S_pad"], m["nc"], m["C"], m["U"],
                   N * P, cfg["BLOCK"], out["inc"] is not out["states"] and not m["OUT_STATES"]),
                  num_warps=4)
