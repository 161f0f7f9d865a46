"""One decode step of the Mamba-3 MIMO recurrence (SPEC section 7) for every (b, h), updating the
four state tensors in place: the running angle, the state h [P, N], the previous step's rotated
k and its v. Per (b, h):

    angle <- (angle + tanh(Angles) pi DT) mod 2*pi
    h     <- exp(ADT) (h + DT sigmoid(-Trap) sum_r k_prev[r] (x) v_prev MIMO_V[r])
             + DT sigmoid(Trap) sum_r kr[r] (x) V MIMO_V[r]
    raw_y[r] = qr[r] . h + D V MIMO_V[r], then the output stage of SPEC section 6
    k_prev <- kr, v_prev <- V

with qr, kr = rot(Q + Q_bias), rot(K + K_bias) by the new angle. One program per (b, h) walks N
in blocks of BJ pairs: each block's part of the state is read, updated and written back, and its
share of raw_y accumulated; the rank sums go through dots whose rank dimension is padded to 16.
No atomics, no allocation: the same inputs give the same bits, and a step can be captured in a
CUDA graph."""
import triton
import triton.language as tl

from ..runtime.device import interpreter_active, on_device
from ..runtime.launcher import Launch
from . import next_pow2
from .common import dot, landed, load_pair_columns, rotate_pairs, tanh


