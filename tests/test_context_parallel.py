"""Context parallelism (`mamba3_mimo(..., context_parallel_group=...)`): a sequence split into
contiguous slices gives the output, final state and every gradient of one call over the whole
sequence. In one process the slices' summaries are folded as the ranks fold them
(`entering_state`); across processes, groups of 2, 3 and 4 ranks run the public call, each on
its slice: gloo through the interpreter on the CPU, NCCL with one GPU per rank on a machine of
as many GPUs."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import DEVICE
from mamba3_mimo import mamba3_mimo
from mamba3_mimo.inputs import Shape, operator_inputs
from mamba3_mimo.phases.context_parallel import entering_state, summary
from mamba3_mimo.testing import THRESHOLDS, rel_rms

LIMIT = THRESHOLDS[torch.float32]
SEQ_DIM = dict(Q=1, K=1, V=1, Z=1, Angles=1, ADT=2, DT=2, Trap=2)  # the step axis of each
CASES = {
    # name: (shape, features, cut points of the sequence), every slice any length, one of 1 step
    "z_d_norm_gqa": (Shape(1, 13, 4, 2, 8, 8, 2, 4), dict(norm=True), (5, 6)),
    "per_rank_nod_init": (Shape(2, 11, 2, 1, 8, 8, 3, 4), dict(mimo_out=False, d_skip=False,
                                                               init=True), (4, 5, 9)),
    "noz_init": (Shape(1, 10, 2, 2, 8, 4, 2, 3), dict(z_gate=False, init=True), (7,)),
}


def _inputs(name: str, device=DEVICE):
    """(leaves: every differentiable tensor, fp32, requiring grad; the other arguments)."""
    shape, f, _ = CASES[name]
    args = operator_inputs(shape, torch.float32, z_gate=f.get("z_gate", True),
                           d_skip=f.get("d_skip", True), mimo_out=f.get("mimo_out", True),
                           device=device, seed=3)
    gen = torch.Generator().manual_seed(4)
    B, H, N, P, R = shape.B, shape.H, shape.N, shape.P, shape.R
    if f.get("norm"):
        args["fuse_pregate_headwise_rms_norm"] = True
        args["outproj_norm_weight"] = 1 + 0.1 * torch.randn(H, P, generator=gen).to(device)
    if f.get("init"):
        args["initial_state"] = tuple(torch.randn(*s, generator=gen).to(device) for s in (
            (B, H, shape.RD), (B, H, P, N), (B, R, H, N), (B, H, P)))
    leaves = {}
    for n, x in list(args.items()):
        if isinstance(x, torch.Tensor):
            leaves[n] = args[n] = x.requires_grad_(True)
    if f.get("init"):
        leaves.update({f"init{i}": x.requires_grad_(True) for i, x in
                       enumerate(args["initial_state"])})
    return leaves, args


def _loss(out, final, name: str, parts=None):
    """A random linear loss of the output (parts: this slice's steps) and of the final state."""
    gen = torch.Generator().manual_seed(7)
    shape = CASES[name][0]
    g = torch.randn(out.shape[0], shape.S, *out.shape[2:], generator=gen).to(out.device)
    if parts is not None:
        g = g[:, parts[0]:parts[1]]
    loss = (out * g).sum()
    if final is not None:
        for x in final:
            loss = loss + (x * torch.randn(x.shape, generator=gen).to(x.device)).sum()
    return loss


def _slice(args: dict, lo: int, hi: int) -> dict:
    return {n: x.narrow(SEQ_DIM[n], lo, hi - lo) if n in SEQ_DIM and x is not None else x
            for n, x in args.items()}


def _whole(name: str):
    """Output, final state and gradients of one call over the whole sequence."""
    leaves, args = _inputs(name)
    out, *final = mamba3_mimo(**args, return_state=True)
    _loss(out, final, name).backward()
    return out.detach(), [x.detach() for x in final], {n: x.grad for n, x in leaves.items()}


def _bounds(name: str):
    shape, _, cuts = CASES[name]
    edges = (0, *cuts, shape.S)
    return list(zip(edges[:-1], edges[1:]))


def _compare(name, out, final, grads):
    """Against one call on DEVICE (compared on the CPU: the ranks' results may come from other
    devices)."""
    want_out, want_final, want_grads = _whole(name)
    errors = {"out": rel_rms(out.cpu(), want_out.cpu())}
    errors.update({f"final{i}": rel_rms(a.cpu(), b.cpu())
                   for i, (a, b) in enumerate(zip(final, want_final))})
    errors.update({n: rel_rms(grads[n].cpu(), want_grads[n].cpu()) for n in want_grads})
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= LIMIT}
    assert not bad, f"above {LIMIT}: {bad}"


@pytest.mark.skipif(DEVICE == "cpu", reason="on the CPU test_gloo_ranks runs the same fold, "
                    "across processes")
@pytest.mark.parametrize("name", ["per_rank_nod_init"])
def test_slices_folded_in_one_process(name):
    """The slices run as the ranks run them (the first from the initial state, the others from
    zero, then again from the state folded from the summaries before them), in one process: the
    fold on one GPU, where no group of several GPUs is at hand."""
    leaves, args = _inputs(name)
    plain = {n: x for n, x in args.items() if n != "initial_state"}
    slices = [_slice(plain, lo, hi) for lo, hi in _bounds(name)]
    first = mamba3_mimo(**slices[0], return_state=True, initial_state=args.get("initial_state"))
    parts = [summary(first[1:], slices[0]["ADT"], slices[0]["DT"], slices[0]["Trap"])]
    for s in slices[1:]:
        alone = mamba3_mimo(**s, return_state=True)
        parts.append(summary(alone[1:], s["ADT"], s["DT"], s["Trap"]))
    results = [first] + [mamba3_mimo(**s, return_state=True,
                                     initial_state=entering_state(parts[:j], args["MIMO_V"]))
                         for j, s in enumerate(slices[1:], 1)]
    out = torch.cat([r[0] for r in results], 1)
    _loss(out, results[-1][1:], name).backward()
    _compare(name, out.detach(), [x.detach() for x in results[-1][1:]],
             {n: x.grad for n, x in leaves.items()})


