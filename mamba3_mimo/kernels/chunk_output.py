"""Production output pass: raw_y of every tile of U consecutive chunks in parallel, then qk_dot,
dz and the per-rank partial sums of dmimo_o / dmimo_z (bwd_fwd). The whole operator runs the
same tiles in two more modes: its output (FORWARD), and its output stage's gradients (GRAD;
phase 2 recomputes d raw_y from dout and z where it reads it).

Grid (B*H * tiles, P blocks). For each tile: scores = Qr Kr^T and inter = Qr states[first chunk]
accumulate over N-pair blocks, then raw_y = (scores * causal weights) psi_v + exp(decay since
the tile's start) inter + D psi_v. A tile of U > 1 chunks is the chunked form with chunk U*C:
the same sums, with the state read once per tile; configs.tile_chunks picks U so that a tile has
about 64 (step, rank) rows.

inter and raw_y are computed transposed ([BP, rows]): tf32 wgmma reads shared-memory operands
only K-major, and the state and psi_v tiles arrive P-contiguous, so as B operands they were
copied into shared memory transposed, with 8-way bank conflicts. As A operands they go to the
dot from registers instead.

Non-finite inputs. The tile's dots multiply every step's k and v by the causal weights, zero
for later steps, and 0 * NaN is NaN: a NaN or Inf in k or v at step t' would reach the outputs
of the tile's earlier steps. Each program flags its tile when its dmimo_o partial sums, which
any non-finite value of the tile reaches, are not all finite; a second launch of the kernel
(CAREFUL), a few programs that each read a block of flags, recomputes only the flagged tiles,
with the later steps masked out; a non-finite v poisons its column from its step on. Outputs
of a step then depend only on that step and earlier ones (docs/api.md, "NaN and Inf"). The
rerun is a separate launch so that the fast path's code and registers stay as they are:
compiled into one kernel, the rerun's code made the fast path spill.
"""
import torch
import triton
import triton.language as tl

from ..runtime.launcher import Launch
from . import cdiv, dependent_launch, input_align, next_pow2
from .common import (after_previous_kernel, chunk_rows, dot, gate_epilogue_steps,
                     gate_output_steps, load_cos_sin, load_mimo_v, load_rotated, load_v_steps,
                     mac, opaque, prefetch, prefetch_steps, psi_v_rows, store_qk_dot,
                     store_rank_sums, tile_weights)
from .step_terms import GAMMA, K_DECAY, LOG_K, LOG_Q, Q_DECAY, TRAP_SCALE

