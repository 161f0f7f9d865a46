"""Launches the production kernels with less host time than `kernel[grid](...)`: the first
launch of each argument signature goes through Triton, later ones call the compiled kernel's
launcher directly.

Triton's `JITFunction.run` specialises every argument, looks its cache key up (a string of the
specialisation and the options) and builds a launch-metadata dict on every call: on the H200,
65-70 us of the operator's four launches, whose compiled launchers take 29-30 us
(docs/performance.md, "Host side"). Here the key is a tuple built mostly by C loops over the
arguments, at least as fine as Triton's specialisation (`signature_key`), so that equal keys
always mean the same compiled kernel; compilation and every check of a first launch stay
Triton's.

What a direct launch leaves out, compared with Triton's: launch hooks, pre-run hooks and JIT
hooks (with any registered, every launch goes through Triton); the check that the global
variables a kernel reads have not changed since it was compiled, and a change of the kernel's
source after its first launch (the production kernels read only constexpr globals and are never
edited at run time).
"""
from __future__ import annotations

from itertools import repeat
from operator import and_, attrgetter, itemgetter, not_
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

from .device import interpreter_active

# False: every launch goes through Triton's own path (A/B runs, tests that patch `fn.run`).
# The direct call follows Triton 3.6's internal CompiledKernel.run signature: another version
# keeps Triton's path until the launcher is checked against it.
DIRECT = triton.__version__.split(".")[:2] == ["3", "6"]

# Past this many kept kernels the table is cleared (each argument signature costs one Triton
# launch to refill); the operator uses a handful per model shape.
MAX_KEPT = 4096

# per-position kinds of a kernel's parameters
_CONSTEXPR, _SPECIALISED, _DNS = 0, 1, 2
# types keyed by value outside constexpr positions (Triton specialises them on their value,
# their type or not at all)
_VALUE_TYPES = (int, bool, float, str, type(None))

_dtype = attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr


def _tensor_key(tensors: tuple, addresses: Optional[list] = None) -> tuple:
    """What selects a compiled kernel among tensors: their dtypes, and whether each address is
    16-byte aligned (never the tensors themselves: a table keyed by them would keep their memory
    alive). `addresses`: the tensors' data_ptr(), where the caller has them."""
    if addresses is None:
        addresses = map(_data_ptr, tensors)
    return tuple(map(_dtype, tensors)), tuple(map(not_, map(and_, addresses, repeat(15))))


def _getter(positions: list) -> Callable[[tuple], tuple]:
    """args -> the tuple of args at these positions (in C, where itemgetter applies)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda args: (args[i],)
    return lambda args: ()


class _Layout:
    """How to key one kernel's arguments for one list of argument types: the positions of
    tensors, of ints of do_not_specialize parameters, and of values keyed as they are. Most of
    the key is then built by C loops (map, itemgetter) instead of a Python loop over up to 60
    arguments."""
    __slots__ = ("exact", "tensors", "dns")

    def __init__(self, exact: list, tensors: list, dns: list):
        self.exact, self.tensors, self.dns = _getter(exact), _getter(tensors), _getter(dns)

    def values(self, args: tuple) -> tuple:
        (exact, dns), tensors = self.fixed(args), self.tensor_part(args)
        return (exact,) + tensors + (dns,)

    def fixed(self, args: tuple) -> tuple:
        """The key of the arguments other than tensors: their values, and the integer class of
        the do_not_specialize ints."""
        # native_specialize_impl types an int of a do_not_specialize parameter by its range
        # only; beyond u64 it raises, and the exact value then sends the launch to Triton
        dns = tuple(["i32" if -0x80000000 <= v <= 0x7FFFFFFF else
                     "i64" if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF else
                     "u64" if 0 <= v <= 0xFFFFFFFFFFFFFFFF else v for v in self.dns(args)])
        return self.exact(args), dns

    def tensor_part(self, args: tuple) -> tuple:
        """The key of the tensors among args (_tensor_key)."""
        return _tensor_key(self.tensors(args))


class _KernelInfo:
    """What the launcher keeps per kernel function: its parameters' kinds and its keying layouts."""
    __slots__ = ("fn", "kinds", "interpreted", "layouts")

    def __init__(self, fn: Any):
        self.fn = fn  # held so that id(fn), the key of _kernel_infos, is never reused
        # None for an interpreted kernel, which has no KernelParams (and is never keyed)
        self.kinds = (tuple(_CONSTEXPR if p.is_constexpr else _DNS if p.do_not_specialize
                            else _SPECIALISED for p in fn.params)
                      if hasattr(fn, "params") else None)
        # Triton picks the interpreter when the kernel is decorated, once: reading the
        # environment on every launch would cost more than the rest of a direct launch
        self.interpreted = interpreter_active()
        self.layouts: Dict[tuple, Any] = {}  # argument types -> _Layout, or False: not keyed

    def layout(self, types: tuple) -> Any:
        """The _Layout for these argument types, or False when one of them is not keyed (a
        tensor given as a constexpr, a tuple, a numpy scalar...)."""
        layout = self.layouts.get(types)
        if layout is None:
            layout = self.layouts[types] = self._new_layout(types)
        return layout

    def _new_layout(self, types: tuple) -> Any:
        if self.kinds is None:
            return False
        exact, tensors, dns = [], [], []
        for i, (kind, t) in enumerate(zip(self.kinds, types)):
            if issubclass(t, torch.Tensor):
                if kind == _CONSTEXPR:
                    return False
                tensors.append(i)
            elif t is int and kind == _DNS:
                dns.append(i)
            elif t in _VALUE_TYPES or kind == _CONSTEXPR:
                exact.append(i)
            else:
                return False
        return _Layout(exact, tensors, dns)


