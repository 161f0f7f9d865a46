"""Packed sequences (`cu_seqlens`, SPEC section 7) on the dense kernels: each sequence is laid out
from a kernel-chunk boundary and followed by zero steps up to the end of one more chunk, its pad
chunk. Zero steps add nothing and do not decay, so the state entering a sequence's pad chunk is
its final state, and a sequence's last step sees no next step in its trapezoid term. The serial
passes (the angle sum, the state pass and the reverse scan) run, with their VARLEN flag, one
program per (sequence, head) over the sequence's own chunks: each sequence starts afresh, and
the sequences run side by side rather than one after another.
Here: the layout's index tables, and the gathers and scatters between the two layouts."""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor


# The serial passes (the state pass, the reverse scan) run no chain longer than this many chunks,
# or than the chunks per chain when they make TARGET_CHAINS chains per head, whichever is
# longer (the official grid's 4 batch entries make 4): longer sequences run in segments side by
# side, joined afterwards (Segments).
MIN_SEGMENT_CHUNKS = 16
TARGET_CHAINS = 4


@dataclass(frozen=True)
class Segments:
    """The sequences of a call cut into segments of at most `length` chunks, for the serial
    passes (packed sequences; or a dense call's chunks, the same segments in every batch entry,
    seq all 0): segment k covers chunks bounds[k] .. bounds[k + 1] - 1 (int32
    [n_segs + 1]) of sequence seq[k]; first[k] and last[k] are the indices of that sequence's
    first and last segments (int32 [n_segs]); ends[j] is sequence j's last segment (int64
    [n_seq]). Each segment runs from a zero state (a zero
    final-state gradient, but the last); the state entering it (the gradient leaving it) is
    then chained over the segments before (after) it and added back
    (chunk_state.segment_join_kernel)."""
    n_segs: int
    length: int
    bounds: Tensor
    seq: Tensor
    first: Tensor
    last: Tensor
    ends: Tensor


@dataclass(frozen=True)
class Packing:
    """The packed layout of one call: n_seq sequences, S given steps, S_pack laid-out steps
    (whole chunks of C). pos [S]: where each given step lies; src [S_pack]: the given step each
    laid-out step takes (0 for a pad step); pads: the laid-out steps that no given step takes
    (each sequence's pad chunk and its last chunk's tail); firsts, lasts
    [n_seq]: where each sequence's first and last steps lie; pad_chunks [n_seq]: each
    sequence's pad chunk (long tensors); chunk_bounds [n_seq + 1] int32: sequence j and its pad
    chunk cover chunks chunk_bounds[j] .. chunk_bounds[j + 1] - 1 (the kernels' VARLEN tables;
    step_bounds the same in steps). All on the call's device."""
    n_seq: int
    C: int
    S_pack: int
    pos: Tensor
    src: Tensor
    pads: Tensor
    firsts: Tensor
    lasts: Tensor
    pad_chunks: Tensor
    chunk_bounds: Tensor
    step_bounds: Tensor
    segments: Optional[Segments]


# The boundaries read from the last few cu_seqlens tensors, and the layouts built from the last
# few boundaries. Reading a device tensor's values waits for the device; every layer of a model
# receives the same cu_seqlens tensor in a training step, so only the first one waits (as
# flash-linear-attention's tensor_cache does). A tensor changed in place has a new _version
# and is read again.
_READ: "OrderedDict[tuple, Tuple[Tensor, List[int]]]" = OrderedDict()
_LAYOUTS: "OrderedDict[tuple, Packing]" = OrderedDict()
MAX_KEPT = 8


def _kept(table: OrderedDict, key, make):
    """table[key], made and kept (the MAX_KEPT most recent) where absent."""
    value = table.get(key)
    if value is None:
        value = table[key] = make()
        while len(table) > MAX_KEPT:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return value