# What a tile writes (chunk_output_kernel's MODE): bwd_fwd's outputs, the whole operator's
# output, or the gradients of its output stage
BWD_FWD = tl.constexpr(0)
FORWARD = tl.constexpr(1)
GRAD = tl.constexpr(2)


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


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _tile(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms, cos, sin, segsum,
          states, qk_dot, dz, part_o, part_z, out, flag, n_prog, bh, o, pid_p, S, S_pad,
          plane, nc,
          n_tiles, H, HG, sqb, sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp,
          sgb, sgh, sgc, R,
          N: tl.constexpr, P: tl.constexpr, C, TP: tl.constexpr, RP: tl.constexpr,
          HALF: tl.constexpr, RD: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
          U: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
          EXACT: tl.constexpr, OPAQUE: tl.constexpr, BA: tl.constexpr, PREFETCH: tl.constexpr,
          PB: tl.constexpr, CAREFUL: tl.constexpr, MODE: tl.constexpr):
    """Tile o of head bh and PB consecutive P blocks from block pid_p: chunks o*U .. o*U + U - 1
    (those < nc), TP >= U*C steps; the scores are computed once for the PB blocks. CAREFUL (the
    rerun of a tile that met a non-finite value): the causal mask is applied to the weighted
    scores rather than through zero weights, non-finite v is zeroed in the dot and its column
    poisoned from its step on, and qk_dot is not stored again. Otherwise the flag of P block pp,
    at flag + pp * n_prog and cleared by the caller, is set where a dmimo_o partial sum of the
    block is not finite (BWD_FWD). MODE: what the tile writes (BWD_FWD, FORWARD or GRAD, see
    chunk_output_kernel)."""
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
    plane = tl.cast(plane, tl.int64)  # six planes of B*H*S_pad steps can pass 2**31
    st = states + (bh * nc + o * U) * N * P
    # batch strides come divided by BA; (b * stride) first, so that the product is 64-bit
    qx, q_off = q + b * sqb * BA + g * sqg, tg * sqs + r * sqr
    kx, k_off = k + b * skb * BA + g * skg, tg * sks + r * skr
    vh = b * svb * BA + h * svh  # the (b, h) slice of v, dout and z
    # The inputs of the weights, psi_v and the epilogue are read only after the dots: asked for
    # now, their misses overlap the pair blocks' loads and dots.
    ts_ok = tt < steps
    seg = segsum + b * sgb * BA + h * sgh * BA + o * U * sgc
    prefetch(seg, tt * C, ts_ok, PREFETCH)
    for kind in tl.static_range(GAMMA, LOG_K + 1):
        if kind != K_DECAY and (U > 1 or kind < LOG_Q):
            prefetch(terms + kind * plane + row + t0, tt, ts_ok, PREFETCH)
    out_ok = ts_ok & (t0 + tt < S)  # steps with a dout, z and dz row
    for pp in tl.static_range(PB):
        blk_ok = p0 + pp * BP < P
        prefetch_steps(v + vh, (t0 + tt) * svs, ts_ok & blk_ok, p0 + pp * BP, svp, BP, PREFETCH)
        if MODE != FORWARD:
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
        # for memory about once instead of once per block. The scores come with the first P
        # block; later ones read q again, not k.
        for j0 in tl.static_range(0, HALF, BJ):
            scores, inter = _pair_block(scores, inter, qx, q_off, kx, k_off, cos + row * RD,
                                        sin + row * RD, tg * RD, rows, q_bias + h * R * N,
                                        k_bias + h * R * N, r * N, st, p, pm, j0, HALF, RD,
                                        sqn, skn, P, BJ, j0 < RD, PREC, OPAQUE, pp == 0)
        if pp == 0:
            if not CAREFUL and MODE == BWD_FWD:
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
            # least at 128 registers.
            if CAREFUL:
                sw_t = tl.trans(tl.where(t[None, :] <= t[:, None], scores * w, 0.0))
            else:
                sw_t = tl.trans(scores * w)
        x = load_v_steps(v + vh, (t0 + tt) * svs, ts_ok, p, pm, svp)
        if CAREFUL:
            x_bad = ~_finite(x.to(tl.float32))
            x = tl.where(x_bad, 0.0, x.to(tl.float32))
            # a column's outputs are poisoned from the step of its first non-finite v on
            poison = tl.cumsum(x_bad.to(tl.int32), axis=0) > 0
        psi_v = psi_v_rows(x, load_mimo_v(mimo_v + h * R * P, R, p, pm, P, RP))
        if pp == 0:
            q_decay = tl.load(terms + Q_DECAY * plane + row + tg, mask=rows, other=0.0)
        psi_t = tl.trans(psi_v)
        raw_t = dot(psi_t, sw_t, PREC) + q_decay[None, :] * inter
        if HAS_D:
            raw_t += tl.load(d + h) * psi_t
        # [BP, TP * RP] -> [TP, RP, BP]: a relabelling of the dot's layout, no data movement
        raw = tl.permute(tl.reshape(raw_t, (BP, TP, RP)), (1, 2, 0))
        if CAREFUL:
            raw = tl.where(poison[:, None, :], float("nan"), raw)
        # dz and out [B, S, H, P], contiguous: the head's slice at the tile's steps, as a base and
        # offsets per step. 32-bit offsets from the tile's first step spill least in bwd_fwd and
        # the forward, 64-bit ones from step 0 in GRAD (offline sm_90: the stack of either form
        # in the other mode is larger)
        if MODE == GRAD:
            t_base = h * P
            t_rows = (b * S + t0 + tt) * H * P
        else:
            t_base = (b * S + t0) * H * P + h * P
            t_rows = tt * (H * P)
        if MODE == FORWARD:
            gate_output_steps(raw, z + vh, (t0 + tt) * svs, out_ok, mimo_o + h * R * P,
                              mimo_z + h * R * P, R, p, pm, P, svp, out + t_base, t_rows, HAS_Z,
                              2 if OPAQUE else 1)
        else:
            sum_o, sum_z = gate_epilogue_steps(
                raw, dout + vh, z + vh, (t0 + tt) * svs, out_ok, mimo_o + h * R * P,
                mimo_z + h * R * P, R, p, pm, P, svp, dz + t_base, t_rows, HAS_Z,
                2 if OPAQUE else 1)  # the sigmoid: inline asm
            part = (bh * n_tiles + o) * R * P
            # GRAD: added to the sums of the groups of batch entries before (common.store_or_add)
            store_rank_sums(part_o + part, part_z + part, sum_o, sum_z, R, p, pm, P, RP, HAS_Z,
                            MODE == GRAD)
            if not CAREFUL and MODE == BWD_FWD:
                # after the barrier, which orders it after the program's clearing of the flag;
                # any thread whose sum is not finite (0 * NaN or Inf is NaN) sets it
                tl.debug_barrier()
                tl.store(flag + pp * n_prog + tl.zeros([RP, BP], dtype=tl.int32), 1.0,
                         mask=(sum_o * 0.0) != 0.0)