class Launch(NamedTuple):
    """One launch of a kernel, as a kernel family's wrapper describes it: every parameter of fn
    by name in `kwargs` (constexprs included), so that a swapped argument cannot go unnoticed.
    `positional()` orders them as fn declares them, for `launch_kernel` and `BoundLaunch`."""
    fn: Any
    grid: Tuple[int, ...]
    kwargs: Dict[str, Any]
    options: dict

    def positional(self) -> tuple:
        """The arguments in fn's parameter order; ValueError naming a missing or unknown one."""
        names, kwargs = self.fn.arg_names, self.kwargs
        # as many names as parameters, each of them found: exactly the parameters
        if len(kwargs) == len(names):
            try:
                return tuple([kwargs[n] for n in names])
            except KeyError:
                pass
        missing = [n for n in names if n not in kwargs]
        unknown = [n for n in kwargs if n not in names]
        raise ValueError(f"{self.fn.__name__}: missing arguments {missing}, unknown "
                         f"arguments {unknown}")

    def run(self) -> Any:
        """Launch it now (launch_kernel)."""
        return launch_kernel(self.fn, self.grid, self.positional(), **self.options)

    def warmup(self) -> Any:
        """Compile it without running it; the compiled kernel (for its resources)."""
        compiled = self.fn.warmup(*self.positional(), grid=self.grid, **self.options)
        return compiled.result() if hasattr(compiled, "result") else compiled


_kernel_infos: Dict[int, _KernelInfo] = {}
_kept: Dict[tuple, Any] = {}


def _kernel_info(fn: Any) -> _KernelInfo:
    info = _kernel_infos.get(id(fn))
    if info is None:
        info = _kernel_infos[id(fn)] = _KernelInfo(fn)
    return info


def _hooked(fn: Any) -> bool:
    """True when a hook is registered that Triton's path would call: pre-run hooks of fn, launch
    hooks, or JIT hooks."""
    return bool(fn.pre_run_hooks) or _hooks_registered()


def _hooks_registered() -> bool:
    """True when a launch or JIT hook is registered (for every kernel). A HookChain is active
    when it holds calls; a hook set to None is not, and one set to a plain callable is."""
    rt = knobs.runtime
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
                or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)
                or rt.jit_cache_hook is not None or rt.jit_post_compile_hook is not None)


