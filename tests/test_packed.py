"""`mamba3_mimo(..., cu_seqlens=...)`, packed sequences (SPEC section 7) through the production
kernels: every sequence restarts the angle sum, the decay and the state; the result equals
running each sequence alone (outputs, one row of final states per sequence, every gradient) and
both float64 references, with and without initial states, on sequences of one step, shorter
than a chunk, of whole chunks and not."""
import pytest
import torch

from conftest import DEVICE, requires_gpu
from test_initial_state import OUT_NAMES, _assert_within, _f64, _grads, _ours, _run
from test_reference_operator import _slice, make_args, state_for
from mamba3_mimo import configs, mamba3_mimo
from mamba3_mimo.configs import StateConfig
from mamba3_mimo.reference import mamba3_mimo_reference, mamba3_mimo_stepwise

F64 = torch.float64


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


CASES = {
    # name: (lengths, make_args kwargs, operator kwargs); chunk_size 4
    "mixed": ([1, 6, 8, 3], dict(H=4, G=2, R=3, N=12, P=10), {}),
    "per_rank_noz": ([5, 2], dict(H=2, G=1, R=2, N=8, P=6, mimo_out=False, z=False), {}),
    "norm": ([3, 4, 9], dict(H=2, G=1, R=2, N=8, P=12),
             dict(fuse_pregate_headwise_rms_norm=True)),
    "one_sequence": ([7], dict(H=2, G=2, R=1, N=8, P=6), {}),
}


def _args(lengths, kw, seed):
    return make_args(B=1, S=sum(lengths), chunk_size=4, rotary_dim_divisor=2, seed=seed, **kw)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_references(case, with_state):
    """Every output (one row of final states per sequence) and gradient against both float64
    references, fp32 inputs."""
    lengths, make_kw, op_kw = CASES[case]
    args = _args(lengths, make_kw, seed=91)
    init = state_for(args, seed=92) if with_state else None
    if init is not None:  # one row per sequence
        n = len(lengths)
        init = tuple(torch.cat([x] * n) + 0.1 * torch.arange(n, dtype=F64).view(-1, *[1] * (
            x.dim() - 1)) for x in init)
    a, i = _ours(args, init)
    cu = _cu(lengths)
    got_out, got_grads = _run(mamba3_mimo, a, i, cu_seqlens=cu, **op_kw)
    assert got_out["final_state"].shape[0] == len(lengths)
    for ref in (mamba3_mimo_reference, mamba3_mimo_stepwise):
        ra, ri = _f64(a, i)
        want_out, want_grads = _run(ref, ra, ri, cu_seqlens=cu.cpu(), **op_kw)
        assert set(got_grads) == set(want_grads)
        _assert_within(got_out, want_out, f"{ref.__name__} outputs")
        _assert_within(got_grads, want_grads, f"{ref.__name__} gradients")


@pytest.mark.parametrize("case", ["mixed", "one_sequence"])
def test_training_call(case):
    """As training calls it (no final states: the output stage on chunk_output's tiles, which
    must not reach across a sequence's end): out and every gradient against the float64
    reference, fp32 inputs."""
    lengths, make_kw, op_kw = CASES[case]
    a, _ = _ours(_args(lengths, make_kw, seed=93), None)
    cu = _cu(lengths)
    gen = torch.Generator().manual_seed(5)
    out = mamba3_mimo(**a, cu_seqlens=cu, **op_kw)
    weight = torch.randn(out.shape, generator=gen, dtype=F64)
    (out.double() * weight.to(out.device)).sum().backward()
    got_out, got_grads = dict(out=out.detach().cpu()), _grads(a, None)
    ra, _ = _f64(a, None)
    want = mamba3_mimo_reference(**ra, cu_seqlens=cu.cpu(), **op_kw)
    (want * weight).sum().backward()
    _assert_within(got_out, dict(out=want.detach()), "outputs")
    _assert_within(got_grads, _grads(ra, None), "gradients")


