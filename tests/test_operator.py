"""The whole operator `mamba3_mimo(...)` against the float64 chunked reference and the per-step
recurrence (SPEC sections 6-7): the output, the four final states and the gradient of every
input, on small odd shapes (GQA, R = 3, N = 12, P = 10, S not a multiple of chunk_size,
divisor 2), with and without Z, D, MIMO_Out, the fused norm (weight given, None, flattened),
in fp32, bf16 and fp16 (through the interpreter, the dots' operands are fp32 whatever the
input dtype; the GPU runs them at the kernels' precision)."""
import pytest
import torch

from conftest import DEVICE, LiveBytes, requires_gpu, seed_for
from test_reference_operator import INPUT_NAMES, make_args
from mamba3_mimo import configs, mamba3_mimo
from mamba3_mimo.inputs import Shape, official_shapes, operator_inputs
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


def _assert_identical(got_out, got_grads, want_out, want_grads):
    """Every output and gradient equal bit for bit."""
    for name in OUT_NAMES:
        assert torch.equal(got_out[name], want_out[name]), name
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert torch.equal(got_grads[name], g), name


def _run(fn, args, w, op_kw, seed=5, like=None, return_state=True, **extra):
    """(outputs, gradients) of loss = sum_i <outs[i], weights[i]> with seeded random weights.
    The weights are the cotangents autograd hands the operator: in each output's dtype. A
    reference run gets `like`, the operator's outputs, so that its weights are rounded to the
    same dtypes: both see the same d out (a bf16 d out is part of a bf16 operator's input).
    Without return_state the outputs are out alone."""
    outs = fn(**args, return_state=return_state, outproj_norm_weight=w, **op_kw, **extra)
    if not return_state:
        outs = (outs,)
    gen = torch.Generator().manual_seed(seed)
    dtypes = [o.dtype for o in (outs if like is None else like.values())]
    weights = [torch.randn(o.shape, generator=gen, dtype=F64).to(dt).to(F64)
               for o, dt in zip(outs, dtypes)]
    loss = sum((o.double() * wt.to(o.device)).sum() for o, wt in zip(outs, weights))
    loss.backward()
    # a non-leaf input (e.g. angles expanded over the heads) has no .grad of its own: None, as
    # reading it would give, without PyTorch's warning
    grads = {k: args[k].grad if args[k].is_leaf else None
             for k in INPUT_NAMES if isinstance(args[k], torch.Tensor)}
    if w is not None:
        grads["outproj_norm_weight"] = w.grad
    return dict(zip(OUT_NAMES, [o.detach() for o in outs])), grads


def _against_reference(ours, w, op_kw, limit, **run_kw):
    """Every output and gradient of the operator on the leaves `ours` (norm weight w) within
    `limit` of the float64 reference operator's on the same values."""
    got_out, got_grads = _run(mamba3_mimo, ours, w, op_kw, **run_kw)
    ref = {k: (v.detach().double().cpu().requires_grad_(True) if isinstance(v, torch.Tensor)
               else v) for k, v in ours.items()}
    ref["dtype"] = F64
    rw = None if w is None else w.detach().double().cpu().requires_grad_(True)
    want_out, want_grads = _run(mamba3_mimo_reference, ref, rw, op_kw, like=got_out, **run_kw)
    errors = {n: rel_rms(got_out[n].cpu(), want_out[n]) for n in want_out}
    errors.update({f"d{n}": rel_rms(got_grads[n].cpu(), want_grads[n]) for n in want_grads})
    assert set(got_grads) == set(want_grads)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= limit}
    assert not bad, f"relative RMS errors above {limit}: {bad}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
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
        want_out, want_grads = _run(ref_fn, ref_a, rw, op_kw, like=got_out)
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


