"""PyTorch reference of the Mamba-3 MIMO bwd_fwd operator (SPEC sections 2-4), built from small ops.

Runs in any float dtype: float64 is the "golden", float32 the "bench" of the dual check. It is a
test oracle only; the production path never imports it.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def decay_pieces(adt: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Chunked pieces of A = cumsum(adt) (SPEC section 2).

    adt: [B, H, S] per-step log-decay. Returns da_cs, da_cs_rev [B, H, S] and
    segsum [B, H, nchunks, C, C]; a partial last chunk is cut at S.
    """
    B, H, S = adt.shape
    C = chunk_size
    nc = math.ceil(S / C)
    padded = torch.nn.functional.pad(adt, (0, nc * C - S)).view(B, H, nc, C)
    da_cs = padded.cumsum(-1)
    da_cs_rev = da_cs[..., -1:] - da_cs
    seg = da_cs[..., :, None] - da_cs[..., None, :]
    causal = torch.ones(C, C, dtype=torch.bool, device=adt.device).tril(-1)
    segsum = torch.where(causal, seg, torch.zeros((), dtype=seg.dtype, device=seg.device))
    return (da_cs.reshape(B, H, nc * C)[..., :S].contiguous(),
            da_cs_rev.reshape(B, H, nc * C)[..., :S].contiguous(),
            segsum.contiguous())


def rotate(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate-half on the first RD pairs (n, N/2 + n). x: [..., N], angles: [..., RD]."""
    N = x.shape[-1]
    RD = angles.shape[-1]
    half = N // 2
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2 = x[..., :RD], x[..., half:half + RD]
    out = x.clone()
    out[..., :RD] = cos * x1 - sin * x2
    out[..., half:half + RD] = sin * x1 + cos * x2
    return out


def _per_head(qk: Tensor, H: int) -> Tensor:
    """[B, S, R, G, N] -> [B, S, R, H, N], head h reading group h // (H // G)."""
    G = qk.shape[3]
    index = torch.arange(H, device=qk.device) // (H // G)
    return qk.index_select(3, index)


def _prepare(q, k, v, q_bias, k_bias, mimo_v, angles, dt, trap, dtype):
    """Common per-step quantities: qr, kr [B,S,R,H,N], psi_v [B,S,R,H,P], gamma, trap_scale [B,H,S]."""
    H = v.shape[2]
    qb = _per_head(q.to(dtype), H) + q_bias.to(dtype).transpose(0, 1)
    kb = _per_head(k.to(dtype), H) + k_bias.to(dtype).transpose(0, 1)
    ang = angles.to(dtype)[:, :, None]  # [B, S, 1, H, RD]
    qr, kr = rotate(qb, ang), rotate(kb, ang)
    psi_v = v.to(dtype)[:, :, None] * mimo_v.to(dtype).transpose(0, 1)  # [B,S,R,H,P]
    dt, trap = dt.to(dtype), trap.to(dtype)
    gamma = dt * torch.sigmoid(trap)
    nxt = torch.nn.functional.pad((dt * torch.sigmoid(-trap))[..., 1:], (0, 1))
    return qb, kb, qr, kr, psi_v, gamma, gamma + nxt


def chunked_forward(q, k, v, q_bias, k_bias, mimo_v, angles, da_cs, da_cs_rev, dt, trap, segsum,
                    d=None, chunk_size: int = 16, dtype=torch.float64):
    """raw_y [B,S,H,R,P], states [B,H,nc,N,P] and qk_dot [B,H,S,R,R] chunk by chunk.

    Uses da_cs, da_cs_rev and segsum as given; a partial last chunk is handled without padding.
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    C = chunk_size
    nc = math.ceil(S / C)
    qb, kb, qr, kr, psi_v, gamma, trap_scale = _prepare(q, k, v, q_bias, k_bias, mimo_v, angles,
                                                        dt, trap, dtype)
    da_cs, da_cs_rev, segsum = da_cs.to(dtype), da_cs_rev.to(dtype), segsum.to(dtype)
    qk_dot = torch.einsum("bsrhn,bsuhn->bhsru", qb, kb)
    state = torch.zeros(B, H, N, P, dtype=dtype, device=q.device)
    states, raw = [], []
    for c in range(nc):
        lo, hi = c * C, min(S, c * C + C)
        L = hi - lo
        states.append(state)
        qc, kc, pc = qr[:, lo:hi], kr[:, lo:hi], psi_v[:, lo:hi]  # [B,L,R,H,*]
        # inter-chunk: decayed entering state
        inter = torch.einsum("blrhn,bhnp->blrhp", qc, state)
        inter = inter * da_cs[:, :, lo:hi].exp().transpose(1, 2)[:, :, None, :, None]
        # intra-chunk: strictly causal decayed part plus the same-step gamma term
        scores = torch.einsum("blrhn,bmuhn->bhlrmu", qc, kc)
        tri = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
        decay = torch.where(tri, segsum[:, :, c, :L, :L].exp(), torch.zeros((), dtype=dtype,
                                                                            device=q.device))
        decay = decay * trap_scale[:, :, None, lo:hi]
        decay = decay + torch.diag_embed(gamma[:, :, lo:hi])
        intra = torch.einsum("bhlrmu,bhlm,bmuhp->blrhp", scores, decay, pc)
        y = inter + intra
        if d is not None:
            y = y + d.to(dtype)[None, None, None, :, None] * pc
        raw.append(y)
        if hi == c * C + C:  # the state after a partial last chunk is never needed
            w = trap_scale[:, :, lo:hi] * da_cs_rev[:, :, lo:hi].exp()  # [B,H,L]
            inc = torch.einsum("blrhn,bhl,blrhp->bhnp", kc, w, pc)
            state = state * da_cs[:, :, hi - 1].exp()[..., None, None] + inc
    raw_y = torch.cat(raw, 1).permute(0, 1, 3, 2, 4)  # [B,S,H,R,P]
    return raw_y, torch.stack(states, 2), qk_dot


def stepwise_raw_y(q, k, v, q_bias, k_bias, mimo_v, angles, adt, dt, trap, d=None,
                   dtype=torch.float64) -> Tensor:
    """raw_y [B,S,H,R,P] by a per-step recurrence on the full state (no chunks), from adt [B,H,S]."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    _, _, qr, kr, psi_v, gamma, trap_scale = _prepare(q, k, v, q_bias, k_bias, mimo_v, angles, dt,
                                                      trap, dtype)
    adt = adt.to(dtype)
    state = torch.zeros(B, H, N, P, dtype=dtype, device=q.device)
    out = []
    for t in range(S):
        state = state * adt[:, :, t].exp()[..., None, None]
        y = torch.einsum("brhn,bhnp->brhp", qr[:, t], state)
        diag = torch.einsum("brhn,buhn->bhru", qr[:, t], kr[:, t])
        y = y + gamma[:, None, :, t, None] * torch.einsum("bhru,buhp->brhp", diag, psi_v[:, t])
        if d is not None:
            y = y + d.to(dtype)[None, None, :, None] * psi_v[:, t]
        out.append(y)
        state = state + torch.einsum("brhn,bh,brhp->bhnp", kr[:, t], trap_scale[:, :, t], psi_v[:, t])
    return torch.stack(out, 1).permute(0, 1, 3, 2, 4)