@triton.jit
def _tile_of(pid, n_bh, n_tiles):
    """(b*h, tile) of the fast launch's program pid on grid axis 0: b*h fastest, the last tiles
    first (the state pass wrote their states last, so those are the ones still in L2 when the
    kernel starts)."""
    return pid % n_bh, n_tiles - 1 - pid // n_bh


@triton.jit(do_not_specialize=["S", "S_pad", "plane", "nc", "n_tiles", "n_bh", "n_prog", "sqb",
                               "skb", "svb", "sgb", "sgh"])
def chunk_output_kernel(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms, cos,
                        sin, segsum, states, qk_dot, dz, part_o, part_z, out, flags,
                        S, S_pad, plane, nc, n_tiles, n_bh, n_prog, H, HG, sqb, sqs, sqr, sqg,
                        sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp, sgb, sgh, sgc, R,
                        N: tl.constexpr, P: tl.constexpr, C,
                        TP: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr,
                        RD: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr,
                        U: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
                        PREC: tl.constexpr, EXACT: tl.constexpr, OPAQUE: tl.constexpr,
                        BA: tl.constexpr, PREFETCH: tl.constexpr, PB: tl.constexpr,
                        CAREFUL: tl.constexpr, FLAG_BLOCK: tl.constexpr, MODE: tl.constexpr,
                        PDL: tl.constexpr):
    """One tile of one (b, h) and PB P blocks (`_tile`), grid (B*H * tiles, P blocks) = n_prog
    programs. MODE: BWD_FWD (bwd_fwd's outputs: qk_dot, dz, the dmimo partial sums and the
    flags below), FORWARD (the whole operator's output `out` alone; dout, qk_dot, dz, part_o,
    part_z, flags unread) or GRAD (the operator's backward: dz and the partial sums; no qk_dot,
    no flags). flags [PB, n_prog]:
    flags[pp, pid_p * B*H * tiles + pid] is 1 where a dmimo_o partial sum of P block pp is not
    finite, else 0. CAREFUL: the rerun launch, grid
    (cdiv(n_prog, FLAG_BLOCK),), whose programs read the flags of FLAG_BLOCK programs each and
    rerun the flagged tiles (none, almost always). sqb, skb, svb, sgb, sgh come divided by BA
    (kernels.input_align)."""
    after_previous_kernel(PDL, START_NEXT=True)
    n_prog = n_prog.to(tl.int64)  # PB * n_prog flags can pass 2**31
    if CAREFUL:
        first = tl.program_id(0).to(tl.int64) * FLAG_BLOCK
        i = tl.arange(0, FLAG_BLOCK)
        flag = tl.zeros([FLAG_BLOCK], dtype=tl.float32)
        for pp in tl.static_range(PB):
            flag += tl.load(flags + pp * n_prog + first + i, mask=first + i < n_prog, other=0.0)
        if tl.sum(flag, axis=0) > 0:
            for j in range(FLAG_BLOCK):
                if tl.sum(tl.where(i == j, flag, 0.0), axis=0) > 0:
                    # program first + j of the fast launch: pid_p * B*H * tiles + pid
                    pid = (first + j) % (n_bh * n_tiles)
                    pid_p = (first + j) // (n_bh * n_tiles)
                    bh, o = _tile_of(pid, n_bh, n_tiles)
                    _tile(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms,
                          cos, sin, segsum, states, qk_dot, dz, part_o, part_z, out, flags,
                          n_prog,
                          bh, o, pid_p.to(tl.int32), S, S_pad, plane, nc, n_tiles, H, HG, sqb,
                          sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp, sgb,
                          sgh, sgc, R, N, P, C, TP, RP, HALF, RD, BJ, BP, U, HAS_Z, HAS_D, PREC,
                          EXACT, OPAQUE, BA, PREFETCH, PB, True, MODE)
    else:
        # (b*h, tile) flattened on grid axis 0: axis 1 would cap the tiles at 65,535. The
        # program ids are < 2**31: 32-bit division, then 64-bit offsets.
        pid, pid_p = tl.program_id(0), tl.program_id(1)
        bh, o = _tile_of(pid, n_bh, n_tiles)
        flag = flags + pid_p.to(tl.int64) * n_bh * n_tiles + pid
        # cleared here, set by the threads that meet a non-finite sum after a barrier (_tile):
        # a reduction of the sums to one flag made the fast path spill
        if MODE == BWD_FWD:
            for pp in tl.static_range(PB):
                tl.store(flag + pp * n_prog, 0.0)
        _tile(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms, cos, sin,
              segsum, states, qk_dot, dz, part_o, part_z, out, flag, n_prog, bh.to(tl.int64),
              o.to(tl.int64), pid_p, S, S_pad, plane, nc, n_tiles, H, HG, sqb, sqs, sqr, sqg,
              sqn, skb, sks, skr, skg, skn, svb, svs, svh, svp, sgb, sgh, sgc, R, N, P, C, TP,
              RP, HALF, RD, BJ, BP, U, HAS_Z, HAS_D, PREC, EXACT, OPAQUE, BA, PREFETCH, PB,
              False, MODE)


