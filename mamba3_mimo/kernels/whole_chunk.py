"""The whole operator's first-form kernels (chunk_forward, chunk_grads) work on whole chunks: one
program holds a chunk's (step, rank) rows (row = t * RP + r), all N pair columns and all P
columns. Here: the operands such a program loads, and the reshapes between rows and steps."""
import triton
import triton.language as tl

from .common import chunk_rows, load_cos_sin, load_mimo_v, load_pair_columns, psi_v_rows
from .step_terms import GAMMA, K_DECAY, Q_DECAY, TRAP_SCALE


@triton.jit
def rows_of_steps(x, RP: tl.constexpr):
    """[TP, TP] per pair of steps -> [TP * RP, TP * RP] per pair of rows."""
    TP: tl.constexpr = x.shape[0]
    x = tl.broadcast_to(x[:, None, :, None], (TP, RP, TP, RP))
    return tl.reshape(x, (TP * RP, TP * RP))


@triton.jit
def steps_of_rows(x, RP: tl.constexpr):
    """[TP * RP, TP * RP] per pair of rows -> [TP, TP], summed over the ranks."""
    TPR: tl.constexpr = x.shape[0]
    TP: tl.constexpr = TPR // RP
    return tl.sum(tl.sum(tl.reshape(x, (TP, RP, TP, RP)), axis=3), axis=1)


@triton.jit
def step_sums(x, RP: tl.constexpr):
    """[TP * RP] per row -> [TP] per step, summed over the ranks."""
    TPR: tl.constexpr = x.shape[0]
    return tl.sum(tl.reshape(x, (TPR // RP, RP)), axis=1)


@triton.jit
def rotated_rows(x_ptr, row_off, rows, bias_ptr, bias_off, cos, sin, HALF, stride_n,
                 BJ: tl.constexpr):
    """(x + bias) rotated, as pair halves [rows, BJ] each, all pairs in one block."""
    x1, x2 = load_pair_columns(x_ptr, row_off, rows, 0, BJ, HALF, stride_n)
    b1, b2 = load_pair_columns(bias_ptr, bias_off, rows, 0, BJ, HALF, 1)
    x1 = x1.to(tl.float32) + b1
    x2 = x2.to(tl.float32) + b2
    return cos * x1 - sin * x2, sin * x1 + cos * x2


@triton.jit
def chunk_operands(q, k, v, q_bias, k_bias, mimo_v, terms, cos, sin, segsum, bh, c, S_pad, nc,
                   plane, H, HG, R, C, N, P, RD, sqb, sqs, sqr, sqg, sqn, skb, sks, skr, skg, skn,
                   svb, svs, svh, svp, TP: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr,
                   PP: tl.constexpr):
    """What a whole-chunk program of (b*h, chunk c) reads (bh, c 64-bit): the rows' cos/sin
    [rows, BJ], Qr and Kr in pair halves [rows, BJ], PsiV [rows, PP], gamma and trap_scale per
    step [TP], K_DECAY and Q_DECAY per row, and the causal weights per pair of steps: E =
    exp(segsum) before the diagonal (else 0) and W = E trap_scale[t'] + gamma on the diagonal
    ([TP, TP]). Returned as a tuple in that order, after (t, r, rows, ts, steps, p, pm)."""
    b, h = bh // H, bh % H
    HALF = N // 2
    s0 = c * C
    row = bh * S_pad + s0  # the chunk's first step in the [B*H, S_pad] planes
    t, r = chunk_rows(TP, RP)
    rows = (t < C) & (r < R)
    ts = tl.arange(0, TP)
    steps = ts < C
    p = tl.arange(0, PP)
    pm = p < P
    cs, sn = load_cos_sin(cos + row * RD, sin + row * RD, t * RD, rows, 0, BJ, RD)
    bias_off = (h * R + r) * N
    g = h // HG
    q1, q2 = rotated_rows(q + b * sqb + g * sqg + s0 * sqs, t * sqs + r * sqr, rows, q_bias,
                          bias_off, cs, sn, HALF, sqn, BJ)
    k1, k2 = rotated_rows(k + b * skb + g * skg + s0 * sks, t * sks + r * skr, rows, k_bias,
                          bias_off, cs, sn, HALF, skn, BJ)
    xv = tl.load(v + b * svb + h * svh + s0 * svs + ts[:, None] * svs + p[None, :] * svp,
                 mask=steps[:, None] & pm[None, :], other=0.0)
    psiv = psi_v_rows(xv, load_mimo_v(mimo_v + h * R * P, R, p, pm, P, RP))
    gamma = tl.load(terms + GAMMA * plane + row + ts, mask=steps, other=0.0)
    trap_scale = tl.load(terms + TRAP_SCALE * plane + row + ts, mask=steps, other=0.0)
    k_decay = tl.load(terms + K_DECAY * plane + row + t, mask=rows, other=0.0)
    q_decay = tl.load(terms + Q_DECAY * plane + row + t, mask=rows, other=0.0)
    before = (ts[None, :] < ts[:, None]) & steps[:, None] & steps[None, :]
    seg = tl.load(segsum + (bh * nc + c) * C * C + ts[:, None] * C + ts[None, :], mask=before,
                  other=0.0)
    e = tl.where(before, tl.exp(seg), 0.0)
    diag = (ts[None, :] == ts[:, None]) & steps[:, None]
    w = e * trap_scale[None, :] + tl.where(diag, gamma[:, None], 0.0)
    return (t, r, rows, ts, steps, p, pm, cs, sn, q1, q2, k1, k2, psiv, gamma, trap_scale,
            k_decay, q_decay, e, w)
