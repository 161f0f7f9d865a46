"""The dimensions of a problem, named as in SPEC.md: `Shape` (sizes only, as the benchmark and
tests name them) and `Problem` (a validated call: a Shape with dtypes, optional inputs and
device)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


@dataclass(frozen=True)
class Shape:
    """Sizes of one problem: batch B, length S, value heads H, q/k groups G, q/k head dim N,
    value head dim P, rank R, chunk_size C; `name` follows BENCHMARK.md (N{N}_P{P}_R{R}_C{C})."""
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

    @property
    def RD(self) -> int:
        """Rotated pairs: N // rotary_dim_divisor."""
        return self.N // self.rotary_dim_divisor


@dataclass(frozen=True, kw_only=True)
class Problem(Shape):
    """One validated call: its Shape, the input dtype, which optional inputs are given (Z gate
    with its mimo_z, D skip), the output dtype and the device."""
    dtype: torch.dtype
    has_z: bool
    has_d: bool
    output_dtype: torch.dtype
    device: torch.device


def official_shapes(B: int = 4, S: int = 2048, H: int = 16, G: int = 1) -> List[Shape]:
    """The eleven shapes of BENCHMARK.md's official grid."""
    grid = [(16, 64, 4, 8), (32, 64, 4, 16), (64, 64, 4, 16), (128, 64, 4, 16), (256, 64, 4, 8),
            (64, 128, 4, 16), (128, 32, 4, 16), (128, 128, 4, 8), (128, 64, 8, 8),
            (128, 64, 2, 32), (128, 64, 1, 64)]
    return [Shape(B, S, H, G, N, P, R, C) for N, P, R, C in grid]
