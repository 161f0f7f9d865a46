"""Shape dispatcher: picks the implementation and kernel configs for a bwd_fwd problem, and runs it.

Rule: "auto" runs the production path, "chunked": step_terms_kernel (per-step terms and the rotary
cos/sin table), then the states, from N = SCAN_MIN_N (64) up by state_scan_kernel (one fused serial
scan; its increment's dot on mma.sync up to N = SCAN_SYNC_MAX_N (64), on wgmma above), below it by
chunk_increment_kernel (chunk-parallel state increments) and state_passing_kernel (serial multiply-
add over chunks), then chunk_output_kernel (chunk-parallel outputs; at most 128 registers up to N =
OUTPUT_SMALL_N (64) and at N = 128 with R = 3-4 and C <= 16, 168 elsewhere; its later inputs
prefetched into L2 where R > 1, except at N = 128 with 128 registers: output_small; at P = 65-128
one program takes both 64-column P blocks, at 168 registers: output_p_blocks; on GPUs whose dots
run on mma.sync (sm_80-89, sm_120), where those configs spill heavily, the fallbacks from 32-column
P blocks on at 168 registers: measured_arch). Configs depend only on model dimensions (N, P, R, C,
dtypes, flags) and the device, never on B or S, so a new batch or length never recompiles. Each
kernel has a list of candidate configs, largest first; the first whose compiled kernel fits the
device's shared memory per block (shared_memory_per_block_optin, or `smem_limit_override`) is used
and cached.
"stage0" is the baseline, never chosen by "auto".
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import triton

from .kernels import (aligned_numel, cdiv, chunk_output, chunk_state, launcher, next_pow2,
                      stage0, step_terms)

IMPLS = ("auto", "chunked", "stage0")
_smem_override: Optional[int] = None
_config_cache: Dict[tuple, dict] = {}
# compute capability per CUDA device: the query costs the host microseconds per call
_capability: Dict[torch.device, Tuple[int, int]] = {}


@dataclass(frozen=True)
class Problem:
    """Model and problem dimensions of one call, after validation."""
    B: int
    S: int
    H: int
    G: int
    N: int
    P: int
    R: int
    C: int
    RD: int
    dtype: torch.dtype
    has_z: bool
    has_d: bool
    output_dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Plan:
    """What `run` will launch: the implementation and each kernel's config."""
    impl: str
    state_cfg: Optional[dict] = None
    output_cfg: Optional[dict] = None
    tile_chunks: int = 1
    sub_chunk: Optional[int] = None  # the kernels' chunk length where the model's is too large

    def describe(self) -> str:
        if self.impl == "stage0":
            return "stage0 (rotary + qk_dot + serial scan per (b, h))"
        s, o = self.state_cfg, self.output_cfg
        state = "state_scan" if s["SCAN"] else "chunk_increment"
        return (f"chunked ({state} BJ={s['BJ']} BP={s['BP']}; "
                f"chunk_output BJ={o['BJ']} BP={o['BP']}"
                + (f"x{o['PB']}" if o["PB"] > 1 else "") + f" U={self.tile_chunks}"
                + (f"; sub-chunks of {self.sub_chunk}" if self.sub_chunk else "") + ")")


def interpreter_active() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device) -> None:
    """Raise NotImplementedError for a device the kernels cannot run on."""
    if device.type == "cpu":
        if not interpreter_active():
            raise NotImplementedError(
                "mamba3_mimo_bwd_fwd on CPU tensors needs the Triton interpreter "
                "(set TRITON_INTERPRET=1 before importing triton); use a CUDA device otherwise")
        return
    if device.type != "cuda":
        raise NotImplementedError(f"device {device} is not supported; expected cuda (sm_80+)")
    if interpreter_active():
        raise NotImplementedError("TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only")
    major, minor = compute_capability(device)
    if major < 8:
        raise NotImplementedError(
            f"device {device} has compute capability {major}.{minor}; expected sm_80 or newer")


