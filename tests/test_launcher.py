"""The production launcher (`mamba3_mimo.runtime.launcher`): its control flow, on a stand-in
kernel with a stand-in driver (CPU), and its key against Triton's own specialisation on the
production kernels' launch arguments (CPU or GPU; Triton's binder runs on the host)."""
import random
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.backends import BaseBackend
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from conftest import DEVICE, op_args, record_launches, run_op
from mamba3_mimo.inputs import Shape, make_inputs, official_shapes
from mamba3_mimo.runtime import launcher
from mamba3_mimo.runtime.launcher import (BoundLaunch, Launch, kept_kernel, launch_kernel,
                                          signature_key)


def _toy(x, y, n, m, flag, scale, BLOCK: tl.constexpr):  # its parameters only: never compiled
    pass


TOY = JITFunction(_toy, do_not_specialize=["n"])
STREAM, FUNCTION, PACKED = 1234, 0xF00, (4, 1, 0)


class FakeKernel:
    """Stands for a CompiledKernel: logs the calls of its launcher."""
    function, packed_metadata = FUNCTION, PACKED

    def __init__(self, log: list):
        self.log = log

    def run(self, *call):
        self.log.append(("direct", call))


class FakeFn:
    """Stands for a JITFunction with _toy's parameters: logs Triton's launches (fn.run) and
    fn[grid] calls."""
    __name__ = "toy"

    def __init__(self):
        self.params, self.arg_names = TOY.params, TOY.arg_names
        self.pre_run_hooks = []
        self.log = []

    def run(self, *args, grid, warmup, **options):
        assert not warmup
        self.log.append(("triton", args, grid, options))
        return FakeKernel(self.log)

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("getitem", args, grid, options))


class FakeDriver:
    @staticmethod
    def get_current_device() -> int:
        return 0

    @staticmethod
    def get_current_stream(device: int) -> int:
        return STREAM


@pytest.fixture
def fn(monkeypatch):
    """A fresh FakeFn, with the interpreter off, the direct path on, a stand-in driver, empty
    launcher tables and no hooks."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launcher, "DIRECT", True)
    monkeypatch.setattr(launcher, "driver", SimpleNamespace(active=FakeDriver))
    monkeypatch.setattr(launcher, "_kernel_infos", {})
    monkeypatch.setattr(launcher, "_kept", {})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", HookChain(reversed=True))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    return FakeFn()


BUF = torch.zeros(256)


def toy_args(**over) -> tuple:
    """_toy's arguments in order: aligned fp32 tensors by default."""
    a = dict(x=BUF[:32], y=BUF[64:96], n=100, m=7, flag=True, scale=0.5, BLOCK=64)
    a.update(over)
    return tuple(a[name] for name in TOY.arg_names)


def change_id(change: dict) -> str:
    return ",".join(f"{k}={v.dtype if isinstance(v, torch.Tensor) else v!r}"
                    for k, v in change.items())


def paths(fn) -> list:
    return [entry[0] for entry in fn.log]


def same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys))


def test_first_launch_through_triton_then_direct(fn):
    args = toy_args()
    first = launch_kernel(fn, (3,), args, num_warps=4)
    second = launch_kernel(fn, (3,), args, num_warps=4)
    assert paths(fn) == ["triton", "direct"]
    _, targs, grid, options = fn.log[0]
    assert same(targs, args) and grid == (3,) and options == {"num_warps": 4}
    call = fn.log[1][1]
    assert call[:9] == (3, 1, 1, STREAM, FUNCTION, PACKED, None, None, None)
    assert same(call[9:], args)
    assert second is first and kept_kernel(fn, args, num_warps=4) is first


def test_grid_of_three(fn):
    for _ in range(2):
        launch_kernel(fn, (2, 5, 7), toy_args())
    assert fn.log[1][1][:3] == (2, 5, 7)


def test_misaligned_tensor_is_a_new_signature(fn):
    aligned, misaligned = toy_args(), toy_args(x=BUF[1:33])
    assert misaligned[0].data_ptr() % 16 != 0
    assert signature_key(fn, aligned) != signature_key(fn, misaligned)
    for args in (aligned, misaligned, misaligned, aligned):
        launch_kernel(fn, (1,), args)
    assert paths(fn) == ["triton", "triton", "direct", "direct"]