def signature_key(fn: Any, args: tuple) -> Optional[tuple]:
    """A hashable key of the arguments' specialisation, at least as fine as Triton's: two
    argument lists with the same key get the same compiled kernel from Triton (for the same
    options and device). None when an argument is of a kind this does not key (a tensor given
    as a constexpr, a tuple, a numpy scalar...): launch_kernel then leaves it to Triton.

    Per argument: a tensor, its dtype and whether its address is 16-byte aligned (even where
    Triton ignores the alignment); an int of a do_not_specialize parameter, whether it fits
    i32, i64 or u64; any other value (specialised ints, bools, floats, None, strings,
    constexprs), the value itself; with the types of all arguments, which tell 1, True and 1.0
    apart (they compare and hash equal).
    """
    types = tuple(map(type, args))
    layout = _kernel_info(fn).layout(types)
    return (types,) + layout.values(args) if layout else None


def _key(info: _KernelInfo, device: int, args: tuple, options: dict) -> Optional[tuple]:
    """The key of launch_kernel's table: signature_key with the _Layout standing for the
    argument types (and the kernel) it was found by, plus what Triton adds to the options."""
    layout = info.layout(tuple(map(type, args)))
    if not layout:
        return None
    # debug and the instrumentation mode are global knobs that Triton adds to the options
    return (layout, device, tuple(sorted(options.items())), knobs.runtime.debug,
            knobs.compilation.instrumentation_mode) + layout.values(args)


def launch_kernel(fn: Any, grid: Tuple[int, ...], args: tuple, **options: Any) -> Any:
    """fn[grid](*args, **options), with Triton's per-call binding skipped after the first launch
    of each argument signature. `args` holds every parameter of fn in order, constexprs
    included; grid is a tuple of one to three ints; options are Triton's launch options
    (num_warps, num_stages, maxnreg...). Returns the compiled kernel, as fn[grid] does."""
    return _launch(fn, grid, args, options, None)


class BoundLaunch:
    """launch_kernel(fn, grid, args, **options) for argument lists that differ from the one it
    was made with in their tensors only, as a dispatcher's call plan binds each call's tensors
    into otherwise fixed arguments: the key of every other argument is built once, and each
    launch adds its tensors' dtypes and alignment. The key is launch_kernel's, so both find the
    same kept kernels."""
    __slots__ = ("fn", "grid", "options", "layout", "options_key", "fixed")

    def __init__(self, fn: Any, grid: Tuple[int, ...], args: tuple, options: dict):
        self.fn, self.grid, self.options = fn, grid, options
        self.layout = _kernel_info(fn).layout(tuple(map(type, args)))
        if self.layout:
            assert len(args) == len(fn.arg_names), (
                f"{fn.__name__}: {len(args)} arguments for {len(fn.arg_names)} parameters")
            self.options_key = tuple(sorted(options.items()))
            self.fixed = self.layout.fixed(args)
            try:
                hash((self.options_key, self.fixed))
            except TypeError:  # an unhashable constexpr: every launch keyed by Triton
                self.layout = False

    def __call__(self, args: tuple) -> Any:
        return _launch(self.fn, self.grid, args, self.options, self)

    def key(self, device: int, args: tuple) -> tuple:
        """launch_kernel's key of these arguments (_key)."""
        exact, dns = self.fixed
        return ((self.layout, device, self.options_key, knobs.runtime.debug,
                 knobs.compilation.instrumentation_mode, exact)
                + self.layout.tensor_part(args) + (dns,))


def _through_triton(fn: Any) -> bool:
    """True when fn's launches must take Triton's path: DIRECT off, the interpreter, a hook."""
    return not DIRECT or _kernel_info(fn).interpreted or _hooked(fn)