def reduce_out(raw_y: Tensor, mimo_o: Tensor, mimo_z: Optional[Tensor] = None,
               z: Optional[Tensor] = None) -> Tensor:
    """out [B,S,H,P] = sum_r Phi * silu(z * Zeta) * raw_y. raw_y: [B,S,H,R,P]; Phi/Zeta [.., H,R,P]."""
    y = mimo_o[..., None, :, :, :] * raw_y if mimo_o.dim() == 4 else mimo_o * raw_y
    if mimo_z is not None:
        zeta = mimo_z[:, None] if mimo_z.dim() == 4 else mimo_z
        y = y * torch.nn.functional.silu(z[:, :, :, None, :] * zeta)
    return y.sum(3)


def bwd_fwd_reference(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt,
                      trap, segsum, mimo_z=None, d=None, z=None, chunk_size: int = 16,
                      rotary_dim_divisor: int = 4, dtype=torch.float64):
    """The 5-tuple of SPEC section 3 computed in `dtype` (no output rounding).

    states and qk_dot by direct recomputation; dmimo_o, dmimo_z and dz by autograd through
    reduce_out, with Phi and Zeta expanded per batch so that the gradients come per batch.
    """
    del rotary_dim_divisor  # implied by angles.shape[-1]
    raw_y, states, qk_dot = chunked_forward(q, k, v, q_bias, k_bias, mimo_v, angles, da_cs,
                                            da_cs_rev, dt, trap, segsum, d, chunk_size, dtype)
    B = q.shape[0]
    with torch.enable_grad():
        phi = mimo_o.to(dtype).expand(B, *mimo_o.shape).clone().requires_grad_(True)
        zeta = zt = None
        if mimo_z is not None:
            zeta = mimo_z.to(dtype).expand(B, *mimo_z.shape).clone().requires_grad_(True)
            zt = z.to(dtype).clone().requires_grad_(True)
        out = reduce_out(raw_y.detach(), phi, zeta, zt)
        out.backward(dout.to(dtype))
    dmimo_z = zeta.grad if zeta is not None else None
    dz = zt.grad if zt is not None else None
    return states, qk_dot, phi.grad, dmimo_z, dz


