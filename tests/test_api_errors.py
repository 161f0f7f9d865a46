"""Bad inputs raise ValueError / TypeError naming the argument; unsupported devices raise
NotImplementedError (SPEC section 5). No kernel runs here."""
import re

import pytest
import torch

from conftest import DEVICE, op_args, run_op, seed_for
from mamba3_mimo import configs
from mamba3_mimo.phases import bwd_fwd
from mamba3_mimo.runtime.device import check_device
from mamba3_mimo.inputs import Shape, make_inputs

SHAPE = Shape(B=1, S=20, H=2, G=1, N=16, P=8, R=2, C=8)
TENSORS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
           "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z")
# q and v define B, S, R, G, N, H, P: a wrong shape there may be reported on the argument that
# then disagrees with them (e.g. "dout must have shape ..."), so any argument name will do.
DEFINING = ("q", "v")
OTHER_DEVICE = "meta" if DEVICE == "cpu" else "cpu"


@pytest.fixture(scope="module")
def good():
    return op_args(make_inputs(SHAPE, torch.float16, True, True, device=DEVICE,
                               seed=seed_for("errors")))


def _names_any(message, names):
    return any(re.search(rf"\b{re.escape(n)}\b", message) for n in names)


def _expect(exc, args, names, **extra):
    with pytest.raises(exc) as info:
        run_op(args, **extra)
    msg = str(info.value)
    assert _names_any(msg, names), f"message does not name {names}: {msg!r}"
    return msg


@pytest.mark.parametrize("name", TENSORS)
def test_wrong_rank(good, name):
    _expect(ValueError, {**good, name: good[name].unsqueeze(0)}, [name])


@pytest.mark.parametrize("dim", [0, -1], ids=["first_dim", "last_dim"])
@pytest.mark.parametrize("name", TENSORS)
def test_wrong_shape(good, name, dim):
    x = good[name]
    shape = list(x.shape)
    shape[dim] += 1
    bad = torch.randn(shape, generator=torch.Generator().manual_seed(seed_for(name, dim)))
    bad = bad.to(device=x.device, dtype=x.dtype)
    _expect(ValueError, {**good, name: bad}, TENSORS if name in DEFINING else [name])


def _wrong_dtype(name):
    """A dtype the argument does not accept: q must be fp16/bf16/fp32, the input-dtype family must
    match q (fp16 here), the fp32 parameters must be fp32, trap fp32 or q's dtype."""
    return {"q": torch.float64, "k": torch.bfloat16, "v": torch.float32, "dout": torch.bfloat16,
            "z": torch.float32, "trap": torch.bfloat16}.get(name, torch.float16)


@pytest.mark.parametrize("name", TENSORS)
def test_wrong_dtype(good, name):
    _expect(TypeError, {**good, name: good[name].to(_wrong_dtype(name))}, [name])


def test_integer_q(good):
    _expect(TypeError, {**good, "q": good["q"].to(torch.int32)}, ["q"])


@pytest.mark.parametrize("name", [n for n in TENSORS if n != "q"])
def test_wrong_device(good, name):
    """Every tensor must be on q's device."""
    _expect(ValueError, {**good, name: good[name].to(OTHER_DEVICE)}, [name])


@pytest.mark.parametrize("name", TENSORS)
def test_not_a_tensor(good, name):
    _expect((TypeError, ValueError), {**good, name: good[name].tolist()}, [name])