@triton.jit
def decode_step_kernel(q, k, v, z, adt, dt, trap, q_bias, k_bias, mimo_v, mimo_z, mimo_o,
                       angles_raw, d, norm_w, angle, state, k_prev, v_prev, out, H, HG, R, N, P,
                       RD, eps, sqb, sqr, sqg, sqn, skb, skr, skg, skn, svb, svh, svp, szb, szh,
                       szp, sab, sah, sar, sxb, sxh, sdb, sdh, stb, sth, sob, sor, soh, sop,
                       RK: tl.constexpr, BJ: tl.constexpr, PP: tl.constexpr,
                       HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_OUT: tl.constexpr,
                       NORM: tl.constexpr, NORM_W: tl.constexpr, PREC: tl.constexpr,
                       TWO_PI: tl.constexpr, PREPARED: tl.constexpr, OPAQUE: tl.constexpr):
    """One (b, h) per program. q, k [B, R, G, N]; v, z [B, H, P]; adt, dt, trap [B, H] (strides
    sxb, sxh; sdb, sdh; stb, sth); angles_raw [B, H, RD]; norm_w [H * P] (NORM_W, else ones);
    angle [B, H, RD], state [B, H, P, N], k_prev [B, R, H, N] (fp32) and v_prev [B, H, P],
    contiguous, read and written; out [B, H, P] (HAS_OUT) or [B, R, H, P] (strides sob, sor,
    soh, sop).

    PREPARED (upstream's step, compat.mamba3_step_fn): q and k come bias-added and rotated, one
    per head (G = H); adt holds A (the decay is exp(A dt)) and trap sigmoid(Trap); the angle is
    not read, and k_prev and v_prev (of any dtype) are read but not written."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    g = h // HG
    HALF = N // 2
    r = tl.arange(0, RK)
    rm = r < R
    p = tl.arange(0, PP)
    pm = p < P
    rp_ok = rm[:, None] & pm[None, :]
    step_dt = tl.load(dt + b * sdb + h * sdh)
    step_trap = tl.load(trap + b * stb + h * sth).to(tl.float32)
    if PREPARED:
        decay = tl.exp(tl.load(adt + b * sxb + h * sxh) * step_dt)
        gamma = step_dt * step_trap
        shifted = step_dt * (1.0 - step_trap)
    else:
        decay = tl.exp(tl.load(adt + b * sxb + h * sxh))
        gamma = step_dt * tl.sigmoid(step_trap)
        shifted = step_dt * tl.sigmoid(-step_trap)
    # PsiV of this step and of the previous one, [RK, PP] (zero rows past R)
    mv = tl.load(mimo_v + (h * R + r)[:, None] * P + p[None, :], mask=rp_ok, other=0.0)
    xv = tl.load(v + b * svb + h * svh + p * svp, mask=pm, other=0.0)
    psiv = xv.to(tl.float32)[None, :] * mv
    psiv_prev = tl.load(v_prev + bh * P + p, mask=pm, other=0.0).to(tl.float32)[None, :] * mv
    raw = tl.zeros([RK, PP], dtype=tl.float32)
    st = state + bh * P * N  # [P, N]
    kp_at = k_prev + b * R * H * N + h * N  # rank r at r * H * N
    for j0 in range(0, HALF, BJ):
        j = j0 + tl.arange(0, BJ)
        # every load of the block before any of its math, so that the program waits for memory
        # once per block (common.landed)
        s_ok = (j < HALF)[:, None] & pm[None, :]
        s_off = p[None, :] * N + j[:, None]  # [BJ, PP] of the [P, N] state
        h1 = tl.load(st + s_off, mask=s_ok, other=0.0)
        h2 = tl.load(st + s_off + HALF, mask=s_ok, other=0.0)
        kp1, kp2 = load_pair_columns(kp_at, r * H * N, rm, j0, BJ, HALF, 1)
        q1, q2 = load_pair_columns(q + b * sqb + g * sqg, r * sqr, rm, j0, BJ, HALF, sqn)
        k1, k2 = load_pair_columns(k + b * skb + g * skg, r * skr, rm, j0, BJ, HALF, skn)
        if not PREPARED:
            rot = j < RD
            old = tl.load(angle + bh * RD + j, mask=rot, other=0.0)
            x = tl.load(angles_raw + b * sab + h * sah + j * sar, mask=rot, other=0.0)
            qb1, qb2 = load_pair_columns(q_bias, (h * R + r) * N, rm, j0, BJ, HALF, 1)
            kb1, kb2 = load_pair_columns(k_bias, (h * R + r) * N, rm, j0, BJ, HALF, 1)
        h1, h2 = landed(h1, OPAQUE), landed(h2, OPAQUE)
        kp1, kp2 = landed(kp1, OPAQUE), landed(kp2, OPAQUE)
        if PREPARED:
            q1, q2 = landed(q1, OPAQUE), landed(q2, OPAQUE)
            k1, k2 = landed(k1, OPAQUE), landed(k2, OPAQUE)
        else:
            new = landed(old, OPAQUE) + tanh(landed(x, OPAQUE)) * (TWO_PI / 2) * step_dt
            new = new - TWO_PI * tl.floor(new / TWO_PI)
            cs = tl.where(rot, tl.cos(new), 1.0)[None, :]
            sn = tl.where(rot, tl.sin(new), 0.0)[None, :]
            q1, q2 = rotate_pairs(q1, q2, qb1, qb2, cs, sn, True, OPAQUE)
            k1, k2 = rotate_pairs(k1, k2, kb1, kb2, cs, sn, True, OPAQUE)
        # sum_r k[r, j] psiv[r, p]: dots over the rank rows
        h1 = decay * (h1 + shifted * dot(tl.trans(kp1), psiv_prev, PREC)) + gamma * dot(
            tl.trans(k1), psiv, PREC)
        h2 = decay * (h2 + shifted * dot(tl.trans(kp2), psiv_prev, PREC)) + gamma * dot(
            tl.trans(k2), psiv, PREC)
        raw += dot(q1, h1, PREC) + dot(q2, h2, PREC)
        # every thread has read this block before any writes it back
        tl.debug_barrier()
        tl.store(st + s_off, h1, mask=s_ok)
        tl.store(st + s_off + HALF, h2, mask=s_ok)
        if not PREPARED:
            k_ok = rm[:, None] & (j < HALF)[None, :]
            k_off = r[:, None] * H * N + j[None, :]
            tl.store(kp_at + k_off, k1, mask=k_ok)
            tl.store(kp_at + k_off + HALF, k2, mask=k_ok)
            tl.store(angle + bh * RD + j, new, mask=rot)
    if HAS_D:
        raw += tl.load(d + h) * psiv
    y = raw
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=1) / P + eps)
        y = raw * rstd[:, None]
        if NORM_W:
            y *= tl.load(norm_w + h * P + p, mask=pm, other=0.0)[None, :]
    if HAS_Z:
        zeta = tl.load(mimo_z + (h * R + r)[:, None] * P + p[None, :], mask=rp_ok, other=0.0)
        u = tl.load(z + b * szb + h * szh + p * szp, mask=pm, other=0.0).to(tl.float32)[
            None, :] * zeta
        y = y * u * tl.sigmoid(u)
    o_at = out + b * sob + h * soh
    if HAS_OUT:
        phi = tl.load(mimo_o + (h * R + r)[:, None] * P + p[None, :], mask=rp_ok, other=0.0)
        tl.store(o_at + p * sop, tl.sum(phi * y, axis=0).to(out.dtype.element_ty), mask=pm)
    else:
        tl.store(o_at + r[:, None] * sor + p[None, :] * sop, y.to(out.dtype.element_ty),
                 mask=rp_ok)
    if not PREPARED:
        tl.debug_barrier()  # v_prev was read by every thread above
        tl.store(v_prev + bh * P + p, xv.to(v_prev.dtype.element_ty), mask=pm)


TWO_PI = 6.283185307179586
# Pairs of N per block, by the number of (b, h) programs (H200, 2026-12-03, N64 and N128,
# P64, R4, graph-replayed): 32 where the programs are few (B*H = 16 or 256: 8-12 % faster than
# 16, their chain of blocks the bound), 16 where they are many (B*H = 4096: 32 and 64 were
# 3-11 % slower); 8 warps and two stages gained nothing beyond B*H = 16.
BLOCK_PAIRS, FEW_PROGRAMS_BLOCK_PAIRS, FEW_PROGRAMS = 16, 32, 1024
OPTIONS = dict(num_warps=4)


def block_pairs(n_programs: int, N: int) -> int:
    """The pairs of N per block of a step of n_programs (b, h) programs."""
    bj = FEW_PROGRAMS_BLOCK_PAIRS if n_programs <= FEW_PROGRAMS else BLOCK_PAIRS
    return max(16, min(bj, next_pow2(N // 2)))


def launch(*, q, k, v, z, adt, dt, trap, q_bias, k_bias, mimo_v, mimo_z, mimo_o, angles_raw, d,
           norm_w, angle, state, k_prev, v_prev, out, eps: float, has_z: bool, has_d: bool,
           has_out: bool, norm: bool, norm_w_given: bool, precision: str,
           prepared: bool = False) -> None:
    """Launch decode_step_kernel over every (b, h); absent inputs are stand-ins that the flags
    keep unread. Shapes as the kernel's docstring; q_bias, k_bias, mimo_* [H, R, N or P] and
    norm_w [H * P] contiguous; `prepared`: the kernel's PREPARED form."""
    B, R, G, N = q.shape
    H, P = v.shape[1], v.shape[2]
    RD = angles_raw.shape[-1]
    qs, ks, vs, zs, as_ = q.stride(), k.stride(), v.stride(), z.stride(), angles_raw.stride()
    # out [B, H, P], or [B, R, H, P] without MIMO_Out
    sob, sor, soh, sop = ((out.stride(0), 0) + out.stride()[1:] if has_out else out.stride())
    # through the fast launcher: Triton's own launch of these 60 arguments took most of a
    # step's host time (about 100 us on the H200's host, the kernel 8-18 us at B <= 16)
    with on_device(q.device):
        Launch(decode_step_kernel, (B * H,), dict(
            q=q, k=k, v=v, z=z, adt=adt, dt=dt, trap=trap, q_bias=q_bias, k_bias=k_bias,
            mimo_v=mimo_v, mimo_z=mimo_z, mimo_o=mimo_o, angles_raw=angles_raw, d=d,
            norm_w=norm_w, angle=angle, state=state, k_prev=k_prev, v_prev=v_prev, out=out, H=H,
            HG=H // G, R=R, N=N, P=P, RD=RD, eps=float(eps), sqb=qs[0], sqr=qs[1], sqg=qs[2],
            sqn=qs[3], skb=ks[0], skr=ks[1], skg=ks[2], skn=ks[3], svb=vs[0], svh=vs[1],
            svp=vs[2], szb=zs[0] if has_z else 0, szh=zs[1] if has_z else 0,
            szp=zs[2] if has_z else 0, sab=as_[0], sah=as_[1], sar=as_[2],
            sxb=adt.stride(0), sxh=adt.stride(1), sdb=dt.stride(0), sdh=dt.stride(1),
            stb=trap.stride(0), sth=trap.stride(1), sob=sob, sor=sor, soh=soh, sop=sop, RK=max(16, next_pow2(R)),
            BJ=block_pairs(B * H, N), PP=next_pow2(P), HAS_Z=has_z,
            HAS_D=has_d, HAS_OUT=has_out, NORM=norm, NORM_W=norm_w_given, PREC=precision,
            TWO_PI=TWO_PI, PREPARED=prepared, OPAQUE=not interpreter_active()),
            dict(OPTIONS)).run()
