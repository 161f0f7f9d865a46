"""Upstream's decode entry points, under their names and signatures, on this package's kernels:
`apply_rotary_qk_inference_fwd` (mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step) and
`mamba3_step_fn` (mamba_ssm.ops.cute.mamba3.mamba3_step_fn, a CuTe kernel upstream), which
flash-linear-attention's Mamba3 layer calls one after the other for each generated token.
`compat.install()` registers them under upstream's module paths."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .kernels import decode
from .phases.bwd_fwd import check_tensor
from .phases.step import _precision
from .runtime.device import check_device, on_device
from .runtime.plans import placeholder

Tensor = torch.Tensor
TWO_PI = 2 * math.pi


def apply_rotary_qk_inference_fwd(q: Tensor, k: Tensor, angle_state: Tensor, angle_proj: Tensor,
                                  dt: Tensor, bias_q: Optional[Tensor] = None,
                                  bias_k: Optional[Tensor] = None, inplace: bool = False,
                                  conjugate: bool = False,
                                  rotate_pairwise: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """(q_out, k_out, next angle_state): the decode step's rotation, as upstream's.

    q, k [B, R, H, N] (any strides, e.g. expanded over the heads); angle_state, angle_proj
    [B, H, RD]; dt [B, H]; bias_q, bias_k [R, H, N] or None. The next angle is angle_state +
    tanh(angle_proj) pi dt, kept mod 2*pi (upstream leaves it unreduced; the cosines and sines
    are the same, and the operator's final angle is reduced too). q + bias_q and k + bias_k are
    rotated by it on their first RD pairs: pairs (i, N/2 + i) (rotate-half, the MIMO
    operator's) or, with rotate_pairwise, (2i, 2i + 1); by minus the angle with `conjugate`.
    q_out, k_out in q's dtype, contiguous; with `inplace` the three results are written into q,
    k and angle_state and returned."""
    if not all(isinstance(x, Tensor) for x in (q, k, angle_state, angle_proj, dt)):
        raise TypeError("q, k, angle_state, angle_proj and dt must be tensors")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, R, H, N] of one shape, got {list(q.shape)} and "
                         f"{list(k.shape)}")
    Bsz, R, H, N = q.shape
    RD = angle_state.shape[-1]
    if N % 2 or not 1 <= RD <= N // 2:
        raise ValueError(f"N must be even and angle_state's last dimension in 1..N/2, got N={N}, "
                         f"{RD}")
    for name, x, shape in (("angle_state", angle_state, (Bsz, H, RD)),
                           ("angle_proj", angle_proj, (Bsz, H, RD)), ("dt", dt, (Bsz, H)),
                           ("bias_q", bias_q, (R, H, N)), ("bias_k", bias_k, (R, H, N))):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    f32 = torch.float32
    angle = angle_state.to(f32) + torch.tanh(angle_proj.to(f32)) * math.pi * dt.to(f32)[..., None]
    angle = torch.remainder(angle, TWO_PI)
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]  # [B, 1, H, RD]
    if conjugate:
        sin = -sin

    def rotate(x: Tensor, bias: Optional[Tensor]) -> Tensor:
        x = x.to(f32) if bias is None else x.to(f32) + bias.to(f32)
        if rotate_pairwise:
            x1, x2 = x[..., 0:2 * RD:2], x[..., 1:2 * RD:2]
        else:
            x1, x2 = x[..., :RD], x[..., N // 2:N // 2 + RD]
        r1, r2 = cos * x1 - sin * x2, sin * x1 + cos * x2
        out = x.clone()
        if rotate_pairwise:
            out[..., 0:2 * RD:2], out[..., 1:2 * RD:2] = r1, r2
        else:
            out[..., :RD], out[..., N // 2:N // 2 + RD] = r1, r2
        return out.to(q.dtype)

    q_out, k_out = rotate(q, bias_q), rotate(k, bias_k)
    if inplace:
        q.copy_(q_out)
        k.copy_(k_out)
        angle_state.copy_(angle)
        return q, k, angle_state
    return q_out, k_out, angle.to(angle_state.dtype)


def mamba3_step_fn(state: Tensor, Bstate: Tensor, Xstate: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor, x: Tensor, dt: Tensor, trap: Tensor, xproj: Tensor,
                   outproj: Optional[Tensor] = None, state_out: Optional[Tensor] = None,
                   out: Optional[Tensor] = None, z: Optional[Tensor] = None,
                   zproj: Optional[Tensor] = None, state_batch_indices: Optional[Tensor] = None,
                   update_kv_state: bool = False, tile_D: int = 64,
                   num_warps: int = 2) -> Optional[Tensor]:
    """One decode step from q and k already rotated (apply_rotary_qk_inference_fwd), as
    upstream's: with alpha = exp(A dt),

        state <- alpha state + dt trap sum_r B[r] (x) x xproj[r]
                 + alpha dt (1 - trap) sum_r Bstate[r] (x) Xstate xproj[r]
        out_r  = C[r] . state + D x xproj[r], times silu(z zproj[r]) with z,
        out    = sum_r out_r outproj[r], or out_r per rank without outproj.

    state [B, H, P, N] fp32 contiguous, updated in place (or the new state written into
    state_out, state left as it was); Bstate [B, R, H, N] and Xstate [B, H, P], contiguous, of
    any float dtype, read only (the caller stores this step's B and x into them afterwards, as
    upstream's callers do); A, dt, trap [B, H] fp32 (trap = sigmoid(Trap), A the decay rate:
    the operator's ADT is A dt; trap may also be in x's dtype); B, C [B, R, H, N]; D [H] fp32;
    x, z [B, H, P]; xproj, zproj, outproj [R, H, P] fp32 (zproj unused without z). out
    [B, H, P], or [B, R, H, P] without outproj, in x's dtype; allocated when None and returned.
    tile_D and num_warps (upstream's CuTe tiling) are accepted and ignored; state_batch_indices
    and update_kv_state are not supported."""
    if state_batch_indices is not None or update_kv_state:
        raise NotImplementedError("mamba3_step_fn: state_batch_indices and update_kv_state are "
                                  "not supported; index the state pools before the call")
    if not isinstance(x, Tensor) or x.dim() != 3 or not isinstance(B, Tensor) or B.dim() != 4:
        raise ValueError("x must be a tensor [B, H, P] and B a tensor [B, R, H, N]")
    Bsz, H, P = x.shape
    R, N = B.shape[1], B.shape[3]
    dev, f32 = x.device, (torch.float32,)
    if z is not None and zproj is None:
        raise ValueError("z needs zproj, the gate's projection [R, H, P]")
    out_shape = (Bsz, H, P) if outproj is not None else (Bsz, R, H, P)
    if out is None:
        out = torch.empty(out_shape, device=dev, dtype=x.dtype)
    checks = [("state", state, (Bsz, H, P, N), f32), ("Bstate", Bstate, (Bsz, R, H, N), None),
              ("Xstate", Xstate, (Bsz, H, P), None), ("A", A, (Bsz, H), f32),
              ("B", B, (Bsz, R, H, N), None), ("C", C, (Bsz, R, H, N), (B.dtype,)),
              ("D", D, (H,), f32), ("dt", dt, (Bsz, H), f32),
              ("trap", trap, (Bsz, H), (torch.float32, x.dtype)),
              ("xproj", xproj, (R, H, P), f32), ("out", out, out_shape, (x.dtype,))]
    if state_out is not None:
        checks.append(("state_out", state_out, (Bsz, H, P, N), f32))
    if z is not None:
        checks += [("z", z, (Bsz, H, P), (x.dtype,)), ("zproj", zproj, (R, H, P), f32)]
    if outproj is not None:
        checks.append(("outproj", outproj, (R, H, P), f32))
    for name, t, shape, dtypes in checks:
        check_tensor(name, t, shape, dtypes or (t.dtype if isinstance(t, Tensor) else None,),
                     dev)
    for name, t in (("state", state if state_out is None else state_out), ("Bstate", Bstate),
                    ("Xstate", Xstate)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_device(dev)
    if state_out is not None:
        state = state_out.copy_(state)
    stand = placeholder(dev)
    # upstream's projections are [R, H, P]; the kernel reads [H, R, P]
    heads_first = lambda t: t.transpose(0, 1).contiguous()  # noqa: E731
    with on_device(dev):
        decode.launch(q=C, k=B, v=x, z=stand if z is None else z, adt=A, dt=dt, trap=trap,
                      q_bias=stand, k_bias=stand, mimo_v=heads_first(xproj),
                      mimo_z=stand if z is None else heads_first(zproj),
                      mimo_o=stand if outproj is None else heads_first(outproj),
                      angles_raw=A[..., None], d=D, norm_w=stand, angle=stand, state=state,
                      k_prev=Bstate, v_prev=Xstate, out=out, eps=0.0, has_z=z is not None,
                      has_d=True, has_out=outproj is not None, norm=False, norm_w_given=False,
                      precision=_precision(dev), prepared=True)
    return out
