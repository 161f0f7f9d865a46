"""`mamba3_mimo_step`, the in-place decode step (SPEC section 7): prefill S tokens with the operator,
then step T tokens, and the outputs and the final state equal the operator's over S + T tokens;
the state is updated in place and the output written into a given buffer; deterministic."""
import pytest
import torch

from conftest import DEVICE, LiveBytes, requires_gpu
from test_reference_operator import make_args
from mamba3_mimo import mamba3_mimo, mamba3_mimo_step
from mamba3_mimo.phases.operator import SEQ_DIM
from mamba3_mimo.phases.step import step_arguments
from mamba3_mimo.testing import THRESHOLDS, rel_rms

LIMIT = THRESHOLDS[torch.float32]

CASES = {
    # name: (make_args kwargs, operator kwargs, norm weight shape)
    "z_d_gqa": (dict(B=2, H=4, G=2, R=3, N=12, P=10, chunk_size=4, rotary_dim_divisor=2), {},
                None),
    "noz_nod_per_rank": (dict(B=3, H=2, G=1, R=2, N=8, P=6, chunk_size=5, z=False, d=False,
                              mimo_out=False), {}, None),
    # N = 80: two blocks of 32 pairs (block_pairs), the second partial
    "norm_blocks": (dict(B=1, H=2, G=1, R=2, N=80, P=40, chunk_size=4),
                    dict(fuse_pregate_headwise_rms_norm=True), (2, 40)),
    "norm_unweighted": (dict(B=2, H=2, G=2, R=1, N=8, P=12, chunk_size=4),
                        dict(fuse_pregate_headwise_rms_norm=True), None),
}


def _fp32(args, device=DEVICE):
    a = {k: (v.detach().to(device=device, dtype=torch.float32) if isinstance(v, torch.Tensor)
             else v) for k, v in args.items()}
    a["dtype"] = torch.float32
    return a


def _steps(a, lo, hi):
    s = dict(a)
    for name, dim in SEQ_DIM.items():
        if s[name] is not None:
            s[name] = s[name].narrow(dim, lo, hi - lo)
    return s


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_equals_forward(case):
    make_kw, op_kw, w_shape = CASES[case]
    S, T = 7, 5
    a = _fp32(make_args(S=S + T, seed=101, **make_kw))
    w = None if w_shape is None else 1 + 0.3 * torch.randn(
        w_shape, generator=torch.Generator().manual_seed(102)).to(DEVICE)
    whole = mamba3_mimo(**a, return_state=True, outproj_norm_weight=w, **op_kw)
    first = mamba3_mimo(**_steps(a, 0, S), return_state=True, outproj_norm_weight=w, **op_kw)
    state = tuple(x.clone() for x in first[1:])
    ids = [x.data_ptr() for x in state]
    out = torch.empty_like(whole[0][:, 0])
    outs = []
    for t in range(S, S + T):
        got = mamba3_mimo_step(**step_arguments(a, t), state=state, outproj_norm_weight=w, out=out,
                               **op_kw)
        assert got is out
        outs.append(got.clone())
    assert [x.data_ptr() for x in state] == ids
    err = rel_rms(torch.stack(outs, 1).cpu(), whole[0][:, S:].cpu())
    assert err <= LIMIT, f"decoded outputs: {err:.2e}"
    for name, got, want in zip(("angle", "state", "k", "v"), state, whole[1:]):
        err = rel_rms(got.cpu(), want.cpu())
        assert err <= LIMIT, f"state {name} after decoding: {err:.2e}"


def test_decode_is_deterministic():
    a = _fp32(make_args(B=2, S=3, H=2, G=1, R=2, N=8, P=6, chunk_size=4, seed=103))
    first = mamba3_mimo(**_steps(a, 0, 2), return_state=True)
    results = []
    for _ in range(2):
        state = tuple(x.clone() for x in first[1:])
        out = mamba3_mimo_step(**step_arguments(a, 2), state=state)
        results.append((out, state))
    assert torch.equal(results[0][0], results[1][0])
    for x, y in zip(results[0][1], results[1][1]):
        assert torch.equal(x, y)


