"""Packed sequences (`cu_seqlens`, SPEC section 7) on the dense kernels: each sequence is laid out
from a kernel-chunk boundary and followed by zero steps up to the end of one more chunk, its pad
chunk. Zero steps add nothing and do not decay, so the state entering a sequence's pad chunk is
its final state, and a sequence's last step sees no next step in its trapezoid term. The state
pass and the reverse scan restart at every sequence's first chunk (their VARLEN flag), and the
running angles restart by subtracting, per sequence, the running sum before its first step.
Here: the layout's index tables, and the gathers and scatters between the two layouts."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

import torch

Tensor = torch.Tensor
TWO_PI = 2 * math.pi


@dataclass(frozen=True)
class Packing:
    """The packed layout of one call: n_seq sequences, S given steps, S_pack laid-out steps
    (whole chunks of C). pos [S]: where each given step lies; seq [S_pack]: the sequence of each
    laid-out step (a pad step: the sequence it follows); firsts, lasts [n_seq]: where each
    sequence's first and last steps lie; pad_chunks [n_seq]: each sequence's pad chunk;
    starts [S_pack // C] int32: j for the chunk that starts sequence j, else -1. Long tensors on
    the call's device."""
    n_seq: int
    C: int
    S_pack: int
    pos: Tensor
    seq: Tensor
    firsts: Tensor
    lasts: Tensor
    pad_chunks: Tensor
    starts: Tensor


def check_cu_seqlens(cu_seqlens, B: int, S: int) -> List[int]:
    """The sequence boundaries as a list, or TypeError / ValueError naming cu_seqlens: a 1-D
    integer tensor [n_seq + 1], 0 first, S last, strictly increasing (no empty sequence); B = 1."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens must be a 1-D int32 or int64 tensor, got "
                        f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in one batch entry (B = 1), "
                         f"got B = {B}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at S = {S} and increase strictly "
                         f"(every sequence at least one step), got {cu[:8]}"
                         + (" ..." if len(cu) > 8 else ""))
    return cu


def packing(cu: List[int], C: int, device: torch.device) -> Packing:
    """The layout of sequences cu[j]..cu[j+1]-1, each from a chunk boundary and followed by zero
    steps to the end of one more chunk (C: the kernels' chunk)."""
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    chunks = [-(-n // C) + 1 for n in lengths]  # the sequence's chunks and its pad chunk
    first_chunk = [0]
    for n in chunks[:-1]:
        first_chunk.append(first_chunk[-1] + n)
    nc = first_chunk[-1] + chunks[-1]
    pos, seq = [], []
    for j, (n, c0, m) in enumerate(zip(lengths, first_chunk, chunks)):
        pos.extend(range(c0 * C, c0 * C + n))
        seq.extend([j] * (m * C))
    starts = [-1] * nc
    for j, c0 in enumerate(first_chunk):
        starts[c0] = j

    def longs(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return Packing(n_seq=len(lengths), C=C, S_pack=nc * C, pos=longs(pos), seq=longs(seq),
                   firsts=longs([c0 * C for c0 in first_chunk]),
                   lasts=longs([c0 * C + n - 1 for c0, n in zip(first_chunk, lengths)]),
                   pad_chunks=longs([c0 + m - 1 for c0, m in zip(first_chunk, chunks)]),
                   starts=torch.tensor(starts, dtype=torch.int32, device=device))


def pack(x: Tensor, dim: int, pk: Packing) -> Tensor:
    """x with its S steps on dim laid out as pk says, zeros elsewhere (contiguous)."""
    shape = list(x.shape)
    shape[dim] = pk.S_pack
    return x.new_zeros(shape).index_copy_(dim, pk.pos, x)


def unpack(x: Tensor, dim: int, pk: Packing) -> Tensor:
    """The given steps of a laid-out x (dim: its step dimension)."""
    return x.index_select(dim, pk.pos)


def restart_angles(angles: Tensor, pk: Packing, angle0) -> Tensor:
    """Running angles [1, S_pack, H, RD] that restart at every sequence (from angle0[j]
    [n_seq, H, RD], or 0), from angles summed over the whole layout (mod 2*pi): the running sum
    before a sequence's first step, taken at the step before it (a zero step, or 0 for the
    first sequence), is subtracted from the sequence's steps, mod 2*pi."""
    before = angles[0].index_select(0, (pk.firsts - 1).clamp(min=0))  # [n_seq, H, RD]
    before[0] = 0
    shift = -before if angle0 is None else angle0 - before
    out = angles[0] + shift.index_select(0, pk.seq)
    return torch.remainder(out, TWO_PI)[None]


def restart_angles_backward(d_angles: Tensor, pk: Packing):
    """(the gradient of the angles summed over the whole layout [1, S_pack, H, RD], d angle0
    [n_seq, H, RD]) from d_angles [1, S_pack, H, RD] of restart_angles' output: each sequence's
    total enters angle0 and leaves at the step before its first step (whose running sum was
    subtracted)."""
    totals = torch.zeros((pk.n_seq,) + tuple(d_angles.shape[2:]), device=d_angles.device,
                         dtype=d_angles.dtype).index_add_(0, pk.seq, d_angles[0])
    out = d_angles.clone()
    out[0].index_add_(0, pk.firsts[1:] - 1, -totals[1:])
    return out, totals
