"""The kernels' configurations and the rules that choose them, from model dimensions only.

Configs depend on N, P, R, C, the dtypes, the optional inputs and the device, never on B or S,
so a new batch or length never recompiles. Each rule below is one short function; the numbers
that justify it are in docs/performance.md ("Configuration rules").

Tests and experiments change what the rules return through one documented door,
`override(...)`, a context manager that also clears every cache that depends on the rules:

    with configs.override(state=[StateConfig(scan=False, BJ=16, BP=32)], tile_chunks=2):
        ...  # calls inside run the split state pass and output tiles of two chunks
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from .kernels import next_pow2
from .problem import Problem, Shape
from .runtime.device import clear_cache as clear_device_cache
from .runtime.device import compute_capability, interpreter_active


@dataclass(frozen=True)
class StateConfig:
    """The state pass: the fused `state_scan_kernel` (scan) or `chunk_increment_kernel` with
    `state_passing_kernel`; BJ pair columns of N and BP columns of P per program; BLOCK and
    DEPTH are state_passing's slice of a state and chunks loaded per group (split form only)."""
    scan: bool
    BJ: int
    BP: int
    num_warps: int = 4
    BLOCK: int = 256
    DEPTH: int = 16


@dataclass(frozen=True)
class OutputConfig:
    """chunk_output: BJ pair columns per dot step, PB blocks of BP columns of P per program,
    and the compiler's options."""
    BJ: int
    BP: int
    PB: int = 1
    num_warps: int = 4
    num_stages: int = 1
    maxnreg: int = 168


@dataclass(frozen=True, kw_only=True)
class Constants(Shape):
    """Compile-time constants of the production kernels for one model (its Shape's dimensions
    and the values below, never B or S: those are 0 in the cached model constants), and the
    lengths of one call (B, S, S_pad, nc).

    RDP: RD padded to a power of two; TP, RP: a chunk tile's steps and ranks padded to powers
    of two (row = t * RP + r); U: chunks per chunk_output tile, TPO its padded steps; PREC /
    EXACT: dot input precisions for the data and for 0/1 selections; OUT_STATES: chunk_output
    reads the rounded `states` output; ALIGN: the alignment assumed of batch strides
    (kernels.input_align); OPAQUE, PREFETCH: inline-assembly helpers (GPU only); SCAN_SYNC: the
    scan's dot on mma.sync; STEP_BS: steps per step_terms program; PDL: bwd_fwd's kernels
    launched as programmatic dependent launches (sm_90 and newer; kernels.dependent_launch)."""
    RDP: int
    TP: int
    RP: int
    U: int
    TPO: int
    HAS_Z: bool
    HAS_D: bool
    PREC: str
    EXACT: str
    OUT_STATES: bool
    ALIGN: int
    OPAQUE: bool
    SCAN_SYNC: bool
    PREFETCH: int
    STEP_BS: int
    PDL: bool
    S_pad: int = 0
    nc: int = 0


@dataclass(frozen=True)
class Overrides:
    """What `override` may replace: the candidate lists of the state pass and chunk_output
    (each tried in order until one fits the shared memory), the chunks per output tile, the
    scan's dot form, whether the device counts as one the configs were measured on, the
    shared memory per block assumed of every device, whether the kernels launch as
    programmatic dependent launches (on where the device lacks them, a launch fails: for offline
    compiles and A/B runs), the batch entries per group of the operator's backward, and the
    parts of each row's walk in the angles' running sum (preprocess.PARTS)."""
    state: Optional[Tuple[StateConfig, ...]] = None
    output: Optional[Tuple[OutputConfig, ...]] = None
    tile_chunks: Optional[int] = None
    scan_sync: Optional[bool] = None
    measured_arch: Optional[bool] = None
    smem_limit: Optional[int] = None
    dependent_launches: Optional[bool] = None
    backward_group: Optional[int] = None
    angle_parts: Optional[int] = None


_active = Overrides()
_dependent_caches: List[Callable[[], None]] = []


def active() -> Overrides:
    """The overrides in force (all None outside `override`)."""
    return _active


def register_cache(clear: Callable[[], None]) -> Callable[[], None]:
    """Register a function that forgets a cache built from the rules (call plans, chosen
    configs); `clear_caches` and `override` call it."""
    _dependent_caches.append(clear)
    return clear


