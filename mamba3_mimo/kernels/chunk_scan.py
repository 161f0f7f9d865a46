"""Production fused pass: each program walks a superchunk (K consecutive chunks) of one (b, h) and
P block in order, carrying the fp32 state in registers, so states never make an fp32 round trip.

Three launches (see `launch`):
1. `chunk_scan_kernel` with OUTPUTS=False: every superchunk's increment (its state recurrence
   started from zero) and log-decay, all superchunks in parallel;
2. chunk_state's `state_passing_kernel` over superchunks: the fp32 state entering each;
3. `chunk_scan_kernel` with OUTPUTS=True: from that state, every chunk's raw_y, the gate epilogue,
   qk_dot and the states output (written once, in output_dtype).
"""
import torch
import triton
import triton.language as tl

from .chunk_state import state_passing_kernel
from .common import (loop_rows, gate_epilogue, head_params, intra_weights, load_cos_sin,
                     load_psi_v, load_rotated_half, mac, store_qk_dot, store_rank_sums)
from .step_terms import GAMMA, K_DECAY, Q_DECAY, TRAP_SCALE


@triton.jit
def _half(scores, inter, s, qx, q_off, kx, k_off, q_bias_h, k_bias_h, bias_off, cos_bh, sin_bh,
          cs_off, rows, psi_t, k_decay, decay, st_ptr, st_off, st_m, HALF, HP: tl.constexpr, RD,
          sqn, skn, SECOND: tl.constexpr, OUTPUTS: tl.constexpr, PREC: tl.constexpr):
    """One half of a chunk step, state rows :HALF (or HALF: with SECOND), s = that half of the
    state, transposed [BP, HP]: scores += q_h k_h^T, inter += q_h s^T and s stored as the state
    entering the chunk (OUTPUTS only); then s = s decay + psi_v^T (k_h k_decay). Halves run one
    after the other so that only one half of the rotated q and k is live."""
    cs, sn = load_cos_sin(cos_bh, sin_bh, cs_off, rows, 0, HP, RD)
    k_h = load_rotated_half(kx, k_off, rows, k_bias_h, bias_off, cs, sn, HP, HALF, skn, SECOND)
    if OUTPUTS:
        q_h = load_rotated_half(qx, q_off, rows, q_bias_h, bias_off, cs, sn, HP, HALF, sqn,
                                SECOND)
        scores = mac(scores, q_h, tl.trans(k_h), PREC)
        inter = mac(inter, q_h, tl.trans(s), PREC)
        tl.store(st_ptr + st_off, s.to(st_ptr.dtype.element_ty), mask=st_m)
    s = mac(s * decay, psi_t, k_h * k_decay[:, None], PREC)
    return scores, inter, s


@triton.jit(do_not_specialize=["S", "S_pad", "plane", "nc", "K", "n_sc", "sqb", "skb", "svb",
                               "sgb", "sgh"])
