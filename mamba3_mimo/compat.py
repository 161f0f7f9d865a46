"""A one-line switch for code written against upstream's module paths: after `install()`,
`from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo` (as upstream's Mamba3 module
and flash-linear-attention's Mamba3 layer import it) gives this package's `mamba3_mimo`, and the
decode path's `apply_rotary_qk_inference_fwd` and `mamba3_step_fn` (upstream.py) answer under
theirs, without mamba_ssm, TileLang or CuTe installed.

    import mamba3_mimo.compat
    mamba3_mimo.compat.install()   # before importing the code that imports upstream's path
    import fla.layers              # flash-linear-attention resolves the import at its import

install() registers modules in sys.modules only: nothing is written to disk, and uninstall()
removes exactly what install() added (or restores what force=True replaced).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict, Optional

from . import upstream
from .phases.operator import mamba3_mimo

TARGET = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo"
# every module install() provides, with what it exposes
MODULES = {
    TARGET: {"mamba3_mimo": mamba3_mimo},
    "mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step": {
        "apply_rotary_qk_inference_fwd": upstream.apply_rotary_qk_inference_fwd},
    "mamba_ssm.ops.cute.mamba3.mamba3_step_fn": {"mamba3_step_fn": upstream.mamba3_step_fn},
}

# what install() changed: module name -> the sys.modules entry it replaced (None: it added one)
_replaced: Dict[str, Optional[types.ModuleType]] = {}


def installed() -> bool:
    """Whether upstream's paths answer with this package's functions now."""
    return all(getattr(sys.modules.get(name), attr, None) is fn
               for name, exposed in MODULES.items() for attr, fn in exposed.items())


def _upstream_present() -> bool:
    """Whether a real mamba_ssm is importable (found on sys.path or already imported)."""
    if "mamba_ssm" in sys.modules:
        return "mamba_ssm" not in _replaced
    return importlib.util.find_spec("mamba_ssm") is not None


def _module(name: str, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, "registered by mamba3_mimo.compat.install()")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    return module


def install(force: bool = False) -> bool:
    """Make upstream's paths (MODULES) give this package's operator and decode functions.

    Where a real mamba_ssm is installed, nothing changes unless force=True, which replaces only
    these modules (upstream's other modules stay). Idempotent. Returns whether upstream's paths
    now give this package's functions."""
    if installed():
        return True
    if _upstream_present() and not force:
        return False
    for target, exposed in MODULES.items():
        _install_module(target, exposed, force)
    return True


def _install_module(target: str, exposed: dict, force: bool) -> None:
    """Register `target` exposing `exposed`, with the packages above it where absent."""
    parts = target.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        leaf = depth == len(parts)
        if not leaf and name not in sys.modules and force:
            try:  # upstream's own package at this level, where it imports
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - e.g. TileLang missing: stand in for it
                pass
        existing = sys.modules.get(name)
        if existing is not None and not leaf:
            continue  # a package already there (upstream's, or added above): keep it
        module = _module(name, package=not leaf)
        if leaf:
            module.__dict__.update(exposed)
            module.__all__ = list(exposed)
        if name not in _replaced:
            _replaced[name] = existing
        sys.modules[name] = module
        if depth > 1:
            setattr(sys.modules[".".join(parts[:depth - 1])], parts[depth - 1], module)


def uninstall() -> None:
    """Undo install(): remove the modules it added and restore those it replaced."""
    for name in sorted(_replaced, key=len, reverse=True):
        previous = _replaced.pop(name)
        parent, _, child = name.rpartition(".")
        if previous is None:
            sys.modules.pop(name, None)
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
                delattr(sys.modules[parent], child)
        else:
            sys.modules[name] = previous
            if parent in sys.modules:
                setattr(sys.modules[parent], child, previous)
