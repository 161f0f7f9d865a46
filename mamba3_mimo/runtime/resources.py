"""Shared-memory probes: the first config of a kernel family, in the rules' order, whose compiled
kernel fits the device's shared memory per block, chosen once per model and device."""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List, TypeVar

import torch
import triton

from .. import configs
from .launcher import Launch

Config = TypeVar("Config")
_chosen: Dict[tuple, object] = {}
configs.register_cache(_chosen.clear)


def smem_limit(device: torch.device) -> int:
    """Shared memory per block the device allows (opt-in), or `configs.override(smem_limit=...)`
    to stand for a smaller GPU."""
    limit = configs.active().smem_limit
    if limit is not None:
        return limit
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def fits(launch: Launch, limit: int) -> bool:
    """Compile (without running) one launch and compare its shared memory with the limit."""
    try:
        compiled = launch.warmup()
    except triton.runtime.errors.OutOfResources:
        return False
    return compiled.metadata.shared <= limit


def choose(key: Hashable, candidates: List[Config], first_launch: Callable[[Config], Launch],
           device: torch.device) -> Config:
    """The first of `candidates` whose `first_launch(config)` fits the shared memory of `device`
    (the first candidate under the interpreter). `key` names the kernel family and every model
    dimension its resources depend on: the choice is cached under it with the device and limit,
    so that a model's candidates compile only on its first call."""
    if device.type != "cuda":
        return candidates[0]
    limit = smem_limit(device)
    full_key = (key, device, limit)
    if full_key not in _chosen:
        fit = next((c for c in candidates if fits(first_launch(c), limit)), None)
        if fit is None:
            raise RuntimeError(f"no config of {key[0] if isinstance(key, tuple) else key} fits "
                               f"in {limit} bytes of shared memory per block")
        _chosen[full_key] = fit
    return _chosen[full_key]