def _with_dims(N=SHAPE.N, H=SHAPE.H, G=SHAPE.G, rdd=4):
    """Inputs of SHAPE with some model dims changed (made by hand where Shape would refuse)."""
    gen = torch.Generator().manual_seed(seed_for("dims", N, H, G, rdd))
    B, S, R, P, C = SHAPE.B, SHAPE.S, SHAPE.R, SHAPE.P, SHAPE.C
    nc = -(-S // C)

    def t(*size, dtype=torch.float32):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)

    return dict(dout=t(B, S, H, P, dtype=torch.float16), q=t(B, S, R, G, N, dtype=torch.float16),
                k=t(B, S, R, G, N, dtype=torch.float16), v=t(B, S, H, P, dtype=torch.float16),
                q_bias=t(H, R, N), k_bias=t(H, R, N), mimo_v=t(H, R, P), mimo_o=t(H, R, P),
                angles=t(B, S, H, max(1, N // rdd)), da_cs=t(B, H, S), da_cs_rev=t(B, H, S),
                dt=t(B, H, S), trap=t(B, H, S), segsum=t(B, H, nc, C, C), mimo_z=None, d=None,
                z=None, chunk_size=C, rotary_dim_divisor=rdd)


@pytest.mark.parametrize("N", [15, 17])
def test_odd_n(N):
    _expect(ValueError, _with_dims(N=N), ["N", "q"])


@pytest.mark.parametrize("N,rdd", [(16, 1), (2, 1), (16, 17)])
def test_rotary_dims(N, rdd):
    """RD = N // rotary_dim_divisor must satisfy 1 <= RD <= N/2."""
    _expect(ValueError, _with_dims(N=N, rdd=rdd), ["rotary_dim_divisor"])


@pytest.mark.parametrize("rdd,exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                     ("4", TypeError)])
def test_bad_rotary_dim_divisor(good, rdd, exc):
    _expect(exc, {**good, "rotary_dim_divisor": rdd}, ["rotary_dim_divisor"])


@pytest.mark.parametrize("H,G", [(3, 2), (4, 3), (2, 4)])
def test_heads_not_multiple_of_groups(H, G):
    msg = _expect(ValueError, _with_dims(H=H, G=G), ["H"])
    assert re.search(r"\bG\b", msg), msg


@pytest.mark.parametrize("missing", ["z", "mimo_z"])
def test_gate_pair(good, missing):
    """mimo_z and z come together or not at all."""
    _expect(ValueError, {**good, missing: None}, [missing])


@pytest.mark.parametrize("chunk_size,exc", [(0, ValueError), (-8, ValueError),
                                            (8.0, TypeError), (True, TypeError)])
def test_bad_chunk_size(good, chunk_size, exc):
    _expect(exc, {**good, "chunk_size": chunk_size}, ["chunk_size"])


@pytest.mark.parametrize("output_dtype", [torch.float64, torch.int32, torch.float8_e4m3fn,
                                          "float32", None])
def test_bad_output_dtype(good, output_dtype):
    _expect((ValueError, TypeError), good, ["output_dtype"], output_dtype=output_dtype)


def test_tiles_beyond_the_kernels():
    """The kernels' tiles compile up to 128 (step, rank) rows. bwd_fwd.run refuses a larger
    chunk tile, naming chunk_size and R (the public entry splits such chunks, test_bwd_fwd's
    test_large_chunks), and an R whose one-step tile is larger is refused, naming R, for
    every impl."""
    from mamba3_mimo.kernels import next_pow2
    for C, R in ((64, 4), (32, 8), (129, 1)):
        assert next_pow2(C) * next_pow2(R) > configs.MAX_TILE_ROWS
        with pytest.raises(NotImplementedError, match=rf"chunk_size={C} with R={R}\b"):
            configs.check_tile_rows(C, R)
    configs.check_tile_rows(16, 8)
    configs.check_tile_rows(128, 1)
    shape = Shape(1, 4, 2, 1, 2, 2, 129, 1, rotary_dim_divisor=2)
    args = op_args(make_inputs(shape, torch.float32, False, False, device=DEVICE, seed=1))
    for impl in bwd_fwd.IMPLS:
        with pytest.raises(NotImplementedError, match=r"R=129\b.*R <= 128"):
            bwd_fwd.bwd_fwd(**args, impl=impl)


def test_bad_impl(good):
    with pytest.raises(ValueError, match=r"\bimpl\b"):
        bwd_fwd.bwd_fwd(**good, impl="fastest")


# ---------------------------------------------------------------------------- devices


@pytest.fixture
def no_interpreter(monkeypatch):
    """The process as it would be without TRITON_INTERPRET=1 (check_device reads it per call)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_cpu_without_interpreter(no_interpreter):
    with pytest.raises(NotImplementedError, match="(?i)interpret"):
        check_device(torch.device("cpu"))


def test_public_entry_cpu_without_interpreter(no_interpreter):
    args = op_args(make_inputs(SHAPE, torch.float32, False, False, device="cpu", seed=1))
    with pytest.raises(NotImplementedError):
        run_op(args)


def test_cuda_older_than_sm80(no_interpreter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    configs.clear_caches()  # each device's capability is cached
    try:
        with pytest.raises(NotImplementedError, match=r"7\.5|sm_?75|sm_80"):
            check_device(torch.device("cuda", 0))
    finally:
        configs.clear_caches()  # forget the pretended 7.5


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_other_device_types(no_interpreter, device):
    with pytest.raises(NotImplementedError):
        check_device(torch.device(device))