@pytest.mark.parametrize("scan", [False, True], ids=["split_pass", "fused_scan"])
def test_equals_separate_runs(scan):
    """The packed call's outputs, final states and gradients equal running each sequence alone
    (per-step gradients side by side, the others summed), with either form of the state pass,
    the loss reading every final state."""
    lengths = [4, 1, 7, 5]
    args = _args(lengths, dict(H=2, G=1, R=3, N=12, P=10), seed=95)
    init = state_for(args, seed=96)
    init = tuple(torch.cat([x] * len(lengths)) for x in init)
    bounds = _cu(lengths).tolist()
    with configs.override(state=[StateConfig(scan=scan, BJ=16, BP=16)]):
        a, i = _ours(args, init)
        whole_out, whole_grads = _run(mamba3_mimo, a, i, cu_seqlens=_cu(lengths))
        a, i = _ours(args, init)
        outs, gen = [], torch.Generator().manual_seed(5)
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            outs.append(mamba3_mimo(**_slice(a, lo, hi), return_state=True,
                                    initial_state=tuple(x[j:j + 1] for x in i)))
        joined = [torch.cat([o[0] for o in outs], 1)] + [
            torch.cat([o[k] for o in outs], 0) for k in range(1, 5)]
        loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64).to(o.device))
                   .sum() for o in joined)
        loss.backward()
    alone_out = dict(zip(OUT_NAMES, [o.detach().cpu() for o in joined]))
    _assert_within(whole_out, alone_out, "packed against separate runs: outputs")
    _assert_within(whole_grads, _grads(a, i), "packed against separate runs: gradients")


def test_packed_deterministic():
    """Two runs with an initial state per sequence give the same bits: outputs and every
    gradient, the initial states' included (a per-sequence sum by index_add_ on the GPU, with
    its atomics, once differed in the last bits of d DT, d Angles and d angle0)."""
    lengths = [3, 6]
    args = _args(lengths, dict(H=2, G=1, R=2, N=8, P=6), seed=95)
    init = tuple(torch.cat([x] * 2) for x in state_for(args, seed=96))
    runs = [_run(mamba3_mimo, *_ours(args, init), cu_seqlens=_cu(lengths)) for _ in range(2)]
    for part in (0, 1):
        for name, want in runs[0][part].items():
            assert torch.equal(runs[1][part][name], want), name


