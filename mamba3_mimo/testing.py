"""Error measures and thresholds shared by the tests, the demo and the benchmark: one definition
of how a result is compared with the float64 reference."""
from __future__ import annotations

import torch

# relative RMS error allowed against the float64 reference, by input dtype
THRESHOLDS = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 5e-3}
# bwd_fwd's outputs, in the order it returns them
OUTPUTS = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
# those written in output_dtype (the others in fp32)
SEQ_OUTPUT_DTYPE = ("states", "qk_dot", "dz")
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (absolute ||x - ref|| when ref is all zeros)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref| in float64."""
    x, ref = x.double(), ref.double()
    den = ref.abs().max().item() if ref.numel() else 0.0
    num = (x - ref).abs().max().item() if ref.numel() else 0.0
    return num / den if den > 0 else num


def threshold(input_dtype: torch.dtype, written_dtype: torch.dtype) -> float:
    """The relative RMS threshold of an output written in written_dtype from inputs in
    input_dtype: the looser of the two dtypes' thresholds."""
    return max(THRESHOLDS[input_dtype], THRESHOLDS[written_dtype])