def compute_capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) of a CUDA device, cached."""
    cc = _capability.get(device)
    if cc is None:
        cc = _capability[device] = torch.cuda.get_device_capability(device)
    return cc


@contextlib.contextmanager
def smem_limit_override(limit_bytes: int) -> Iterator[None]:
    """Pretend the device allows at most `limit_bytes` of shared memory per block (for tests of
    small-shared-memory GPUs such as the RTX 4090); clears the caches on entry and exit."""
    global _smem_override
    old, _smem_override = _smem_override, limit_bytes
    clear_caches()
    try:
        yield
    finally:
        _smem_override = old
        clear_caches()


def smem_limit(device: torch.device) -> int:
    if _smem_override is not None:
        return _smem_override
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, next_pow2(x))


def output_tile_chunks(C: int, R: int) -> int:
    """Chunks per chunk_output tile: as many as keep the tile at about 64 (step, rank) rows (the
    wgmma tile height), at least one. C=8, R=4 gives 2; the other official shapes have 64 rows
    per chunk already (docs/optimisation.md, step 14)."""
    return max(1, 64 // (_pow2(C, 1) * _pow2(R, 1)))


def _meta(pb: Problem) -> dict:
    """The kernels' constants for this problem: the model's (cached) plus the lengths."""
    nc = cdiv(pb.S, pb.C)
    U = output_tile_chunks(pb.C, pb.R)  # outside the cache, so that tests can force it
    return dict(_model_meta(pb.H, pb.G, pb.N, pb.P, pb.R, pb.C, pb.RD, U, pb.dtype,
                            pb.output_dtype, pb.has_z, pb.has_d, interpreter_active()),
                B=pb.B, S=pb.S, S_pad=nc * pb.C, nc=nc)


# Cached because the operator runs this on every call, and a small shape's kernels take less GPU
# time than the host spends launching them (docs/optimisation.md, step 21).
@functools.lru_cache(maxsize=None)
def _model_meta(H: int, G: int, N: int, P: int, R: int, C: int, RD: int, U: int,
                dtype: torch.dtype, output_dtype: torch.dtype, has_z: bool, has_d: bool,
                interpret: bool) -> dict:
    """Compile-time constants of the kernels, from the model dimensions and the chunks per
    output tile U (never B or S). The returned dict is shared: copy it before changing it."""
    TP = _pow2(C, 1)
    RP = _pow2(R, 1)
    TP = max(TP, 16 // RP)  # a chunk tile has at least 16 rows, the smallest dot size
    TPO = max(_pow2(U * C, 1), 16 // RP)
    if interpret:
        prec = exact = "ieee"
    else:
        # tf32 operands keep bf16 inputs at about a third of their 5e-3 threshold; measured on
        # the H200 they reach 0.8 of fp16's 2e-3, so fp16 and fp32 inputs and the 0/1
        # selection dots of the reductions use 3xTF32 (about fp32 accuracy).
        prec = "tf32" if dtype == torch.bfloat16 else "tf32x3"
        exact = "tf32x3"
    return dict(H=H, G=G, N=N, P=P, R=R, C=C, RD=RD, RDP=next_pow2(RD), TP=TP, RP=RP, U=U,
                TPO=TPO, HAS_Z=has_z, HAS_D=has_d, PREC=prec, EXACT=exact,
                OUT_STATES=out_states_suffice(dtype, output_dtype),
                # batch strides known BA-element aligned (kernels.input_align) up to 4: 16-bit
                # loads 8 bytes wide, as wide as the fp32 cos/sin/bias tiles they are combined
                # with (docs/optimisation.md, step 27; 8, as in step 13, made them disagree)
                ALIGN=4,
                OPAQUE=not interpret,  # common.opaque: inline assembly, GPU only
                SCAN_SYNC=N <= SCAN_SYNC_MAX_N,
                # common.prefetch into L2 (inline assembly, GPU only)
                PREFETCH=2 if not interpret and output_prefetch(N, R, C) else 0,
                STEP_BS=step_terms_steps(N))


def step_terms_steps(N: int) -> int:
    """Steps per step_terms program. Measured on the H200 (docs/optimisation.md, step 62): 16
    took 27 % off the kernel at N = 256, and cost 0.3-5.5 us at N <= 128, where 32 keeps each
    program's [steps, RD] tables large enough for its 128 threads."""
    return 16 if N >= 256 else 32


def out_states_suffice(dtype: torch.dtype, output_dtype: torch.dtype) -> bool:
    """Whether chunk_output may read the rounded `states` output instead of an fp32 copy of the
    states (which state_passing then does not write): 6 bytes less per state element of a tile,
    0.4-0.8 GB per call on the largest official shapes.

    Yes for bf16 inputs with a 16-bit output dtype and for fp16 inputs with fp16 outputs: the
    rounding alone moves the outputs by at most about a third of the input dtype's error
    threshold (docs/optimisation.md, step 26). No for fp32 inputs (dmimo_o and dmimo_z are
    written in fp32 and keep fp32's threshold), for fp16 inputs with bf16 outputs (bf16's
    rounding is eight times fp16's), and for fp32 outputs, whose `states` is the fp32 state."""
    if output_dtype == torch.float32:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float16 and output_dtype == torch.float16)


