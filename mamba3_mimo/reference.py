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