def test_mimo_z_without_z_is_unused():
    """MIMO_Z given with Z None (as flash-linear-attention's layer passes it with its
    output-projection norm): the results of MIMO_Z None, bit for bit, and a zero gradient for
    MIMO_Z (of MIMO_Z's shape, as the backward op's fake says: test_custom_ops_pass_opcheck)."""
    args = make_args(B=1, S=6, H=2, G=1, R=2, N=8, P=4, chunk_size=4, z=False, mimo_out=False)
    args["MIMO_Z"] = torch.randn(2, 2, 4, dtype=torch.float64)
    results = []
    for mimo_z in (args["MIMO_Z"], None):
        a, _ = _leaves(dict(args, MIMO_Z=mimo_z), torch.float32, DEVICE, None)
        out = mamba3_mimo(**a)
        out.sum().backward()
        results.append((out.detach(), a["Q"].grad, a["MIMO_Z"]))
    (out, dq, mimo_z), (want, want_dq, _) = results
    assert torch.equal(out, want) and torch.equal(dq, want_dq)
    assert mimo_z.grad is not None and not mimo_z.grad.any()


@pytest.mark.parametrize("bad,match", [
    (dict(MIMO_Z=None), "Z needs MIMO_Z"),
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


EDGE_CASES = {
    # name: (make_args kwargs): one step; S shorter than a chunk; chunk_size 1; R = 8 with
    # chunks split into kernel tiles; N = 48, P = 24
    "one_step": dict(B=1, S=1, H=2, G=1, R=2, N=8, P=6, chunk_size=4),
    "short": dict(B=2, S=3, H=2, G=2, R=3, N=12, P=10, chunk_size=16),
    "chunk_1": dict(B=1, S=6, H=2, G=1, R=2, N=8, P=6, chunk_size=1),
    "split_tiles": dict(B=1, S=21, H=2, G=1, R=8, N=8, P=6, chunk_size=16),
    "n48_p24": dict(B=1, S=9, H=3, G=3, R=3, N=48, P=24, chunk_size=4, rotary_dim_divisor=2),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_operator_edge_shapes(case):
    """Every output and gradient against the float64 chunked reference (fp32 inputs)."""
    args = make_args(**EDGE_CASES[case])
    ours, _ = _leaves(args, torch.float32, DEVICE, None)
    got_out, got_grads = _run(mamba3_mimo, ours, None, {})
    ref = {k: (v.detach().double().cpu().requires_grad_(True) if isinstance(v, torch.Tensor)
               else v) for k, v in ours.items()}
    ref["dtype"] = F64
    want_out, want_grads = _run(mamba3_mimo_reference, ref, None, {})
    errors = {n: rel_rms(got_out[n].cpu(), want_out[n]) for n in OUT_NAMES}
    errors.update({f"d{n}": rel_rms(got_grads[n].cpu(), want_grads[n]) for n in want_grads})
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= THRESHOLDS[torch.float32]}
    assert not bad, f"relative RMS errors above {THRESHOLDS[torch.float32]}: {bad}"


def test_angles_expanded_over_heads():
    """Angles given as a [B, S, 1, RD] tensor expanded over the heads (head stride 0, as
    flash-linear-attention passes it): the same output and input gradients as a dense copy,
    and the gradient of the unexpanded leaf summed over the heads."""
    args = make_args(B=1, S=7, H=3, G=1, R=2, N=8, P=6, chunk_size=4)
    dense, _ = _leaves(args, torch.float32, DEVICE, None)
    base = dense["Angles"][:, :, :1].detach().clone().requires_grad_(True)
    dense["Angles"] = base.detach().expand(-1, -1, 3, -1).contiguous().requires_grad_(True)
    expanded = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor)
                    and k != "Angles" else v) for k, v in dense.items()}
    expanded["Angles"] = base.expand(-1, -1, 3, -1)
    out_d = mamba3_mimo(**dense)
    out_e = mamba3_mimo(**expanded)
    assert torch.equal(out_d, out_e)
    g = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(3)).to(out_d.device)
    out_d.backward(g)
    out_e.backward(g)
    assert torch.equal(base.grad, dense["Angles"].grad.sum(2, keepdim=True))
    assert torch.equal(expanded["Q"].grad, dense["Q"].grad)