# The fused state scan (chunk_state.state_scan_kernel) from this N up: on the H200 it took 3-33 %
# off the whole call at N >= 64 and added 8-12 % at N = 16 and 32, where its grid of
# B*H*N/32 programs, each walking every chunk, is too small for the GPU (optimisation.md, step 34)
SCAN_MIN_N = 64
# Up to this N the fused scan's increment goes through mma.sync (common.dot_sync) rather than
# wgmma, whose proxy fence waits for the chunks the loop loads ahead. With at most two N
# blocks per head the scan runs about one program per SM (on the official batch, B*H = 64),
# so that wait is exposed: measured 12 % faster at N64_P64 and 3 % at N64_P128; with more
# programs per SM the wait is hidden and mma.sync measured up to 9 % slower (N = 128, 256 at
# C = 8; docs/optimisation.md, step 50).
SCAN_SYNC_MAX_N = 64
# state_passing loads the increments and decays of this many chunks before it chains them: its
# chain then waits for memory once per group of chunks (optimisation.md, step 47); 16 rather
# than 8 took a further 18 % off it at N = 16 and 13 % at N = 32 (step 54)
PASSING_DEPTH = 16
# state_passing's slice of a state per program: 256 rather than 512 doubles its programs (the
# official N = 16 grid is one program per SM), 3 % faster with DEPTH = 16 (step 54)
PASSING_BLOCK = 256


