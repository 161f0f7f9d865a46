"""Where the kernels may run: the Triton interpreter check, device checks, compute capability
and the guard that makes a call launch on its inputs' device."""
from __future__ import annotations

import contextlib
import os
from typing import ContextManager, Dict, Tuple

import torch

# compute capability per CUDA device: the query costs the host microseconds per call
_capability: Dict[torch.device, Tuple[int, int]] = {}


def interpreter_active() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1). Triton
    reads the variable when a kernel is decorated, so it must be set before the kernels are
    imported; this reads it as it is now."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compute_capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) of a CUDA device, cached."""
    cc = _capability.get(device)
    if cc is None:
        cc = _capability[device] = torch.cuda.get_device_capability(device)
    return cc


def check_device(device: torch.device) -> None:
    """Raise NotImplementedError for a device the kernels cannot run on: CPU tensors without the
    interpreter, CUDA tensors with it, CUDA older than sm_80, any other device type."""
    if device.type == "cpu":
        if not interpreter_active():
            raise NotImplementedError(
                "mamba3_mimo on CPU tensors needs the Triton interpreter (set TRITON_INTERPRET=1 "
                "before importing triton); use a CUDA device otherwise")
        return
    if device.type != "cuda":
        raise NotImplementedError(f"device {device} is not supported; expected cuda (sm_80+)")
    if interpreter_active():
        raise NotImplementedError("TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only")
    major, minor = compute_capability(device)
    if major < 8:
        raise NotImplementedError(
            f"device {device} has compute capability {major}.{minor}; expected sm_80 or newer")


_ALREADY_CURRENT = contextlib.nullcontext()


def on_device(device: torch.device) -> ContextManager:
    """A context in which `device` is the current CUDA device, for the launches inside (Triton
    launches on the current device and stream, whatever device the tensors are on); the
    previous device is current again after it. Where it already is current, the common case,
    a context that does nothing (no generator on every call); a CPU device is left alone."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _ALREADY_CURRENT
    return torch.cuda.device(device)


def clear_cache() -> None:
    """Forget the devices' capabilities (tests that pretend another GPU)."""
    _capability.clear()