def test_deterministic():
    """The same inputs give bitwise identical outputs, final states and gradients."""
    args = make_args(B=1, S=11, H=4, G=2, R=3, N=12, P=10, chunk_size=4)
    results = []
    for _ in range(2):
        ours, _ = _leaves(args, torch.float32, DEVICE, None)
        results.append(_run(mamba3_mimo, ours, None, {}))
    for name in OUT_NAMES:
        assert torch.equal(results[0][0][name], results[1][0][name]), name
    for name, g in results[0][1].items():
        assert torch.equal(g, results[1][1][name]), name


def test_joined_chunk_size():
    """The operator joins chunks to tiles of 33-64 (step, rank) rows: C = 8 with R = 4 runs 16
    steps, the official shapes with 64-row chunks keep theirs, and an R whose one-step tile is
    larger than 64 rows one step."""
    from mamba3_mimo.phases.operator import kernel_chunk
    from mamba3_mimo.problem import Problem
    cases = {(8, 4): 16, (16, 4): 16, (8, 8): 8, (32, 2): 32, (64, 1): 64, (3, 3): 12,
             (5, 1): 40, (1, 128): 1, (1, 72): 1}
    for (C, R), want in cases.items():
        assert configs.joined_chunk_size(C, R) == want, (C, R)
    for s in official_shapes():
        pb = Problem(B=s.B, S=s.S, H=s.H, G=s.G, N=s.N, P=s.P, R=s.R, C=s.C,
                     rotary_dim_divisor=s.rotary_dim_divisor, dtype=torch.bfloat16, has_z=True,
                     has_d=True, output_dtype=torch.bfloat16, device=torch.device("cpu"))
        assert kernel_chunk(pb) == (16 if (s.C, s.R) == (8, 4) else s.C), s.name


@pytest.mark.parametrize("op_kw,make_kw", [
    ({}, dict(mimo_out=True)),
    ({}, dict(mimo_out=False, d=False)),
    (dict(fuse_pregate_headwise_rms_norm=True), dict(mimo_out=True)),
], ids=["reduced", "per_rank", "norm"])
def test_operator_in_several_blocks(monkeypatch, op_kw, make_kw):
    """N walked in several blocks (16 pairs of N = 48: 2 blocks), and chunk_grads' P too (16 of
    P = 40 columns: 3 blocks), as the official shapes' larger N and P are: every output and
    gradient against the float64 reference."""
    from mamba3_mimo.kernels import chunk_forward, chunk_grads
    monkeypatch.setattr(chunk_forward, "block_pairs", lambda P: 16)
    monkeypatch.setattr(chunk_grads, "config", lambda *shape: chunk_grads.GradsConfig(
        BJ=16, BP=16, V_BJ=16, V_BP=16, STATE_BJ=16, STATE_BP=16))
    args = make_args(B=1, S=10, H=2, G=1, R=2, N=48, P=40, chunk_size=4, **make_kw)
    w = 1 + 0.3 * torch.randn(2, 40, generator=torch.Generator().manual_seed(4),
                              dtype=F64) if op_kw else None
    ours, w32 = _leaves(args, torch.float32, DEVICE, w)
    # chunk_output's tiles (the reduced output without the norm) in blocks too
    with configs.override(output=[configs.OutputConfig(BJ=16, BP=16)]):
        _against_reference(ours, w32, op_kw, THRESHOLDS[torch.float32])


