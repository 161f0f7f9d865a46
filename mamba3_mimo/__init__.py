"""mamba3-mimo: Triton kernels for the Mamba-3 MIMO chunked scan (bwd_fwd phase)."""
from .api import bwd_fwd, mamba3_mimo_bwd_fwd

__all__ = ["mamba3_mimo_bwd_fwd", "bwd_fwd"]
__version__ = "0.1.0"
