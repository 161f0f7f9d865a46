"""`mamba3_mimo_step`: one decode step of the Mamba-3 MIMO operator for inference (SPEC section 7),
updating a preallocated state in place: the argument checks and the launch of kernels/decode.py.
Its outputs equal the whole operator's: prefill S tokens with `mamba3_mimo(...,
return_state=True)`, then step T tokens, and the outputs are the forward's over S + T tokens."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels import decode
from ..runtime.device import check_device, on_device
from ..runtime.plans import placeholder
from .bwd_fwd import check_tensor
from .operator import SEQ_DIM

Tensor = torch.Tensor
# the operator's arguments that a step does not take
CALL_ONLY = ("chunk_size", "rotary_dim_divisor", "dtype", "return_state", "cu_seqlens",
             "initial_state")


def step_arguments(args: dict, t: int) -> dict:
    """The arguments of mamba3_mimo_step for step t of a call's keyword arguments `args` (the
    per-step inputs at step t, the weights as they are, the call-only options dropped)."""
    out = {k: v for k, v in args.items() if k not in CALL_ONLY}
    for name, dim in SEQ_DIM.items():
        if out.get(name) is not None:
            out[name] = out[name].select(dim, t)
    return out


def mamba3_mimo_step(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor,
                     Q_bias: Tensor, K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor],
                     MIMO_Out: Optional[Tensor], Angles: Tensor, D: Optional[Tensor],
                     Z: Optional[Tensor], state: Tuple[Tensor, Tensor, Tensor, Tensor],
                     fuse_pregate_headwise_rms_norm: bool = False,
                     outproj_norm_weight: Optional[Tensor] = None,
                     outproj_norm_eps: float = 1e-5, out: Optional[Tensor] = None) -> Tensor:
    """One token per batch entry through the operator, from and into `state`.

    Shapes (one step, no S axis): Q, K [B, R, G, N]; V, Z [B, H, P]; ADT, DT, Trap [B, H];
    Q_bias, K_bias [H, R, N]; MIMO_V, MIMO_Z, MIMO_Out [H, R, P]; Angles [B, H, RD]; D [H];
    outproj_norm_weight [H, P] or [H * P]. state: (angle [B, H, RD], state [B, H, P, N],
    k [B, R, H, N], all fp32 contiguous, and v [B, H, P] in V's dtype or fp32, contiguous), as
    `mamba3_mimo(..., return_state=True)` returns them; updated in place to the state after
    this step. Returns the step's output [B, H, P] in Q's dtype ([B, R, H, P] with
    MIMO_Out=None), written into `out` when given (no allocation: a step can then be captured
    in a CUDA graph). Deterministic. Raises TypeError / ValueError naming a bad argument."""
    if not isinstance(Q, Tensor) or Q.dim() != 4:
        raise ValueError("Q must be a tensor [B, R, G, N]")
    if not isinstance(V, Tensor) or V.dim() != 3:
        raise ValueError("V must be a tensor [B, H, P]")
    B, R, G, N = Q.shape
    H, P = V.shape[1], V.shape[2]
    if N % 2 or H % G or not isinstance(Angles, Tensor) or Angles.dim() != 3:
        raise ValueError(f"N must be even, H a multiple of G and Angles [B, H, RD]; got N={N}, "
                         f"H={H}, G={G}")
    RD = Angles.shape[-1]
    if not 1 <= RD <= N // 2:
        raise ValueError(f"Angles' last dimension must be in 1..N/2 = {N // 2}, got {RD}")
    if not isinstance(state, (tuple, list)) or len(state) != 4:
        raise TypeError("state must be a tuple (angle, state, k, v), as return_state=True "
                        "returns it")
    fuse_norm = bool(fuse_pregate_headwise_rms_norm)
    if Z is not None and MIMO_Z is None:
        raise ValueError("Z needs MIMO_Z, the gate's projection [H, R, P]")
    if fuse_norm and (MIMO_Out is None or Z is None):
        raise ValueError("fuse_pregate_headwise_rms_norm needs MIMO_Out, Z and MIMO_Z")
    dev, x16, f32 = Q.device, (Q.dtype,), (torch.float32,)
    angle, h_state, k_prev, v_prev = state
    checks = [("K", K, (B, R, G, N), x16), ("V", V, (B, H, P), x16),
              ("ADT", ADT, (B, H), f32), ("DT", DT, (B, H), f32),
              ("Trap", Trap, (B, H), (torch.float32, Q.dtype)),
              ("Q_bias", Q_bias, (H, R, N), f32), ("K_bias", K_bias, (H, R, N), f32),
              ("MIMO_V", MIMO_V, (H, R, P), f32), ("Angles", Angles, (B, H, RD), f32),
              ("state[0] (angle)", angle, (B, H, RD), f32),
              ("state[1] (state)", h_state, (B, H, P, N), f32),
              ("state[2] (k)", k_prev, (B, R, H, N), f32),
              ("state[3] (v)", v_prev, (B, H, P), (V.dtype, torch.float32))]
    if Z is not None:
        checks += [("MIMO_Z", MIMO_Z, (H, R, P), f32), ("Z", Z, (B, H, P), x16)]  # else unused
    if MIMO_Out is not None:
        checks.append(("MIMO_Out", MIMO_Out, (H, R, P), f32))
    if D is not None:
        checks.append(("D", D, (H,), f32))
    if outproj_norm_weight is not None:
        if not fuse_norm:
            raise ValueError("outproj_norm_weight is only used with fuse_pregate_headwise_rms_norm")
        flat = outproj_norm_weight.dim() == 1
        checks.append(("outproj_norm_weight", outproj_norm_weight, (H * P,) if flat else (H, P),
                       f32))
    out_shape = (B, H, P) if MIMO_Out is not None else (B, R, H, P)
    if out is not None:
        checks.append(("out", out, out_shape, x16))
    for name, x, shape, dtypes in checks:
        check_tensor(name, x, shape, dtypes, dev)
    for name, x in (("state[0] (angle)", angle), ("state[1] (state)", h_state),
                    ("state[2] (k)", k_prev), ("state[3] (v)", v_prev)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is updated in place")
    check_device(dev)
    if out is None:
        out = torch.empty(out_shape, device=dev, dtype=Q.dtype)
    # under torch.compile the launch is the custom op below (the checks above ran at trace time)
    run = _step_op if torch.compiler.is_compiling() else _step
    run(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
        outproj_norm_weight, angle, h_state, k_prev, v_prev, out, fuse_norm,
        float(outproj_norm_eps))
    return out


def _step(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor, Q_bias: Tensor,
          K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor], MIMO_Out: Optional[Tensor],
          Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
          norm_weight: Optional[Tensor], angle: Tensor, state: Tensor, k_prev: Tensor,
          v_prev: Tensor, out: Tensor, fuse_norm: bool, eps: float) -> None:
    """The launch of a checked step (mamba3_mimo_step's arguments; the four state tensors and
    out written in place)."""
    dev = Q.device
    stand = placeholder(dev)
    with on_device(dev):
        decode.launch(q=Q, k=K, v=V, z=stand if Z is None else Z, adt=ADT, dt=DT, trap=Trap,
                      q_bias=Q_bias.contiguous(), k_bias=K_bias.contiguous(),
                      mimo_v=MIMO_V.contiguous(),
                      mimo_z=stand if Z is None else MIMO_Z.contiguous(),
                      mimo_o=stand if MIMO_Out is None else MIMO_Out.contiguous(),
                      angles_raw=Angles, d=stand if D is None else D,
                      norm_w=(stand if norm_weight is None
                              else norm_weight.reshape(-1).contiguous()),
                      angle=angle, state=state, k_prev=k_prev, v_prev=v_prev, out=out,
                      eps=eps, has_z=Z is not None, has_d=D is not None,
                      has_out=MIMO_Out is not None, norm=fuse_norm,
                      norm_w_given=norm_weight is not None, precision=_precision(dev))


# Under torch.compile the step is this custom op, which mutates the state and out in place
# (no graph break; a compiled decode loop can be captured in a CUDA graph).
_step_op = torch.library.custom_op(
    "mamba3_mimo::decode_step", _step,
    mutates_args=("angle", "state", "k_prev", "v_prev", "out"))


@_step_op.register_fake
def _step_fake(*args) -> None:
    return None


def _precision(device: torch.device) -> str:
    """The dots' input precision: fp32 operands exact in the interpreter; on the GPU tf32x3,
    as the operator's fp16 and fp32 calls (a step's dots are tiny)."""
    return "ieee" if device.type == "cpu" else "tf32x3"