def test_compiled_decode_loop():
    """torch.compile(fullgraph=True) of a loop of three steps (the step is a custom op that
    mutates the state and the output): the eager steps' outputs and states, bit for bit."""
    a = _fp32(make_args(B=2, S=6, H=4, G=2, R=3, N=12, P=10, chunk_size=4, seed=105))
    first = mamba3_mimo(**_steps(a, 0, 3), return_state=True)

    def loop(state, out):
        ys = []
        for t in range(3, 6):
            ys.append(mamba3_mimo_step(**step_arguments(a, t), state=state, out=out).clone())
        return torch.stack(ys, 1)

    compiled = torch.compile(loop, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    results = []
    for fn in (loop, compiled):
        state = tuple(x.clone() for x in first[1:])
        results.append((fn(state, torch.empty_like(first[0][:, 0])), state))
    assert torch.equal(results[0][0], results[1][0])
    for x, y in zip(results[0][1], results[1][1]):
        assert torch.equal(x, y)


def test_step_op_passes_opcheck():
    """The custom op behind the compiled step: its schema declares every tensor it writes, its
    fake implementation and its dispatch agree with the real one (torch.library.opcheck)."""
    from mamba3_mimo.phases import step as step_module
    a = _fp32(make_args(B=1, S=3, H=2, G=1, R=2, N=8, P=6, chunk_size=4, seed=106))
    first = mamba3_mimo(**_steps(a, 0, 2), return_state=True)
    t = step_arguments(a, 2)
    state = tuple(x.clone() for x in first[1:])
    out = torch.empty_like(first[0][:, 0])
    args = (t["Q"], t["K"], t["V"], t["ADT"], t["DT"], t["Trap"], t["Q_bias"], t["K_bias"],
            t["MIMO_V"], t["MIMO_Z"], t["MIMO_Out"], t["Angles"], t["D"], t["Z"], None, *state,
            out, False, 1e-5)
    torch.library.opcheck(step_module._step_op, args)


def test_step_allocates_nothing(monkeypatch):
    """With the output buffer given, a step after the first creates no tensor storage: the
    state is updated in place and every buffer it needs exists already (what lets a server
    preallocate, and a CUDA graph replay it without its allocator). The measured step's
    launches do nothing: the interpreter copies a kernel's arguments, a compiled kernel
    allocates nothing, and what is counted is the host's work."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    from mamba3_mimo.runtime import launcher

    a = _fp32(make_args(B=2, S=4, H=4, G=2, R=3, N=12, P=10, chunk_size=4, seed=107))
    first = mamba3_mimo(**_steps(a, 0, 2), return_state=True)
    state = tuple(x.clone() for x in first[1:])
    out = torch.empty_like(first[0][:, 0])
    mamba3_mimo_step(**step_arguments(a, 2), state=state, out=out)  # the first: compiles
    t = step_arguments(a, 3)
    known = [x for x in (*t.values(), *state, out) if isinstance(x, torch.Tensor)]
    for cls in (JITFunction, InterpretedFunction):
        monkeypatch.setattr(cls, "run", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(launcher, "DIRECT", False)  # every launch through run
    with LiveBytes(known) as live:
        mamba3_mimo_step(**t, state=state, out=out)
    assert live.peak == 0, f"a step allocated {live.peak} bytes"


@requires_gpu
def test_decode_in_a_cuda_graph():
    """Three steps of N64_P64_R4_C16 (bf16, B = 16) captured in one CUDA graph, as a server
    replays them, and replayed from the prefill's state: the eager steps' outputs and final
    state, bit for bit."""
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo.problem import Shape
    S, T = 32, 3
    bf = operator_inputs(Shape(16, S + T, 16, 1, 64, 64, 4, 16), torch.bfloat16, device=DEVICE,
                         seed=122)
    first = mamba3_mimo(**_steps(bf, 0, S), return_state=True)
    steps = [step_arguments(bf, t) for t in range(S, S + T)]

    def run(state, outs):
        for t, o in zip(steps, outs):
            mamba3_mimo_step(**t, state=state, out=o)

    eager_state = tuple(x.clone() for x in first[1:])
    eager = [torch.empty_like(first[0][:, 0]) for _ in range(T)]
    run(eager_state, eager)
    state = tuple(x.clone() for x in first[1:])
    outs = [torch.empty_like(first[0][:, 0]) for _ in range(T)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: the state is still the prefill's after
        run(state, outs)
    for x in outs:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        assert torch.equal(got, want)
    for name, got, want in zip(("angle", "state", "k", "v"), state, eager_state):
        assert torch.equal(got, want), name


def test_bad_state():
    a = _fp32(make_args(B=1, S=3, H=2, G=1, R=2, N=8, P=6, chunk_size=4, seed=104))
    _, angle, state, k, v = mamba3_mimo(**a, return_state=True)
    with pytest.raises(TypeError, match="state must be a tuple"):
        mamba3_mimo_step(**step_arguments(a, 2), state=(angle, state, k))
    with pytest.raises(ValueError, match=r"state\[1\] \(state\) must be contiguous"):
        mamba3_mimo_step(**step_arguments(a, 2), state=(angle, state.transpose(-1, -2).contiguous()
                                                .transpose(-1, -2), k, v))
    with pytest.raises(ValueError, match=r"state\[2\] \(k\) must have shape"):
        mamba3_mimo_step(**step_arguments(a, 2), state=(angle, state, k[:, :1], v))


@requires_gpu
@pytest.mark.parametrize("B", [1, 16, 256])
def test_decode_on_the_gpu(B):
    """N128_P64_R4_C16 (H = 16), bf16: a prefill of 64 tokens by the operator, then 8 tokens by
    the step; the decoded outputs and the final state within the bf16 threshold of the float64
    reference over all 72 tokens."""
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo.problem import Shape
    from mamba3_mimo.reference import mamba3_mimo_reference
    S, T = 64, 8
    args = operator_inputs(Shape(B, S + T, 16, 1, 128, 64, 4, 16), torch.float64, seed=121)
    bf = {k: (v.to(DEVICE, torch.bfloat16 if k in ("Q", "K", "V", "Z", "Trap")
                   else torch.float32) if isinstance(v, torch.Tensor) else v)
          for k, v in args.items()}
    bf["dtype"] = torch.bfloat16
    ref = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in bf.items()}
    ref["dtype"] = torch.float64
    want = mamba3_mimo_reference(**ref, return_state=True)
    first = mamba3_mimo(**_steps(bf, 0, S), return_state=True)
    state = tuple(x.clone() for x in first[1:])
    out = torch.empty(B, 16, 64, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for t in range(S, S + T):
        outs.append(mamba3_mimo_step(**step_arguments(bf, t), state=state, out=out).clone())
    errors = {"out": rel_rms(torch.stack(outs, 1), want[0][:, S:])}
    errors.update({name: rel_rms(got, w) for name, got, w in
                   zip(("angle", "state", "k", "v"), state, want[1:])})
    print(f"\ndecode B={B} " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= THRESHOLDS[torch.bfloat16]}
    assert not bad, bad