@triton.jit(do_not_specialize=["n_bh", "n_tiles", "s_part"])
def rank_sums_kernel(parts, sums, n_bh, n_tiles, s_part, RP_SIZE: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """sums[i] = the sum over tiles of parts[i // n_bh, i % n_bh, tile], [RP_SIZE] = R*P per
    (partial sum, b*h) row i: the dmimo_o / dmimo_z of one (b, h) from chunk_output's per-tile
    sums. ROWS tiles are loaded at once and reduced, then added in tile order: a fixed order, so
    the result is the same on every run. parts: [n_sums, B*H, n_tiles, R*P] with stride s_part
    between its n_sums blocks; sums: [n_sums * B*H, R*P], contiguous."""
    after_previous_kernel(PDL, START_NEXT=True)
    i = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = col < RP_SIZE
    src = parts + (i // n_bh) * s_part + (i % n_bh) * n_tiles * RP_SIZE
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.arange(0, ROWS)
    for t0 in range(0, n_tiles, ROWS):
        # tiles x R*P can pass 2**31: the pointer moves by ROWS tiles as a 64-bit scalar, the
        # offsets of the ROWS tiles stay 32-bit
        x = tl.load(src + t[:, None] * RP_SIZE + col[None, :],
                    mask=(t < n_tiles - t0)[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(x, axis=0)
        src += ROWS * RP_SIZE
    tl.store(sums + i * RP_SIZE + col, acc, mask=cm)


# flags that one program of the rerun launch reads: a few programs, one load each
FLAG_BLOCK = 1024


def program_count(consts, cfg) -> int:
    """The number of programs of chunk_output's fast launch in config cfg."""
    return consts.B * consts.H * cdiv(consts.nc, consts.U) * cdiv(consts.P, cfg.BP * cfg.PB)


def flag_count(consts, cfg) -> int:
    """The number of flags of chunk_output in config cfg: one per P block of each program."""
    return cfg.PB * program_count(consts, cfg)


def _arguments(*, q, k, v, segsum, S: int, consts, cfg, **tensors) -> dict:
    """chunk_output_kernel's arguments but CAREFUL: the tensors, S (the steps of the outputs
    with a step axis), MODE, the strides, the model's constants and cfg's blocks."""
    m = consts
    BA = input_align(m.ALIGN, q, k, v, segsum)
    qs, ks, vs, gs = q.stride(), k.stride(), v.stride(), segsum.stride()
    return dict(
        tensors, q=q, k=k, v=v, segsum=segsum, S=S, S_pad=m.S_pad, plane=m.B * m.H * m.S_pad,
        nc=m.nc, n_tiles=cdiv(m.nc, m.U), n_bh=m.B * m.H, n_prog=program_count(m, cfg), H=m.H,
        HG=m.H // m.G, sqb=qs[0] // BA, sqs=qs[1], sqr=qs[2], sqg=qs[3], sqn=qs[4],
        skb=ks[0] // BA, sks=ks[1], skr=ks[2], skg=ks[3], skn=ks[4],
        svb=vs[0] // BA, svs=vs[1], svh=vs[2], svp=vs[3],
        sgb=gs[0] // BA, sgh=gs[1] // BA, sgc=gs[2], R=m.R, N=m.N, P=m.P, C=m.C, TP=m.TPO,
        RP=m.RP, HALF=m.N // 2, RD=m.RD, BJ=cfg.BJ, BP=cfg.BP, U=m.U, HAS_Z=m.HAS_Z,
        HAS_D=m.HAS_D, PREC=m.PREC, EXACT=m.EXACT, OPAQUE=m.OPAQUE, BA=BA, PREFETCH=m.PREFETCH,
        PB=cfg.PB, FLAG_BLOCK=FLAG_BLOCK, PDL=m.PDL)


def _options(consts, cfg) -> dict:
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
                **dependent_launch(consts))


def operator_launch(*, grad: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dout: torch.Tensor, z: torch.Tensor, q_bias: torch.Tensor,
                    k_bias: torch.Tensor, mimo_v: torch.Tensor, mimo_o: torch.Tensor,
                    mimo_z: torch.Tensor, d: torch.Tensor, segsum: torch.Tensor,
                    terms: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    states: torch.Tensor, out: torch.Tensor, dz: torch.Tensor,
                    part_o: torch.Tensor, part_z: torch.Tensor, consts, cfg) -> Launch:
    """The whole operator's launch (MIMO_Out given, no fused norm), over padded inputs as
    `launches` reads them: without `grad` (FORWARD) it writes out [B, S_pad, H, P] in out's
    dtype; with it (GRAD), given dout [B, S_pad, H, P], dz [B, S_pad, H, P] (with Z) and the
    per-tile partial sums of the gradients of MIMO_Out and MIMO_Z, added to part_o and part_z
    [B*H, n_tiles, R, P] fp32 (common.store_or_add; phase 2 recomputes d raw_y from dout and
    z). Tensors a mode does not write or
    read may be stand-ins. No rerun of tiles that meet a non-finite value (bwd_fwd's CAREFUL):
    within a tile, a NaN or Inf of a later step reaches the outputs of earlier ones."""
    kwargs = _arguments(q=q, k=k, v=v, dout=dout, z=z, q_bias=q_bias, k_bias=k_bias,
                        mimo_v=mimo_v, mimo_o=mimo_o, mimo_z=mimo_z, d=d, terms=terms, cos=cos,
                        sin=sin, segsum=segsum, states=states, qk_dot=out, dz=dz, part_o=part_o,
                        part_z=part_z, out=out, flags=part_o, S=consts.S_pad,
                        MODE=(GRAD if grad else FORWARD).value, consts=consts, cfg=cfg)
    m = consts
    grid = (m.B * m.H * cdiv(m.nc, m.U), cdiv(m.P, cfg.BP * cfg.PB))
    return Launch(chunk_output_kernel, grid, dict(kwargs, CAREFUL=False), _options(m, cfg))


def launches(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
             z: torch.Tensor, q_bias: torch.Tensor, k_bias: torch.Tensor, mimo_v: torch.Tensor,
             mimo_o: torch.Tensor, mimo_z: torch.Tensor, d: torch.Tensor, segsum: torch.Tensor,
             terms: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, states: torch.Tensor,
             qk_dot: torch.Tensor, dz: torch.Tensor, parts: torch.Tensor, part_o: torch.Tensor,
             part_z: torch.Tensor, flags: torch.Tensor, dmimo: torch.Tensor, consts,
             cfg) -> list:
    """The launch that writes qk_dot [B, H, S, R, R], dz [B, S, H, P], the dmimo partial sums
    and a flag per program in `flags` (fp32, at least flag_count(...) elements), its rerun of the
    flagged tiles (CAREFUL), then the one that reduces the partial sums into dmimo
    [n_sums, B, H, R, P] fp32 (dmimo_o, and dmimo_z with Z). Reads the padded inputs (q, k
    [B, S_pad, R, G, N]; v, dout, z [B, S_pad, H, P];
    segsum [B, H, nc, C, C]; z and mimo_z, d may be stand-ins when absent), step_terms' terms,
    cos, sin and chunk_state's `states` (the output, or its fp32 copy). part_o, part_z:
    [B*H, n_tiles, R, P] fp32 views of parts [n_sums, B, H, n_tiles, R, P], n_tiles =
    cdiv(nc, U). cfg: configs.OutputConfig."""
    m = consts
    B, H = m.B, m.H
    n_tiles = cdiv(m.nc, m.U)
    n_prog = program_count(m, cfg)
    if flags.numel() < flag_count(m, cfg):
        raise ValueError(f"flags: {flag_count(m, cfg)} elements needed, got {flags.numel()}")
    # out: an unread stand-in
    kwargs = _arguments(q=q, k=k, v=v, dout=dout, z=z, q_bias=q_bias, k_bias=k_bias,
                        mimo_v=mimo_v, mimo_o=mimo_o, mimo_z=mimo_z, d=d, terms=terms, cos=cos,
                        sin=sin, segsum=segsum, states=states, qk_dot=qk_dot, dz=dz,
                        part_o=part_o, part_z=part_z, out=parts, flags=flags,
                        S=m.S, MODE=BWD_FWD.value, consts=m, cfg=cfg)
    grid = (B * H * n_tiles, cdiv(m.P, cfg.BP * cfg.PB))
    RP_SIZE = m.R * m.P
    BLOCK = min(128, next_pow2(RP_SIZE))
    options = _options(m, cfg)
    return [Launch(chunk_output_kernel, grid, dict(kwargs, CAREFUL=False), options),
            # the rerun of flagged tiles: a program reads FLAG_BLOCK flags and, if none is set,
            # exits
            Launch(chunk_output_kernel, (cdiv(n_prog, FLAG_BLOCK),), dict(kwargs, CAREFUL=True),
                   options),
            Launch(rank_sums_kernel, (parts.shape[0] * B * H, cdiv(RP_SIZE, BLOCK)), dict(
                parts=parts, sums=dmimo, n_bh=B * H, n_tiles=n_tiles, s_part=parts.stride(0),
                RP_SIZE=RP_SIZE, BLOCK=BLOCK, ROWS=32, PDL=m.PDL),
                dict(num_warps=4, **dependent_launch(m)))]