def test_do_not_specialize_int_keyed_by_range(fn):
    ns = [100, 5000, 2 ** 31 - 1, -2 ** 31,  # i32: one kernel
          2 ** 31, 2 ** 40, -2 ** 31 - 1,  # i64
          2 ** 63, 2 ** 64 - 1,  # u64
          2 ** 64, 2 ** 64]  # too large for Triton: keyed by value
    for n in ns:
        launch_kernel(fn, (1,), toy_args(n=n))
    assert paths(fn) == ["triton", "direct", "direct", "direct",
                         "triton", "direct", "direct",
                         "triton", "direct",
                         "triton", "direct"]


@pytest.mark.parametrize("change", [
    dict(m=8), dict(m=16), dict(m=True), dict(m=7.0), dict(flag=False), dict(scale=0.25),
    dict(BLOCK=128), dict(BLOCK=64.0), dict(y=BUF[64:96].to(torch.float16)), dict(n=True),
], ids=change_id)
def test_changed_argument_is_a_new_signature(fn, change):
    """A changed specialised int, constexpr, value type or dtype: Triton's launch again."""
    base, changed = toy_args(), toy_args(**change)
    assert signature_key(fn, base) != signature_key(fn, changed)
    for args in (base, changed, changed):
        launch_kernel(fn, (1,), args)
    assert paths(fn) == ["triton", "triton", "direct"]


@pytest.mark.parametrize("options", [dict(num_warps=8), dict(num_warps=4, num_stages=2), {}],
                         ids=repr)
def test_changed_options_are_a_new_signature(fn, options):
    for opts in (dict(num_warps=4), options, options):
        launch_kernel(fn, (1,), toy_args(), **opts)
    assert paths(fn) == ["triton", "triton", "direct"]


def test_options_order_does_not_matter(fn):
    launch_kernel(fn, (1,), toy_args(), num_warps=4, num_stages=2)
    launch_kernel(fn, (1,), toy_args(), num_stages=2, num_warps=4)
    assert paths(fn) == ["triton", "direct"]


def test_direct_off_goes_through_triton(fn, monkeypatch):
    monkeypatch.setattr(launcher, "DIRECT", False)
    for _ in range(2):
        launch_kernel(fn, (1,), toy_args())
    assert paths(fn) == ["getitem", "getitem"]