def test_compiled_packed():
    """torch.compile(fullgraph=True) with cu_seqlens and an initial state per sequence: the
    eager results bit for bit."""
    lengths = [3, 5]
    args = _args(lengths, dict(H=2, G=1, R=2, N=8, P=6), seed=97)
    init = tuple(torch.cat([x] * 2) for x in state_for(args, seed=98))
    a, i = _ours(args, init)
    want_out, want_grads = _run(mamba3_mimo, a, i, cu_seqlens=_cu(lengths))
    compiled = torch.compile(mamba3_mimo, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    a, i = _ours(args, init)
    got_out, got_grads = _run(compiled, a, i, cu_seqlens=_cu(lengths))
    for name in OUT_NAMES:
        assert torch.equal(got_out[name], want_out[name]), name
    for name, g in want_grads.items():
        assert torch.equal(got_grads[name], g), name


@pytest.mark.parametrize("cu,B,match", [
    ([0, 3, 3, 8], 1, "increase strictly"),
    ([0, 3, 7], 1, "end at S = 8"),
    ([1, 3, 8], 1, "start at 0"),
    ([0, 3, 8], 2, "B = 1"),
    (None, 1, "int32 or int64"),
])
def test_bad_cu_seqlens(cu, B, match):
    args = make_args(B=B, S=8, H=2, G=1, R=2, N=8, P=4, chunk_size=4, seed=99)
    a, _ = _ours(args, None)
    bad = (torch.tensor([0.0, 8.0], device=DEVICE) if cu is None
           else torch.tensor(cu, dtype=torch.int64, device=DEVICE))
    with pytest.raises((TypeError, ValueError), match=match):
        mamba3_mimo(**a, cu_seqlens=bad)


@requires_gpu
def test_full_size_on_the_gpu():
    """Eight sequences of random lengths summing to 4 x 2048 steps at N128_P64_R4_C16 (H = 16),
    bf16, with an initial state per sequence: every output and gradient within the bf16
    threshold of the float64 chunked reference (run on the GPU)."""
    from test_operator import _leaves, _run
    from mamba3_mimo.bench_sequences import random_lengths
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo.problem import Shape
    from mamba3_mimo.testing import THRESHOLDS, rel_rms
    lengths = random_lengths(8192, 8, seed=1)
    args = operator_inputs(Shape(1, 8192, 16, 1, 128, 64, 4, 16), F64, seed=111)
    init = tuple(torch.cat([x] * 8) for x in state_for(args, seed=112))
    ours, _ = _leaves(args, torch.bfloat16, DEVICE, None)
    ours_init = tuple(x.to(DEVICE, torch.float32) for x in init[:3]) + (
        init[3].to(DEVICE, torch.bfloat16),)
    cu = _cu(lengths)
    got_out, got_grads = _run(mamba3_mimo, ours, None, {}, cu_seqlens=cu,
                              initial_state=ours_init)
    ref = {k: (v.detach().double().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
           for k, v in ours.items()}
    ref["dtype"] = F64
    ref_init = tuple(x.double() for x in ours_init)
    want_out, want_grads = _run(mamba3_mimo_reference, ref, None, {}, like=got_out,
                                cu_seqlens=cu, initial_state=ref_init)
    errors = {n: rel_rms(got_out[n], want_out[n]) for n in OUT_NAMES}
    errors.update({f"d{n}": rel_rms(got_grads[n], want_grads[n]) for n in want_grads})
    print("\npacked N128_P64_R4_C16 " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= THRESHOLDS[torch.bfloat16]}
    assert not bad, bad


def test_boundaries_read_once_per_tensor(monkeypatch):
    """A cu_seqlens tensor's values are read once (a read waits for the device; a model's layers
    share one tensor), read again after an in-place change, and a new tensor of other values
    gives its own layout."""
    from mamba3_mimo.phases import packed
    cu, reversed_cu = _cu([3, 5]), _cu([3, 5]).flip(0).contiguous()
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    assert packed.check_cu_seqlens(cu, 1, 8) == [0, 3, 8]
    assert packed.check_cu_seqlens(cu, 1, 8) == [0, 3, 8] and len(reads) == 1
    cu[1] = 6
    assert packed.check_cu_seqlens(cu, 1, 8) == [0, 6, 8] and len(reads) == 2
    with pytest.raises(ValueError, match="increase strictly"):
        packed.check_cu_seqlens(reversed_cu, 1, 8)
    a, b = packed.packing([0, 3, 8], 4, cu.device), packed.packing([0, 6, 8], 4, cu.device)
    assert a is packed.packing([0, 3, 8], 4, cu.device) and a is not b
    monkeypatch.undo()
    assert a.pos.tolist() == [0, 1, 2, 8, 9, 10, 11, 12] and b.chunk_bounds.tolist() == [0, 3, 5]


@pytest.mark.parametrize("cu, C", [([0, 5], 4), ([0, 8, 9, 30], 8), ([0, 16, 32], 16),
                                   ([0, 1, 2, 3, 70], 16)])
def test_layout_covers_every_step_once(cu, C):
    """The packed layout's given steps (pos) and pad steps (pads) together are every laid-out
    step, each once, and src takes each given step back from its place: pack gathers every
    laid-out step from src and zeroes the pads, so a step in neither would hold another step's
    values. pack equals zeros with the steps copied in, for contiguous and strided inputs."""
    from mamba3_mimo.phases import packed
    pk = packed.packing(cu, C, torch.device(DEVICE))
    both = torch.cat([pk.pos, pk.pads]).sort().values
    assert torch.equal(both.cpu(), torch.arange(pk.S_pack))
    assert torch.equal(pk.src[pk.pos].cpu(), torch.arange(cu[-1]))
    for x in (torch.randn(2, cu[-1], 3, device=DEVICE),
              torch.randn(3, cu[-1], 2, device=DEVICE).transpose(0, 2),
              torch.randn(2, cu[-1], 1, device=DEVICE).expand(2, cu[-1], 3)):
        want = x.new_zeros(2, pk.S_pack, 3).index_copy_(1, pk.pos, x)
        got = packed.pack(x, 1, pk)
        assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("scan", [True, False], ids=["fused_scan", "split_pass"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_start", "given_start"])
@pytest.mark.parametrize("lengths", [[1, 60, 3], [25, 6, 2, 33], [2, 700, 5]],
                         ids=["one_long", "two_long", "long_segments"])
def test_sequences_in_segments(monkeypatch, lengths, with_state, scan):
    """Sequences longer than the average cut into segments for the state pass (here of a
    kernel chunk or more: packed.MIN_SEGMENT_CHUNKS = 1), each run from zero and then joined
    (chunk_state.segment_join_kernel) from the sequence's initial state or zero: every output
    and gradient against the float64 reference, fp32 inputs; with the split state pass only
    the reverse scan runs in segments. long_segments: segments of more chunks than the join
    updates at a time (chunk_state.JOIN_CHUNKS), and not a multiple of it."""
    from mamba3_mimo.phases import packed
    monkeypatch.setattr(packed, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(packed, "_LAYOUTS", type(packed._LAYOUTS)())
    packed.segments.cache_clear()
    args = _args(lengths, dict(H=2, G=1, R=3, N=12, P=10), seed=97)
    init = None
    if with_state:
        n = len(lengths)
        init = tuple(torch.cat([x] * n) + 0.1 * torch.arange(n, dtype=F64).view(-1, *[1] * (
            x.dim() - 1)) for x in state_for(args, seed=98))
    a, i = _ours(args, init)
    cu = _cu(lengths)
    layouts = []
    packing = packed.packing
    monkeypatch.setattr(packed, "packing", lambda *a: layouts.append(packing(*a)) or layouts[-1])
    with configs.override(state=[StateConfig(scan=scan, BJ=16, BP=16)]):
        got_out, got_grads = _run(mamba3_mimo, a, i, cu_seqlens=cu)
    segments = layouts[0].segments
    assert segments is not None and segments.n_segs > len(lengths), segments
    if len(lengths) == 3 and lengths[1] > 200:
        from mamba3_mimo.kernels import chunk_state
        longest = int((segments.bounds[1:] - segments.bounds[:-1]).max())
        assert longest > chunk_state.JOIN_CHUNKS and longest % chunk_state.JOIN_CHUNKS, longest
    ra, ri = _f64(a, i)
    want_out, want_grads = _run(mamba3_mimo_reference, ra, ri, cu_seqlens=cu.cpu())
    _assert_within(got_out, want_out, "outputs")
    _assert_within(got_grads, want_grads, "gradients")


def test_segment_plan():
    """packed.segments: sequences longer than the chunks per chain at TARGET_CHAINS chains per
    head (and MIN_SEGMENT_CHUNKS) cut into near-equal segments, in order, with each segment's
    sequence, the sequence's first and last segments, and each sequence's last segment; None
    where no sequence is longer: the official grid's dense calls (B = 4) are never cut."""
    from mamba3_mimo.phases import packed
    cpu = torch.device("cpu")
    assert packed.segments((3, 5, 4), 1, cpu) is None
    seg = packed.segments((100, 10, 40, 2), 1, cpu)
    assert seg.length == max(packed.MIN_SEGMENT_CHUNKS, 38)
    assert seg.bounds.tolist() == [0, 34, 67, 100, 110, 130, 150, 152]
    assert seg.seq.tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert seg.first.tolist() == [0, 0, 0, 3, 4, 4, 6]
    assert seg.last.tolist() == [2, 2, 2, 3, 5, 5, 6]
    assert seg.ends.tolist() == [2, 3, 5, 6]
    assert packed.segments((128,), 4, cpu) is None and packed.segments((129,), 4, cpu) is None
    assert packed.segments((256,), 2, cpu).bounds.tolist() == [0, 128, 256]
    assert packed.segments((512,), 1, cpu).bounds.tolist() == [0, 128, 256, 384, 512]
