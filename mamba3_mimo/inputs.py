"""Random problem generator for bwd_fwd, built the way upstream's tests build inputs (BENCHMARK.md).

Shared by the tests, the demo and the benchmark so that all three time and check the same data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .reference import decay_pieces


@dataclass(frozen=True)
class Shape:
    """One bwd_fwd problem size; `name` follows BENCHMARK.md (N{N}_P{P}_R{R}_C{C})."""
    B: int
    S: int
    H: int
    G: int
    N: int
    P: int
    R: int
    C: int
    rotary_dim_divisor: int = 4

    @property
    def name(self) -> str:
        return f"N{self.N}_P{self.P}_R{self.R}_C{self.C}"


def official_shapes(B: int = 4, S: int = 2048, H: int = 16, G: int = 1) -> list:
    """The eleven shapes of BENCHMARK.md's official grid."""
    grid = [(16, 64, 4, 8), (32, 64, 4, 16), (64, 64, 4, 16), (128, 64, 4, 16), (256, 64, 4, 8),
            (64, 128, 4, 16), (128, 32, 4, 16), (128, 128, 4, 8), (128, 64, 8, 8),
            (128, 64, 2, 32), (128, 64, 1, 64)]
    return [Shape(B, S, H, G, N, P, R, C) for N, P, R, C in grid]


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
