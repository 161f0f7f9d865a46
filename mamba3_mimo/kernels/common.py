"""Shared @triton.jit pieces of the Mamba-3 MIMO math, used by the production kernels (and some by
the stage-0 baseline).

Rows of a chunk tile are (time, rank) pairs flattened as row = t * RP + r, with TP >= C and
RP >= R padded to powers of two; padded rows are masked to zero on load.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def tanh(x):
    """tanh(x) = 2 sigmoid(2x) - 1 (Triton 3.6 has no tanh that the interpreter runs): about one
    ulp of 1 in absolute error, which is what the angles, a running sum, need."""
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """fp32-accumulated dot of fp32 operands at the chosen input precision (ieee / tf32 / tf32x3)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def dot_sync(a, b, PREC: tl.constexpr, ON: tl.constexpr, OPAQUE: tl.constexpr):
    """dot(a, b), for a [M, K] with M a multiple of 64 through warp-level mma.sync rather than
    Hopper's wgmma (ON; a plain `dot` otherwise). Triton gives a dot of rank 3 the older MMA
    with its warps over the batch, so the rows of a go in batches of 16, one per warp at M = 64
    and 4 warps. A wgmma whose operands were written from registers waits behind a proxy fence
    for every memory access in flight, so in a loop that loads later chunks' inputs ahead, each
    wgmma waited for those loads. b goes through `opaque`
    (OPAQUE) so that its computation stays in its own layout rather than being redone by every
    warp."""
    if not ON:
        return dot(a, b, PREC)
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    N: tl.constexpr = b.shape[1]
    b = opaque(b, OPAQUE)
    prod = tl.dot(tl.reshape(a, (M // 16, 16, K)), tl.broadcast_to(b[None, :, :], (M // 16, K, N)),
                  input_precision=PREC)
    return tl.reshape(prod, (M, N))


@triton.jit
def mac(acc, a, b, PREC: tl.constexpr):
    """acc + a @ b accumulated in place: the sum of two separate dots would give each its own
    register layout and force conversions of the fp32 accumulator through shared memory."""
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def chunk_rows(TP: tl.constexpr, RP: tl.constexpr):
    """(step-in-chunk t, rank r) of each row of a chunk tile."""
    row = tl.arange(0, TP * RP)
    return row // RP, row % RP


@triton.jit
def trap_terms(dt_ptr, trap_ptr, t, t_mask, S_pad):
    """gamma[t] = dt[t] sigmoid(trap[t]); trap_scale[t] = gamma[t] + dt[t+1] sigmoid(-trap[t+1]).

    dt_ptr/trap_ptr point at the (b, h) row; the second term is 0 at the last padded step.
    """
    dt_t = tl.load(dt_ptr + t, mask=t_mask, other=0.0)
    tr_t = tl.load(trap_ptr + t, mask=t_mask, other=0.0).to(tl.float32)
    nxt_mask = t_mask & (t + 1 < S_pad)
    dt_n = tl.load(dt_ptr + t + 1, mask=nxt_mask, other=0.0)
    tr_n = tl.load(trap_ptr + t + 1, mask=nxt_mask, other=0.0).to(tl.float32)
    gamma = dt_t * tl.sigmoid(tr_t)
    return gamma, gamma + dt_n * tl.sigmoid(-tr_n)


@triton.jit
def rotary_cos_sin(ang_ptr, t_off, row_mask, j0, BJ: tl.constexpr, RD, stride_an):
    """cos/sin [rows, BJ] of the angles of pair columns j0..j0+BJ at each row's step (t_off:
    offsets of the rows' steps into angles). Pairs >= RD are not rotated: cos = 1, sin = 0."""
    j = j0 + tl.arange(0, BJ)
    m = row_mask[:, None] & (j < RD)[None, :]
    a = tl.load(ang_ptr + t_off[:, None] + j[None, :] * stride_an, mask=m, other=0.0)
    return tl.cos(a), tl.sin(a)


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, t_off, row_mask, j0, BJ: tl.constexpr, RD):
    """cos/sin [rows, BJ] of pair columns j0..j0+BJ from step_terms' tables (cos_ptr, sin_ptr at
    the (b, h) [S_pad, RD] slice; t_off = step * RD). Pairs >= RD: cos = 1, sin = 0."""
    j = j0 + tl.arange(0, BJ)
    m = row_mask[:, None] & (j < RD)[None, :]
    off = t_off[:, None] + j[None, :]
    return tl.load(cos_ptr + off, mask=m, other=1.0), tl.load(sin_ptr + off, mask=m, other=0.0)


@triton.jit
def load_pair_columns(x_ptr, row_off, row_mask, j0, BJ: tl.constexpr, HALF, stride_n):
    """Pair columns (j, HALF + j), j in j0..j0+BJ, of the rows at row_off, in the tensor's dtype
    (with stride_n = 1 and row_off = rank * N, the rows' bias)."""
    j = j0 + tl.arange(0, BJ)
    m = row_mask[:, None] & (j < HALF)[None, :]
    x1 = tl.load(x_ptr + row_off[:, None] + j[None, :] * stride_n, mask=m, other=0.0)
    x2 = tl.load(x_ptr + row_off[:, None] + (HALF + j)[None, :] * stride_n, mask=m, other=0.0)
    return x1, x2


@triton.jit
def rotate_pairs(x1, x2, b1, b2, cos, sin, ROTATE: tl.constexpr, LAND: tl.constexpr = False):
    """rot(x + bias) on pair columns as two fp32 tiles:
    rot(x)[j] = cos x[j] - sin x[HALF+j];  rot(x)[HALF+j] = sin x[j] + cos x[HALF+j].
    ROTATE=False skips the rotation for blocks that hold no rotated pair. LAND: x's and the
    bias's tiles, as loaded, landed first (`landed`; cos and sin are the caller's, which
    usually rotates more than one tile with them)."""
    x1 = landed(x1, LAND) + landed(b1, LAND)
    x2 = landed(x2, LAND) + landed(b2, LAND)
    if ROTATE:
        return cos * x1 - sin * x2, sin * x1 + cos * x2
    return x1, x2


@triton.jit
def load_rotated(x_ptr, row_off, row_mask, bias_ptr, bias_off, cos, sin, j0, BJ: tl.constexpr,
                 HALF, stride_n, ROTATE: tl.constexpr):
    """Bias-added, rotated pair columns (j, HALF + j), j in j0..j0+BJ, as two fp32 tiles
    (rotate_pairs of the load_pair_columns of x and of the bias)."""
    x1, x2 = load_pair_columns(x_ptr, row_off, row_mask, j0, BJ, HALF, stride_n)
    b1, b2 = load_pair_columns(bias_ptr, bias_off, row_mask, j0, BJ, HALF, 1)
    return rotate_pairs(x1, x2, b1, b2, cos, sin, ROTATE)


@triton.jit
def causal_mix(expo, before, same, gamma_row, trap_scale_col):
    """exp(expo) trap_scale[t'] where `before`, gamma[t] where `same`, 0 elsewhere."""
    w = tl.where(before, tl.exp(expo) * trap_scale_col[None, :], 0.0)
    return tl.where(same, gamma_row[:, None] + tl.zeros_like(w), w)


@triton.jit
def tile_weights(seg_ptr, log_q, log_k, ts, steps_ok, C, gamma, trap_scale, RP: tl.constexpr,
                 U: tl.constexpr):
    """intra_weights over a tile of U consecutive chunks, as [TP * RP, TP * RP] rows: computed
    once per pair of steps ([TP, TP]; ts the step in the tile, steps_ok which exist, gamma,
    trap_scale, log_q, log_k per step) and repeated over the ranks, since the weight of
    (t, r) on (t', r') does not depend on r, r'. (Rows of a rank >= R get weights too; their
    q, k and psi_v are zero.)

    Within a chunk the exponent A[t] - A[t'] is segsum (seg_ptr: the tile's first [C, C] block;
    segsum is contiguous, so chunk k's block follows at k * C * C). Across chunks it is
    log_q[t] + log_k[t'] (step_terms' LOG_Q, LOG_K: da_cs[t] + da_cs_rev[t'] and the decays of
    the chunks between), assembled from the given pieces as SPEC section 2 allows."""
    ok = steps_ok[:, None] & steps_ok[None, :]
    before = (ts[None, :] < ts[:, None]) & ok
    if U == 1:
        expo = tl.load(seg_ptr + ts[:, None] * C + ts[None, :], mask=before, other=0.0)
    else:
        same_chunk = (ts // C)[:, None] == (ts // C)[None, :]
        seg = tl.load(seg_ptr + ts[:, None] * C + (ts % C)[None, :], mask=before & same_chunk,
                      other=0.0)
        expo = tl.where(same_chunk, seg, log_q[:, None] + log_k[None, :])
    w = causal_mix(expo, before, (ts[None, :] == ts[:, None]) & ok, gamma, trap_scale)
    TP: tl.constexpr = w.shape[0]
    w = tl.broadcast_to(w[:, None, :, None], (TP, RP, TP, RP))
    return tl.reshape(w, (TP * RP, TP * RP))


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """tl.sigmoid (FAST 0); 1 / (1 + exp(-x)) through the approximate division (FAST 1, 2 ulp:
    the precise division's slow-path branch was the largest stall of chunk_output's epilogue);
    or (FAST 2, inline assembly, GPU only) the same from the two special-function instructions
    alone, ex2 and rcp with denormals flushed: 4 instructions where FAST 1 takes 12, most of
    them the range fix-ups around the same ex2 and rcp. A few
    ulp either way; exp(-x) overflowing to inf still gives 0."""
    if FAST == 2:
        y = tl.inline_asm_elementwise(
            "{ .reg .f32 e; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; "
            "add.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 $0, e; }",  # 0fBFB8AA3B: -log2(e)
            "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    elif FAST == 1:
        y = tl.fdiv(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x), ieee_rounding=False)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def silu_terms(u, FAST: tl.constexpr):
    """(silu(u), silu'(u)) = (u sigmoid(u), sigmoid(u) (1 + u (1 - sigmoid(u))))."""
    sg = sigmoid(u, FAST)
    gate = u * sg
    return gate, sg + gate * (1.0 - sg)


@triton.jit
def gate_grads(raw, dout, z, zeta, HAS_Z: tl.constexpr, FAST: tl.constexpr):
    """Per-element terms of the gradients for out = sum_r Phi * silu(z * Zeta) * raw.

    Returns dout*gate*raw (dmimo_o's) and h = dout*raw*silu'(u) (zeros when HAS_Z is False),
    from which dmimo_z = Phi * sum_t h*z and dz = sum_r h*Phi*Zeta: Phi is left to the caller,
    which can apply it after a sum over time, once per (rank, column) instead of per element.
    """
    if HAS_Z:
        gate, d_gate = silu_terms(z * zeta, FAST)
        dr = dout * raw
        return dr * gate, dr * d_gate
    return dout * raw, tl.zeros_like(raw)


@triton.jit
def load_v_steps(v_ptr, t_off, t_mask, p, p_mask, stride_vp):
    """v of the steps at t_off ([TP, BP], input dtype; t_mask says which steps exist)."""
    m = t_mask[:, None] & p_mask[None, :]
    return tl.load(v_ptr + t_off[:, None] + p[None, :] * stride_vp, mask=m, other=0.0)


@triton.jit
def load_mimo_v(mimo_v_ptr, R, p, p_mask, P, RP: tl.constexpr):
    """The head's mimo_v rows ([RP, BP], zero beyond R) from its contiguous [R, P] block."""
    r = tl.arange(0, RP)
    return tl.load(mimo_v_ptr + r[:, None] * P + p[None, :],
                   mask=(r < R)[:, None] & p_mask[None, :], other=0.0)


@triton.jit
def psi_v_rows(x, mv):
    """psi_v [TP * RP, BP] with row = t * RP + r from v [TP, BP] and mimo_v [RP, BP]."""
    psi = x.to(tl.float32)[:, None, :] * mv[None, :, :]
    return tl.reshape(psi, (x.shape[0] * mv.shape[0], x.shape[1]))


@triton.jit
def selection_matrix(ROWS: tl.constexpr, M: tl.constexpr, RP: tl.constexpr, BY_RANK: tl.constexpr):
    """0/1 matrix [M, ROWS] picking, for output row i, the chunk rows of rank i (BY_RANK) or of
    step i. Stage 0's reductions over time or rank are dots with it; the production kernels sum
    exactly along an axis of a [steps, ranks, ...] view (a fifth less of chunk_output's issue
    slots)."""
    row = tl.arange(0, ROWS)[None, :]
    key = row % RP if BY_RANK else row // RP
    return (tl.arange(0, M)[:, None] == key).to(tl.float32)


@triton.jit
def store_qk_dot(qk_ptr, scores, t, r, row_ok, R, RP: tl.constexpr, ROWS: tl.constexpr,
                 EXACT: tl.constexpr, LEAN: tl.constexpr):
    """qk_dot[t, r, r'] = scores[(t, r), (t, r')]: the same-step blocks of a chunk's Q K^T.

    qk_ptr points at the chunk's first step in the contiguous [S, R, R] output; (t, r) are the
    rows' step-in-chunk and rank and row_ok says which rows are stored. LEAN picks the blocks
    with an exact reshape-sum (production); otherwise with a 0/1 selection dot (stage 0).
    """
    same = t[:, None] == t[None, :]
    if LEAN:
        RS: tl.constexpr = RP
        qk = tl.sum(tl.reshape(tl.where(same, scores, 0.0), (ROWS, ROWS // RP, RP)), axis=1)
    else:
        RS: tl.constexpr = 16 if RP < 16 else RP
        qk = tl.dot(tl.where(same, scores, 0.0), tl.trans(selection_matrix(ROWS, RS, RP, True)),
                    input_precision=EXACT)  # [ROWS, RS]
    r2 = tl.arange(0, RS)[None, :]
    off = (t[:, None] * R + r[:, None]) * R + r2
    tl.store(qk_ptr + off, qk.to(qk_ptr.dtype.element_ty), mask=row_ok[:, None] & (r2 < R))


@triton.jit
def gate_epilogue_steps(raw, dout_ptr, z_ptr, t_off, t_mask, mimo_o, mimo_z, R, p, p_mask, P,
                        stride_p, dz_ptr, dz_off, HAS_Z: tl.constexpr, FAST: tl.constexpr):
    """The production reduce-O gradients of a tile held as raw [TP, RP, BP] (step, rank,
    column): stores dz and returns the per-rank sums (sum_t dout*gate*raw,
    sum_t dout*Phi*raw*silu'(u)*z), each [RP, BP].

    dout and z are loaded once per step ([TP, 1, BP]; t_off, t_mask: the steps' offsets in the
    (b, h) slices at dout_ptr, z_ptr, and which exist) and Phi, Zeta once per rank (from the
    head's [R, P] blocks at mimo_o, mimo_z); the sums run along a tensor axis, so no
    row-grouped tile is rebuilt, and Phi multiplies dmimo_z's sum over time, not its terms.
    dz_off: the steps' offsets in the contiguous dz at dz_ptr. Rows of raw with rank >= R must
    be zero.
    """
    m = t_mask[:, None] & p_mask[None, :]
    off = t_off[:, None] + p[None, :] * stride_p
    r = tl.arange(0, raw.shape[1])
    hm = (r < R)[:, None] & p_mask[None, :]
    hoff = r[:, None] * P + p[None, :]
    # the loads together, then the math (landed: FAST 2 is the GPU's inline assembly)
    dout = tl.load(dout_ptr + off, mask=m, other=0.0)
    z, zeta, phi = 0.0, 0.0, 0.0
    if HAS_Z:
        phi = tl.load(mimo_o + hoff, mask=hm, other=0.0)  # [RP, BP]
        z = tl.load(z_ptr + off, mask=m, other=0.0)
        zeta = tl.load(mimo_z + hoff, mask=hm, other=0.0)
    dout = landed(dout, FAST == 2)[:, None, :]
    if HAS_Z:
        phi = landed(phi, FAST == 2)
        z = landed(z, FAST == 2)[:, None, :]
        zeta = landed(zeta, FAST == 2)[None, :, :]
        gate, d_gate = silu_terms(z * zeta, FAST)
        dr = dout * raw
        g_o, h = dr * gate, dr * d_gate
    else:
        g_o, h = dout * raw, 0.0
    sum_o = tl.sum(g_o, axis=0)
    sum_z = tl.zeros_like(sum_o)
    if HAS_Z:
        dz = tl.sum(h * (phi * zeta), axis=1)
        tl.store(dz_ptr + dz_off[:, None] + p[None, :], dz.to(dz_ptr.dtype.element_ty), mask=m)
        sum_z = phi * tl.sum(h * z, axis=0)
    return sum_o, sum_z


@triton.jit
def gate_output_steps(raw, z_ptr, t_off, t_mask, mimo_o, mimo_z, R, p, p_mask, P, stride_p,
                      out_ptr, out_off, HAS_Z: tl.constexpr, FAST: tl.constexpr):
    """The output stage of a tile held as raw [TP, RP, BP] (step, rank, column): stores
    out[t, p] = sum_r Phi * silu(z Zeta) * raw (gate 1 without Z) at out_ptr + out_off[t] + p in
    out's dtype; z read as gate_epilogue_steps reads it."""
    m = t_mask[:, None] & p_mask[None, :]
    r = tl.arange(0, raw.shape[1])
    hm = (r < R)[:, None] & p_mask[None, :]
    hoff = r[:, None] * P + p[None, :]
    # the loads together, then the math (landed: FAST 2 is the GPU's inline assembly)
    phi = tl.load(mimo_o + hoff, mask=hm, other=0.0)
    if HAS_Z:
        z = tl.load(z_ptr + t_off[:, None] + p[None, :] * stride_p, mask=m, other=0.0)
        zeta = tl.load(mimo_z + hoff, mask=hm, other=0.0)
    y = raw * landed(phi, FAST == 2)[None, :, :]
    if HAS_Z:
        u = landed(z, FAST == 2)[:, None, :] * landed(zeta, FAST == 2)[None, :, :]
        gate, _ = silu_terms(u, FAST)
        y = y * gate
    tl.store(out_ptr + out_off[:, None] + p[None, :],
             tl.sum(y, axis=1).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def opaque(x, ON: tl.constexpr):
    """x through an fp32 identity the compiler cannot see into (ON; a no-op otherwise, as under
    the interpreter, which has no inline assembly). Two effects on Triton 3.6's layout passes:
    a dot operand behind it is "not from a load", so wgmma takes it from registers rather than
    shared memory, and the conversion into the dot's register layout stays behind it instead of
    being repeated on every load it was computed from."""
    if ON:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def landed(x, ON: tl.constexpr):
    """A loaded tile in fp32 behind `opaque` (ON): Triton 3.6's layout passes place a tile's
    conversion to the layout its use needs right after its load, where the conversion (through
    shared memory) waits for that load before the program issues its next one; behind the
    identity the conversion stays where the tile is used, so that a program issues all the loads
    of a step first and waits for memory once."""
    return opaque(x.to(tl.float32), ON)


@triton.jit
def prefetch(base, off, mask, LEVEL: tl.constexpr):
    """Ask for the lines at base + off (where mask; elsewhere base's own line) to be brought
    into L1 (LEVEL 1) or L2 (LEVEL 2) ahead of the load that reads them, so that a program's
    later loads overlap its first dots; LEVEL 0 does nothing, as under the interpreter, which
    has no inline assembly. A hint only: the values come from the loads."""
    ptrs = base + tl.where(mask, off, 0)
    if LEVEL == 1:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L1 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif LEVEL == 2:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_steps(base, t_off, t_mask, p0, stride_p, BP: tl.constexpr, LEVEL: tl.constexpr):
    """prefetch of the [steps, BP] block at base (t_off: the steps' offsets, t_mask which exist;
    columns p0.. with stride_p): the first element of each 128-byte line of a contiguous row."""
    LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth
    NL: tl.constexpr = (BP + LINE - 1) // LINE
    off = t_off[:, None] + (p0 + tl.arange(0, NL) * LINE)[None, :] * stride_p
    prefetch(base, off, tl.broadcast_to(t_mask[:, None], off.shape), LEVEL)


@triton.jit
def store_rank_sums(o_ptr, z_ptr, acc_o, acc_z, R, p, p_mask, P, RS: tl.constexpr,
                    HAS_Z: tl.constexpr, ADD: tl.constexpr = False):
    """Store [RS, BP] per-rank sums (rank on the rows) into the [R, P] blocks at o_ptr/z_ptr, or
    with ADD add them there (store_or_add)."""
    r = tl.arange(0, RS)
    m = (r < R)[:, None] & p_mask[None, :]
    off = r[:, None] * P + p[None, :]
    store_or_add(o_ptr + off, acc_o, m, ADD)
    if HAS_Z:
        store_or_add(z_ptr + off, acc_z, m, ADD)


@triton.jit
def store_or_add(ptr, val, mask, ADD: tl.constexpr):
    """Store val at ptr, or with ADD add it to what is there: the operator's backward runs its
    groups of batch entries one after another on the same buffers, whose per-chunk partial
    sums then accumulate over the groups in their order (deterministic), each element written
    by one program of a launch."""
    if ADD:
        val += tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, val, mask=mask)


@triton.jit
def chain(pid, n_bh, nc, bounds, VARLEN: tl.constexpr):
    """(b*h, first chunk, number of chunks, row in a per-chain table such as the initial
    states) of a program of a serial pass over the chunks (the state pass, the reverse scan):
    one (b*h) over all nc chunks, or with VARLEN one (chain j, b*h) over chunks bounds[j] ..
    bounds[j + 1] - 1 (packed sequences at B = 1, or segments, packed.Segments, the same in
    every batch entry), so that each chain starts afresh from its own row and the chains run
    side by side."""
    if VARLEN:
        seq = pid // n_bh
        bh = (pid % n_bh).to(tl.int64)
        lo = tl.load(bounds + seq)
        return bh, lo.to(tl.int64), tl.load(bounds + seq + 1) - lo, seq.to(tl.int64) * n_bh + bh
    else:
        bh = pid.to(tl.int64)
        return bh, bh * 0, nc, bh


@triton.jit
def after_previous_kernel(PDL: tl.constexpr, START_NEXT: tl.constexpr):
    """The first statement of a kernel launched as a programmatic dependent launch (PDL, sm_90
    and newer; kernels.dependent_launch): its programs may be resident before the previous
    kernel on the stream has finished, so they wait for its results (griddepcontrol.wait:
    everything it wrote visible) before touching memory. START_NEXT: then let the next kernel
    start launching once every program of this one has started (otherwise it starts when this
    one ends). Without PDL, nothing."""
    if PDL:
        gdc_wait()
        if START_NEXT:
            gdc_launch_dependents()