def clear_caches() -> None:
    """Forget everything derived from the rules: constants, chosen configs, call plans, devices'
    capabilities."""
    _model_constants.cache_clear()
    for clear in _dependent_caches:
        clear()


@contextlib.contextmanager
def override(**changes) -> Iterator[None]:
    """Replace rules inside a `with` block (fields of `Overrides`; lists become tuples);
    clears the dependent caches on entry and exit. Not thread-safe: for tests and scripts."""
    global _active
    for key in ("state", "output"):
        if changes.get(key) is not None:
            changes[key] = tuple(changes[key])
    old, _active = _active, dataclasses.replace(_active, **changes)
    clear_caches()
    try:
        yield
    finally:
        _active = old
        clear_caches()


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, next_pow2(x))


# ---------------------------------------------------------------------------- tiles

# Every kernel holds a chunk as one tile of next_pow2(C) * next_pow2(R) (step, rank) rows, with a
# square [rows, rows] scores tile. 128 rows is the largest that compiles in reasonable time; tiles
# above 64 rows spill heavily in chunk_output, and larger chunks run faster as sub-chunks of
# 64-row tiles despite their extra states (docs/performance.md, "Chunk tiles").
MAX_TILE_ROWS = 128
TILE_ROWS = 64


def _tile_fits(C: int, R: int, rows: int) -> bool:
    return next_pow2(C) * next_pow2(R) <= rows


@functools.lru_cache(maxsize=None)
def kernel_chunk_size(C: int, R: int) -> int:
    """The chunk length the kernels run for chunk_size C and rank R: C when its tile fits
    TILE_ROWS, else the largest divisor of C whose tile fits, and 1 for an R whose one-step tile
    is larger (up to MAX_TILE_ROWS). The chunked form holds for any chunk length; the states at
    the model's chunk boundaries are every (C // result)-th of the sub-chunks'. Raises
    NotImplementedError, naming R, when not even a one-step tile fits."""
    if not _tile_fits(1, R, MAX_TILE_ROWS):
        raise NotImplementedError(f"R={R} (q.shape[2]): the kernels hold at most "
                                  f"{MAX_TILE_ROWS} (step, rank) rows per tile, so R <= "
                                  f"{MAX_TILE_ROWS}")
    return max(c for c in range(1, C + 1)
               if C % c == 0 and (c == 1 or _tile_fits(c, R, TILE_ROWS)))


@functools.lru_cache(maxsize=None)
def joined_chunk_size(C: int, R: int) -> int:
    """The whole operator's chunk length for a kernel chunk C: C doubled while its tile stays
    within TILE_ROWS, so that every chunk of phase 2 and the output stage fills a tile (C = 8,
    R = 4 runs chunks of 16). The chunked form holds for any chunk length, and fewer chunks
    hold fewer states. Phase 2 over 32-row chunks took 1.6-3x as long per step as over 64-row
    ones on the H200 (docs/performance.md)."""
    while _tile_fits(2 * C, R, TILE_ROWS):
        C *= 2
    return C


def check_tile_rows(C: int, R: int) -> None:
    """Raise NotImplementedError, naming chunk_size and R, for chunks larger than the kernels'
    tiles (next_pow2(chunk_size) * next_pow2(R) > MAX_TILE_ROWS)."""
    if not _tile_fits(C, R, MAX_TILE_ROWS):
        raise NotImplementedError(
            f"chunk_size={C} with R={R} (q.shape[2]) needs chunk tiles of "
            f"{next_pow2(C) * next_pow2(R)} (step, rank) rows; the kernels support "
            f"next_pow2(chunk_size) * next_pow2(R) <= {MAX_TILE_ROWS}")