def chunk_scan_kernel(q, k, v, dout, z, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, terms, cos,
                      sin, da_cs, segsum, sc_state, sc_decay, states, qk_dot, dz, part_o, part_z,
                      S, S_pad, plane, nc, K, n_sc, H, HG, sqb, sqs, sqr, sqg, sqn,
                      skb, sks, skr, skg, skn, svb, svs, svh, svp, sgb, sgh, sgc, R,
                      N: tl.constexpr, P: tl.constexpr, C, TP: tl.constexpr, RP: tl.constexpr,
                      HALF: tl.constexpr, HP: tl.constexpr, RD: tl.constexpr, BP: tl.constexpr,
                      HAS_Z: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
                      EXACT: tl.constexpr, OUTPUTS: tl.constexpr):
    """Program (b*h, superchunk sc, P block) over chunks sc*K .. min(sc*K + K, nc) - 1.

    The state is held transposed, as s1 = state[:HALF, p]^T and s2 = state[HALF:, p]^T ([BP, HP],
    HP = HALF padded to a power of two >= 16), so that its update psi_v^T (k_w) takes the
    elementwise-built k_w as the B operand.
    OUTPUTS=False: start from zero; store the superchunk's increment in sc_state[b*h, sc + 1] and
    its log-decay (sum of the chunks' da_cs[last]) in sc_decay[b*h, sc].
    OUTPUTS=True: start from sc_state[b*h, sc]; store states, qk_dot, dz and the per-rank partial
    sums part_o/part_z[b*h, sc].
    """
    ROWS: tl.constexpr = TP * RP
    bh = tl.program_id(0).to(tl.int64)
    sc = tl.program_id(1).to(tl.int64)
    pid_p = tl.program_id(2)
    b, h = bh // H, bh % H
    g = h // HG
    p = pid_p * BP + tl.arange(0, BP)
    pm = p < P
    j = tl.arange(0, HP)
    # [BP, HP]: state[j, p] of an [N, P] block (built where used: live across the loop it
    # would cost registers)
    row = bh * S_pad
    vb = v + b * svb + h * svh
    kx = k + b * skb + g * skg
    qx = q + b * sqb + g * sqg
    sc_base = sc_state + (bh * n_sc + sc) * N * P
    if OUTPUTS:
        st_off = j[None, :] * P + p[:, None]
        st_m = (j < HALF)[None, :] & pm[:, None]
        s1 = tl.load(sc_base + st_off, mask=st_m, other=0.0)
        s2 = tl.load(sc_base + HALF * P + st_off, mask=st_m, other=0.0)
    else:
        s1 = tl.zeros([BP, HP], dtype=tl.float32)
        s2 = tl.zeros([BP, HP], dtype=tl.float32)
    log_decay = 0.0
    acc_o = tl.zeros([RP, BP], dtype=tl.float32)
    acc_z = tl.zeros([RP, BP], dtype=tl.float32)
    c0 = sc * K
    for i in range(tl.minimum(K, nc - c0)):
        c = c0 + i
        # Index vectors rebuilt from the loop counter: otherwise Triton hoists every [rows, X]
        # offset tile built from them out of the loop and keeps it live across it (as 64-bit
        # pointers), which spilled this kernel (docs/optimisation.md, step 10).
        t, r = loop_rows(i, TP, RP)
        tt = (tl.arange(0, TP) + i * TP) % TP
        pc = pid_p * BP + (tl.arange(0, BP) + i * BP) % BP
        jc = (tl.arange(0, HP) + i * HP) % HP
        rank_ok = (t < C) & (r < R)
        pmc = pc < P
        st_offc = jc[None, :] * P + pc[:, None]
        st_mc = (jc < HALF)[None, :] & pmc[:, None]
        tg = c * C + t
        psi_v = load_psi_v(vb, tg * svs, rank_ok, mimo_v + h * R * P, r, R, pc, pmc, P, svp)
        k_decay = tl.load(terms + K_DECAY * plane + row + tg, mask=rank_ok, other=0.0)
        chunk_decay = tl.load(da_cs + row + c * C + C - 1)
        decay = tl.exp(chunk_decay)
        log_decay += chunk_decay
        scores = tl.zeros([ROWS, ROWS], dtype=tl.float32)
        inter = tl.zeros([ROWS, BP], dtype=tl.float32)
        st = states + (bh * nc + c) * N * P
        psi_t = tl.trans(psi_v)
        q_off, k_off, cs_off = tg * sqs + r * sqr, tg * sks + r * skr, tg * RD
        scores, inter, s1 = _half(scores, inter, s1, qx, q_off, kx, k_off, q_bias + h * R * N,
                                  k_bias + h * R * N, r * N, cos + row * RD, sin + row * RD,
                                  cs_off, rank_ok, psi_t, k_decay, decay, st, st_offc, st_mc, HALF,
                                  HP, RD, sqn, skn, False, OUTPUTS, PREC)
        scores, inter, s2 = _half(scores, inter, s2, qx, q_off, kx, k_off, q_bias + h * R * N,
                                  k_bias + h * R * N, r * N, cos + row * RD, sin + row * RD,
                                  cs_off, rank_ok, psi_t, k_decay, decay, st + HALF * P, st_offc,
                                  st_mc, HALF, HP, RD, sqn, skn, True, OUTPUTS, PREC)
        if OUTPUTS:
            store_qk_dot(qk_dot + (bh * S + c * C) * R * R, scores, t, r,
                         rank_ok & (tg < S) & (pid_p == 0), R, RP, ROWS, EXACT, True)
            gamma = tl.load(terms + GAMMA * plane + row + tg, mask=rank_ok, other=0.0)
            trap_scale = tl.load(terms + TRAP_SCALE * plane + row + tg, mask=rank_ok, other=0.0)
            q_decay = tl.load(terms + Q_DECAY * plane + row + tg, mask=rank_ok, other=0.0)
            w = intra_weights(segsum + b * sgb + h * sgh + c * sgc, t, t, rank_ok, rank_ok, C,
                              gamma, trap_scale)
            raw = mac(q_decay[:, None] * inter, scores * w, psi_v, PREC)
            phi, zeta, d_h = head_params(mimo_o, mimo_z, d, h, r, rank_ok, pc, pmc, R, P, HAS_Z,
                                         HAS_D)
            if HAS_D:
                raw += d_h * psi_v
            part_o_c, part_z_c = gate_epilogue(raw, dout + b * svb + h * svh,
                                               z + b * svb + h * svh, tg * svs, rank_ok, phi,
                                               zeta, pc, pmc, svp, dz + (b * S * H + h) * P,
                                               (c * C + tt) * H * P, (tt < C) & (c * C + tt < S),
                                               TP, RP, HAS_Z, EXACT, True)
            acc_o += part_o_c
            acc_z += part_z_c
    if OUTPUTS:
        part = (bh * n_sc + sc) * R * P
        store_rank_sums(part_o + part, part_z + part, acc_o, acc_z, R, p, pm, P, RP, HAS_Z)
    else:
        nxt = sc_base + N * P
        st_off = j[None, :] * P + p[:, None]
        st_m = (j < HALF)[None, :] & pm[:, None]
        tl.store(nxt + st_off, s1, mask=st_m)
        tl.store(nxt + HALF * P + st_off, s2, mask=st_m)
        if pid_p == 0:
            tl.store(sc_decay + bh * n_sc + sc, log_decay)


