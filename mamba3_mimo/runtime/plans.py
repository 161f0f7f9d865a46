"""Call plans: what one call signature launches, built once and replayed.

A phase describes its launches by keyword (`launcher.Launch`) over named tensors (its inputs,
outputs and scratch). `CallPlan.build` turns them into a `launcher.BoundGroup` with every
non-tensor argument fixed, and records which named tensor goes in which argument slot; a
repeated call then only allocates its outputs and binds its tensors. On small shapes the host's
time per call, not the GPU's, decides the end-to-end time (docs/performance.md, "Host side").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Generic, Hashable, List, Optional, TypeVar

import torch

from .. import configs
from .launcher import BoundGroup, BoundLaunch, Launch

Value = TypeVar("Value")
_data_ptr = torch.Tensor.data_ptr

# Past this many entries a plan cache is cleared (each signature costs one plan build to refill).
MAX_CALL_PLANS = 1024

# False: a plan's direct launches pass its tensors themselves, whose addresses the compiled
# launcher then asks for at every launch (for A/B runs of the host's time).
ADDRESSES = True

_placeholders: Dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor, one per device and kept, for pointer arguments that a kernel
    never follows (absent optional inputs, unused scratch): a call allocates nothing for them."""
    t = _placeholders.get(device)
    if t is None:
        t = _placeholders[device] = torch.empty(1, device=device, dtype=torch.float32)
    return t


class PlanCache(Generic[Value]):
    """A bounded map from call signatures to plans, cleared with the rules' caches."""

    def __init__(self, limit: int = MAX_CALL_PLANS):
        self.limit = limit
        self.entries: Dict[Hashable, Value] = {}
        configs.register_cache(self.entries.clear)

    def get(self, key: Hashable) -> Optional[Value]:
        return self.entries.get(key)

    def put(self, key: Hashable, value: Value) -> None:
        if len(self.entries) >= self.limit:
            self.entries.clear()
        self.entries[key] = value

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class CallPlan:
    """The launches of one call signature: `group` holds the kernels with their grids, options
    and fixed arguments; `slots[i]` says, for launch i, which argument positions take which
    named tensor at every call; `names` lists every name bound; `layout` is the phase's
    description of the outputs and scratch to allocate per call. `addresses` are the templates
    with the constant's address in its place, for launches of kept kernels, which take every
    tensor as its address (BoundGroup.run_kept); `positions` are the slots with each name's
    index in `names`."""
    layout: Any
    group: BoundGroup
    templates: tuple
    slots: tuple
    names: tuple
    addresses: tuple
    positions: tuple

    @staticmethod
    def build(layout: Any, launches: List[Launch], env: Dict[str, Any],
              constant: torch.Tensor) -> "CallPlan":
        """The plan of `launches`, whose tensor arguments are the named tensors of `env`
        (inputs, outputs, scratch) or `constant` (kept, bound once). A launch with an empty grid
        launches nothing and is left out. Raises AssertionError for a tensor argument that is
        neither named in env nor the constant."""
        names: Dict[int, str] = {}
        for name, x in env.items():
            if isinstance(x, torch.Tensor):
                names.setdefault(id(x), name)
        bounds, templates, slots, bound_names = [], [], [], {}
        for launch in launches:
            if 0 in launch.grid:
                continue
            args = launch.positional()
            template, slot = list(args), []
            for i, x in enumerate(args):
                if isinstance(x, torch.Tensor) and x is not constant:
                    if id(x) not in names:
                        raise AssertionError(
                            f"{launch.fn.__name__}: argument {launch.fn.arg_names[i]} is a "
                            "tensor that is neither an input nor an output of the call")
                    template[i] = None
                    slot.append((i, names[id(x)]))
                    bound_names.setdefault(names[id(x)], len(bound_names))
            bounds.append(BoundLaunch(launch.fn, launch.grid, args, launch.options))
            templates.append(tuple(template))
            slots.append(tuple(slot))
        at = constant.data_ptr()
        addresses = tuple([tuple([at if x is constant else x for x in template])
                           for template in templates])
        positions = tuple([tuple([(i, bound_names[name]) for i, name in slot])
                           for slot in slots])
        return CallPlan(layout, BoundGroup(tuple(bounds)), tuple(templates), tuple(slots),
                        tuple(bound_names), addresses, positions)

    def launch(self, env: Dict[str, Any]) -> None:
        """Launch every kernel with the tensors of env (by name): once the group's kernels are
        kept, with the tensors' addresses (BoundGroup.run_kept)."""
        tensors = [env[name] for name in self.names]
        addresses = list(map(_data_ptr, tensors))
        kernels = self.group.kept(tensors, addresses)
        if kernels is None:
            self.group(self._bind(self.templates, tensors), tensors)
        elif ADDRESSES:
            self.group.run_kept(kernels, self._bind(self.addresses, addresses))
        else:
            self.group.run_kept(kernels, self._bind(self.templates, tensors))

    def _bind(self, templates: tuple, values: list) -> list:
        """The argument lists of the templates with the value of each slot's name (values in
        the order of `names`)."""
        arg_lists = []
        for template, position in zip(templates, self.positions):
            args = list(template)
            for i, k in position:
                args[i] = values[k]
            arg_lists.append(tuple(args))
        return arg_lists