def _launch(fn: Any, grid: Tuple[int, ...], args: tuple, options: dict,
            bound: Optional[BoundLaunch]) -> Any:
    if _through_triton(fn):
        return fn[grid](*args, **options)
    info = _kernel_info(fn)
    device = driver.active.get_current_device()
    if bound is not None and bound.layout:
        key = bound.key(device, args)  # hashable: checked when it was bound
        kernel = _kept.get(key)
    else:
        # Triton's binder checks the count on its path; a direct launch would pass the
        # arguments to the compiled launcher unchecked
        assert len(args) == len(fn.arg_names), (
            f"{fn.__name__}: {len(args)} arguments for {len(fn.arg_names)} parameters")
        try:
            key = _key(info, device, args, options)
            kernel = None if key is None else _kept.get(key)
        except TypeError:  # an unhashable constexpr
            key = kernel = None
    if kernel is None:
        kernel = fn.run(*args, grid=grid, warmup=False, **options)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        if key is not None and kernel is not None:
            if len(_kept) >= MAX_KEPT:
                _kept.clear()
            _kept[key] = kernel
        return kernel
    _run_kept(kernel, grid, driver.active.get_current_stream(device), args)
    return kernel


def _run_kept(kernel: Any, grid: Tuple[int, ...], stream: int, args: tuple) -> None:
    # as JITFunction.run launches, with no launch metadata and no hooks: _hooked() is False
    n = len(grid)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
               kernel.function, kernel.packed_metadata, None, None, None, *args)


class BoundGroup:
    """BoundLaunches that always run together, in order, as one call plan's launches: the
    compiled kernel of each is found once per (current device, Triton's global debug and
    instrumentation knobs, dtypes and 16-byte alignment of the group's tensors) and then
    launched directly, without a key per launch. `tensors` of a call must hold every tensor
    argument of its launches that differs between calls (the plan binds them by name; a tensor
    fixed in every argument list, such as a kept placeholder, may be left out)."""
    __slots__ = ("bounds", "kernels", "keyed", "infos")

    def __init__(self, bounds: Tuple[BoundLaunch, ...]):
        self.bounds = bounds
        self.kernels: Dict[tuple, tuple] = {}
        self.keyed = all(b.layout for b in bounds)
        self.infos = tuple([_kernel_info(b.fn) for b in bounds])

    def __call__(self, arg_lists: list, tensors: list) -> None:
        kernels = self.kept(tensors)
        if kernels is not None:
            self.run_kept(kernels, arg_lists)
            return
        if not self._direct():
            for b, args in zip(self.bounds, arg_lists):
                b(args)
            return
        key = self._key(tensors)
        kernels = tuple([b(args) for b, args in zip(self.bounds, arg_lists)])
        if all(k is not None for k in kernels):
            if len(self.kernels) >= MAX_KEPT:
                self.kernels.clear()
            self.kernels[key] = kernels

    def kept(self, tensors: list, addresses: Optional[list] = None) -> Optional[tuple]:
        """The group's compiled kernels for these tensors (whose data_ptr() are `addresses`,
        where the caller has them) when every launch may be direct and they were kept by an
        earlier call (run_kept launches them), else None: the call then goes through
        __call__'s bound launches."""
        if not self.kernels or not self._direct():
            return None
        return self.kernels.get(self._key(tensors, addresses))

    def run_kept(self, kernels: tuple, arg_lists: list) -> None:
        """Launch `kernels` (from kept) with these argument lists, in which a pointer argument
        may be a tensor or its address as an int: the compiled launcher reads an int as the
        address itself, without calling data_ptr() and asking CUDA for the pointer's
        attributes, as it does for every tensor at every launch."""
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        for b, kernel, args in zip(self.bounds, kernels, arg_lists):
            _run_kept(kernel, b.grid, stream, args)

    def _direct(self) -> bool:
        """Whether every launch may skip Triton's path (_through_triton of each kernel, with the
        global hooks checked once)."""
        return (DIRECT and self.keyed and not any([i.interpreted for i in self.infos])
                and not any([b.fn.pre_run_hooks for b in self.bounds])
                and not _hooks_registered())

    @staticmethod
    def _key(tensors: list, addresses: Optional[list] = None) -> tuple:
        return (driver.active.get_current_device(), knobs.runtime.debug,
                knobs.compilation.instrumentation_mode, _tensor_key(tensors, addresses))


def kept_kernel(fn: Any, args: tuple, **options: Any) -> Any:
    """The compiled kernel that launch_kernel keeps for these arguments and options on the
    current device, or None (for tests)."""
    key = _key(_kernel_info(fn), driver.active.get_current_device(), args, options)
    return None if key is None else _kept.get(key)