@pytest.mark.parametrize("case", ["z_d_gqa", "noz_nod"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
def test_output_without_states(case, dtype):
    """Without return_state the forward writes the reduced output through chunk_output's tiles
    (phases.operator.tiled_output), not chunk_forward: out and every gradient against the
    float64 reference."""
    make_kw, op_kw, _ = CASES[case]
    ours, _ = _leaves(make_args(**make_kw), dtype, DEVICE, None)
    _against_reference(ours, None, op_kw, THRESHOLDS[dtype], return_state=False)


@requires_gpu
@pytest.mark.parametrize("shape", official_shapes(B=1), ids=lambda s: s.name)
def test_official_shapes_accuracy(shape):
    """Every official model shape at full length (S = 2048, H = 16, one batch entry: the errors
    are per element), bf16, Z and D on, as training calls it (no final states: the forward on
    chunk_output's tiles; test_initial_state's full-size cases cover the states): the output and
    every gradient within the bf16 threshold of the float64 chunked reference (run on the GPU)."""
    _official_accuracy(shape)


@requires_gpu
def test_official_batch_in_groups():
    """Two batch entries of N128_P64_R4_C16 at full length, whose backward runs one entry at a
    time (configs.backward_group; each entry's serial passes then in segments, joined), as
    test_official_shapes_accuracy checks one: every gradient within the bf16 threshold of the
    float64 reference."""
    shape = next(s for s in official_shapes(B=2) if s.name == "N128_P64_R4_C16")
    assert configs.backward_group(2, 4 * shape.H * shape.N * shape.P * 2 * 128) == 1
    _official_accuracy(shape)


def _official_accuracy(shape: Shape) -> None:
    args = operator_inputs(shape, torch.float64, seed=seed_for(shape.name))
    ours, _ = _leaves(args, torch.bfloat16, DEVICE, None)
    got_out, got_grads = _run(mamba3_mimo, ours, None, {}, return_state=False)
    ref = {k: (v.detach().double().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
           for k, v in ours.items()}
    ref["dtype"] = F64
    want_out, want_grads = _run(mamba3_mimo_reference, ref, None, {}, like=got_out,
                                return_state=False)
    errors = {n: rel_rms(got_out[n], want_out[n]) for n in want_out}
    errors.update({f"d{n}": rel_rms(got_grads[n], want_grads[n]) for n in want_grads})
    print(f"\n{shape.name} " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= THRESHOLDS[torch.bfloat16]}
    assert not bad, f"relative RMS errors above {THRESHOLDS[torch.bfloat16]}: {bad}"


@requires_gpu
def test_new_batch_or_length_never_recompiles():
    """After a model's first forward and backward in one chain per sequence and its first in
    segments (a call with fewer than four batch entries whose sequences pass 16 chunks cuts its
    serial passes into segments: the join kernel and the scans' final-storing forms compile
    then, once), other batch sizes and lengths (multiples of the chunk or not, shorter than a
    chunk, in more or fewer segments) compile nothing: every B- and S-dependent integer of the
    operator's kernels is left unspecialised, and a chunk longer than S runs as one chunk of
    whole kernel tiles."""
    from test_gpu import compiled_count
    shape = Shape(1, 256, 4, 1, 64, 64, 4, 16)
    counts = []
    for B, S in [(1, 256), (2, 512), (1, 2000), (3, 1000), (1, 77), (2, 5)]:
        s = Shape(B, S, shape.H, shape.G, shape.N, shape.P, shape.R, shape.C)
        a, _ = _leaves(operator_inputs(s, F64, seed=seed_for(B, S)), torch.bfloat16, DEVICE,
                       None)
        mamba3_mimo(**a).float().sum().backward()
        torch.cuda.synchronize()
        counts.append(compiled_count())
    assert 0 < counts[0] < counts[1] and counts[1:] == counts[1:2] * (len(counts) - 1), counts


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) of a function calling the operator (with return_state and
    the fused norm) traces it as its custom ops, with no graph break, and gives the eager
    outputs and gradients bit for bit (aot_eager on the CPU; Inductor on a GPU)."""
    args = make_args(B=1, S=7, H=2, G=1, R=2, N=8, P=6, chunk_size=4)
    w = torch.ones(2, 6, dtype=F64)
    op_kw = dict(fuse_pregate_headwise_rms_norm=True)
    eager_args, ew = _leaves(args, torch.float32, DEVICE, w)
    want_out, want_grads = _run(mamba3_mimo, eager_args, ew, op_kw)
    compiled = torch.compile(mamba3_mimo, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    comp_args, cw = _leaves(args, torch.float32, DEVICE, w)
    got_out, got_grads = _run(compiled, comp_args, cw, op_kw)
    _assert_identical(got_out, got_grads, want_out, want_grads)


@requires_gpu
def test_training_step_in_a_cuda_graph():
    """Forward and backward of the operator (official shape N64_P64_R4_C16 at S = 512, bf16)
    captured in one CUDA graph and replayed on new inputs copied into the captured ones: the
    eager step's output and gradients, bit for bit (nothing reads back to the host, every
    launch goes to the capturing stream)."""
    shape = Shape(2, 512, 16, 1, 64, 64, 4, 16)
    names = ("Q", "K", "V", "Z", "ADT", "DT", "Trap", "Angles")
    args = operator_inputs(shape, torch.bfloat16, device=DEVICE, seed=3)
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.requires_grad_(True)
    dout = torch.randn(args["V"].shape, device=DEVICE, dtype=torch.bfloat16)

    def step():
        mamba3_mimo(**args).backward(dout)

    def grads():
        return {n: x.grad.clone() for n, x in args.items() if isinstance(x, torch.Tensor)}

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compilation and the call plans, off the graph
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fresh = operator_inputs(shape, torch.bfloat16, device=DEVICE, seed=4)
    with torch.no_grad():
        for n in names:
            args[n].copy_(fresh[n])
        for x in args.values():
            if isinstance(x, torch.Tensor):
                x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = grads()
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.grad = None
    step()
    for name, g in grads().items():
        assert torch.equal(got[name], g), name


def test_custom_ops_pass_opcheck():
    """The operator's two custom ops (what torch.compile traces): schema, fake implementations,
    autograd registration and dispatch agree with the real ones (torch.library.opcheck), with
    MIMO_Z given without Z (whose gradient the fake backward gives MIMO_Z's shape)."""
    from mamba3_mimo.phases import operator as op
    args = make_args(B=1, S=6, H=2, G=1, R=2, N=8, P=4, chunk_size=4, z=False)
    args["MIMO_Z"] = torch.randn(2, 2, 4, dtype=torch.float64)
    a, _ = _leaves(args, torch.float32, DEVICE, None)
    tensors = tuple(a[n] for n in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias",
                                   "MIMO_V", "MIMO_Z", "MIMO_Out", "Angles", "D", "Z"))
    fwd_args = tensors + (None,) * 6 + (4, 2, False, 1e-5)  # norm weight, initial state, cu
    # AOT dispatch is what test_torch_compile_fullgraph runs end to end
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op._fwd_op, fwd_args, test_utils=checks)
    d_outs = tuple(torch.randn_like(o) for o in op._fwd_op(*fwd_args))
    plain = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in fwd_args[:19])
    torch.library.opcheck(op._bwd_op, plain + d_outs + fwd_args[19:], test_utils=checks)