# ------------------------------------------------------------------------------------------------
# The whole operator `mamba3_mimo(...)` (SPEC sections 6 and 7), two independent float64 goldens:
# mamba3_mimo_reference (chunked, through chunked_forward) and mamba3_mimo_stepwise (the per-step
# recurrence of SPEC section 7). Both are plain differentiable torch code: `.backward()` gives
# every input gradient, initial_state included, and the state outputs are differentiable too.
# ------------------------------------------------------------------------------------------------


def _check_operator_args(Q, V, ADT, Angles, MIMO_Z, MIMO_Out, Z, rotary_dim_divisor, cu_seqlens,
                         fuse_pregate_headwise_rms_norm, initial_state) -> None:
    """ValueError for argument combinations that SPEC section 6 does not define."""
    B, S, R, G, N = Q.shape
    H = V.shape[2]
    if H % G != 0:
        raise ValueError(f"V has {H} heads, not a multiple of the {G} q/k heads of Q")
    if Z is not None and MIMO_Z is None:
        raise ValueError("Z needs MIMO_Z (MIMO_Z without Z is unused)")
    if Angles.shape[-1] != N // rotary_dim_divisor:
        raise ValueError(f"Angles has {Angles.shape[-1]} angles per head, expected "
                         f"N // rotary_dim_divisor = {N} // {rotary_dim_divisor}")
    if fuse_pregate_headwise_rms_norm and (MIMO_Out is None or Z is None):
        raise ValueError("fuse_pregate_headwise_rms_norm needs MIMO_Out, Z and MIMO_Z")
    if ADT.shape != (B, H, S):
        raise ValueError(f"ADT has shape {list(ADT.shape)}, expected {[B, H, S]}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got B = {B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != S or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to S = {S}, got {bounds}")
    if initial_state is not None and len(initial_state) != 4:
        raise ValueError("initial_state is a tuple (angle, state, k, v)")


def _running_angles(Angles: Tensor, DT: Tensor, angle0: Optional[Tensor], dtype) -> Tensor:
    """angles[t] = (angle0 + sum_{u<=t} tanh(Angles[u]) * pi * DT[u]) mod 2*pi, [B, S, H, RD].

    Angles [B, S, H, RD], DT [B, H, S], angle0 [B, H, RD] or None (zero). torch.remainder has
    gradient 1 with respect to its input, so the mod leaves every gradient unchanged.
    """
    step = torch.tanh(Angles.to(dtype)) * math.pi * DT.to(dtype).transpose(1, 2)[..., None]
    total = step.cumsum(1)
    if angle0 is not None:
        total = total + angle0.to(dtype)[:, None]
    return torch.remainder(total, 2 * math.pi)


def _output_stage(raw_y: Tensor, MIMO_Out, MIMO_Z, Z, fuse_norm: bool, norm_weight, norm_eps: float,
                  dtype) -> Tensor:
    """Gate and reduce of SPEC section 6 on raw_y [B, S, H, R, P] (D included).

    MIMO_Out None: the per-rank output gate * raw_y as [B, S, R, H, P]. Otherwise
    out [B, S, H, P] = sum_r MIMO_Out * silu(Z * MIMO_Z) * y with y = raw_y, or with the fused
    pre-gate headwise RMSNorm y = raw_y * rsqrt(mean_p(raw_y^2) + eps) * w[h, :].
    """
    H, P = raw_y.shape[2], raw_y.shape[4]
    zeta = None if Z is None else MIMO_Z.to(dtype)  # MIMO_Z without Z is unused
    z = None if Z is None else Z.to(dtype)
    if MIMO_Out is None:
        y = raw_y
        if zeta is not None:
            y = y * torch.nn.functional.silu(z[:, :, :, None, :] * zeta)
        return y.permute(0, 1, 3, 2, 4)
    y = raw_y
    if fuse_norm:
        w = (torch.ones(H, P, dtype=dtype, device=raw_y.device) if norm_weight is None
             else norm_weight.to(dtype).reshape(H, P))
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + norm_eps) * w[:, None, :]
    return reduce_out(y, MIMO_Out.to(dtype), zeta, z)


