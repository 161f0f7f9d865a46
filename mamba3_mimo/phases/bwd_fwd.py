"""Phase 1 of the Mamba-3 MIMO backward, `mamba3_mimo_bwd_fwd` (SPEC sections 1-5): argument
checks, tail padding and sub-chunks on the host, then the production kernels (step_terms, the
state pass, chunk_output) through a cached call plan, or the stage-0 baseline.

The public function is also the torch.library custom op `mamba3_mimo::bwd_fwd`, with a fake
(meta) implementation, so that `torch.compile(fullgraph=True)` keeps it in the graph; eager calls
skip the op's dispatch, whose host time would exceed a small shape's kernels.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Tuple

import torch

from .. import configs
from ..baseline import stage0
from ..kernels import aligned_numel, cdiv, chunk_output, chunk_state, step_terms
from ..problem import Problem
from ..runtime import resources
from ..runtime.device import check_device, on_device
from ..runtime.plans import CallPlan, PlanCache, placeholder

Tensor = torch.Tensor
IMPLS = ("auto", "stage0")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ARG_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
             "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z")
# grid axis 0 carries (b*h, chunk tile) pairs: at most 2**31 - 1 programs
MAX_GRID_X = 2 ** 31 - 1

Outputs = Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]


# ---------------------------------------------------------------------------- argument checks

def check_tensor(name: str, x, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """Raise TypeError / ValueError naming `name` unless x is a strided tensor of this shape, one
    of these dtypes and on this device."""
    # one line of plain comparisons for a good argument, which is every call's case (the host's
    # time per call matters); the messages only for a bad one
    if (isinstance(x, Tensor) and x.layout is torch.strided and x.shape == shape
            and x.dtype in dtypes and x.device == device):
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    raise ValueError(f"{name} must be on {device} like q, got {x.device}")


def check_dims(q, v, chunk_size, rotary_dim_divisor, q_name: str = "q",
               v_name: str = "v") -> Tuple[int, ...]:
    """(B, S, R, G, N, H, P, RD) of q [B, S, R, G, N] and v [B, S, H, P] (named q_name, v_name
    in the messages), or TypeError / ValueError naming the first bad one: the checks that
    bwd_fwd and the whole operator share."""
    if not isinstance(q, Tensor):
        raise TypeError(f"{q_name} must be a torch.Tensor, got {type(q).__name__}")
    if q.layout is not torch.strided:
        raise TypeError(f"{q_name} must be a dense (strided) tensor, got layout {q.layout}")
    if q.dim() != 5:
        raise ValueError(f"{q_name} must have 5 dims [B, S, R, G, N], got shape "
                         f"{list(q.shape)}")
    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"{q_name} must be float16, bfloat16 or float32, got {q.dtype}")
    B, S, R, G, N = q.shape
    for name, val in (("B", B), ("S", S), ("R", R), ("G", G), ("N", N)):
        if val < 1:
            raise ValueError(f"{q_name}: dimension {name} must be >= 1, got shape "
                             f"{list(q.shape)}")
    if not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError(f"{v_name} must be a 4-dim tensor [B, S, H, P]"
                         + (f", got shape {list(v.shape)}" if isinstance(v, Tensor) else ""))
    H, P = v.shape[2], v.shape[3]
    if H < 1 or P < 1:
        raise ValueError(f"{v_name}: H and P must be >= 1, got shape {list(v.shape)}")
    if H % G != 0:
        raise ValueError(f"H ({v_name}.shape[2] = {H}) must be a multiple of G "
                         f"({q_name}.shape[3] = {G})")
    if N % 2 != 0:
        raise ValueError(f"N ({q_name}.shape[4] = {N}) must be even")
    for name, val in (("chunk_size", chunk_size), ("rotary_dim_divisor", rotary_dim_divisor)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if rotary_dim_divisor < 1:
        raise ValueError(f"rotary_dim_divisor must be >= 1, got {rotary_dim_divisor}")
    RD = N // rotary_dim_divisor
    if RD < 1 or 2 * RD > N:
        raise ValueError(f"rotary_dim_divisor={rotary_dim_divisor} gives RD = N // divisor = {RD}; "
                         f"expected 1 <= RD <= N/2 = {N // 2}")
    return B, S, R, G, N, H, P, RD


def validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
             segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype) -> Problem:
    """The Problem of a call, or TypeError / ValueError naming the first bad argument."""
    B, S, R, G, N, H, P, RD = check_dims(q, v, chunk_size, rotary_dim_divisor)
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {[str(t) for t in OUTPUT_DTYPES]}, "
                         f"got {output_dtype}")
    if (mimo_z is None) != (z is None):
        raise ValueError("mimo_z and z must be given together or both be None "
                         f"(got mimo_z={'None' if mimo_z is None else 'tensor'}, "
                         f"z={'None' if z is None else 'tensor'})")
    if B * H * (S + configs.TILE_ROWS) > MAX_GRID_X:
        raise ValueError(f"B * H * S = {B * H * S}: the kernels' grids take fewer than "
                         f"{MAX_GRID_X - B * H * configs.TILE_ROWS} steps of all heads "
                         "(split the batch)")
    dev, x16, f32 = q.device, (q.dtype,), (torch.float32,)
    nc = math.ceil(S / chunk_size)
    seq, hs, hrp = (B, S, H, P), (B, H, S), (H, R, P)
    checks = [("dout", dout, seq, x16), ("k", k, (B, S, R, G, N), x16), ("v", v, seq, x16),
              ("q_bias", q_bias, (H, R, N), f32), ("k_bias", k_bias, (H, R, N), f32),
              ("mimo_v", mimo_v, hrp, f32), ("mimo_o", mimo_o, hrp, f32),
              ("angles", angles, (B, S, H, RD), f32), ("da_cs", da_cs, hs, f32),
              ("da_cs_rev", da_cs_rev, hs, f32), ("dt", dt, hs, f32),
              ("trap", trap, hs, (torch.float32, q.dtype)),
              ("segsum", segsum, (B, H, nc, chunk_size, chunk_size), f32)]
    if mimo_z is not None:
        checks += [("mimo_z", mimo_z, hrp, f32), ("z", z, seq, x16)]
    if d is not None:
        checks.append(("d", d, (H,), f32))
    for name, x, shape, dtypes in checks:
        check_tensor(name, x, shape, dtypes, dev)
    return Problem(B=B, S=S, H=H, G=G, N=N, P=P, R=R, C=chunk_size,
                   rotary_dim_divisor=rotary_dim_divisor, dtype=q.dtype, has_z=z is not None,
                   has_d=d is not None, output_dtype=output_dtype, device=dev)


def signature(tensors: tuple, chunk_size, rotary_dim_divisor, output_dtype,
              impl) -> Optional[tuple]:
    """What `validate`'s outcome and the call plan depend on: each tensor's shape, strides,
    dtype and device (None for an absent one), and the other arguments. None for a call
    the cache does not take (a non-tensor where a tensor belongs, non-int sizes, stage 0): it
    goes the checked way and raises there if it is wrong."""
    if (type(chunk_size) is not int or type(rotary_dim_divisor) is not int
            or impl != "auto" or not any(output_dtype is t for t in OUTPUT_DTYPES)):
        return None
    sig = []
    for x in tensors:
        if x is None:
            sig.append(None)
        elif isinstance(x, Tensor) and x.layout is torch.strided:  # others have no strides
            sig.append((x.shape, x.stride(), x.dtype, x.device))
        else:
            return None
    return (chunk_size, rotary_dim_divisor, output_dtype, tuple(sig))


# ---------------------------------------------------------------------------- host-side rewrites

def pad_steps(x: Tensor, dim: int, n: int) -> Tensor:
    """Append n zeros along dim."""
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x, x.new_zeros(shape)], dim)


# sequence inputs with the step on dim 1 ([B, S, ...]) and on dim 2 ([B, H, S]; da_cs apart)
_STEP_DIM1 = ("dout", "q", "k", "v", "angles", "z")
_STEP_DIM2 = ("dt", "trap", "da_cs_rev")


def one_chunk_size(C: int, S: int, R: int) -> int:
    """The chunk length to run a call whose chunk_size C is at least S, a single chunk: S rounded
    up to whole kernel tiles (configs.kernel_chunk_size of a chunk of S steps), at most C. The
    outputs do not depend on it (states has one chunk, zero, either way), and a C far larger
    than S then costs neither O(C) padding nor an O(C**2) segsum copy."""
    tile = configs.kernel_chunk_size(configs.TILE_ROWS, R)  # the longest chunk a tile holds
    return min(C, cdiv(S, tile) * tile)


def pad_tail(args: dict, chunk_size: int) -> dict:
    """SPEC section 4: pad every sequence input to whole chunks so padded steps contribute nothing.

    q, k, v, dout, angles, z, dt and trap get zeros (dt = 0 keeps trap_scale[S-1] = gamma[S-1]);
    da_cs is extended with its last valid value; da_cs_rev is 0 and segsum is rebuilt from the
    extended da_cs on the padded steps, keeping every given valid entry as it is. A segsum of
    chunks longer than chunk_size (one_chunk_size) keeps its leading [chunk_size, chunk_size]
    block.
    """
    S = args["q"].shape[1]
    C = chunk_size
    pad = math.ceil(S / C) * C - S
    seg = args["segsum"]
    if seg.shape[-1] != C:
        seg = seg[..., :C, :C]
    if pad == 0:
        return dict(args, segsum=seg) if seg is not args["segsum"] else args
    out = dict(args)
    for name in _STEP_DIM1:
        if out.get(name) is not None:
            out[name] = pad_steps(out[name], 1, pad)
    for name in _STEP_DIM2:
        out[name] = pad_steps(out[name], 2, pad)
    da_cs = args["da_cs"]
    out["da_cs"] = torch.cat([da_cs, da_cs[..., -1:].expand(*da_cs.shape[:-1], pad)], -1)
    last = out["da_cs"][..., -C:]  # the whole last chunk
    valid = C - pad
    seg = seg.clone()
    rebuilt = last[..., :, None] - last[..., None, :]
    i = torch.arange(C, device=seg.device)
    fill = (i[:, None] >= valid) & (i[:, None] > i[None, :])
    seg[:, :, -1] = torch.where(fill, rebuilt, torch.where(i[:, None] >= valid, 0.0, seg[:, :, -1]))
    out["segsum"] = seg
    return out


def split_chunks(args: dict, chunk_size: int, sub: int, S: int) -> dict:
    """The inputs of chunks of length chunk_size (padded to whole chunks, pad_tail) rewritten
    for chunks of length `sub`, a divisor: within a chunk, da_cs restarts after each sub-chunk
    (minus the value at the previous sub-chunk's end), da_cs_rev stops at the sub-chunk's end
    (minus its value there) and segsum keeps its diagonal [sub, sub] blocks. Differences of the
    given pieces on the host, as SPEC section 2 allows; the kernels then read them as given.
    Sub-chunks wholly past the S valid steps are dropped: the kernels expect ceil(S / sub)."""
    K = chunk_size // sub
    out = dict(args)
    B, H, S_pad = args["da_cs"].shape
    nc = S_pad // chunk_size
    da = args["da_cs"].reshape(B, H, nc, K, sub)
    before = torch.cat([torch.zeros_like(da[..., :1, -1]), da[..., :-1, -1]], -1)
    out["da_cs"] = (da - before[..., None]).reshape(B, H, S_pad)
    rev = args["da_cs_rev"].reshape(B, H, nc, K, sub)
    out["da_cs_rev"] = (rev - rev[..., -1:]).reshape(B, H, S_pad)
    seg = args["segsum"].reshape(B, H, nc, K, sub, K, sub)
    out["segsum"] = (torch.diagonal(seg, dim1=3, dim2=5).permute(0, 1, 2, 5, 3, 4)
                     .reshape(B, H, nc * K, sub, sub))
    n_sub = math.ceil(S / sub)
    for name in _STEP_DIM1:
        if out.get(name) is not None:
            out[name] = out[name][:, :n_sub * sub]
    for name in _STEP_DIM2 + ("da_cs",):
        out[name] = out[name][..., :n_sub * sub]
    out["segsum"] = out["segsum"][:, :, :n_sub]
    return out


def kernel_problem(pb: Problem, args: dict) -> Tuple[Problem, dict, int]:
    """What the kernels run for a validated call of pb on `args`: a chunk_size beyond S taken as
    one chunk of whole kernel tiles (one_chunk_size), the tail padded to whole chunks (pad_tail)
    and chunks beyond the kernels' tiles split (split_chunks). Returns the kernels' Problem,
    their inputs (`args` itself where nothing was rewritten) and every how many of their states
    the model's chunks begin (1 unless split)."""
    C = pb.C if pb.C <= pb.S else one_chunk_size(pb.C, pb.S, pb.R)
    padded = pad_tail(args, C)
    sub = configs.kernel_chunk_size(C, pb.R)
    if sub == C:
        return dataclasses.replace(pb, C=C), padded, 1
    return dataclasses.replace(pb, C=sub), split_chunks(padded, C, sub, pb.S), C // sub


def prepare(args: dict, pb: Problem) -> dict:
    """The kernels' view of padded inputs: contiguous small tensors, shared strides inside the
    (v, dout, z) family, placeholders for absent optional inputs (never read: their flags are
    off) and v standing for an absent z."""
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


# ---------------------------------------------------------------------------- the production path

class OutputLayout(NamedTuple):
    """A call's outputs and scratch as shapes: `allocate` makes them."""
    states: tuple
    qk_dot: tuple
    dz: Optional[tuple]  # None without Z (the placeholder stands in)
    dmimo: tuple  # [n_sums, B, H, R, P] fp32: dmimo_o, and dmimo_z with Z
    inc: str  # "states" (fp32 outputs), "fp32" (its own fp32 copy) or "none" (the placeholder)
    dtype: torch.dtype
    scratch: int  # elements of the one fp32 scratch buffer
    views: tuple  # (name, size, stride, offset) into the scratch


def output_layout(pb: Problem, m: configs.Constants, inc: str) -> OutputLayout:
    """The outputs and one fp32 scratch buffer (step_terms' tables, the dmimo partial sums at
    256-byte aligned offsets, and chunk_output's flags) of a production call; `inc` says what
    the state pass's fp32 copy of the states is."""
    B, H, R, P = pb.B, pb.H, pb.R, pb.P
    numel, views = step_terms.table_views(m)
    tiles = cdiv(m.nc, m.U)
    n_sums, block = (2 if pb.has_z else 1), aligned_numel(B * H * tiles * R * P)
    part = (B, H, tiles, R, P), (H * tiles * R * P, tiles * R * P, R * P, P, 1)
    # chunk_output's flags, as many as the candidate config with the most programs needs
    flags = max(chunk_output.flag_count(m, cfg) for cfg in configs.output_candidates(pb))
    views += [("parts", (n_sums,) + part[0], (block,) + part[1], numel),
              ("part_o", *part, numel), ("part_z", *part, numel + (n_sums - 1) * block),
              ("flags", (flags,), (1,), numel + n_sums * block)]
    return OutputLayout(
        states=(B, H, m.nc, pb.N, P), qk_dot=(B, H, pb.S, R, R),
        dz=(B, pb.S, H, P) if pb.has_z else None, dmimo=(n_sums, B, H, R, P), inc=inc,
        dtype=pb.output_dtype, scratch=numel + n_sums * block + flags, views=tuple(views))


def allocate(layout: OutputLayout, dev: torch.device) -> dict:
    """A call's outputs and scratch, by name: states, qk_dot, dz (the placeholder without Z),
    dmimo, inc, step_terms' tables, the dmimo partial sums (parts, part_o, part_z) and
    chunk_output's flags."""
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


def _tables(out: dict) -> dict:
    return dict(terms=out["terms"], cos=out["cos"], sin=out["sin"])


def _state_launches(a: dict, out: dict, m: configs.Constants,
                    cfg: configs.StateConfig) -> list:
    """The state pass's launches of a production call."""
    return chunk_state.launches(**{n: a[n] for n in ("k", "v", "k_bias", "mimo_v", "da_cs")},
                                **_tables(out), states=out["states"], inc=out["inc"], consts=m,
                                cfg=cfg)


def _output_launches(a: dict, out: dict, m: configs.Constants,
                     cfg: configs.OutputConfig) -> list:
    """chunk_output's launches (and rank_sums') of a production call."""
    inputs = {n: a[n] for n in ("q", "k", "v", "dout", "z", "q_bias", "k_bias", "mimo_v",
                                "mimo_o", "mimo_z", "d", "segsum")}
    outs = {n: out[n] for n in ("qk_dot", "dz", "parts", "part_o", "part_z", "flags", "dmimo")}
    return chunk_output.launches(**inputs, **_tables(out), **outs, consts=m, cfg=cfg,
                                 states=out["states"] if m.OUT_STATES else out["inc"])


def _model_key(family: str, pb: Problem, m: configs.Constants) -> tuple:
    # U sets chunk_output's tile height, hence its shared memory: part of the key even though it
    # follows from C and R, so that a config is never reused for another tile
    return (family, pb.N, pb.P, pb.R, pb.C, pb.RD, m.U, pb.dtype, pb.output_dtype, pb.has_z,
            pb.has_d)


def new_call_plan(pb: Problem, a: dict) -> Tuple[CallPlan, dict]:
    """The call plan of this problem and prepared inputs, and this call's outputs."""
    configs.check_tile_rows(pb.C, pb.R)
    m = configs.constants(pb)
    # the configs are chosen with the placeholder standing for the fp32 state copy, whose type
    # and alignment are the copy's, so that the probes compile the kernels that run
    inc = "states" if pb.output_dtype == torch.float32 else "none"
    out = allocate(output_layout(pb, m, inc), pb.device)
    # each family's first launch is the one whose resources decide its config
    s_cfg = resources.choose(_model_key("state", pb, m), configs.state_candidates(pb),
                             lambda cfg: _state_launches(a, out, m, cfg)[0], pb.device)
    o_cfg = resources.choose(_model_key("output", pb, m), configs.output_candidates(pb),
                             lambda cfg: _output_launches(a, out, m, cfg)[0], pb.device)
    # Narrower outputs need an fp32 copy of the states, except where the scan runs and
    # chunk_output reads the rounded states: then nothing reads or writes it (268 MB at
    # N128_P64_R4_C16, B = 4) and the placeholder stands in.
    if inc == "none" and not (s_cfg.scan and m.OUT_STATES):
        inc = "fp32"
        out["inc"] = torch.empty(out["states"].shape, device=pb.device, dtype=torch.float32)
    layout = output_layout(pb, m, inc)
    launches = ([step_terms.launch(angles=a["angles"], da_cs=a["da_cs"],
                                   da_cs_rev=a["da_cs_rev"], dt=a["dt"], trap=a["trap"],
                                   consts=m, **_tables(out))]
                + _state_launches(a, out, m, s_cfg) + _output_launches(a, out, m, o_cfg))
    plan = CallPlan.build(layout, launches, dict(a, **out), placeholder(pb.device))
    return plan, out


# A call's plan is cached per (Problem, strides of the given tensors); the public entry keeps a
# second map from its own call signature to the validated Problem and plan, so that a repeated
# call skips the checks as well: they depend on that signature alone.
call_plans: PlanCache[CallPlan] = PlanCache()
entry_calls: PlanCache[Tuple[Problem, CallPlan]] = PlanCache()


def run(pb: Problem, args: dict, impl: str = "auto", sig: Optional[tuple] = None) -> Outputs:
    """The outputs of padded inputs `args` by `impl`; a production call's plan is cached, and
    with it the call's entry signature `sig` when given."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "stage0":
        configs.check_tile_rows(pb.C, pb.R)
        return stage0.run(prepare(args, pb), configs.constants(pb), pb.output_dtype)
    # the strides decide the prepared inputs' strides and every integer argument of a launch;
    # the Problem everything else (the launcher keys each launch on its tensors' dtypes and
    # alignment)
    key = (pb, tuple([None if x is None else x.stride() for x in args.values()]))
    plan = call_plans.get(key)
    a = prepare(args, pb)
    if plan is not None:
        if sig is not None:
            entry_calls.put(sig, (pb, plan))
        return execute(pb, plan, a)
    plan, out = new_call_plan(pb, a)
    # a plan built from one tensor given as two inputs would bind both from one name
    given = [id(x) for x in args.values() if x is not None]
    if len(set(given)) == len(given):
        call_plans.put(key, plan)
        if sig is not None:
            entry_calls.put(sig, (pb, plan))
    return execute(pb, plan, a, out)


def execute(pb: Problem, plan: CallPlan, a: dict, out: Optional[dict] = None) -> Outputs:
    """Run plan on prepared inputs a, into out (allocated from the plan when None)."""
    if out is None:
        out = allocate(plan.layout, pb.device)
    plan.launch(dict(a, **out))
    sums = out["dmimo"].unbind(0)
    return (out["states"], out["qk_dot"], sums[0], sums[-1] if pb.has_z else None,
            out["dz"] if pb.has_z else None)


# ---------------------------------------------------------------------------- public entry

def bwd_fwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
            mimo_v: Tensor, mimo_o: Tensor, angles: Tensor, da_cs: Tensor, da_cs_rev: Tensor,
            dt: Tensor, trap: Tensor, segsum: Tensor, mimo_z: Optional[Tensor] = None,
            d: Optional[Tensor] = None, z: Optional[Tensor] = None, chunk_size: int = 16,
            rotary_dim_divisor: int = 4, output_dtype: torch.dtype = torch.float32,
            impl: str = "auto") -> Outputs:
    """`mamba3_mimo_bwd_fwd` with a choice of implementation: "auto" (production) or "stage0"
    (the baseline). Eager only: the public function adds the custom op for torch.compile."""
    tensors = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
               segsum, mimo_z, d, z)
    sig = signature(tensors, chunk_size, rotary_dim_divisor, output_dtype, impl)
    cached = None if sig is None else entry_calls.get(sig)
    if cached is not None:
        problem, plan = cached
        check_device(problem.device)
        with on_device(problem.device):
            return execute(problem, plan, prepare(dict(zip(ARG_NAMES, tensors)), problem))
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    problem = validate(*tensors, chunk_size, rotary_dim_divisor, output_dtype)
    check_device(problem.device)
    args = dict(zip(ARG_NAMES, tensors))
    kernel_pb, kernel_args, every = kernel_problem(problem, args)
    with on_device(problem.device):
        # a call that runs on its own tensors (nothing rewritten) can skip the checks next time
        outs = run(kernel_pb, kernel_args, impl, sig if kernel_args is args else None)
    if every == 1:
        return outs
    # chunks beyond the kernels' tiles ran as sub-chunks; `states` keeps the model's chunks
    return (outs[0][:, :, ::every].contiguous(),) + outs[1:]


@torch.library.custom_op("mamba3_mimo::bwd_fwd", mutates_args=())
def _bwd_fwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
                mimo_v: Tensor, mimo_o: Tensor, angles: Tensor, da_cs: Tensor,
                da_cs_rev: Tensor, dt: Tensor, trap: Tensor, segsum: Tensor,
                mimo_z: Optional[Tensor], d: Optional[Tensor], z: Optional[Tensor],
                chunk_size: int, rotary_dim_divisor: int, output_dtype: torch.dtype
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """bwd_fwd as a custom op: (states, qk_dot, dmimo [n_sums, B, H, R, P], dz or an empty
    tensor); outputs of an op may not alias each other, so dmimo_o and dmimo_z come as one."""
    states, qk_dot, dmimo_o, dmimo_z, dz = bwd_fwd(
        dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
        segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
    sums = torch.stack([dmimo_o] if dmimo_z is None else [dmimo_o, dmimo_z])
    return states, qk_dot, sums, q.new_empty(0, dtype=output_dtype) if dz is None else dz


@_bwd_fwd_op.register_fake
def _bwd_fwd_fake(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt,
                  trap, segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype):
    B, S, R, _, N = q.shape
    H, P = v.shape[2], v.shape[3]
    nc = -(-S // chunk_size)
    return (q.new_empty(B, H, nc, N, P, dtype=output_dtype),
            q.new_empty(B, H, S, R, R, dtype=output_dtype),
            q.new_empty(1 if z is None else 2, B, H, R, P, dtype=torch.float32),
            q.new_empty(0 if z is None else (B, S, H, P), dtype=output_dtype))


def mamba3_mimo_bwd_fwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor,
                        k_bias: Tensor, mimo_v: Tensor, mimo_o: Tensor, angles: Tensor,
                        da_cs: Tensor, da_cs_rev: Tensor, dt: Tensor, trap: Tensor,
                        segsum: Tensor, mimo_z: Optional[Tensor] = None,
                        d: Optional[Tensor] = None, z: Optional[Tensor] = None,
                        chunk_size: int = 16, rotary_dim_divisor: int = 4,
                        output_dtype: torch.dtype = torch.float32) -> Outputs:
    """Phase 1 of the Mamba-3 MIMO backward (SPEC sections 1-5).

    Shapes: dout, v, z [B,S,H,P]; q, k [B,S,R,G,N]; q_bias, k_bias [H,R,N]; mimo_v, mimo_o,
    mimo_z [H,R,P]; angles [B,S,H,N//rotary_dim_divisor]; da_cs, da_cs_rev, dt, trap [B,H,S];
    segsum [B,H,ceil(S/C),C,C]; d [H].

    Returns (states [B,H,nchunks,N,P], qk_dot [B,H,S,R,R], dmimo_o [B,H,R,P] fp32,
    dmimo_z [B,H,R,P] fp32 or None, dz [B,S,H,P] or None); states, qk_dot and dz are written in
    output_dtype. Raises ValueError/TypeError naming a bad argument and NotImplementedError on an
    unsupported device (CPU without TRITON_INTERPRET=1, CUDA older than sm_80) or for R > 128.
    Launches on the inputs' device; under torch.compile it is the custom op
    `mamba3_mimo::bwd_fwd`."""
    if torch.compiler.is_compiling():
        states, qk_dot, sums, dz = _bwd_fwd_op(
            dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
            segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
        has_z = z is not None
        return (states, qk_dot, sums[0], sums[1] if has_z else None, dz if has_z else None)
    return bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt,
                   trap, segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