def _launch_scan(a: dict, out: dict, m: dict, cfg: dict, n_sc: int, outputs: bool, grid,
                 warmup: bool):
    seg = a["segsum"]
    B, H = m["B"], m["H"]
    kernel = chunk_scan_kernel.warmup if warmup else chunk_scan_kernel[grid]
    return kernel(
        a["q"], a["k"], a["v"], a["dout"], a["z"], a["q_bias"], a["k_bias"], a["mimo_v"],
        a["mimo_o"], a["mimo_z"], a["d"], out["terms"], out["cos"], out["sin"], a["da_cs"], seg,
        out["sc_state"], out["sc_decay"], out["states"], out["qk_dot"], out["dz"],
        out["part_o"], out["part_z"],
        m["S"], m["S_pad"], B * H * m["S_pad"], m["nc"], cfg["K"], n_sc, H, H // m["G"],
        *a["q"].stride(), *a["k"].stride(), *a["v"].stride(), seg.stride(0), seg.stride(1),
        seg.stride(2), m["R"], m["N"], m["P"], m["C"], m["TP"], m["RP"], m["N"] // 2,
        max(16, triton.next_power_of_2(m["N"] // 2)), m["RD"], cfg["BP"], m["HAS_Z"], m["HAS_D"],
        m["PREC"], m["EXACT"], outputs, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **({"grid": grid} if warmup else {}))


def launch(a: dict, out: dict, meta: dict, cfg: dict, warmup: bool = False):
    """Write out["states"], out["qk_dot"], out["dz"] and the per-superchunk partial sums
    out["part_o"], out["part_z"] [B*H, n_sc, R, P] (fp32), reading step_terms' out["terms"],
    out["cos"], out["sin"]. cfg: BP, num_warps, num_stages and K, the chunks per superchunk
    (a runtime value: changing it never recompiles; n_sc = cdiv(nc, K)).
    With warmup, compiles the output pass without running anything and returns it.
    """
    m = meta
    B, H, N, P = m["B"], m["H"], m["N"], m["P"]
    n_pb = triton.cdiv(P, cfg["BP"])
    dev = a["v"].device
    if warmup:
        scratch = torch.empty(1, device=dev, dtype=torch.float32)
        probe = dict(out, sc_state=scratch, sc_decay=scratch, part_o=scratch, part_z=scratch)
        return _launch_scan(a, probe, m, dict(cfg, K=1), 1, True, (B * H, 1, n_pb), True)
    n_sc = triton.cdiv(m["nc"], cfg["K"])
    # [B*H, n_sc, N, P]: superchunk increments, then (in place) the states entering each
    out["sc_state"] = torch.empty(B * H, n_sc, N, P, device=dev, dtype=torch.float32)
    out["sc_decay"] = torch.empty(B * H, n_sc, device=dev, dtype=torch.float32)
    if n_sc > 1:
        _launch_scan(a, out, m, cfg, n_sc, False, (B * H, n_sc - 1, n_pb), False)
    state_passing_kernel[(B * H, triton.cdiv(N * P, 512))](
        out["sc_state"], out["sc_decay"], out["sc_state"], n_sc, n_sc, 1, N * P, 512, False,
        num_warps=4)
    _launch_scan(a, out, m, cfg, n_sc, True, (B * H, n_sc, n_pb), False)