def test_non_contiguous_inputs():
    """Q, K, V, Z, Trap and the per-step inputs as strided views (every other step of longer
    tensors, heads and steps transposed): the results of contiguous copies, bit for bit. S is a
    multiple of chunk_size, so that no padding copy makes them contiguous on the way."""
    args = make_args(B=1, S=8, H=2, G=2, R=2, N=8, P=6, chunk_size=4)
    dense, _ = _leaves(args, torch.float32, DEVICE, None)
    strided = {}
    for name, x in dense.items():
        if not isinstance(x, torch.Tensor):
            strided[name] = x
        elif name in ("Q", "K", "V", "Z"):  # every other step of a tensor twice as long
            wide = torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:], dtype=x.dtype,
                               device=x.device)
            wide[:, ::2] = x.detach()
            strided[name] = wide[:, ::2].requires_grad_(True)
        elif name in ("ADT", "DT", "Trap"):  # [B, S, H] transposed to [B, H, S]
            strided[name] = x.detach().transpose(1, 2).contiguous().transpose(1, 2)
            strided[name].requires_grad_(True)
        else:
            strided[name] = x.detach().clone().requires_grad_(True)
    assert not strided["Z"].is_contiguous() and not strided["DT"].is_contiguous()
    want_out, want_grads = _run(mamba3_mimo, dense, None, {})
    got_out, got_grads = _run(mamba3_mimo, strided, None, {})
    _assert_identical(got_out, got_grads, want_out, want_grads)