def _state_candidates(pb: Problem, m: dict) -> List[dict]:
    """chunk_state configs, preferred first; model dimensions only (never B or S, so a new batch
    or length never recompiles).

    From N = SCAN_MIN_N the fused scan, with 16-pair N blocks (168 registers, no spill; 8
    pairs were slower on every such shape but N64_P64, where the two tied; 32 need 255
    registers). Below it, and as the fallbacks for small shared memory, the split increments
    and state passing. The first configs keep 64-column P blocks even when P < 64 (masked
    columns): the increment's dot is psi_v^T [BP, rows] x k_w [rows, BJ], and with fewer than 64
    rows in M Triton leaves wgmma for mma.sync, which at P = 32 cost 255 registers, 528 bytes of
    spill and twice the time (docs/optimisation.md, step 17)."""
    BJ = min(32, _pow2(pb.N // 2))
    passing = dict(num_warps=4, BLOCK=PASSING_BLOCK, DEPTH=PASSING_DEPTH)
    split = [dict(SCAN=False, BJ=BJ, BP=64, **passing),
             dict(SCAN=False, BJ=BJ, BP=min(32, _pow2(pb.P)), **passing),
             dict(SCAN=False, BJ=min(16, BJ), BP=min(16, _pow2(pb.P)), **passing)]
    if pb.N >= SCAN_MIN_N:
        return [dict(SCAN=True, BJ=16, BP=64, num_warps=4)] + split
    return split


# chunk_output's register cap: 168 registers x 128 threads leave room for three programs of 4
# warps per SM (65536 registers) where 170-255 left two; measured on the H200 it saves 8-17 % of
# the whole call on every official shape, although three of them spill (2-20 words of local memory)
# (docs/optimisation.md, step 22)
OUTPUT_MAXNREG = 168
# Up to this N, 128 registers (four programs per SM, 16-40 bytes of local memory per thread):
# chunk_output 0.88-0.93x at N = 16, 32 and 64, with the Z gate on and off; at N = 128 with the L2
# prefetch (176-224 bytes) 1.02x, and at N = 256 (688 bytes) 1.6-1.8x (steps 57 and 58)
OUTPUT_SMALL_N = 64
OUTPUT_SMALL_MAXNREG = 128


def output_small(N: int, R: int, C: int) -> bool:
    """Whether chunk_output runs with OUTPUT_SMALL_MAXNREG registers (four programs per SM): up
    to N = OUTPUT_SMALL_N, and at N = 128 with three or four ranks and chunks of at most 16
    steps, where it drops the L2 prefetch to make room (output_prefetch). There it spills 16-80
    bytes per thread and measured 0.95x; at R = 1, 2 and 8 it spills 232-408 bytes and measured
    1.05x (docs/optimisation.md, step 58)."""
    return N <= OUTPUT_SMALL_N or (N == 128 and _pow2(R, 1) == 4 and C <= 16)


def output_maxnreg(N: int, R: int, C: int) -> int:
    """chunk_output's register cap for q/k head dim N, rank R and chunk size C."""
    return OUTPUT_SMALL_MAXNREG if output_small(N, R, C) else OUTPUT_MAXNREG


# Where P takes two 64-column blocks, one chunk_output program does both (PB = 2): the scores of
# a tile are computed once instead of once per block. With 168 registers (three programs per SM;
# at 128 it spills 264-328 bytes) chunk_output measured 0.90x at N128_P128_R4_C8 and 0.94x at
# N64_P128_R4_C16 (docs/optimisation.md, step 60)
OUTPUT_PAIRED_P = (64, 128)


def output_p_blocks(P: int) -> int:
    """P blocks per chunk_output program in the preferred config (64-column blocks): 2 where P
    takes two of them, else 1."""
    lo, hi = OUTPUT_PAIRED_P
    return 2 if lo < P <= hi else 1


def output_prefetch(N: int, R: int, C: int) -> bool:
    """Whether chunk_output prefetches its later inputs into L2 (common.prefetch): not at R = 1,
    where it made the kernel 8 % slower, and 5 % without the segsum block (steps 46 and 52), nor
    where 128 registers above N = OUTPUT_SMALL_N need the registers it takes (step 58)."""
    return R > 1 and not (N > OUTPUT_SMALL_N and output_small(N, R, C))


# The configs above were measured on the H200 (sm_90), where Triton runs chunk_output's dots on
# wgmma. On GPUs whose dots run on mma.sync with both operands in registers (sm_80-89, sm_120)
# the same configs compile with 136-2608 bytes of local memory per thread on the official shapes
# (sm_89); the fallbacks from 32-column P blocks on (16-pair N blocks), at OUTPUT_MAXNREG
# registers, take 0-56 (up to 264 on sm_80). On sm_100 (tcgen05) the H200's configs spill
# nothing. Offline, ptxas for each target (docs/optimisation.md, step 66); not timed on those
# GPUs.
MEASURED_MAJORS = (9, 10)  # compute capabilities whose GPUs take the H200's configs


def measured_arch(device: torch.device) -> bool:
    """Whether chunk_output takes the H200-measured configs on this device: compute capability
    9.x or 10.x (wgmma, tcgen05), or the CPU interpreter (whose tests then cover the configs the
    H200 runs)."""
    return device.type != "cuda" or compute_capability(device)[0] in MEASURED_MAJORS


def _output_candidates(pb: Problem, m: dict) -> List[dict]:
    """chunk_output configs, preferred first (measured on the H200, docs/optimisation.md steps
    7, 11, 22, 57, 58 and 60): 32-pair N blocks (16 when N/2 is smaller; 16 at N = 256 measured
    1.15x slower), 64-column P blocks, 4 warps, at most output_maxnreg(N, R, C) registers, on
    every shape of the official grid; first, where P takes two such blocks, both in one program
    with OUTPUT_MAXNREG registers (output_p_blocks). The shared-memory check falls back to
    narrower blocks on smaller GPUs. Where measured_arch is false, the list starts at those
    fallbacks, with OUTPUT_MAXNREG registers (step 66). (The chunks per tile, meta["U"], follow
    C and R alone.)"""
    half = pb.N // 2
    blocks, maxnreg = ((32, 64), (16, 32), (16, 16)), output_maxnreg(pb.N, pb.R, pb.C)
    out = []
    PB = output_p_blocks(pb.P)
    if not measured_arch(pb.device):
        blocks, maxnreg = blocks[1:], OUTPUT_MAXNREG
    elif PB > 1:
        out.append(dict(BJ=min(32, _pow2(half)), BP=64, PB=PB, num_warps=4, num_stages=1,
                        maxnreg=OUTPUT_MAXNREG))
    for BJ, BP in blocks:
        cfg = dict(BJ=min(BJ, _pow2(half)), BP=min(BP, _pow2(pb.P)), PB=1, num_warps=4,
                   num_stages=1, maxnreg=maxnreg)
        if cfg not in out:
            out.append(cfg)
    return out


def _fits(launches, a, out, m, cfg, limit) -> bool:
    """Compile (without running) the first of the launches and compare its shared memory with
    the limit."""
    fn, grid, args, options = launches(a, out, m, cfg)[0]
    try:
        compiled = fn.warmup(*args, grid=grid, **options)
    except triton.runtime.errors.OutOfResources:
        return False
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    return compiled.metadata.shared <= limit


def select(pb: Problem) -> Plan:
    """The plan "auto" runs for this problem through the public entry (configs before the
    shared-memory check; for chunks beyond the kernels' tiles, those of its sub-chunks)."""
    sub = kernel_chunk_size(pb.C, pb.R)
    if sub != pb.C:
        return dataclasses.replace(select(dataclasses.replace(pb, C=sub)), sub_chunk=sub)
    m = _meta(pb)
    return Plan("chunked", _state_candidates(pb, m)[0], _output_candidates(pb, m)[0], m["U"])


def _choose(launches, candidates: Callable[[Problem, dict], List[dict]], a, out, m, pb) -> dict:
    """First of candidates(pb, m) whose compiled kernel fits the shared-memory limit (cached per
    model, so that the list is built and compiled only on a model's first call)."""
    if pb.device.type != "cuda":
        return candidates(pb, m)[0]
    limit = smem_limit(pb.device)
    # U sets chunk_output's tile height, hence its shared memory: part of the key even though it
    # follows from C and R, so that a config is never reused for another tile
    key = (launches.__module__, pb.N, pb.P, pb.R, pb.C, pb.RD, m["U"], pb.dtype, pb.output_dtype,
           pb.has_z, pb.has_d, pb.device, limit)
    if key not in _config_cache:
        fit = next((c for c in candidates(pb, m) if _fits(launches, a, out, m, c, limit)), None)
        if fit is None:
            raise RuntimeError(f"no config of {launches.__module__} fits in {limit} bytes of "
                               "shared memory per block")
        _config_cache[key] = fit
    return _config_cache[key]


_placeholders: Dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor, one per device and kept, for pointer arguments that a kernel
    never follows (absent optional inputs, unused scratch): a call then allocates none for them
    (each allocation costs the host a few microseconds, docs/optimisation.md step 39)."""
    t = _placeholders.get(device)
    if t is None:
        t = _placeholders[device] = torch.empty(1, device=device, dtype=torch.float32)
    return t


def _prepare(args: dict, pb: Problem) -> dict:
    """Contiguous small tensors, shared strides inside the (q, k) and (v, dout, z) families,
    and placeholders for absent optional inputs (never read: their flags are off)."""
    a = dict(args)
    for name in ("q_bias", "k_bias", "mimo_v", "mimo_o", "mimo_z", "d", "da_cs", "da_cs_rev",
                 "dt", "trap", "segsum"):
        if a[name] is not None:
            a[name] = a[name].contiguous()
    if a["v"].stride() != a["dout"].stride() or (a["z"] is not None
                                                 and a["z"].stride() != a["v"].stride()):
        for name in ("v", "dout", "z"):
            if a[name] is not None:
                a[name] = a[name].contiguous()
    for name in ("mimo_z", "d"):
        if a[name] is None:
            a[name] = placeholder(pb.device)
    if a["z"] is None:
        a["z"] = a["v"]
    return a


# Every kernel holds a chunk as one tile of next_pow2(C) * next_pow2(R) (step, rank) rows, with
# a square [rows, rows] scores tile. 128 rows is the largest that compiles (at 256 ptxas fails
# under chunk_output's register cap after 30 s, at 512 after 6 minutes, and stage 0's qk_dot
# kernel asks for 256 KB of shared memory; docs/optimisation.md, step 32). Tiles above 64 rows
# spill 400-730 bytes per thread in chunk_output, and on the H200 models with 128-row chunks
# ran 1.7-3.1x faster as sub-chunks of 64-row tiles despite their extra states (step 33). The
# public entry therefore runs every chunk larger than TILE_ROWS as sub-chunks (kernel_chunk_size,
# api.split_chunks); MAX_TILE_ROWS only bounds R, whose one-step tile cannot be split.
MAX_TILE_ROWS = 128
TILE_ROWS = 64


def _tile_fits(C: int, R: int, rows: int) -> bool:
    return next_pow2(C) * next_pow2(R) <= rows


def check_tile_rows(C: int, R: int) -> None:
    """Raise NotImplementedError, naming chunk_size and R, for chunks larger than the kernels'
    tiles (next_pow2(chunk_size) * next_pow2(R) > MAX_TILE_ROWS)."""
    if not _tile_fits(C, R, MAX_TILE_ROWS):
        raise NotImplementedError(
            f"chunk_size={C} with R={R} (q.shape[2]) needs chunk tiles of "
            f"{next_pow2(C) * next_pow2(R)} (step, rank) rows; the kernels support "
            f"next_pow2(chunk_size) * next_pow2(R) <= {MAX_TILE_ROWS}")


@functools.lru_cache(maxsize=None)
def kernel_chunk_size(C: int, R: int) -> int:
    """The chunk length the kernels run for a model with chunk_size C and rank R: C itself when
    its tile fits TILE_ROWS, else the largest divisor of C whose tile fits, and 1 for an R whose
    one-step tile is larger (up to MAX_TILE_ROWS). The chunked form holds for any chunk length,
    and the states at the model's chunk boundaries are every (C // result)-th of the
    sub-chunks' (api.split_chunks). Raises NotImplementedError, naming R, when not even a
    one-step tile fits (R > MAX_TILE_ROWS)."""
    if not _tile_fits(1, R, MAX_TILE_ROWS):
        raise NotImplementedError(f"R={R} (q.shape[2]): the kernels hold at most "
                                  f"{MAX_TILE_ROWS} (step, rank) rows per tile, so R <= "
                                  f"{MAX_TILE_ROWS}")
    return max(c for c in range(1, C + 1)
               if C % c == 0 and (c == 1 or _tile_fits(c, R, TILE_ROWS)))


# A chunked call's plan, cached per signature (the Problem, with B and S, and the strides of the
# given tensors): the constants, the configs, the outputs' layout and each launch's arguments
# with its tensors left open. A repeated call then only allocates its outputs and binds its
# tensors; on the small shapes the host's time per call, not the GPU's, decides
# (docs/optimisation.md, steps 42-43). The public entry keeps a second map from its own call
# signature (every tensor's shape, strides, dtype and device, and the other arguments) to the
# validated Problem and the plan, so that a repeated call skips the checks as well: they depend
# on that signature alone.
MAX_CALL_PLANS = 1024
_call_plans: Dict[tuple, "_CallPlan"] = {}
_entry_calls: Dict[tuple, Tuple[Problem, "_CallPlan"]] = {}


def clear_caches() -> None:
    """Forget the compile-time constants, the chosen configs, the call plans, the entry
    signatures and the devices checked and classified (after a change to what the dispatcher
    picks, such as a shared-memory limit or, in tests, its candidates or rules)."""
    _model_meta.cache_clear()
    _config_cache.clear()
    _call_plans.clear()
    _entry_calls.clear()
    _capability.clear()


def cached_call(signature: tuple) -> Optional[Tuple[Problem, "_CallPlan"]]:
    """The Problem and call plan that `run` stored for this public-entry call signature."""
    return _entry_calls.get(signature)


class _OutputLayout(NamedTuple):
    """A call's outputs and scratch as shapes: `_allocate` makes them."""
    states: tuple
    qk_dot: tuple
    dz: Optional[tuple]  # None without Z (the placeholder stands in)
    dmimo: tuple  # [n_sums, B, H, R, P] fp32: dmimo_o, and dmimo_z with Z
    inc: str  # "states" (fp32 outputs), "fp32" (its own fp32 copy) or "none" (the placeholder)
    dtype: torch.dtype
    scratch: int  # elements of the one fp32 scratch buffer
    views: tuple  # (name, size, stride, offset) into the scratch


def _output_layout(pb: Problem, m: dict) -> _OutputLayout:
    """The outputs and scratch of a chunked call of pb, before the state pass is chosen: without
    an fp32 copy of the states (the call plan adds it where the chosen pass needs it)."""
    B, H, R, P = pb.B, pb.H, pb.R, pb.P
    numel, views = step_terms.table_views(m)
    # the partial sums of dmimo_o and dmimo_z follow step_terms' tables in the scratch, as
    # views of one [n_sums, ...] block that one launch reduces (steps 39 and 49)
    tiles = cdiv(m["nc"], m["U"])
    n_sums, block = (2 if pb.has_z else 1), aligned_numel(B * H * tiles * R * P)
    part = (B, H, tiles, R, P), (H * tiles * R * P, tiles * R * P, R * P, P, 1)
    views += [("parts", (n_sums,) + part[0], (block,) + part[1], numel),
              ("part_o", *part, numel), ("part_z", *part, numel + (n_sums - 1) * block)]
    odt = pb.output_dtype
    return _OutputLayout(
        states=(B, H, m["nc"], pb.N, P), qk_dot=(B, H, pb.S, R, R),
        dz=(B, pb.S, H, P) if pb.has_z else None, dmimo=(n_sums, B, H, R, P),
        inc="states" if odt == torch.float32 else "none",
        dtype=odt, scratch=numel + n_sums * block, views=tuple(views))


def _allocate(layout: _OutputLayout, dev: torch.device) -> dict:
    """A call's outputs and scratch, by name: states, qk_dot, dz (the placeholder without Z),
    dmimo (dmimo_o and dmimo_z as one tensor), inc (the states themselves for fp32 outputs, an
    fp32 copy, or the placeholder), step_terms' tables, and the dmimo partial sums ("parts",
    with the views part_o and part_z)."""
    L = layout
    states = torch.empty(L.states, device=dev, dtype=L.dtype)
    out = dict(states=states, qk_dot=torch.empty(L.qk_dot, device=dev, dtype=L.dtype),
               dmimo=torch.empty(L.dmimo, device=dev, dtype=torch.float32),
               dz=placeholder(dev) if L.dz is None else torch.empty(L.dz, device=dev,
                                                                      dtype=L.dtype),
               inc=states if L.inc == "states" else placeholder(dev) if L.inc == "none"
               else torch.empty(L.states, device=dev, dtype=torch.float32))
    buf = torch.empty(L.scratch, device=dev, dtype=torch.float32)
    for name, size, stride, offset in L.views:
        out[name] = buf.as_strided(size, stride, offset)
    return out


@dataclass(frozen=True)
class _CallPlan:
    """What `run` launches for one signature: `group`, the launcher.BoundGroup of the kernels
    with their grids, options and fixed arguments; per launch (args, slots), the arguments with
    None at the tensors and slots ((position, name), ...) naming the input or output each tensor
    is bound from at every call; `names`, every name bound."""
    outputs: _OutputLayout
    group: launcher.BoundGroup
    launches: tuple
    names: tuple

    def launch(self, env: dict) -> None:
        """Launch every kernel with the tensors of env (the inputs and outputs by name)."""
        arg_lists = []
        for template, slots in self.launches:
            args = list(template)
            for i, name in slots:
                args[i] = env[name]
            arg_lists.append(tuple(args))
        self.group(arg_lists, [env[name] for name in self.names])


def _templates(launches: list, env: dict, constant: torch.Tensor) -> tuple:
    """(group, launches, names) of a _CallPlan: the launches with every tensor argument but
    `constant` (the kept placeholder) replaced by the name it has in env; launches with an empty
    grid (chunk_increment for a single chunk) left out, since they launch nothing."""
    names: Dict[int, str] = {}
    for name, x in env.items():
        if isinstance(x, torch.Tensor):
            names.setdefault(id(x), name)
    bounds, plans, bound_names = [], [], {}
    for fn, grid, args, options in launches:
        if 0 in grid:
            continue
        template, slots = list(args), []
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and x is not constant:
                if id(x) not in names:
                    raise AssertionError(f"{fn.__name__}: argument {i} is a tensor that is "
                                         "neither an input nor an output of the call")
                template[i] = None
                slots.append((i, names[id(x)]))
                bound_names[names[id(x)]] = None
        bounds.append(launcher.BoundLaunch(fn, grid, args, options))
        plans.append((tuple(template), tuple(slots)))
    return launcher.BoundGroup(tuple(bounds)), tuple(plans), tuple(bound_names)


def _new_call_plan(pb: Problem, a: dict) -> Tuple["_CallPlan", dict]:
    """The call plan of this problem and prepared inputs, and the outputs of this call."""
    check_tile_rows(pb.C, pb.R)
    m = _meta(pb)
    # the configs are chosen with the stand-in for the fp32 scratch, whose type and alignment are
    # the scratch's, so that the probes compile the kernels that run
    layout = _output_layout(pb, m)
    out = _allocate(layout, pb.device)
    s_cfg = _choose(chunk_state.launches, _state_candidates, a, out, m, pb)
    probe = dict(out, part_o=out["inc"], part_z=out["inc"])  # compiled, never run
    o_cfg = _choose(chunk_output.launches, _output_candidates, a, probe, m, pb)
    # fp32 outputs: the states are their own scratch. Otherwise an fp32 tensor of their shape,
    # except where the scan runs and chunk_output reads the rounded states: then nothing reads
    # or writes it (268 MB at N128_P64_R4_C16, B = 4) and the placeholder stands in.
    if pb.output_dtype != torch.float32 and not (s_cfg["SCAN"] and m["OUT_STATES"]):
        layout = layout._replace(inc="fp32")
        out["inc"] = torch.empty(out["states"].shape, device=pb.device, dtype=torch.float32)
    launches = (step_terms.launches(a, out, m) + chunk_state.launches(a, out, m, s_cfg)
                + chunk_output.launches(a, out, m, o_cfg))
    env = dict(a, **out)
    return _CallPlan(layout, *_templates(launches, env, placeholder(pb.device))), out


def run(pb: Problem, args: dict, impl: str = "auto", signature: Optional[tuple] = None):
    """Allocate the outputs and run the chosen implementation on padded inputs `args`. A
    chunked call's plan is cached, and with it this call's public-entry `signature` when given
    (`cached_call`, `run_cached`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "stage0":
        return _run_stage0(pb, args)
    # the strides decide the prepared inputs' strides and every integer argument of a launch;
    # the Problem everything else (the launcher keys each launch on its tensors' dtypes and
    # alignment)
    key = (pb, tuple([None if x is None else x.stride() for x in args.values()]))
    plan = _call_plans.get(key)
    a = _prepare(args, pb)
    if plan is not None:
        _remember(signature, pb, plan)
        return _execute(pb, plan, a)
    plan, out = _new_call_plan(pb, a)
    # a plan built from one tensor given as two inputs would bind both from one name
    given = [id(x) for x in args.values() if x is not None]
    if len(set(given)) == len(given):
        if len(_call_plans) >= MAX_CALL_PLANS:
            _call_plans.clear()
            _entry_calls.clear()
        _call_plans[key] = plan
        _remember(signature, pb, plan)
    return _execute(pb, plan, a, out)


def _remember(signature: Optional[tuple], pb: Problem, plan: "_CallPlan") -> None:
    """Map a checked call's entry signature to its Problem and cached plan (several signatures
    can share a plan: trap's dtype, for one, is not part of the plan's key)."""
    if signature is None:
        return
    if len(_entry_calls) >= MAX_CALL_PLANS:
        _entry_calls.clear()
    _entry_calls[signature] = (pb, plan)


def run_cached(pb: Problem, plan: "_CallPlan", args: dict):
    """`run` of a call whose Problem and plan `cached_call` gave."""
    return _execute(pb, plan, _prepare(args, pb))


def _execute(pb: Problem, plan: "_CallPlan", a: dict, out: Optional[dict] = None):
    """Run plan on prepared inputs a, into out (allocated from the plan when None)."""
    if out is None:
        out = _allocate(plan.outputs, pb.device)
    plan.launch(dict(a, **out))
    sums = out["dmimo"].unbind(0)
    return (out["states"], out["qk_dot"], sums[0], sums[-1] if pb.has_z else None,
            out["dz"] if pb.has_z else None)


def _run_stage0(pb: Problem, args: dict):
    """The stage-0 baseline: three kernels, outputs allocated per call."""
    check_tile_rows(pb.C, pb.R)
    m = _meta(pb)
    a = _prepare(args, pb)
    dev, odt = pb.device, pb.output_dtype
    B, H, R, P = pb.B, pb.H, pb.R, pb.P
    out = dict(
        states=torch.empty(B, H, m["nc"], pb.N, P, device=dev, dtype=odt),
        qk_dot=torch.empty(B, H, pb.S, R, R, device=dev, dtype=odt),
        dz=torch.empty(B, pb.S, H, P, device=dev, dtype=odt) if pb.has_z else a["d"],
        dmimo_o=torch.empty(B, H, R, P, device=dev, dtype=torch.float32))
    out["dmimo_z"] = (torch.empty(B, H, R, P, device=dev, dtype=torch.float32)
                      if pb.has_z else out["dmimo_o"])
    stage0.launch(a, out, m)
    return (out["states"], out["qk_dot"], out["dmimo_o"], out["dmimo_z"] if pb.has_z else None,
            out["dz"] if pb.has_z else None)
