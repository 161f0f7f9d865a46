"""The whole operator `mamba3_mimo(...)` against the float64 chunked reference and the per-step
recurrence (SPEC sections 6-7): the output, the four final states and the gradient of every
input, on small odd shapes (GQA, R = 3, N = 12, P = 10, S not a multiple of chunk_size,
divisor 2), with and without Z, D, MIMO_Out, the fused norm (weight given, None, flattened),
fp32 inputs through the interpreter (bf16 and fp16 on the GPU)."""
import pytest
import torch

from conftest import DEVICE, ON_GPU
from test_reference_operator import INPUT_NAMES, make_args
from mamba3_mimo import mamba3_mimo
from mamba3_mimo.reference import mamba3_mimo_reference, mamba3_mimo_stepwise
from mamba3_mimo.testing import THRESHOLDS, rel_rms

F64 = torch.float64
OUT_NAMES = ("out", "final_angle", "final_state", "final_k", "final_v")

CASES = {
    # name: (make_args kwargs, operator kwargs, norm weight shape)
    "z_d_gqa": (dict(B=2, S=13, H=4, G=2, R=3, N=12, P=10, chunk_size=4,
                     rotary_dim_divisor=2), {}, None),
    "noz_nod": (dict(B=1, S=11, H=2, G=1, R=2, N=8, P=6, chunk_size=5, z=False, d=False,
                     rotary_dim_divisor=4), {}, None),
    "per_rank": (dict(B=2, S=9, H=2, G=2, R=3, N=12, P=10, chunk_size=4, mimo_out=False), {},
                 None),
    "norm_w": (dict(B=1, S=10, H=2, G=1, R=2, N=8, P=12, chunk_size=3),
               dict(fuse_pregate_headwise_rms_norm=True), (2, 12)),
    "norm_flat": (dict(B=1, S=7, H=2, G=1, R=2, N=8, P=12, chunk_size=8),
                  dict(fuse_pregate_headwise_rms_norm=True), (24,)),
    "norm_none": (dict(B=1, S=6, H=2, G=2, R=1, N=8, P=12, chunk_size=2),
                  dict(fuse_pregate_headwise_rms_norm=True), None),
}


def _leaves(args, dtype, device, norm_w):
    """Leaf copies that require grad: Q, K, V, Z in dtype, the rest fp32 (Trap in dtype)."""
    out = {}
    for name, x in args.items():
        if isinstance(x, torch.Tensor):
            to = dtype if name in ("Q", "K", "V", "Z", "Trap") else torch.float32
            out[name] = x.detach().to(device=device, dtype=to).requires_grad_(True)
        else:
            out[name] = x
    out["dtype"] = dtype
    w = None if norm_w is None else norm_w.detach().to(device, torch.float32).requires_grad_(True)
    return out, w


def _run(fn, args, w, op_kw, seed=5, **extra):
    outs = fn(**args, return_state=True, outproj_norm_weight=w, **op_kw, **extra)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]
    loss = sum((o.double() * wt.to(o.device)).sum() for o, wt in zip(outs, weights))
    loss.backward()
    grads = {k: args[k].grad for k in INPUT_NAMES if isinstance(args[k], torch.Tensor)}
    if w is not None:
        grads["outproj_norm_weight"] = w.grad
    return dict(zip(OUT_NAMES, [o.detach() for o in outs])), grads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16, torch.float16]
                                                      if ON_GPU else []),
                         ids=lambda d: str(d).split(".")[-1])
def test_operator_against_references(case, dtype):
    make_kw, op_kw, w_shape = CASES[case]
    args = make_args(**make_kw)
    w64 = None if w_shape is None else 1 + 0.3 * torch.randn(
        w_shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    ours_args, w = _leaves(args, dtype, DEVICE, w64)
    got_out, got_grads = _run(mamba3_mimo, ours_args, w, op_kw)
    # the references take what the operator took (inputs rounded to dtype), in float64
    ref_args = {k: (v.detach().double().cpu().requires_grad_(True) if isinstance(v, torch.Tensor)
                    else v) for k, v in ours_args.items()}
    ref_args["dtype"] = F64
    ref_w = None if w is None else w.detach().double().cpu().requires_grad_(True)
    limit = THRESHOLDS[dtype]
    for ref_fn in (mamba3_mimo_reference, mamba3_mimo_stepwise):
        ref_a = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor)
                     else v) for k, v in ref_args.items()}
        rw = None if ref_w is None else ref_w.detach().clone().requires_grad_(True)
        want_out, want_grads = _run(ref_fn, ref_a, rw, op_kw)
        errors = {n: rel_rms(got_out[n].cpu(), want_out[n]) for n in OUT_NAMES}
        errors.update({f"d{n}": rel_rms(got_grads[n].cpu(), want_grads[n]) for n in want_grads})
        assert set(got_grads) == set(want_grads)
        bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= limit}
        assert not bad, f"{ref_fn.__name__}: relative RMS errors above {limit}: {bad}"


def test_gradient_dtypes():
    """Q, K, V, Z gradients in their dtype, Trap's in Trap's, the others fp32; None for an
    absent input."""
    args = make_args(B=1, S=5, H=2, G=1, R=2, N=8, P=4, chunk_size=2, d=False)
    a, _ = _leaves(args, torch.float32, DEVICE, None)
    a["Trap"] = a["Trap"].detach().double().requires_grad_(False).float().requires_grad_(True)
    out = mamba3_mimo(**a)
    out.sum().backward()
    for name in INPUT_NAMES:
        x = a[name]
        if x is None:
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype, name


def test_cu_seqlens_not_yet():
    args = make_args(B=1, S=5, H=2, G=1, R=2, N=8, P=4, chunk_size=2)
    a, _ = _leaves(args, torch.float32, DEVICE, None)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        mamba3_mimo(**a, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))


@pytest.mark.parametrize("bad,match", [
    (dict(MIMO_Z=None), "MIMO_Z and Z"),
    (dict(MIMO_Out=None, fuse_pregate_headwise_rms_norm=True), "fuse_pregate"),
    (dict(rotary_dim_divisor=1), "rotary_dim_divisor"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(D=torch.zeros(3)), "D must have shape"),
])
def test_bad_arguments(bad, match):
    args = make_args(B=1, S=5, H=2, G=1, R=2, N=8, P=4, chunk_size=2)
    a, _ = _leaves(args, torch.float32, DEVICE, None)
    a.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()})
    with pytest.raises((ValueError, TypeError), match=match):
        mamba3_mimo(**a)