def _rank(rank: int, world: int, name: str, folder: str, backend: str) -> None:
    """One rank (gloo: on the CPU; nccl: on GPU `rank`): its slice through the public call, its
    loss's backward, its output and its gradients saved (on the CPU) for the parent."""
    device = "cpu" if backend == "gloo" else f"cuda:{rank}"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)
    try:
        leaves, args = _inputs(name, device)
        lo, hi = _bounds(name)[rank]
        out, *final = mamba3_mimo(**_slice(args, lo, hi), return_state=True,
                                  context_parallel_group=dist.group.WORLD)
        _loss(out, final if rank == world - 1 else None, name, (lo, hi)).backward()
        cpu = lambda x: None if x is None else x.detach().cpu()  # noqa: E731
        torch.save(dict(out=cpu(out), final=[cpu(x) for x in final],
                        grads={n: cpu(x.grad) for n, x in leaves.items()}),
                   os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _ranks_against_one_call(name: str, backend: str) -> None:
    """len(cuts) + 1 ranks, one slice each: the slices' outputs, the last rank's final state and
    the gradients summed over the ranks equal one call's."""
    world = len(_bounds(name))
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(world, name, folder, backend), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]
    # the initial state reaches the first rank's graph only: no gradient on the others
    grads = {n: sum(r["grads"][n] for r in ranks if r["grads"][n] is not None)
             for n in ranks[0]["grads"]}
    _compare(name, torch.cat([r["out"] for r in ranks], 1), ranks[-1]["final"], grads)


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU (the interpreter)")
@pytest.mark.parametrize("name", list(CASES))
def test_gloo_ranks(name):
    """3, 4 and 2 gloo ranks through the interpreter (_ranks_against_one_call)."""
    _ranks_against_one_call(name, "gloo")


@pytest.mark.skipif(DEVICE == "cpu", reason="NCCL ranks need GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_nccl_ranks(name):
    """3, 4 and 2 NCCL ranks, one GPU each (_ranks_against_one_call); skipped where the machine
    has fewer GPUs than the case has slices."""
    if torch.cuda.device_count() < len(_bounds(name)):
        pytest.skip(f"{len(_bounds(name))} ranks need as many GPUs, "
                    f"{torch.cuda.device_count()} present")
    _ranks_against_one_call(name, "nccl")


def test_errors():
    leaves, args = _inputs("noz_init")
    args.pop("initial_state")
    with pytest.raises(NotImplementedError, match="cu_seqlens with context_parallel_group"):
        mamba3_mimo(**args, cu_seqlens=torch.tensor([0, 10]), context_parallel_group=object())
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="initialized torch.distributed"):
            mamba3_mimo(**args, context_parallel_group=object())


@pytest.mark.parametrize("case", ["z_d_gqa", "noz_nod", "per_rank", "norm_w"])
def test_final_states_alone(case):
    """operator.final_states, a slice's summary (no output stage; phase 2 without dy's terms):
    the four final states bit for bit those of mamba3_mimo(..., return_state=True), and the
    gradients of a loss on them within the fp32 threshold of the float64 reference's; None for
    the inputs that reach the output alone, whose reference gradient is zero."""
    from test_operator import CASES as OPERATOR_CASES
    from test_reference_operator import INPUT_NAMES, make_args
    from mamba3_mimo.phases.operator import final_states
    from mamba3_mimo.reference import mamba3_mimo_reference
    make_kw, op_kw, w_shape = OPERATOR_CASES[case]
    args64 = make_args(**make_kw)
    if w_shape is not None:
        gen = torch.Generator().manual_seed(9)
        args64["outproj_norm_weight"] = 1 + 0.3 * torch.randn(w_shape, generator=gen,
                                                              dtype=torch.float64)
    args64.update(op_kw)

    def leaves(dtype, device):
        out = {n: (x.detach().to(device, dtype).requires_grad_(True)
                   if isinstance(x, torch.Tensor) else x) for n, x in args64.items()}
        out["dtype"] = dtype
        return out

    ours = leaves(torch.float32, DEVICE)
    got = final_states(**ours)
    whole = mamba3_mimo(**ours, return_state=True)[1:]
    for g, w in zip(got, whole):
        assert torch.equal(g, w)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in got]
    sum((x.double() * w.to(x.device)).sum() for x, w in zip(got, weights)).backward()
    ref = leaves(torch.float64, "cpu")
    want = mamba3_mimo_reference(**ref, return_state=True)[1:]
    sum((x * w).sum() for x, w in zip(want, weights)).backward()
    names = [n for n in INPUT_NAMES + ("outproj_norm_weight",)
             if isinstance(ref.get(n), torch.Tensor)]
    for n in names:
        g, w = ours[n].grad, ref[n].grad
        if g is None or w is None:  # not on the final states' path, or zero there
            assert (g is None or not g.any()) and (w is None or not w.any()), n
        else:
            e = rel_rms(g.cpu(), w)
            assert e <= LIMIT, f"d{n}: {e:.2e} above {LIMIT}"
