"""mamba3-mimo: Triton kernels for the Mamba-3 MIMO chunked scan.

Public entry points: `mamba3_mimo` (the whole differentiable operator, upstream's signature,
SPEC section 6) and `mamba3_mimo_bwd_fwd` (phase 1 of the backward, SPEC sections 1-5).
"""
from .phases.bwd_fwd import mamba3_mimo_bwd_fwd
from .phases.operator import mamba3_mimo

__all__ = ["mamba3_mimo", "mamba3_mimo_bwd_fwd"]
__version__ = "0.1.0"