HOOKS = {
    "pre_run": lambda fn, monkeypatch: fn.pre_run_hooks.append(lambda *a, **k: None),
    "launch_enter": lambda fn, monkeypatch: knobs.runtime.launch_enter_hook.add(print),
    "launch_exit": lambda fn, monkeypatch: knobs.runtime.launch_exit_hook.add(print),
    "launch_enter_callable": lambda fn, monkeypatch: monkeypatch.setattr(
        knobs.runtime, "launch_enter_hook", print),
    "jit_cache": lambda fn, monkeypatch: monkeypatch.setattr(
        knobs.runtime, "jit_cache_hook", lambda *a, **k: None),
    "jit_post_compile": lambda fn, monkeypatch: monkeypatch.setattr(
        knobs.runtime, "jit_post_compile_hook", lambda *a, **k: None),
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_go_through_triton(fn, monkeypatch, hook):
    """With a hook registered, before or after the kernel was kept, every launch is Triton's."""
    launch_kernel(fn, (1,), toy_args())
    HOOKS[hook](fn, monkeypatch)
    for _ in range(2):
        launch_kernel(fn, (1,), toy_args())
    assert paths(fn) == ["triton", "getitem", "getitem"]


def test_launch_hook_set_to_none_is_no_hook(fn, monkeypatch):
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    for _ in range(2):
        launch_kernel(fn, (1,), toy_args())
    assert paths(fn) == ["triton", "direct"]


def test_interpreter_uses_fn_grid(fn, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for _ in range(2):
        launch_kernel(fn, (1,), toy_args())
    assert paths(fn) == ["getitem", "getitem"]


def test_argument_count_checked(fn):
    with pytest.raises(AssertionError, match="6 arguments for 7 parameters"):
        launch_kernel(fn, (1,), toy_args()[:-1])


@pytest.mark.parametrize("change", [dict(m=(1, 2)), dict(x=torch.zeros(2).numpy()),
                                    dict(BLOCK=torch.zeros(4)), dict(BLOCK=[64])],
                         ids=change_id)
def test_arguments_not_keyed_go_through_triton(fn, change):
    """A tuple, an object that is neither tensor nor Python scalar, a tensor as a constexpr, an
    unhashable constexpr: never kept, every launch is Triton's."""
    args = toy_args(**change)
    if not isinstance(change.get("BLOCK"), list):
        assert signature_key(fn, args) is None
    for _ in range(2):
        launch_kernel(fn, (1,), args)
    assert paths(fn) == ["triton", "triton"]
    assert not launcher._kept


def test_table_is_bounded(fn, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_KEPT", 2)
    for m in (2, 3, 4, 5, 2):
        launch_kernel(fn, (1,), toy_args(m=m))
        assert len(launcher._kept) <= 2
    assert paths(fn) == ["triton"] * 5  # m=2 was dropped when the table was cleared


def test_interpreted_kernel_is_never_keyed(monkeypatch):
    """An interpreted kernel has no KernelParams: no key, rather than a key of no arguments."""
    monkeypatch.setattr(launcher, "_kernel_infos", {})
    interpreted = SimpleNamespace(arg_names=TOY.arg_names, pre_run_hooks=[])
    assert signature_key(interpreted, toy_args()) is None


# ---------------------------------------------------------------------------- bound launches


def test_bound_launch_keys_as_launch_kernel(fn):
    """A BoundLaunch's key is launch_kernel's for every tensor binding (other tensors, another
    alignment, another dtype), so the two share their kept kernels: after a bound launch,
    launch_kernel of the same arguments is direct, and the other way round."""
    bound = BoundLaunch(fn, (1,), toy_args(), dict(num_warps=4))
    info = launcher._kernel_info(fn)
    for x in (BUF[:32], BUF[128:160], BUF[1:33], BUF[64:96].to(torch.float16)):
        args = toy_args(x=x)
        assert bound.key(0, args) == launcher._key(info, 0, args, dict(num_warps=4))
    bound(toy_args())
    launch_kernel(fn, (1,), toy_args(x=BUF[128:160]), num_warps=4)  # same signature
    launch_kernel(fn, (1,), toy_args(x=BUF[1:33]), num_warps=4)  # misaligned: new
    bound(toy_args(x=BUF[1:33]))
    assert paths(fn) == ["triton", "direct", "triton", "direct"]
    call = fn.log[1][1]
    assert call[:9] == (1, 1, 1, STREAM, FUNCTION, PACKED, None, None, None)
    def plain(args):
        return [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in args]

    assert plain(call[9:]) == plain(toy_args(x=BUF[128:160]))


def test_bound_launch_binds_its_tensors(fn):
    """Each bound launch passes the tensors it is given, not those it was made with."""
    bound = BoundLaunch(fn, (2, 3), toy_args(), {})
    for x in (BUF[:32], BUF[128:160]):
        bound(toy_args(x=x))
    assert paths(fn) == ["triton", "direct"]
    assert fn.log[0][1][0].data_ptr() == BUF[:32].data_ptr()  # Triton's launch: (args, ...)
    call = fn.log[1][1]  # the direct launch: (grid, stream, ..., args)
    assert call[:3] == (2, 3, 1) and call[9].data_ptr() == BUF[128:160].data_ptr()


def test_bound_launch_follows_direct_hooks_and_interpreter(fn, monkeypatch):
    """The switches of launch_kernel hold for bound launches: DIRECT off, a hook, the
    interpreter each send every launch through fn[grid]."""
    bound = BoundLaunch(fn, (1,), toy_args(), {})
    bound(toy_args())
    monkeypatch.setattr(launcher, "DIRECT", False)
    bound(toy_args())
    monkeypatch.setattr(launcher, "DIRECT", True)
    HOOKS["launch_enter"](fn, monkeypatch)
    bound(toy_args())
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", HookChain())
    bound(toy_args())
    assert paths(fn) == ["triton", "getitem", "getitem", "direct"]


def test_bound_launch_of_unkeyed_arguments(fn):
    """Arguments that launch_kernel does not key (an unhashable constexpr, a tuple) are not
    keyed bound either: every launch is Triton's, none kept."""
    for change in (dict(BLOCK=[64]), dict(m=(1, 2))):
        bound = BoundLaunch(fn, (1,), toy_args(**change), {})
        assert not bound.layout
        for _ in range(2):
            bound(toy_args(**change))
    assert paths(fn) == ["triton"] * 4
    assert not launcher._kept


def test_bound_launch_checks_the_argument_count(fn):
    with pytest.raises(AssertionError, match="6 arguments for 7 parameters"):
        BoundLaunch(fn, (1,), toy_args()[:-1], {})


# ---------------------------------------------------------------------------- launches by name


def test_launch_orders_arguments_by_name(fn):
    """A Launch holds its arguments by name, in any order, and gives them in the kernel's
    parameter order; run() is launch_kernel's launch with its grid and options (Triton's, then
    direct)."""
    args = toy_args()
    launch = Launch(fn, (3,), dict(reversed(list(zip(TOY.arg_names, args)))), dict(num_warps=4))
    assert same(launch.positional(), args)
    first, second = launch.run(), launch.run()
    assert paths(fn) == ["triton", "direct"] and second is first
    _, targs, grid, options = fn.log[0]
    assert same(targs, args) and grid == (3,) and options == {"num_warps": 4}
    assert same(fn.log[1][1][9:], args)
    assert kept_kernel(fn, args, num_warps=4) is first


@pytest.mark.parametrize("change", ["missing", "unknown", "misspelt"])
def test_launch_names_a_missing_or_unknown_argument(fn, change):
    """A name left out or one the kernel does not declare is an error naming it, never an
    argument list shifted by one; a misspelt name (as many names as parameters) is both."""
    by_name = dict(zip(TOY.arg_names, toy_args()))
    if change == "missing":
        del by_name["n"]
        match = r"missing arguments \['n'\], unknown arguments \[\]"
    elif change == "unknown":
        by_name["extra"] = 1
        match = r"missing arguments \[\], unknown arguments \['extra'\]"
    else:
        by_name["N"] = by_name.pop("n")
        match = r"missing arguments \['n'\], unknown arguments \['N'\]"
    launch = Launch(fn, (1,), by_name, {})
    with pytest.raises(ValueError, match=match):
        launch.positional()
    with pytest.raises(ValueError, match=match):
        launch.run()
    assert paths(fn) == []


# ---------------------------------------------------------------------------- bound groups


def group_of_two(fn) -> launcher.BoundGroup:
    return launcher.BoundGroup((BoundLaunch(fn, (1,), toy_args(), {}),
                                BoundLaunch(fn, (2, 3), toy_args(), dict(num_warps=8))))


def run_group(group, x, y=BUF[64:96]):
    group([toy_args(x=x, y=y), toy_args(x=y, y=x)], [x, y])


def test_group_launches_its_kernels_directly(fn):
    """After a group's first call (its bound launches, Triton's then), a call with other tensors
    of the same dtypes and alignment launches each kept kernel directly with its own grid,
    options-free, and with the tensors it is given."""
    group = group_of_two(fn)
    run_group(group, BUF[:32])
    run_group(group, BUF[128:160])
    assert paths(fn) == ["triton", "triton", "direct", "direct"]
    first, second = fn.log[2][1], fn.log[3][1]
    assert first[:9] == (1, 1, 1, STREAM, FUNCTION, PACKED, None, None, None)
    assert second[:3] == (2, 3, 1)
    assert first[9].data_ptr() == BUF[128:160].data_ptr() == second[10].data_ptr()
    assert len(group.kernels) == 1


@pytest.mark.parametrize("change", ["misaligned", "dtype", "device", "debug"])
def test_group_keys_what_selects_a_kernel(fn, monkeypatch, change):
    """A misaligned tensor, another dtype, another current device or Triton's debug knob is a
    new group key: the call goes through the bound launches (which key it themselves), and the
    next such call is direct."""
    group = group_of_two(fn)
    run_group(group, BUF[:32])
    x = BUF[:32]
    if change == "misaligned":
        x = BUF[1:33]
    elif change == "dtype":
        x = BUF[:32].to(torch.float16)
    elif change == "device":
        monkeypatch.setattr(FakeDriver, "get_current_device", staticmethod(lambda: 1))
    else:
        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    run_group(group, x)
    run_group(group, x)
    assert paths(fn) == ["triton"] * 4 + ["direct"] * 2
    assert len(group.kernels) == 2


def test_group_follows_direct_hooks_and_interpreter(fn, monkeypatch):
    """DIRECT off, a hook or the interpreter send every launch of a group through fn[grid], as
    for single launches."""
    group = group_of_two(fn)
    run_group(group, BUF[:32])
    monkeypatch.setattr(launcher, "DIRECT", False)
    run_group(group, BUF[:32])
    monkeypatch.setattr(launcher, "DIRECT", True)
    HOOKS["launch_enter"](fn, monkeypatch)
    run_group(group, BUF[:32])
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", HookChain())
    monkeypatch.setattr(launcher._kernel_info(fn), "interpreted", True)
    run_group(group, BUF[:32])
    assert paths(fn) == ["triton"] * 2 + ["getitem"] * 6


def test_plan_replays_with_addresses(fn, monkeypatch):
    """A call plan's first call launches through Triton with the call's tensors; once its
    group's kernels are kept, a call launches them directly with each tensor's address as an
    int (the bound tensors' and the constant's, which the compiled launcher takes as they are),
    every other argument as bound."""
    from mamba3_mimo.runtime import plans
    from mamba3_mimo.runtime.plans import CallPlan
    constant = torch.zeros(4)
    env = dict(x=BUF[:32], y=BUF[64:96])
    by_name = lambda **over: dict(zip(TOY.arg_names, toy_args(**over)))  # noqa: E731
    plan = CallPlan.build(None, [Launch(fn, (3,), by_name(x=env["x"], y=constant), {}),
                                 Launch(fn, (2,), by_name(**env), dict(num_warps=8))],
                          env, constant)
    plan.launch(env)
    other = dict(x=BUF[128:160], y=BUF[192:224])
    plan.launch(other)
    assert paths(fn) == ["triton", "triton", "direct", "direct"]
    first, second = fn.log[2][1][9:], fn.log[3][1][9:]
    assert first[:2] == (other["x"].data_ptr(), constant.data_ptr())
    assert second[:2] == (other["x"].data_ptr(), other["y"].data_ptr())
    assert first[2:] == second[2:] == toy_args()[2:]
    plan.launch(dict(x=BUF[1:33], y=BUF[64:96]))  # misaligned: a new key, Triton's path
    assert paths(fn)[4:] == ["triton", "triton"]
    monkeypatch.setattr(plans, "ADDRESSES", False)  # the A/B switch: the tensors themselves
    plan.launch(other)
    assert paths(fn)[6:] == ["direct", "direct"]
    assert same(fn.log[6][1][9:11], (other["x"], constant))


# ---------------------------------------------------------------------------- against Triton

BF16 = torch.bfloat16
# model dims of two official shapes (U = 2 and U = 1) at a small B and S
SMALL = [Shape(1, 48, 2, 1, s.N, s.P, s.R, s.C) for s in official_shapes()[:2]]


def _jit(fn) -> JITFunction:
    """fn as a JITFunction: under the interpreter, triton.jit made an InterpretedFunction, which
    keeps the decorator's arguments."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)


def production_launches(monkeypatch, shape: Shape, seed: int = 0) -> list:
    """(JITFunction, grid, args, options) of the production path's launches for this shape
    (through the public entry), recorded without running them."""
    log = record_launches(monkeypatch, forward=False)
    run_op(op_args(make_inputs(shape, BF16, True, True, device=DEVICE, seed=seed)))
    assert [fn.__name__ for fn, *_ in log] == ["step_terms_kernel", "chunk_increment_kernel",
                                               "state_passing_kernel", "chunk_output_kernel",
                                               "chunk_output_kernel", "rank_sums_kernel"]
    return [(_jit(fn), grid, args, options) for fn, grid, args, options in log]


def triton_key(binder, args: tuple) -> str:
    """The cache key under which Triton's JITFunction.run finds the compiled kernel for these
    arguments (same options): its binder, then compute_cache_key (with an empty key cache, so
    that no earlier argument list answers for this one)."""
    return compute_cache_key({}, binder(*args)[1], "")


def variants(v) -> list:
    """Other values for an argument: Triton-relevant changes and irrelevant ones."""
    if isinstance(v, torch.Tensor):
        n, step = v.numel(), 16 // v.element_size()
        buf = torch.zeros(n + 2 * step, dtype=v.dtype, device=v.device)
        other = torch.float16 if v.dtype != torch.float16 else torch.float32
        return [torch.zeros_like(v), buf[step:step + n], buf[1:1 + n], buf[2:2 + n],
                torch.zeros(n, dtype=other, device=v.device)]
    if isinstance(v, bool):
        return [not v, int(v)]
    if isinstance(v, int):
        return [v + 1, v + 16, 2 * v + 1, 0, 1, 2, 16, 32, -16, 2 ** 31 - 1, 2 ** 31, -2 ** 31,
                -2 ** 31 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, True, float(v)]
    if isinstance(v, str):
        return [s for s in ("ieee", "tf32", "tf32x3") if s != v]
    return []


@pytest.mark.parametrize("shape", SMALL, ids=lambda s: s.name)
def test_signature_key_at_least_as_fine_as_triton(monkeypatch, shape):
    """On the production launches' arguments and variants of them (each argument changed alone,
    and random pairs changed together): argument lists with the same signature_key always have
    the same Triton cache key, i.e. get the same compiled kernel. Equivalently, lists that
    Triton specialises differently have different keys."""
    monkeypatch.setattr(launcher, "_kernel_infos", {})
    rng = random.Random(0)
    for fn, _, args, _ in production_launches(monkeypatch, shape):
        binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
        singles = [(i, w) for i, v in enumerate(args) for w in variants(v)]
        samples = [args] + [args[:i] + (w,) + args[i + 1:] for i, w in singles]
        for _ in range(300):
            (i, w), (j, u) = rng.sample(singles, 2)
            if i != j:
                s = list(args)
                s[i], s[j] = w, u
                samples.append(tuple(s))
        seen = {}
        for s in samples:
            key = signature_key(fn, s)
            assert key is not None, f"{fn.__name__}: a production argument list is not keyed"
            tk = triton_key(binder, s)
            assert seen.setdefault(key, tk) == tk, (
                f"{fn.__name__}: one signature_key for two Triton specialisations:\n"
                f"{seen[key]}\n{tk}")


@pytest.mark.parametrize("shape", SMALL, ids=lambda s: s.name)
def test_signature_key_ignores_batch_and_length(monkeypatch, shape):
    """Other B and S with the same model dims give the same keys: after the first call, the
    production path launches directly (the do_not_specialize parameters carry B and S)."""
    monkeypatch.setattr(launcher, "_kernel_infos", {})
    first = production_launches(monkeypatch, shape)
    other = Shape(3, 5 * shape.S + 3, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C)
    for (fn, _, a, _), (_, _, b, _) in zip(first, production_launches(monkeypatch, other, 1)):
        assert signature_key(fn, a) == signature_key(fn, b), fn.__name__
        for i, p in enumerate(fn.params):
            if p.do_not_specialize and type(a[i]) is int and a[i] + 1 < 2 ** 31:
                changed = a[:i] + (a[i] + 1,) + a[i + 1:]
                assert signature_key(fn, changed) == signature_key(fn, a), (fn.__name__, p.name)