def test_far_batches():
    """Q and V whose batch stride is 2**32 elements (views of buffers of 2**32 + one batch,
    virtual memory barely touched) give the contiguous call's output and gradients: the
    kernels' batch offsets are 64-bit."""
    from test_hardening import _far_batches
    args = make_args(B=2, S=8, H=2, G=1, R=2, N=8, P=6, chunk_size=4)
    dense, _ = _leaves(args, torch.float32, DEVICE, None)
    far = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
           for k, v in dense.items()}
    for name in ("Q", "V"):
        far[name] = _far_batches(dense[name].detach()).requires_grad_(True)
    want_out, want_grads = _run(mamba3_mimo, dense, None, {})
    got_out, got_grads = _run(mamba3_mimo, far, None, {})
    _assert_identical(got_out, got_grads, want_out, want_grads)


def test_sparse_input_is_refused():
    args = make_args(B=1, S=5, H=2, G=1, R=2, N=8, P=4, chunk_size=2)
    a, _ = _leaves(args, torch.float32, DEVICE, None)
    a["Q"] = a["Q"].detach().to_sparse()
    with pytest.raises(TypeError, match="Q must be a dense"):
        mamba3_mimo(**a)


def test_backward_peak_is_phase_2(monkeypatch):
    """The backward releases the states, their gradients and dy (the largest buffers) as soon
    as phase 2 is done: nothing it allocates afterwards (the reductions, the angles' backward,
    the casts of the inputs' gradients) raises the memory in use above the high-water mark of
    the groups' phase 2 and the parameters' sums read from their buffers. The kernels are not run (the buffers'
    lifetimes are the host's; the interpreter's launches hold their arguments in reference
    cycles until a collection)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    from mamba3_mimo.phases import operator
    from mamba3_mimo.runtime import launcher
    for cls in (JITFunction, InterpretedFunction):
        # launches do nothing; a warmup (the configs' shared-memory probe on a GPU) still compiles
        def run(self, *args, warmup=False, _run=cls.run, **kwargs):
            return _run(self, *args, warmup=True, **kwargs) if warmup else None
        monkeypatch.setattr(cls, "run", run)
    monkeypatch.setattr(launcher, "DIRECT", False)  # every launch through run
    args = make_args(B=2, S=32, H=2, G=1, R=2, N=64, P=64, chunk_size=8)  # N, P as official
    ours, _ = _leaves(args, torch.float32, DEVICE, None)
    leaves = [t for t in ours.values() if isinstance(t, torch.Tensor)]
    after_phase_2 = []
    parameter_sums = operator._parameter_sums

    def spy(*args, **kw):  # the groups' phase 2 done, their sums read: the high-water mark
        out = parameter_sums(*args, **kw)
        after_phase_2.append(live.peak)
        return out

    monkeypatch.setattr(operator, "_parameter_sums", spy)
    for group in (2, 1):
        after_phase_2.clear()
        live = LiveBytes(known=leaves)
        with configs.override(backward_group=group), live:
            out = mamba3_mimo(**ours)
            out.backward(torch.ones_like(out))
        assert len(after_phase_2) == 1
        assert live.peak <= after_phase_2[-1], (group, live.peak, after_phase_2[-1])


def test_backward_group_bytes(monkeypatch):
    """configs.set_backward_group_bytes: its budget decides the backward's groups (0: one entry
    at a time; None: the default, which holds this small batch at once); three entries in groups
    of one give the same outputs, bit for bit, and every gradient within fp32 rounding of the
    whole batch's at once (only the parameters' sums over the entries change order); a budget
    that is not an int (TypeError) or is negative (ValueError) is refused."""
    from mamba3_mimo.phases import operator
    sizes = []
    group_grads = operator._group_grads
    monkeypatch.setattr(operator, "_group_grads",
                        lambda pb, *a, **k: sizes.append(pb.B) or group_grads(pb, *a, **k))
    args = make_args(B=3, S=12, H=2, G=1, R=2, N=8, P=8, chunk_size=4, seed=141)
    runs = {}
    try:
        for budget, want in ((0, [1, 1, 1]), (None, [3])):
            configs.set_backward_group_bytes(budget)
            sizes.clear()
            ours, _ = _leaves(args, torch.float32, DEVICE, None)
            runs[budget] = _run(mamba3_mimo, ours, None, {})
            assert sizes == want, budget
    finally:
        configs.set_backward_group_bytes(None)
    (out_one, grads_one), (out_all, grads_all) = runs[0], runs[None]
    for name in OUT_NAMES:
        assert torch.equal(out_one[name], out_all[name]), name
    assert set(grads_one) == set(grads_all)
    for name, g in grads_all.items():
        assert rel_rms(grads_one[name], g) <= 1e-6, name
    with pytest.raises(ValueError, match="n_bytes must be non-negative"):
        configs.set_backward_group_bytes(-1)
    for bad in (1.5, True, "1"):
        with pytest.raises(TypeError, match="n_bytes must be an int or None"):
            configs.set_backward_group_bytes(bad)


def _spy_states(monkeypatch) -> list:
    """(grad, the states' dtype, whether the chains run in segments) of every output-stage launch
    the operator builds from here on."""
    from mamba3_mimo.phases import operator
    seen = []
    output_launch = operator.output_launch

    def spy(pb, x, env, tiled, grad):
        seen.append((grad, env["states"].dtype, env["segments"] is not None))
        return output_launch(pb, x, env, tiled, grad)

    monkeypatch.setattr(operator, "output_launch", spy)
    return seen


@pytest.mark.parametrize("case", ["z_d_gqa", "noz_nod"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
def test_forward_with_rounded_states(monkeypatch, case, dtype):
    """A training forward (no final states, the output on chunk_output's tiles) with the fused
    state scan writes the states in the inputs' 16-bit dtype, which the tiles alone read; the
    backward recomputes them in fp32: out and every gradient against the float64 reference.
    (Through the interpreter 16-bit stores truncate: a harder test than the GPU's rounding.)"""
    make_kw, op_kw, _ = CASES[case]
    ours, _ = _leaves(make_args(**make_kw), dtype, DEVICE, None)
    seen = _spy_states(monkeypatch)
    with configs.override(state=[configs.StateConfig(scan=True, BJ=16, BP=16)]):
        _against_reference(ours, None, op_kw, THRESHOLDS[dtype], return_state=False)
    assert seen == [(False, dtype, False), (True, torch.float32, False)], seen


def test_forward_states_stay_fp32_in_segments(monkeypatch):
    """A training forward whose chains run in segments keeps its states in fp32 (the join adds
    the carried state to them in place): out and every gradient against the float64
    reference, the states' dtypes checked."""
    from mamba3_mimo.phases import packed
    monkeypatch.setattr(packed, "MIN_SEGMENT_CHUNKS", 1)
    packed.segments.cache_clear()
    ours, _ = _leaves(make_args(B=1, S=45, H=2, G=1, R=3, N=12, P=10, chunk_size=4, seed=59),
                      torch.bfloat16, DEVICE, None)
    seen = _spy_states(monkeypatch)
    with configs.override(state=[configs.StateConfig(scan=True, BJ=16, BP=16)]):
        _against_reference(ours, None, {}, THRESHOLDS[torch.bfloat16], return_state=False)
    packed.segments.cache_clear()
    assert seen == [(False, torch.float32, True), (True, torch.float32, True)], seen