def tile_chunks(C: int, R: int) -> int:
    """Chunks per chunk_output tile (U): as many as keep the tile at about 64 (step, rank) rows,
    the height of a wgmma tile, at least one. C = 8, R = 4 gives 2; the other official shapes
    have 64 rows per chunk already."""
    if _active.tile_chunks is not None:
        return _active.tile_chunks
    return max(1, 64 // (_pow2(C, 1) * _pow2(R, 1)))


# ---------------------------------------------------------------------------- constants

def step_terms_steps(N: int) -> int:
    """Steps per step_terms program: 16 at N = 256, where it took 27 % off the kernel; 32 below,
    which keeps each program's [steps, RD] tables large enough for its 128 threads."""
    return 16 if N >= 256 else 32


def out_states_suffice(dtype: torch.dtype, output_dtype: torch.dtype) -> bool:
    """Whether chunk_output may read the rounded `states` output instead of an fp32 copy of the
    states: 6 bytes less per state element of a tile. Yes for bf16 inputs with a 16-bit output
    dtype and for fp16 inputs with fp16 outputs (the rounding moves the outputs by at most about
    a third of the input dtype's error threshold); no for fp32 inputs, for fp16 inputs with bf16
    outputs (bf16's rounding is eight times fp16's) and for fp32 outputs."""
    if output_dtype == torch.float32:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float16 and output_dtype == torch.float16)


# The fused state scan from this N up: its grid of B*H*N/32 programs, each walking every chunk,
# is too small for the GPU below it, where the split form is faster.
SCAN_MIN_N = 64
# Up to this N the fused scan's increment goes through mma.sync (common.dot_sync) rather than
# wgmma, whose proxy fence waits for the chunks the loop loads ahead: with about one program per
# SM that wait is exposed; with more programs per SM it is hidden and mma.sync is slower.
SCAN_SYNC_MAX_N = 64


def scan_sync(N: int) -> bool:
    """Whether the fused scan's increment dot runs on mma.sync (common.dot_sync)."""
    if _active.scan_sync is not None:
        return _active.scan_sync
    return N <= SCAN_SYNC_MAX_N


