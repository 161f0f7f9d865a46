"""Random problems for bwd_fwd and for the whole operator, built the way upstream's tests build
inputs (BENCHMARK.md).

Shared by the tests, the demo and the benchmark so that all three time and check the same data.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .problem import Shape, official_shapes  # noqa: F401 (re-exported for callers)
from .reference import decay_pieces


def make_inputs(shape: Shape, dtype: torch.dtype = torch.bfloat16, z_gate: bool = True,
                d_skip: bool = True, device="cpu", seed: int = 0,
                trap_dtype: Optional[torch.dtype] = None) -> Dict[str, object]:
    """Keyword arguments for mamba3_mimo_bwd_fwd; also returns 'adt' (the per-step log-decay).

    q, k, v, dout, z ~ randn in `dtype`; biases ~ randn; mimo_v, mimo_o ~ randn / R;
    mimo_z, d ~ randn; angles ~ rand; dt = softplus(-3 + randn); adt = -dt * rand;
    trap ~ rand (in `trap_dtype`, default `dtype`).
    """
    s = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size, dt=torch.float32):
        return torch.randn(*size, generator=gen).to(dt).to(device)

    def rand(*size, dt=torch.float32):
        return torch.rand(*size, generator=gen).to(dt).to(device)

    RD = s.N // s.rotary_dim_divisor
    dt = torch.nn.functional.softplus(-3.0 + randn(s.B, s.H, s.S))
    adt = -dt * rand(s.B, s.H, s.S)
    da_cs, da_cs_rev, segsum = decay_pieces(adt, s.C)
    args = dict(
        dout=randn(s.B, s.S, s.H, s.P, dt=dtype),
        q=randn(s.B, s.S, s.R, s.G, s.N, dt=dtype),
        k=randn(s.B, s.S, s.R, s.G, s.N, dt=dtype),
        v=randn(s.B, s.S, s.H, s.P, dt=dtype),
        q_bias=randn(s.H, s.R, s.N),
        k_bias=randn(s.H, s.R, s.N),
        mimo_v=randn(s.H, s.R, s.P) / s.R,
        mimo_o=randn(s.H, s.R, s.P) / s.R,
        angles=rand(s.B, s.S, s.H, RD),
        da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt,
        trap=rand(s.B, s.H, s.S, dt=trap_dtype or dtype),
        segsum=segsum,
        mimo_z=randn(s.H, s.R, s.P) if z_gate else None,
        d=randn(s.H) if d_skip else None,
        z=randn(s.B, s.S, s.H, s.P, dt=dtype) if z_gate else None,
        chunk_size=s.C,
        rotary_dim_divisor=s.rotary_dim_divisor,
    )
    args["adt"] = adt
    return args


def operator_inputs(shape: Shape, dtype: torch.dtype = torch.float64, z_gate: bool = True,
                    d_skip: bool = True, mimo_out: bool = True, dt_shift: float = -3.0,
                    device="cpu", seed: int = 0,
                    drawn_on_device: bool = False) -> Dict[str, object]:
    """Keyword arguments of the whole operator `mamba3_mimo` (SPEC section 6) but the optional
    ones: Q, K, V, Z ~ randn and Trap ~ rand in `dtype`; Q_bias, K_bias ~ randn; MIMO_V,
    MIMO_Out ~ randn / R; MIMO_Z, D ~ randn; Angles ~ rand; DT = softplus(dt_shift + randn);
    ADT = -DT * rand; the fp32 ones in float64 when dtype is float64 (a reference's inputs).
    Drawn in float64 on the CPU, the same values on every device; with drawn_on_device, in
    fp32 by a generator on `device` (fast for long sequences; other values)."""
    s = shape
    draw = dict(device=device, dtype=torch.float32) if drawn_on_device else dict(
        device="cpu", dtype=torch.float64)
    gen = torch.Generator(device=draw["device"]).manual_seed(seed)
    real = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*size, dt=real):
        return torch.randn(*size, generator=gen, **draw).to(device=device, dtype=dt)

    def rand(*size, dt=real):
        return torch.rand(*size, generator=gen, **draw).to(device=device, dtype=dt)

    B, S, H, R, P = s.B, s.S, s.H, s.R, s.P
    DT = torch.nn.functional.softplus(dt_shift + randn(B, H, S))
    return dict(
        Q=randn(B, S, R, s.G, s.N, dt=dtype), K=randn(B, S, R, s.G, s.N, dt=dtype),
        V=randn(B, S, H, P, dt=dtype), ADT=-DT * rand(B, H, S), DT=DT,
        Trap=rand(B, H, S, dt=dtype), Q_bias=randn(H, R, s.N), K_bias=randn(H, R, s.N),
        MIMO_V=randn(H, R, P) / R, MIMO_Z=randn(H, R, P) if z_gate else None,
        MIMO_Out=randn(H, R, P) / R if mimo_out else None, Angles=rand(B, S, H, s.RD),
        D=randn(H) if d_skip else None, Z=randn(B, S, H, P, dt=dtype) if z_gate else None,
        chunk_size=s.C, rotary_dim_divisor=s.rotary_dim_divisor, dtype=dtype)


def sweep_shapes() -> list:
    """Every R, N, P and rotary_dim_divisor value (not their product), G = H, and many chunks
    (a chunk count that is no multiple of the kernels' chunk grouping, with a partial last one)."""
    shapes = [Shape(1, 32, 2, 1, 16, 16, R, 16) for R in (1, 2, 3, 4, 8)]
    shapes += [Shape(1, 32, 2, 2, 64, 16, 2, 16, rotary_dim_divisor=rdd) for rdd in (2, 4)]
    shapes += [Shape(1, 16, 1, 1, 16, 16, 2, 8, rotary_dim_divisor=2)]
    # N = 256: step_terms' 16-step programs, three of them, the last one partial
    shapes += [Shape(1, 40, 1, 1, 256, 16, 2, 8), Shape(1, 16, 1, 1, 256, 128, 2, 8)]
    shapes += [Shape(1, 16, 1, 1, 16, P, 2, 8) for P in (64, 128)]
    shapes += [Shape(1, 32, 4, 4, 16, 16, 2, 16)]
    shapes += [Shape(1, 197, 3, 1, 16, 16, 2, 8), Shape(1, 100, 2, 1, 16, 16, 1, 4)]
    return shapes
