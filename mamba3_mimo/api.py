"""Public entry of the Mamba-3 MIMO bwd_fwd operator: argument checks, tail padding, dispatch.

`mamba3_mimo_bwd_fwd` keeps the seed's signature; `bwd_fwd` adds `impl` to force one
implementation ("stage0" baseline or "chunked" production) for tests and benchmarks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from . import dispatch

Tensor = torch.Tensor
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name: str, x, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    # one line of plain comparisons for a good argument, which is every call's case (the host's
    # time per call matters, optimisation.md step 39); the messages only for a bad one
    if isinstance(x, Tensor) and x.shape == shape and x.dtype in dtypes and x.device == device:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {x.device}")


def _validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
              segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 5:
        raise ValueError(f"q must have 5 dims [B, S, R, G, N], got shape {list(q.shape)}")
    if q.dtype not in _INPUT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    B, S, R, G, N = q.shape
    for name, val in (("B", B), ("S", S), ("R", R), ("G", G), ("N", N)):
        if val < 1:
            raise ValueError(f"q: dimension {name} must be >= 1, got shape {list(q.shape)}")
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError("v must be a 4-dim tensor [B, S, H, P]"
                         + (f", got shape {list(v.shape)}" if isinstance(v, torch.Tensor) else ""))
    H, P = v.shape[2], v.shape[3]
    if H < 1 or P < 1:
        raise ValueError(f"v: H and P must be >= 1, got shape {list(v.shape)}")
    if H % G != 0:
        raise ValueError(f"H (v.shape[2] = {H}) must be a multiple of G (q.shape[3] = {G})")
    if N % 2 != 0:
        raise ValueError(f"N (q.shape[4] = {N}) must be even")
    for name, val in (("chunk_size", chunk_size), ("rotary_dim_divisor", rotary_dim_divisor)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if rotary_dim_divisor < 1:
        raise ValueError(f"rotary_dim_divisor must be >= 1, got {rotary_dim_divisor}")
    RD = N // rotary_dim_divisor
    if RD < 1 or 2 * RD > N:
        raise ValueError(f"rotary_dim_divisor={rotary_dim_divisor} gives RD = N // divisor = {RD}; "
                         f"expected 1 <= RD <= N/2 = {N // 2}")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {[str(d) for d in _OUTPUT_DTYPES]}, "
                         f"got {output_dtype}")
    if (mimo_z is None) != (z is None):
        raise ValueError("mimo_z and z must be given together or both be None "
                         f"(got mimo_z={'None' if mimo_z is None else 'tensor'}, "
                         f"z={'None' if z is None else 'tensor'})")
    dev, x16 = q.device, (q.dtype,)
    f32 = (torch.float32,)
    nc = math.ceil(S / chunk_size)
    seq, hs, hrp = (B, S, H, P), (B, H, S), (H, R, P)
    checks = [("dout", dout, seq, x16), ("k", k, (B, S, R, G, N), x16), ("v", v, seq, x16),
              ("q_bias", q_bias, (H, R, N), f32), ("k_bias", k_bias, (H, R, N), f32),
              ("mimo_v", mimo_v, hrp, f32), ("mimo_o", mimo_o, hrp, f32),
              ("angles", angles, (B, S, H, RD), f32), ("da_cs", da_cs, hs, f32),
              ("da_cs_rev", da_cs_rev, hs, f32), ("dt", dt, hs, f32),
              ("trap", trap, hs, (torch.float32, q.dtype)),
              ("segsum", segsum, (B, H, nc, chunk_size, chunk_size), f32)]
    if mimo_z is not None:
        checks += [("mimo_z", mimo_z, hrp, f32), ("z", z, seq, x16)]
    if d is not None:
        checks.append(("d", d, (H,), f32))
    for name, x, shape, dtypes in checks:
        _check_tensor(name, x, shape, dtypes, dev)
    return dispatch.Problem(B=B, S=S, H=H, G=G, N=N, P=P, R=R, C=chunk_size, RD=RD,
                            dtype=q.dtype, has_z=z is not None, has_d=d is not None,
                            output_dtype=output_dtype, device=dev)


_ARG_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
              "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z")


def _signature(tensors: tuple, chunk_size, rotary_dim_divisor, output_dtype,
               impl) -> Optional[tuple]:
    """What `_validate`'s outcome and the dispatcher's plan depend on: each tensor's shape,
    strides, dtype and device (None for an absent one), and the other arguments. None for a
    call the cache does not take (a non-tensor where a tensor belongs, non-int sizes, stage 0):
    it goes the checked way and raises there if it is wrong."""
    if (type(chunk_size) is not int or type(rotary_dim_divisor) is not int
            or type(impl) is not str or impl not in ("auto", "chunked")
            or not any(output_dtype is t for t in _OUTPUT_DTYPES)):  # dtypes are singletons
        return None
    sig = []
    for x in tensors:
        if x is None:
            sig.append(None)
        elif isinstance(x, Tensor):
            sig.append((x.shape, x.stride(), x.dtype, x.device))
        else:
            return None
    return (chunk_size, rotary_dim_divisor, output_dtype, impl, tuple(sig))


def _pad_seq(x: Tensor, dim: int, n: int) -> Tensor:
    """Append n zeros along dim."""
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x, x.new_zeros(shape)], dim)


# sequence inputs with the step on dim 1 ([B, S, ...]) and on dim 2 ([B, H, S]; da_cs apart)
_STEP_DIM1 = ("dout", "q", "k", "v", "angles", "z")
_STEP_DIM2 = ("dt", "trap", "da_cs_rev")


def pad_tail(args: dict, chunk_size: int) -> dict:
    """SPEC section 4: pad every sequence input to whole chunks so padded steps contribute nothing.

    q, k, v, dout, angles, z, dt and trap get zeros (dt = 0 keeps trap_scale[S-1] = gamma[S-1]);
    da_cs is extended with its last valid value; da_cs_rev is 0 and segsum is rebuilt from the
    extended da_cs on the padded steps, keeping every given valid entry as it is.
    """
    S = args["q"].shape[1]
    C = chunk_size
    pad = math.ceil(S / C) * C - S
    if pad == 0:
        return args
    out = dict(args)
    for name in _STEP_DIM1:
        if out.get(name) is not None:
            out[name] = _pad_seq(out[name], 1, pad)
    for name in _STEP_DIM2:
        out[name] = _pad_seq(out[name], 2, pad)
    da_cs = args["da_cs"]
    out["da_cs"] = torch.cat([da_cs, da_cs[..., -1:].expand(*da_cs.shape[:-1], pad)], -1)
    last = out["da_cs"][..., -C:]  # the whole last chunk
    valid = C - pad
    seg = args["segsum"].clone()
    rebuilt = last[..., :, None] - last[..., None, :]
    i = torch.arange(C, device=seg.device)
    fill = (i[:, None] >= valid) & (i[:, None] > i[None, :])
    seg[:, :, -1] = torch.where(fill, rebuilt, torch.where(i[:, None] >= valid, 0.0, seg[:, :, -1]))
    out["segsum"] = seg
    return out


def split_chunks(args: dict, chunk_size: int, sub: int, S: int) -> dict:
    """The inputs of chunks of length chunk_size (padded to whole chunks, pad_tail) rewritten
    for chunks of length `sub`, a divisor: within a chunk, da_cs restarts after each sub-chunk
    (minus the value at the previous sub-chunk's end), da_cs_rev stops at the sub-chunk's end
    (minus its value there) and segsum keeps its diagonal [sub, sub] blocks. Differences of the
    given pieces on the host, as SPEC section 2 allows; the kernels then read them as given.
    Sub-chunks wholly past the S valid steps are dropped: the kernels expect ceil(S / sub)."""
    K = chunk_size // sub
    out = dict(args)
    B, H, S_pad = args["da_cs"].shape
    nc = S_pad // chunk_size
    da = args["da_cs"].reshape(B, H, nc, K, sub)
    before = torch.cat([torch.zeros_like(da[..., :1, -1]), da[..., :-1, -1]], -1)
    out["da_cs"] = (da - before[..., None]).reshape(B, H, S_pad)
    rev = args["da_cs_rev"].reshape(B, H, nc, K, sub)
    out["da_cs_rev"] = (rev - rev[..., -1:]).reshape(B, H, S_pad)
    seg = args["segsum"].reshape(B, H, nc, K, sub, K, sub)
    out["segsum"] = (torch.diagonal(seg, dim1=3, dim2=5).permute(0, 1, 2, 5, 3, 4)
                     .reshape(B, H, nc * K, sub, sub))
    n_sub = math.ceil(S / sub)
    for name in _STEP_DIM1:
        if out.get(name) is not None:
            out[name] = out[name][:, :n_sub * sub]
    for name in _STEP_DIM2 + ("da_cs",):
        out[name] = out[name][..., :n_sub * sub]
    out["segsum"] = out["segsum"][:, :, :n_sub]
    return out


def bwd_fwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
            mimo_v: Tensor, mimo_o: Tensor, angles: Tensor, da_cs: Tensor, da_cs_rev: Tensor,
            dt: Tensor, trap: Tensor, segsum: Tensor, mimo_z: Optional[Tensor] = None,
            d: Optional[Tensor] = None, z: Optional[Tensor] = None, chunk_size: int = 16,
            rotary_dim_divisor: int = 4, output_dtype: torch.dtype = torch.float32,
            impl: str = "auto"):
    """`mamba3_mimo_bwd_fwd` with a choice of implementation: "auto", "stage0" or "chunked"."""
    tensors = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
               segsum, mimo_z, d, z)
    signature = _signature(tensors, chunk_size, rotary_dim_divisor, output_dtype, impl)
    cached = None if signature is None else dispatch.cached_call(signature)
    if cached is not None:
        problem, plan = cached
        dispatch.check_device(problem.device)
        return dispatch.run_cached(problem, plan, dict(zip(_ARG_NAMES, tensors)))
    problem = _validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev,
                        dt, trap, segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor,
                        output_dtype)
    dispatch.check_device(problem.device)
    args = dict(zip(_ARG_NAMES, tensors))
    padded = pad_tail(args, chunk_size)
    sub = dispatch.kernel_chunk_size(chunk_size, problem.R)
    if sub == chunk_size:
        # a call that runs on its own tensors (no tail to pad) can skip the checks next time
        return dispatch.run(problem, padded, impl, signature if padded is args else None)
    args = padded
    # chunks beyond the kernels' tiles run as sub-chunks; `states` keeps the model's chunks
    outs = dispatch.run(dataclasses.replace(problem, C=sub),
                        split_chunks(args, chunk_size, sub, problem.S), impl)
    return (outs[0][:, :, ::chunk_size // sub].contiguous(),) + outs[1:]


def mamba3_mimo_bwd_fwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor,
                        k_bias: Tensor, mimo_v: Tensor, mimo_o: Tensor, angles: Tensor,
                        da_cs: Tensor, da_cs_rev: Tensor, dt: Tensor, trap: Tensor,
                        segsum: Tensor, mimo_z: Optional[Tensor] = None,
                        d: Optional[Tensor] = None, z: Optional[Tensor] = None,
                        chunk_size: int = 16, rotary_dim_divisor: int = 4,
                        output_dtype: torch.dtype = torch.float32
                        ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Phase 1 of the Mamba-3 MIMO backward (SPEC sections 1-5).

    Shapes: dout, v, z [B,S,H,P]; q, k [B,S,R,G,N]; q_bias, k_bias [H,R,N]; mimo_v, mimo_o,
    mimo_z [H,R,P]; angles [B,S,H,N//rotary_dim_divisor]; da_cs, da_cs_rev, dt, trap [B,H,S];
    segsum [B,H,ceil(S/C),C,C]; d [H].

    Returns (states [B,H,nchunks,N,P], qk_dot [B,H,S,R,R], dmimo_o [B,H,R,P] fp32,
    dmimo_z [B,H,R,P] fp32 or None, dz [B,S,H,P] or None); states, qk_dot and dz are written in
    output_dtype. Raises ValueError/TypeError naming a bad argument and NotImplementedError on an
    unsupported device (CPU without TRITON_INTERPRET=1, CUDA older than sm_80) or for R > 128.
    Chunks larger than the kernels' tiles run as sub-chunks (split_chunks)."""
    return bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt,
                   trap, segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