def check_cu_seqlens(cu_seqlens, B: int, S: int) -> List[int]:
    """The sequence boundaries as a list, or TypeError / ValueError naming cu_seqlens: a 1-D
    integer tensor [n_seq + 1], 0 first, S last, strictly increasing (no empty sequence); B = 1.
    The values of a tensor read before (the same object, unchanged since) are not read again."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens must be a 1-D int32 or int64 tensor, got "
                        f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in one batch entry (B = 1), "
                         f"got B = {B}")
    # the entry keeps its tensor alive, so that no other tensor takes its id meanwhile
    key = (id(cu_seqlens), cu_seqlens._version)
    cu = _kept(_READ, key, lambda: (cu_seqlens, [int(x) for x in cu_seqlens.tolist()]))[1]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at S = {S} and increase strictly "
                         f"(every sequence at least one step), got {cu[:8]}"
                         + (" ..." if len(cu) > 8 else ""))
    return cu


def packing(cu: List[int], C: int, device: torch.device) -> Packing:
    """The layout of sequences cu[j]..cu[j+1]-1, each from a chunk boundary and followed by zero
    steps to the end of one more chunk (C: the kernels' chunk); the same object for the same
    boundaries (the forward's and the backward's, the layers' of a model)."""
    return _kept(_LAYOUTS, (tuple(cu), C, device), lambda: _packing(cu, C, device))


def _packing(cu: List[int], C: int, device: torch.device) -> Packing:
    """packing's layout, built with tensor operations on the host (no Python loop over steps)
    and copied to the device once."""
    cu_t = torch.tensor(cu, dtype=torch.int64)
    lengths = cu_t[1:] - cu_t[:-1]
    chunks = (lengths + C - 1) // C + 1  # the sequence's chunks and its pad chunk
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), chunks.cumsum(0)])
    first_chunk = bounds[:-1]
    # a given step's place: its sequence's first laid-out step plus its index in the sequence
    pos = torch.arange(cu[-1]) + torch.repeat_interleave(first_chunk * C - cu_t[:-1], lengths)
    taken = torch.zeros(int(bounds[-1]) * C, dtype=torch.bool)
    taken[pos] = True
    src = torch.zeros(int(bounds[-1]) * C, dtype=torch.int64)
    src[pos] = torch.arange(cu[-1])
    host = dict(pos=pos, src=src, pads=(~taken).nonzero().squeeze(1), firsts=first_chunk * C,
                lasts=first_chunk * C + lengths - 1,
                pad_chunks=bounds[1:] - 1, chunk_bounds=bounds.to(torch.int32),
                step_bounds=(bounds * C).to(torch.int32))
    return Packing(n_seq=len(cu) - 1, C=C, S_pack=int(bounds[-1]) * C,
                   segments=segments(tuple(chunks.tolist()), 1, device),
                   **{k: v.to(device) for k, v in host.items()})


@functools.lru_cache(maxsize=64)
def segments(chunks: Tuple[int, ...], B: int, device: torch.device) -> Optional[Segments]:
    """Segments of the sequences of `chunks` chunks each (a packed call's, pad chunks included;
    or a dense call's one, in each of its B batch entries), or None where no sequence is longer
    than the segment length: then the sequences are the chains."""
    per_chain = -(-B * sum(chunks) // max(B * len(chunks), TARGET_CHAINS))
    length = max(MIN_SEGMENT_CHUNKS, per_chain)
    if max(chunks) <= length:
        return None
    bounds, seq, first, last = [0], [], [], []
    for j, n in enumerate(chunks):
        parts = -(-n // length)
        first += [len(seq)] * parts
        last += [len(seq) + parts - 1] * parts
        seq += [j] * parts
        # near-equal parts: the first n % parts one chunk longer
        for i in range(parts):
            bounds.append(bounds[-1] + n // parts + (i < n % parts))
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
    return Segments(n_segs=len(seq), length=length, bounds=as_i32(bounds), seq=as_i32(seq),
                    first=as_i32(first), last=as_i32(last),
                    ends=torch.tensor(sorted(set(last)), dtype=torch.int64, device=device))


def pack(x: Tensor, dim: int, pk: Packing) -> Tensor:
    """x with its S steps on dim laid out as pk says, zeros elsewhere (contiguous): a gather of
    the layout's steps (index_select reads whole rows at once, where a scatter by index_copy_
    writes element by element), then the pad steps, which gathered step 0, zeroed."""
    return x.index_select(dim, pk.src).index_fill_(dim, pk.pads, 0)


def unpack(x: Tensor, dim: int, pk: Packing) -> Tensor:
    """The given steps of a laid-out x (dim: its step dimension)."""
    return x.index_select(dim, pk.pos)