def _chunked_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, Angles, D, chunk_size,
                  initial_state, dtype):
    """raw_y [B, S, H, R, P] and (angle, state [B, H, P, N], k [B, R, H, N], v [B, H, P]) of one
    sequence per batch row, in the chunked form of SPEC section 2 (chunked_forward).

    An initial state enters by linearity: with h0 = state0 (read as [N, P]) plus the previous
    step's shifted term DT[0] * sigmoid(-Trap[0]) * sum_r k0[r] (x) v0 * MIMO_V[r], step t sees
    exp(A[t]) * h0 (A = cumsum(ADT), inclusive) on top of the zero-state chunked output, and the
    final state gets exp(A[S-1]) * h0.
    """
    angle0 = None if initial_state is None else initial_state[0]
    angles = _running_angles(Angles, DT, angle0, dtype)
    da_cs, da_cs_rev, segsum = decay_pieces(ADT.to(dtype), chunk_size)
    raw_y, _, _ = chunked_forward(Q, K, V, Q_bias, K_bias, MIMO_V, angles, da_cs, da_cs_rev, DT,
                                  Trap, segsum, D, chunk_size, dtype)
    _, _, qr, kr, psi_v, gamma, trap_scale = _prepare(Q, K, V, Q_bias, K_bias, MIMO_V, angles, DT,
                                                      Trap, dtype)
    A = ADT.to(dtype).cumsum(-1)  # [B, H, S]
    # final state = sum_t exp(A[S-1] - A[t]) trap_scale[t] kr[t] (x) PsiV[t]; _prepare's
    # trap_scale already has trap_scale[S-1] = gamma[S-1] (no next step inside the call)
    weight = (A[..., -1:] - A).exp() * trap_scale  # [B, H, S]
    state = torch.einsum("bsrhn,bhs,bsrhp->bhnp", kr, weight, psi_v)
    if initial_state is not None:
        _, state0, k0, v0 = initial_state
        shift0 = DT.to(dtype)[:, :, 0] * torch.sigmoid(-Trap.to(dtype)[:, :, 0])  # [B, H]
        psi_v0 = v0.to(dtype)[:, None] * MIMO_V.to(dtype).transpose(0, 1)  # [B, R, H, P]
        h0 = (state0.to(dtype).transpose(-1, -2)
              + shift0[..., None, None] * torch.einsum("brhn,brhp->bhnp", k0.to(dtype), psi_v0))
        from_h0 = torch.einsum("bsrhn,bhnp->bshrp", qr, h0)
        raw_y = raw_y + from_h0 * A.exp().transpose(1, 2)[..., None, None]
        state = state + A[..., -1].exp()[..., None, None] * h0
    final = (angles[:, -1], state.transpose(-1, -2), kr[:, -1], V[:, -1].to(dtype))
    return raw_y, final


def _stepwise_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, Angles, D, chunk_size,
                   initial_state, dtype):
    """Same results as _chunked_scan by the per-step recurrence of SPEC section 7 on the full state
    h [B, H, N, P]; chunk_size is ignored. No chunked code is involved."""
    del chunk_size
    B, S, R, G, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    angle0 = None if initial_state is None else initial_state[0]
    angles = _running_angles(Angles, DT, angle0, dtype)
    _, _, qr, kr, psi_v, gamma, _ = _prepare(Q, K, V, Q_bias, K_bias, MIMO_V, angles, DT, Trap,
                                             dtype)
    adt, dt, trap = ADT.to(dtype), DT.to(dtype), Trap.to(dtype)
    shift = dt * torch.sigmoid(-trap)  # [B, H, S]: weight of the previous step's k (x) PsiV
    if initial_state is None:
        h = torch.zeros(B, H, N, P, dtype=dtype, device=Q.device)
        prev_k = torch.zeros(B, R, H, N, dtype=dtype, device=Q.device)
        prev_psi_v = torch.zeros(B, R, H, P, dtype=dtype, device=Q.device)
    else:
        _, state0, k0, v0 = initial_state
        h = state0.to(dtype).transpose(-1, -2)
        prev_k = k0.to(dtype)
        prev_psi_v = v0.to(dtype)[:, None] * MIMO_V.to(dtype).transpose(0, 1)
    raw = []
    for t in range(S):
        previous = torch.einsum("brhn,brhp->bhnp", prev_k, prev_psi_v)
        current = torch.einsum("brhn,brhp->bhnp", kr[:, t], psi_v[:, t])
        h = (adt[:, :, t].exp()[..., None, None] * (h + shift[:, :, t, None, None] * previous)
             + gamma[:, :, t, None, None] * current)
        y = torch.einsum("brhn,bhnp->bhrp", qr[:, t], h)
        if D is not None:
            y = y + D.to(dtype)[:, None, None] * psi_v[:, t].transpose(1, 2)
        raw.append(y)
        prev_k, prev_psi_v = kr[:, t], psi_v[:, t]
    final = (angles[:, -1], h.transpose(-1, -2), kr[:, -1], V[:, -1].to(dtype))
    return torch.stack(raw, 1), final