def constants(pb: Problem) -> Constants:
    """The kernels' constants for this problem: the model's (cached) plus the lengths."""
    nc = -(-pb.S // pb.C)
    model = _model_constants(pb.H, pb.G, pb.N, pb.P, pb.R, pb.C, pb.rotary_dim_divisor,
                             tile_chunks(pb.C, pb.R), pb.dtype, pb.output_dtype, pb.has_z,
                             pb.has_d, interpreter_active(), scan_sync(pb.N),
                             _dependent_launches(pb.device))
    return dataclasses.replace(model, B=pb.B, S=pb.S, S_pad=nc * pb.C, nc=nc)


def _dependent_launches(device: torch.device) -> bool:
    """Whether the kernels launch as programmatic dependent launches: where the device runs them
    (CUDA, compute capability 9.0 or newer), unless overridden; never under the interpreter
    (_model_constants)."""
    if _active.dependent_launches is not None:
        return _active.dependent_launches
    return device.type == "cuda" and compute_capability(device)[0] >= 9


# Cached because a new call plan needs it, and building it costs the host more than a small
# shape's kernels take on the GPU.
@functools.lru_cache(maxsize=None)
def _model_constants(H: int, G: int, N: int, P: int, R: int, C: int, divisor: int, U: int,
                     dtype: torch.dtype, output_dtype: torch.dtype, has_z: bool, has_d: bool,
                     interpret: bool, sync: bool, pdl: bool) -> Constants:
    TP = _pow2(C, 1)
    RP = _pow2(R, 1)
    TP = max(TP, 16 // RP)  # a chunk tile has at least 16 rows, the smallest dot size
    TPO = max(_pow2(U * C, 1), 16 // RP)
    if interpret:
        prec = exact = "ieee"
    else:
        # tf32 operands keep bf16 inputs at about a third of their 5e-3 threshold; for fp16 they
        # reach 0.8 of its 2e-3, so fp16 and fp32 inputs and the 0/1 selection dots use 3xTF32
        prec = "tf32" if dtype == torch.bfloat16 else "tf32x3"
        exact = "tf32x3"
    return Constants(B=0, S=0, H=H, G=G, N=N, P=P, R=R, C=C, rotary_dim_divisor=divisor,
                     RDP=next_pow2(N // divisor), TP=TP, RP=RP, U=U,
                     TPO=TPO, HAS_Z=has_z, HAS_D=has_d, PREC=prec, EXACT=exact,
                     OUT_STATES=out_states_suffice(dtype, output_dtype),
                     # 16-bit loads 8 bytes wide where the batch strides allow, as wide as the
                     # fp32 cos/sin/bias tiles they are combined with
                     ALIGN=4,
                     OPAQUE=not interpret,
                     SCAN_SYNC=sync,
                     PREFETCH=2 if not interpret and output_prefetch(N, R, C) else 0,
                     STEP_BS=step_terms_steps(N),
                     PDL=pdl and not interpret)


# ---------------------------------------------------------------------------- state pass

def state_candidates(pb: Problem) -> List[StateConfig]:
    """State-pass configs, preferred first. From N = SCAN_MIN_N the fused scan with 16-pair N
    blocks (168 registers, no spill; 32 pairs need 255). Below it, and as the fallbacks for small
    shared memory, the split form. The first configs keep 64-column P blocks even when P < 64
    (masked columns): the increment's dot has BP rows in M, and below 64 Triton leaves wgmma for
    mma.sync, which at P = 32 spilled and took twice the time."""
    if _active.state is not None:
        return list(_active.state)
    BJ = min(32, _pow2(pb.N // 2))
    split = [StateConfig(scan=False, BJ=BJ, BP=64),
             StateConfig(scan=False, BJ=BJ, BP=min(32, _pow2(pb.P))),
             StateConfig(scan=False, BJ=min(16, BJ), BP=min(16, _pow2(pb.P)))]
    if pb.N >= SCAN_MIN_N:
        return [StateConfig(scan=True, BJ=16, BP=64)] + split
    return split


# ---------------------------------------------------------------------------- chunk_output

# 168 registers x 128 threads leave room for three programs of 4 warps per SM where 170-255 left
# two: 8-17 % off the whole call on every official shape, although three of them spill a little.
OUTPUT_MAXNREG = 168
# Up to this N, 128 registers: four programs per SM, 0.88-0.93x chunk_output's time.
OUTPUT_SMALL_N = 64
OUTPUT_SMALL_MAXNREG = 128
# Where P takes two 64-column blocks, one program does both (the scores are computed once):
# 0.90-0.94x chunk_output's time at P = 128.
OUTPUT_PAIRED_P = (64, 128)
# The configs were measured on the H200 (sm_90), where chunk_output's dots run on wgmma. On GPUs
# whose dots run on mma.sync (sm_80-89, sm_120) the same configs spill 136-2608 bytes per thread
# (ptxas offline); there the list starts at the fallbacks (32-column P blocks), which spill 0-56.
# On sm_100 the H200's configs spill nothing.
MEASURED_MAJORS = (9, 10)


def output_small(N: int, R: int, C: int) -> bool:
    """Whether chunk_output runs with OUTPUT_SMALL_MAXNREG registers: up to N = OUTPUT_SMALL_N,
    and at N = 128 with three or four ranks and chunks of at most 16 steps (0.95x there; at R =
    1, 2 and 8 it spills 232-408 bytes and was slower)."""
    return N <= OUTPUT_SMALL_N or (N == 128 and _pow2(R, 1) == 4 and C <= 16)


def output_maxnreg(N: int, R: int, C: int) -> int:
    """chunk_output's register cap."""
    return OUTPUT_SMALL_MAXNREG if output_small(N, R, C) else OUTPUT_MAXNREG


def output_p_blocks(P: int) -> int:
    """P blocks per chunk_output program in the preferred config: 2 where P takes two 64-column
    blocks, else 1."""
    lo, hi = OUTPUT_PAIRED_P
    return 2 if lo < P <= hi else 1


def output_prefetch(N: int, R: int, C: int) -> bool:
    """Whether chunk_output prefetches its later inputs into L2: not at R = 1, where it was
    slower, nor where 128 registers above N = OUTPUT_SMALL_N need the registers it takes."""
    return R > 1 and not (N > OUTPUT_SMALL_N and output_small(N, R, C))


def measured_arch(device: torch.device) -> bool:
    """Whether chunk_output takes the H200-measured configs on this device: compute capability
    9.x or 10.x, or the CPU interpreter (whose tests then cover the configs the H200 runs)."""
    if _active.measured_arch is not None:
        return _active.measured_arch
    return device.type != "cuda" or compute_capability(device)[0] in MEASURED_MAJORS


def output_candidates(pb: Problem) -> List[OutputConfig]:
    """chunk_output configs, preferred first: 32-pair N blocks (16 when N/2 is smaller),
    64-column P blocks, output_maxnreg registers; first, where P takes two such blocks, both in
    one program (output_p_blocks). The shared-memory check falls back to narrower blocks. Off
    the measured architectures the list starts at those fallbacks, with OUTPUT_MAXNREG."""
    if _active.output is not None:
        return list(_active.output)
    half = pb.N // 2
    blocks, maxnreg = ((32, 64), (16, 32), (16, 16)), output_maxnreg(pb.N, pb.R, pb.C)
    out: List[OutputConfig] = []
    PB = output_p_blocks(pb.P)
    if not measured_arch(pb.device):
        blocks, maxnreg = blocks[1:], OUTPUT_MAXNREG
    elif PB > 1:
        out.append(OutputConfig(BJ=min(32, _pow2(half)), BP=64, PB=PB, maxnreg=OUTPUT_MAXNREG))
    for BJ, BP in blocks:
        cfg = OutputConfig(BJ=min(BJ, _pow2(half)), BP=min(BP, _pow2(pb.P)), maxnreg=maxnreg)
        if cfg not in out:
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------- the backward's groups

# The operator's backward holds, for each batch entry it works on, fp32 buffers that grow with
# the sequence: the states entering each chunk and their gradients (128 MiB per entry at
# N128_P64_R4_C16), and dy = d raw_y where chunk_forward writes it. By default it runs the
# entries in groups whose buffers take at most this many bytes (one entry at a time where one
# entry's take more), on buffers of one group's size that every group reuses: the official grid
# runs one entry at a time, for a peak below upstream's (docs/performance-operator.md, "Peak
# memory"); set_backward_group_bytes changes the budget.
BACKWARD_GROUP_BYTES = 32 << 20
_group_bytes = BACKWARD_GROUP_BYTES


def set_backward_group_bytes(n_bytes: Optional[int]) -> None:
    """Let the operator's backward hold up to n_bytes in its per-group buffers; None restores
    the default, BACKWARD_GROUP_BYTES. Larger groups trade peak memory for speed (fewer launches,
    fuller kernels; measured in docs/operator.md, "Gradients"). A setting for the whole process,
    read at each backward; every grouping gives the same results to fp32 rounding (the
    parameters' gradients are summed over the entries in another order)."""
    global _group_bytes
    if n_bytes is None:
        n_bytes = BACKWARD_GROUP_BYTES
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, int):
        raise TypeError(f"n_bytes must be an int or None, got {type(n_bytes).__name__}")
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be non-negative, got {n_bytes}")
    _group_bytes = n_bytes


def backward_group(B: int, entry_bytes: int) -> int:
    """The batch entries per group of the operator's backward, for B entries whose largest
    buffers take entry_bytes each: as many as fit set_backward_group_bytes' budget, at least
    one."""
    group = _active.backward_group
    if group is None:
        group = _group_bytes // max(entry_bytes, 1)
    return max(1, min(B, group))


# ---------------------------------------------------------------------------- the choice

@dataclass(frozen=True)
class Preferred:
    """The configs the rules prefer for a problem (before the shared-memory check), for
    `describe` and tests; `sub_chunk` is the kernels' chunk length where the model's is too
    large for a tile."""
    state: StateConfig
    output: OutputConfig
    tile_chunks: int
    sub_chunk: Optional[int] = None

    def describe(self) -> str:
        s, o = self.state, self.output
        state = "state_scan" if s.scan else "chunk_increment"
        return (f"{state} BJ={s.BJ} BP={s.BP}; chunk_output BJ={o.BJ} BP={o.BP}"
                + (f"x{o.PB}" if o.PB > 1 else "") + f" U={self.tile_chunks}"
                + (f"; sub-chunks of {self.sub_chunk}" if self.sub_chunk else ""))


def preferred(pb: Problem) -> Preferred:
    """What the production path prefers for this problem through the public entry (for chunks
    beyond the kernels' tiles, the configs of its sub-chunks)."""
    sub = kernel_chunk_size(pb.C, pb.R)
    if sub != pb.C:
        return dataclasses.replace(preferred(dataclasses.replace(pb, C=sub)), sub_chunk=sub)
    return Preferred(state_candidates(pb)[0], output_candidates(pb)[0], tile_chunks(pb.C, pb.R))


register_cache(clear_device_cache)
