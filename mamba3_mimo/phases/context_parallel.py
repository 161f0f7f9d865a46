"""Context parallelism: one sequence split into contiguous slices, one per rank of a
torch.distributed group, each rank computing its slice (SPEC section 7's states across calls).

The recurrence is linear in the state it starts from, and the rotation angle only adds up. So a
rank first runs its slice from a zero state and angle and summarizes it: the slice's angle sum,
its final state and last k (both as if the angle had started at 0), its last v, its total decay
and its first step's shifted-term weight. One all-gather of these small summaries ([B, H, P, N]
dominates) gives every rank what the ranks before it end with; each folds them in sequence order
(`entering_state`, a few tensor operations per rank) into the state entering its own slice and
runs its slice again from that state. The first rank starts from the caller's initial state and
runs once. Every piece is differentiable (the all-gather's backward sums every rank's gradient
of the summaries), so the gradients equal those of one call over the whole sequence.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .operator import _rotate, shifted_term

State = Tuple[Tensor, Tensor, Tensor, Tensor]
# a slice's summary, in this order in the flat fp32 vector every rank contributes
FIELDS = ("angle", "state", "k", "v", "decay", "shift")


class _AllGather(torch.autograd.Function):
    """[numel] per rank -> [world, numel] in rank order. The backward adds every rank's gradient
    of the gathered rows (all_reduce, which every backend has) and keeps this rank's row."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _After(torch.autograd.Function):
    """x unchanged (a copy), depending on `dep` with a zero gradient: ties the first rank's
    output, which depends on no other rank, to the all-gather, whose backward is a collective
    that every rank must join."""

    @staticmethod
    def forward(ctx, x: Tensor, dep: Tensor) -> Tensor:
        ctx.dep = (dep.shape, dep.dtype, dep.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.dep
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def summary(final: State, ADT: Tensor, DT: Tensor, Trap: Tensor) -> Dict[str, Tensor]:
    """A slice's summary from its call's final state (angle [B, H, RD], state [B, H, P, N],
    k [B, R, H, N], v [B, H, P]) and its ADT, DT, Trap [B, H, S]: those four (fp32), the total
    decay sum_t ADT[t] [B, H] and the weight of the shifted term of the previous slice's last
    step at its first step, DT[0] sigmoid(-Trap[0]) [B, H] (SPEC section 7)."""
    angle, state, k, v = final
    return dict(angle=angle.float(), state=state.float(), k=k.float(), v=v.float(),
                decay=ADT.float().sum(-1),
                shift=DT[..., 0].float() * torch.sigmoid(-Trap[..., 0].float()))


def entering_state(parts: List[Dict[str, Tensor]], MIMO_V: Tensor) -> State:
    """The state after the slices whose summaries `parts` are, in sequence order, in SPEC
    section 7's form (angle, state [B, H, P, N], k, v): the state entering the next slice. The
    first summary is absolute (its call started from the sequence's initial state); the others'
    angle, state and k are as if their angle had started at 0, and their state from zero: a
    slice that starts from (angle0, state0, k0, v0) ends with

        angle = angle0 + angle_j (mod 2 pi),   k = rot(angle0) k_j,   v = v_j,
        state = exp(decay_j) (state0 + shift_j sum_r k0[r] (x) v0 MIMO_V[r]) + rot(angle0) state_j

    (rot on the N pairs; the shifted term of the previous slice's last step enters at step 0)."""
    first = parts[0]
    angle, state, k, v = first["angle"], first["state"], first["k"], first["v"]
    for part in parts[1:]:
        shifted = shifted_term(k, v, MIMO_V.float())[0].transpose(-1, -2)  # [B, H, P, N]
        own = _rotate(part["state"].transpose(1, 2), angle).transpose(1, 2)  # via [B, P, H, N]
        state = (torch.exp(part["decay"])[..., None, None]
                 * (state + part["shift"][..., None, None] * shifted) + own)
        k = _rotate(part["k"], angle)
        v = part["v"]
        angle = torch.remainder(angle + part["angle"], 2 * math.pi)
    return angle, state, k, v


def flatten(part: Dict[str, Tensor]) -> Tensor:
    """A summary as the flat fp32 vector a rank contributes (FIELDS' order)."""
    return torch.cat([part[name].reshape(-1) for name in FIELDS])


def unflatten(flat: Tensor, like: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """flatten's inverse: views of flat with the shapes of the summary `like`."""
    out, at = {}, 0
    for name in FIELDS:
        n = like[name].numel()
        out[name] = flat[at:at + n].view(like[name].shape)
        at += n
    return out


# (group, summary sizes) already checked alike on every rank: the check is a collective and a
# host sync, so it runs on a shape's first call only
_checked: Set[Tuple[int, Tuple[int, ...]]] = set()


def _check_group(group, part: Dict[str, Tensor]) -> None:
    """Every rank's summary has the same shape (a mismatch would hang or corrupt all_gather)."""
    sizes = tuple(p.numel() for p in part.values())
    if (id(group), sizes) in _checked:
        return
    dims = torch.tensor(sizes, dtype=torch.int64, device=part["state"].device)
    every = [torch.empty_like(dims) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, dims, group=group)
    for rank, theirs in enumerate(every):
        if not torch.equal(theirs, dims):
            raise ValueError(f"context_parallel_group: rank {rank} has B, H, N, P, R or "
                             f"rotary_dim_divisor other than rank {dist.get_rank(group)}'s; "
                             "every rank passes a slice of the same sequences")
    _checked.add((id(group), sizes))


def context_parallel(call: Callable[..., tuple], final_states: Callable[[], State],
                     args: Dict[str, object], group, return_state: bool):
    """mamba3_mimo(...) over a sequence split across the ranks of `group`, rank order =
    sequence order. `call(initial_state)` runs this rank's slice (the operator's keyword `args`,
    return_state=True) from that state; `final_states()` gives the slice's final states alone
    from zero (no output stage, and a backward without the output's terms: estimated at
    about 0.6 of a forward and 0.3 of a backward, not timed). Returns this rank's output, with
    its slice's final state (the sequence's on the last rank) when return_state."""
    rank = dist.get_rank(group)
    first = call(args.get("initial_state")) if rank == 0 else None
    part = summary(first[1:] if rank == 0 else final_states(), args["ADT"], args["DT"],
                   args["Trap"])
    _check_group(group, part)
    gathered = _AllGather.apply(flatten(part), group)
    if rank == 0:
        # its output depends on no other rank: tied to the all-gather, whose backward every
        # rank must join
        result = (_After.apply(first[0], gathered), *first[1:])
    else:
        parts = [unflatten(row, part) for row in gathered[:rank]]
        result = call(entering_state(parts, args["MIMO_V"]))
    return result if return_state else result[0]
