"""Production state pass: states[c] = the state entering chunk c, for every chunk.

Two forms. "chunked", as in mamba's ssd_chunk_state / ssd_state_passing: `chunk_increment_kernel`
computes every chunk's increment k_w^T psi_v in parallel over (b*h, chunk, N-pair block,
P block), and `state_passing_kernel` chains them, states[c] = states[c-1] exp(da_cs[end of c-1])
+ inc[c-1], a serial loop of multiply-adds over [BLOCK] slices. "scan": `state_scan_kernel`
computes the increments inside that serial loop, so they never go through memory.
"""
import triton
import triton.language as tl

from .common import chunk_rows, dot, load_cos_sin, load_psi_v, load_rotated
from .step_terms import K_DECAY


@triton.jit
def _increment(k, v, k_bias, mimo_v, terms, cos, sin, b, h, row, c, t, r, rows, j0, p, pm, plane,
               HG, sks, skr, skn, skb, skg, svb, svs, svh, svp, R, N: tl.constexpr,
               P: tl.constexpr, C, HALF: tl.constexpr, RD: tl.constexpr, BJ: tl.constexpr,
               PREC: tl.constexpr):
    """Chunk c's increment sum_t k_w[t]^T psi_v[t], k_w = rot(k + k_bias) * trap_scale *
    exp(da_cs_rev), for state rows j0..j0+BJ and HALF+j0..: two transposed [BP, BJ] tiles.

    Computed as psi_v^T k_w: k_w, built by elementwise ops, is then the B operand, which always
    goes through shared memory; as the transposed A operand Triton moved its whole computation
    into the dot-operand layout (255 registers and spills)."""
    tg = c * C + t
    cs, sn = load_cos_sin(cos + row * RD, sin + row * RD, tg * RD, rows, j0, BJ, RD)
    k1, k2 = load_rotated(k + b * skb + (h // HG) * skg, tg * sks + r * skr, rows,
                          k_bias + h * R * N, r * N, cs, sn, j0, BJ, HALF, skn, True)
    w = tl.load(terms + K_DECAY * plane + row + tg, mask=rows, other=0.0)[:, None]
    psi_t = tl.trans(load_psi_v(v + b * svb + h * svh, tg * svs, rows, mimo_v + h * R * P, r, R,
                                p, pm, P, svp))
    return dot(psi_t, k1 * w, PREC), dot(psi_t, k2 * w, PREC)


@triton.jit(do_not_specialize=["S_pad", "plane", "nc", "skb", "svb"])
def chunk_increment_kernel(k, v, k_bias, mimo_v, terms, cos, sin, inc,
                           S_pad, plane, nc, H, HG, n_jb, skb, sks, skr, skg, skn, svb, svs, svh,
                           svp, R, N: tl.constexpr, P: tl.constexpr, C, TP: tl.constexpr,
                           RP: tl.constexpr, HALF: tl.constexpr, RD: tl.constexpr,
                           BJ: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    """inc[b, h, c + 1] = the increment of chunk c, for c < nc - 1 (grid over chunks)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    j0 = (tl.program_id(2) % n_jb) * BJ
    p = (tl.program_id(2) // n_jb) * BP + tl.arange(0, BP)
    b, h = bh // H, bh % H
    t, r = chunk_rows(TP, RP)
    pm = p < P
    inc1, inc2 = _increment(k, v, k_bias, mimo_v, terms, cos, sin, b, h, bh * S_pad, c, t, r,
                            (t < C) & (r < R), j0, p, pm, plane, HG, sks, skr, skn, skb, skg,
                            svb, svs, svh, svp, R, N, P, C, HALF, RD, BJ, PREC)
    j = j0 + tl.arange(0, BJ)
    off = (bh * nc + c + 1) * N * P + j[None, :] * P + p[:, None]
    m = (j < HALF)[None, :] & pm[:, None]
    tl.store(inc + off, inc1, mask=m)
    tl.store(inc + off + HALF * P, inc2, mask=m)


@triton.jit(do_not_specialize=["S_pad", "plane", "nc", "skb", "svb"])
def state_scan_kernel(k, v, k_bias, mimo_v, terms, cos, sin, da_cs, states, states32,
                      S_pad, plane, nc, H, HG, n_jb, skb, sks, skr, skg, skn, svb, svs, svh,
                      svp, R, N: tl.constexpr, P: tl.constexpr, C, TP: tl.constexpr,
                      RP: tl.constexpr, HALF: tl.constexpr, RD: tl.constexpr, BJ: tl.constexpr,
                      BP: tl.constexpr, PREC: tl.constexpr, KEEP_FP32: tl.constexpr):
    """states[b, h, c] for every chunk in one pass: walk the chunks in order, adding each
    chunk's increment (computed here) to the decayed running state, held in registers.

    Nothing loaded in the loop depends on the running state, so the loads of the next chunks
    can be in flight during this chunk's work (num_stages). With KEEP_FP32 the fp32 state is also
    written to states32, for chunk_output."""
    bh = tl.program_id(0).to(tl.int64)
    j0 = (tl.program_id(1) % n_jb) * BJ
    p = (tl.program_id(1) // n_jb) * BP + tl.arange(0, BP)
    b, h = bh // H, bh % H
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    pm = p < P
    row = bh * S_pad
    j = j0 + tl.arange(0, BJ)
    off = bh * nc * N * P + j[None, :] * P + p[:, None]
    m = (j < HALF)[None, :] & pm[:, None]
    run1 = tl.zeros([BP, BJ], dtype=tl.float32)
    run2 = tl.zeros([BP, BJ], dtype=tl.float32)
    _store_state(states, states32, off, m, run1, run2, HALF * P, KEEP_FP32)
    for c in range(1, nc):
        inc1, inc2 = _increment(k, v, k_bias, mimo_v, terms, cos, sin, b, h, row, c - 1, t, r,
                                rows, j0, p, pm, plane, HG, sks, skr, skn, skb, skg, svb, svs,
                                svh, svp, R, N, P, C, HALF, RD, BJ, PREC)
        decay = tl.exp(tl.load(da_cs + row + c * C - 1))
        run1 = run1 * decay + inc1
        run2 = run2 * decay + inc2
        _store_state(states, states32, off + c * N * P, m, run1, run2, HALF * P, KEEP_FP32)


@triton.jit
def _store_state(states, states32, off, m, run1, run2, half_off, KEEP_FP32: tl.constexpr):
    """Store the two [BP, BJ] halves of a state (and their fp32 copy with KEEP_FP32)."""
    tl.store(states + off, run1.to(states.dtype.element_ty), mask=m)
    tl.store(states + off + half_off, run2.to(states.dtype.element_ty), mask=m)
    if KEEP_FP32:
        tl.store(states32 + off, run1, mask=m)
        tl.store(states32 + off + half_off, run2, mask=m)


@triton.jit(do_not_specialize=["S_pad", "nc"])
def state_passing_kernel(inc, da_cs, states, S_pad, nc, C, NP_SIZE: tl.constexpr,
                         BLOCK: tl.constexpr, KEEP_FP32: tl.constexpr):
    """states[c] = states[c-1] * exp(da_cs[c*C - 1]) + inc[c], states[0] = 0, on [BLOCK] slices.

    inc may alias states (fp32 outputs): each slice is read before it is overwritten. With
    KEEP_FP32 (narrower outputs) the fp32 state also replaces inc[c], so that chunk_output reads
    the state at full precision."""
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
            tl.store(inc + base + c * NP_SIZE, running, mask=m)


def launch(a: dict, out: dict, meta: dict, cfg: dict, warmup: bool = False):
    """Write out["states"] and leave the fp32 states in out["inc"] (which may be out["states"]).

    cfg["SCAN"] False: chunk_increment_kernel writes the fp32 increments into out["inc"], then
    state_passing_kernel chains them (BJ, BP, num_warps; BLOCK). True: state_scan_kernel walks
    the chunks once per (b*h, BJ-pair block, BP block) (BJ, BP, num_warps, num_stages).
    """
    m = meta
    B, H, N, P = m["B"], m["H"], m["N"], m["P"]
    half = N // 2
    n_jb = triton.cdiv(half, cfg["BJ"])
    n_blocks = n_jb * triton.cdiv(P, cfg["BP"])
    keep_fp32 = out["inc"].data_ptr() != out["states"].data_ptr()
    common = (a["k"], a["v"], a["k_bias"], a["mimo_v"], out["terms"], out["cos"], out["sin"])
    shape = (m["S_pad"], B * H * m["S_pad"], m["nc"], H, H // m["G"], n_jb, *a["k"].stride(),
             *a["v"].stride(), m["R"], N, P, m["C"], m["TP"], m["RP"], half, m["RD"], cfg["BJ"],
             cfg["BP"], m["PREC"])
    if cfg["SCAN"]:
        grid = (B * H, n_blocks)
        args = (*common, a["da_cs"], out["states"], out["inc"], *shape, keep_fp32)
        kernel = state_scan_kernel.warmup if warmup else state_scan_kernel[grid]
        return kernel(*args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                      **({"grid": grid} if warmup else {}))
    grid = (B * H, max(m["nc"] - 1, 0), n_blocks)
    args = (*common, out["inc"], *shape)
    if warmup:
        return chunk_increment_kernel.warmup(*args, grid=grid, num_warps=cfg["num_warps"])
    if grid[1] > 0:
        chunk_increment_kernel[grid](*args, num_warps=cfg["num_warps"])
    pgrid = (B * H, triton.cdiv(N * P, cfg["BLOCK"]))
    state_passing_kernel[pgrid](out["inc"], a["da_cs"], out["states"], m["S_pad"], m["nc"],
                                m["C"], N * P, cfg["BLOCK"], keep_fp32, num_warps=4)