def _whole_operator(scan, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
                    D, Z, chunk_size, rotary_dim_divisor, dtype, return_state, cu_seqlens,
                    fuse_pregate_headwise_rms_norm, outproj_norm_weight, outproj_norm_eps,
                    initial_state, compute_dtype):
    """The operator around one scan: packed sequences, the output stage, the output dtype."""
    _check_operator_args(Q, V, ADT, Angles, MIMO_Z, MIMO_Out, Z, rotary_dim_divisor, cu_seqlens,
                         fuse_pregate_headwise_rms_norm, initial_state)
    if cu_seqlens is None:
        raw_y, final = scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, Angles, D, chunk_size,
                            initial_state, compute_dtype)
    else:
        # each packed sequence is a batch row of its own: every running sum restarts
        bounds = [int(x) for x in cu_seqlens.tolist()]
        raws, finals = [], []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            init = None if initial_state is None else tuple(x[i:i + 1] for x in initial_state)
            raw_i, final_i = scan(Q[:, lo:hi], K[:, lo:hi], V[:, lo:hi], ADT[..., lo:hi],
                                  DT[..., lo:hi], Trap[..., lo:hi], Q_bias, K_bias, MIMO_V,
                                  Angles[:, lo:hi], D, chunk_size, init, compute_dtype)
            raws.append(raw_i)
            finals.append(final_i)
        raw_y = torch.cat(raws, 1)
        final = tuple(torch.cat(parts, 0) for parts in zip(*finals))
    out = _output_stage(raw_y, MIMO_Out, MIMO_Z, Z, fuse_pregate_headwise_rms_norm,
                        outproj_norm_weight, outproj_norm_eps, compute_dtype).to(dtype)
    if not return_state:
        return out
    return (out, *final)


def mamba3_mimo_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
                          D, Z, chunk_size, rotary_dim_divisor, dtype, return_state=False,
                          cu_seqlens=None, fuse_pregate_headwise_rms_norm=False,
                          outproj_norm_weight=None, outproj_norm_eps=1e-5, initial_state=None, *,
                          compute_dtype=torch.float64):
    """The whole operator of SPEC section 6 (plus initial_state, SPEC section 7), chunked form.

    Upstream's signature and argument order. Everything is computed in `compute_dtype` with
    differentiable torch ops; `out` is cast to `dtype` at the end. With return_state=True the
    result is (out, final_angle [B,H,RD], final_state [B,H,P,N], final_k [B,R,H,N],
    final_v [B,H,P]), one row per batch entry or per cu_seqlens sequence; these four stay in
    `compute_dtype` (a golden is not rounded; the operator writes angle and state in fp32) and are
    differentiable. initial_state is (angle [B,H,RD], state [B,H,P,N], k [B,R,H,N], v [B,H,P]) or
    None, one row per sequence with cu_seqlens.
    """
    return _whole_operator(_chunked_scan, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z,
                           MIMO_Out, Angles, D, Z, chunk_size, rotary_dim_divisor, dtype,
                           return_state, cu_seqlens, fuse_pregate_headwise_rms_norm,
                           outproj_norm_weight, outproj_norm_eps, initial_state, compute_dtype)


def mamba3_mimo_stepwise(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
                         D, Z, chunk_size, rotary_dim_divisor, dtype, return_state=False,
                         cu_seqlens=None, fuse_pregate_headwise_rms_norm=False,
                         outproj_norm_weight=None, outproj_norm_eps=1e-5, initial_state=None, *,
                         compute_dtype=torch.float64):
    """Same contract as mamba3_mimo_reference, computed independently of it by the per-step
    recurrence of SPEC section 7 on the full state (chunk_size is accepted and ignored)."""
    return _whole_operator(_stepwise_scan, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z,
                           MIMO_Out, Angles, D, Z, chunk_size, rotary_dim_divisor, dtype,
                           return_state, cu_seqlens, fuse_pregate_headwise_rms_norm,
                           outproj_norm_weight, outproj_norm_eps, initial_state, compute_dtype)
