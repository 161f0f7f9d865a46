"""A one-line switch for code written against upstream's module path: after `install()`,
`from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo` (as upstream's Mamba3 module
and flash-linear-attention's Mamba3 layer import it) gives this package's `mamba3_mimo`, without
mamba_ssm or TileLang installed.

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

from .phases.operator import mamba3_mimo

TARGET = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo"

# what install() changed: module name -> the sys.modules entry it replaced (None: it added one)
_replaced: Dict[str, Optional[types.ModuleType]] = {}


def installed() -> bool:
    """Whether upstream's path answers with this package's operator now."""
    return getattr(sys.modules.get(TARGET), "mamba3_mimo", None) is mamba3_mimo


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
    """Make `mamba_ssm.ops.tilelang.mamba3.mamba3_mimo.mamba3_mimo` this package's operator.

    Where a real mamba_ssm is installed, nothing changes unless force=True, which replaces only
    the operator's module (upstream's other modules stay). Idempotent. Returns whether upstream's
    path now gives this package's operator."""
    if installed():
        return True
    if _upstream_present() and not force:
        return False
    parts = TARGET.split(".")
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
            continue  # a package already there (upstream's, with force=True): keep it
        module = _module(name, package=not leaf)
        if leaf:
            module.mamba3_mimo = mamba3_mimo
            module.__all__ = ["mamba3_mimo"]
        _replaced[name] = existing
        sys.modules[name] = module
        if depth > 1:
            setattr(sys.modules[".".join(parts[:depth - 1])], parts[depth - 1], module)
    return True


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
