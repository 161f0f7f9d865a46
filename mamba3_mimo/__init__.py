"""mamba3-mimo: Triton kernels for the Mamba-3 MIMO chunked scan.

Public entry points: `mamba3_mimo` (the whole differentiable operator, upstream's signature,
SPEC section 6), `mamba3_mimo_step` (one decode step updating a state in place, SPEC section 7)
and `mamba3_mimo_bwd_fwd` (phase 1 of the backward, SPEC sections 1-5).
"""
from .phases.bwd_fwd import mamba3_mimo_bwd_fwd
from .phases.operator import mamba3_mimo
from .phases.step import mamba3_mimo_step

__all__ = ["mamba3_mimo", "mamba3_mimo_bwd_fwd", "mamba3_mimo_step"]
__version__ = "0.1.0"
