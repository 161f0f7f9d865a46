"""The whole differentiable operator `mamba3_mimo(...)` (SPEC section 6), upstream's signature: the
argument checks, the call's preparation (the preprocessing, step_terms' tables and the state
pass), and one autograd Function whose forward writes the output and whose backward recomputes
the states, runs the output stage's gradient and phase 2 (kernels/chunk_grads.py), then reduces the
gradients to the inputs. The output stage runs on chunk_output's tiles (bwd_fwd's kernel, in
its FORWARD and GRAD modes) where training calls the operator, MIMO_Out given and no fused
norm; on chunk_forward otherwise (the final states, the norm, the per-rank output).

Calls may start from a given state (SPEC section 7) and pack several sequences into one batch
entry (cu_seqlens: the layout of phases/packed.py). The kernels run chunks of at least a tile's
64 (step, rank) rows (configs.joined_chunk_size); the tail is padded by host-side copies.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import configs
from ..kernels import (chunk_forward, chunk_grads, chunk_output, chunk_state, preprocess,
                       step_terms)
from ..problem import Problem
from ..runtime import resources
from ..runtime.device import check_device, on_device
from ..runtime.launcher import Launch
from ..runtime.plans import CallPlan, PlanCache, placeholder
from . import packed
from .bwd_fwd import check_dims, check_tensor, one_chunk_size, pad_steps
from .packed import Packing

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- argument checks

def _check_dtype(dtype, Q) -> None:
    if dtype is not None and isinstance(Q, Tensor) and dtype != Q.dtype:
        raise TypeError(f"dtype is {dtype} but Q is {Q.dtype}")


def validate(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
             chunk_size, rotary_dim_divisor, dtype, cu_seqlens, fuse_norm, norm_weight,
             initial_state=None) -> Tuple[Problem, Optional[List[int]]]:
    """(the Problem of a call, the packed sequences' boundaries or None), or TypeError /
    ValueError naming the first bad argument; NotImplementedError for an unsupported device."""
    _check_dtype(dtype, Q)
    B, S, R, G, N, H, P, RD = check_dims(Q, V, chunk_size, rotary_dim_divisor, "Q", "V")
    cu = None if cu_seqlens is None else packed.check_cu_seqlens(cu_seqlens, B, S)
    n_states = B if cu is None else len(cu) - 1  # the states' rows: one per sequence
    if Z is not None and MIMO_Z is None:
        # MIMO_Z without Z is allowed and unused (flash-linear-attention's layer passes it so)
        raise ValueError("Z needs MIMO_Z, the gate's projection [H, R, P]")
    if fuse_norm and (MIMO_Out is None or Z is None):
        raise ValueError("fuse_pregate_headwise_rms_norm needs MIMO_Out, Z and MIMO_Z")
    if norm_weight is not None and not fuse_norm:
        raise ValueError("outproj_norm_weight is only used with fuse_pregate_headwise_rms_norm")
    dev, x16, f32 = Q.device, (Q.dtype,), (torch.float32,)
    seq, hs, hrp = (B, S, H, P), (B, H, S), (H, R, P)
    checks = [("K", K, (B, S, R, G, N), x16), ("V", V, seq, x16), ("ADT", ADT, hs, f32),
              ("DT", DT, hs, f32), ("Trap", Trap, hs, (torch.float32, Q.dtype)),
              ("Q_bias", Q_bias, (H, R, N), f32), ("K_bias", K_bias, (H, R, N), f32),
              ("MIMO_V", MIMO_V, hrp, f32), ("Angles", Angles, (B, S, H, RD), f32)]
    if Z is not None:
        checks.append(("Z", Z, seq, x16))
    if MIMO_Z is not None:
        checks.append(("MIMO_Z", MIMO_Z, hrp, f32))
    if MIMO_Out is not None:
        checks.append(("MIMO_Out", MIMO_Out, hrp, f32))
    if D is not None:
        checks.append(("D", D, (H,), f32))
    if norm_weight is not None:
        flat = isinstance(norm_weight, Tensor) and norm_weight.dim() == 1
        shape = (H * P,) if flat else (H, P)
        checks.append(("outproj_norm_weight", norm_weight, shape, f32))
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 4:
            raise TypeError("initial_state must be a tuple (angle, state, k, v), as "
                            "return_state=True returns it")
        angle0, state0, k0, v0 = initial_state
        n = n_states
        checks += [("initial_state[0] (angle)", angle0, (n, H, RD), f32),
                   ("initial_state[1] (state)", state0, (n, H, P, N), f32),
                   ("initial_state[2] (k)", k0, (n, R, H, N), f32),
                   ("initial_state[3] (v)", v0, (n, H, P), (V.dtype, torch.float32))]
    for name, x, shape, dtypes in checks:
        check_tensor(name, x, shape, dtypes, dev)
    check_device(dev)
    return Problem(B=B, S=S, H=H, G=G, N=N, P=P, R=R, C=chunk_size,
                   rotary_dim_divisor=rotary_dim_divisor, dtype=Q.dtype, has_z=Z is not None,
                   has_d=D is not None, output_dtype=torch.float32, device=dev), cu


# ---------------------------------------------------------------------------- the call

def _pad_steps(x: Optional[Tensor], dim: int, S_pad: int) -> Optional[Tensor]:
    """x with zeros appended along dim up to S_pad steps (x itself when it has them)."""
    return x if x is None or x.shape[dim] == S_pad else pad_steps(x, dim, S_pad - x.shape[dim])


def kernel_chunk(pb: Problem) -> int:
    """The chunk length the kernels run: the model's chunk_size, or for a chunk_size beyond S
    one chunk of whole kernel tiles (bwd_fwd.one_chunk_size: the same compiled kernels for
    every such S), split to whole kernel tiles (configs.kernel_chunk_size) or joined up to
    them (configs.joined_chunk_size). The outputs do not depend on it."""
    C = pb.C if pb.C <= pb.S else one_chunk_size(pb.C, pb.S, pb.R)
    return configs.joined_chunk_size(configs.kernel_chunk_size(C, pb.R), pb.R)


# the step dimension of each per-step input
SEQ_DIM = {"Q": 1, "K": 1, "V": 1, "Z": 1, "Angles": 1, "ADT": 2, "DT": 2, "Trap": 2}


def layout(pb: Problem, x: dict, cu, final_states: bool = False
           ) -> Tuple[Optional[Packing], Problem, dict]:
    """(packing, problem, inputs) of the kernels' layout of a call: the call itself, or for
    packed sequences (cu: their boundaries) one batch entry of the sequences laid out from
    chunk boundaries with a zero chunk after each (phases/packed.py). With final_states a dense
    call also gets a zero chunk after its steps: zero steps add nothing and do not decay, so
    the state entering it, which the state pass writes, is the final state."""
    if cu is None:
        if not final_states:
            return None, pb, x
        C = kernel_chunk(pb)
        lpb = dataclasses.replace(pb, S=-(-pb.S // C) * C + C, C=C)
        # the running angles sum Angles over the layout's steps; prepare pads the rest
        return None, lpb, dict(x, Angles=_pad_steps(x["Angles"], 1, lpb.S))
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    C = kernel_chunk(dataclasses.replace(pb, S=longest))
    pk = packed.packing(cu, C, pb.device)
    xl = dict(x, **{name: packed.pack(x[name], dim, pk) for name, dim in SEQ_DIM.items()
                    if x[name] is not None})
    return pk, dataclasses.replace(pb, S=pk.S_pack, C=C), xl


def _first_steps(t: Tensor, pk: Optional[Packing]) -> Tensor:
    """t [B, H, S] at each sequence's first step: [B, H], or [n_seq, H] when packed."""
    return t[..., 0] if pk is None else t[0].index_select(1, pk.firsts).T


def _last_rows(t: Tensor, pk: Optional[Packing], S: int) -> Tensor:
    """t [B, S, ...] at each sequence's last step: [B, ...], or [n_seq, ...] when packed."""
    return t[:, S - 1] if pk is None else t[0].index_select(0, pk.lasts)


def _add_last_rows(t: Tensor, val: Tensor, pk: Optional[Packing], S: int) -> None:
    """t [B, S, ...] += val at each sequence's last step (in place), val as _last_rows'."""
    if pk is None:
        t[:, S - 1] += val
    else:
        t[0].index_add_(0, pk.lasts, val.to(t.dtype))


# Cached per call layout (forgotten with the rules, configs.register_cache): building them
# replaces fields of two frozen dataclasses, about a tenth of a forward call's Python time.
@functools.lru_cache(maxsize=256)
def kernel_constants(pb: Problem) -> configs.Constants:
    """The kernels' constants of a call in its layout, one chunk per program (U = 1): the kernel
    chunk already fills a tile."""
    m = configs.constants(dataclasses.replace(pb, C=kernel_chunk(pb)))
    return dataclasses.replace(m, U=1, TPO=m.TP)


configs.register_cache(kernel_constants.cache_clear)


def prepare(pb: Problem, x: dict, pk: Optional[Packing] = None, rounded: bool = False) -> dict:
    """The kernels' view of a call in its layout, by name: kernel_inputs' and
    prepared_buffers'. `rounded`: the states in the inputs' 16-bit dtype where
    configs.out_states_suffice allows it, the chains are not cut in segments (whose join adds
    to the states in place) and the state pass is the fused scan (which needs no fp32 scratch),
    for a forward whose output stage alone reads them; env["rounded"] says whether they are."""
    env = dict(kernel_inputs(pb, x, pk), **prepared_buffers(pb, pk, states_dtype=None))
    dtype = x["Q"].dtype
    env["rounded"] = (rounded and env["segments"] is None
                      and configs.out_states_suffice(dtype, dtype)
                      and _state_config(pb, env, dtype).scan)
    env["states"] = torch.empty(pb.B, pb.H, env["m"].nc, pb.N, pb.P, device=pb.device,
                                dtype=dtype if env["rounded"] else torch.float32)
    return env


# kernel_inputs' tensors with a batch axis (the first), which a group of batch entries takes
# rows of
_BATCH_INPUTS = ("Q", "K", "V", "Z", "DT", "Trap", "ADT", "angle0", "Angles", "init")


def kernel_inputs(pb: Problem, x: dict, pk: Optional[Packing] = None) -> dict:
    """The inputs of a call in its layout as the kernels read them, by name: the sequence
    inputs padded to whole chunks and made contiguous where a kernel needs it, the small inputs
    contiguous, the state entering the first chunk ("init", or None); a packed call (pk) adds
    its chunk and step boundaries."""
    S_pad = kernel_constants(pb).S_pad
    env = {name: _pad_steps(x[name], 1, S_pad) for name in ("Q", "K", "V", "Z")}
    # chunk_output reads V, dout and z with one set of strides; chunk_forward reads z contiguous
    env["V"] = env["V"].contiguous()
    if env["Z"] is not None:
        env["Z"] = env["Z"].contiguous()
    # step_terms reads DT and Trap as contiguous [B*H, S_pad] rows
    for name in ("DT", "Trap", "ADT"):
        env[name] = _pad_steps(x[name], 2, S_pad).contiguous()
    for name in ("Q_bias", "K_bias", "MIMO_V", "MIMO_Z", "MIMO_Out", "D", "angle0"):
        env[name] = None if x[name] is None else x[name].contiguous()
    # angle_sum reads Angles with its strides (flash-linear-attention's are 0 over the heads)
    env["Angles"] = x["Angles"]
    env["init"] = _entering_state(x, pk)
    env["step_bounds"] = env["chunk_bounds"] = None
    if pk is not None:
        env["step_bounds"], env["chunk_bounds"] = pk.step_bounds, pk.chunk_bounds
    return env


def prepared_buffers(pb: Problem, pk: Optional[Packing] = None,
                     states_dtype: Optional[torch.dtype] = torch.float32) -> dict:
    """The buffers that `prepare_launches` writes (the running angles, the decay pieces,
    step_terms' tables, the states entering each chunk in states_dtype (None: left to the
    caller), and where the serial passes run in segments their segments' tables and final
    states), by name, with the kernels' constants `m` (kernel_constants)."""
    m = kernel_constants(pb)
    S_pad, B, H, S = m.S_pad, pb.B, pb.H, pb.S
    f32 = dict(device=pb.device, dtype=torch.float32)
    env = dict(m=m, angles=torch.empty(B, S_pad, H, m.RD, **f32))
    env["angles_s"] = env["angles"]  # the running sum's steps, followed by zeros up to S_pad
    if S < S_pad:
        env["angles_s"] = env["angles"][:, :S]
        env["angles"][:, S:].zero_()
    # ADT zero-padded: past S, da_cs keeps its last value and nothing decays
    env.update(da_cs=torch.empty(B, H, S_pad, **f32), da_cs_rev=torch.empty(B, H, S_pad, **f32),
               segsum=torch.empty(B, H, m.nc, m.C, m.C, **f32))
    numel, views = step_terms.table_views(m)
    buf = torch.empty(numel, **f32)
    env.update({name: buf.as_strided(size, stride, off) for name, size, stride, off in views})
    if states_dtype is not None:
        env["states"] = torch.empty(B, H, m.nc, pb.N, pb.P, device=pb.device,
                                    dtype=states_dtype)
    # the serial passes' chains: longer sequences in segments (packed.segments)
    seg = env["segments"] = (packed.segments((m.nc,), B, pb.device) if pk is None else
                             pk.segments)
    if seg is not None:  # the tensors bound by name in the plans
        env.update(seg_bounds=seg.bounds, seg_seq=seg.seq, seg_first=seg.first,
                   seg_last=seg.last, finals=torch.empty(seg.n_segs, B, H, pb.N, pb.P, **f32))
    return env


def prepare_launches(pb: Problem, env: dict) -> list:
    """The launches that fill `prepare`'s buffers: the running angles, the decay pieces,
    step_terms' tables, then the state pass in the config its shared-memory probe picks."""
    m = env["m"]
    tables = {name: env[name] for name in ("terms", "cos", "sin")}
    launches = [
        preprocess.angle_sum_launch(angles_raw=env["Angles"], dt=env["DT"],
                                    angles=env["angles_s"], angle0=env["angle0"],
                                    bounds=env["step_bounds"]),
        preprocess.decay_pieces_launch(adt=env["ADT"], da_cs=env["da_cs"],
                                       da_cs_rev=env["da_cs_rev"], segsum=env["segsum"],
                                       chunk_size=m.C),
        step_terms.launch(angles=env["angles"], da_cs=env["da_cs"], da_cs_rev=env["da_cs_rev"],
                          dt=env["DT"], trap=env["Trap"], consts=m, **tables)]
    state_args = _state_args(env, env["states"])
    cfg = _state_config(pb, env, env["states"].dtype)
    seg = env["segments"]
    if seg is None or not cfg.scan:
        return launches + chunk_state.launches(**state_args, cfg=cfg, init=env["init"],
                                               bounds=env["chunk_bounds"])
    # sequences longer than the segments: the scan over the segments from zero, then joined
    return launches + chunk_state.launches(**state_args, cfg=cfg, bounds=seg.bounds,
                                           finals=env["finals"]) + [
        chunk_state.join_launch(states=env["states"], finals=env["finals"], da_cs=env["da_cs"],
                                segments=seg, init=env["init"], consts=m)]


def _state_args(env: dict, states: Tensor) -> dict:
    """The state pass's arguments (chunk_state.launches) but cfg, init and bounds, into
    `states`: 16-bit states take no fp32 scratch (the fused scan only)."""
    m = env["m"]
    rounded = states.dtype != torch.float32
    return dict(k=env["K"], v=env["V"], k_bias=env["K_bias"], mimo_v=env["MIMO_V"],
                da_cs=env["da_cs"], terms=env["terms"], cos=env["cos"], sin=env["sin"],
                states=states, inc=placeholder(states.device) if rounded else states,
                consts=dataclasses.replace(m, OUT_STATES=True) if rounded else m)


def _state_config(pb: Problem, env: dict, dtype: torch.dtype) -> configs.StateConfig:
    """The state pass's config of a prepared call with states of `dtype`, as the shared-memory
    probe picks it (on a stand-in of the states: the same config for fp32 and 16-bit states,
    cached per model; here too, before the candidates are listed, which took a tenth of a
    forward's host time)."""
    m = env["m"]
    key = ("operator_state", pb.N, pb.P, pb.R, m.C, pb.RD, pb.dtype)
    cfg = _state_configs.get((key, pb.device))
    if cfg is None:
        kpb = dataclasses.replace(pb, C=m.C)
        cfg = _state_configs[(key, pb.device)] = resources.choose(
            key, configs.state_candidates(kpb),
            lambda cfg: chunk_state.launches(
                **_state_args(env, placeholder(pb.device).to(dtype)), cfg=cfg)[0], pb.device)
    return cfg


_state_configs: Dict[tuple, configs.StateConfig] = {}
configs.register_cache(_state_configs.clear)


# Call plans of the operator's launch groups (runtime/plans.py), per (group, the Problem in the
# kernels' layout, the call's flags, the strides of the inputs that the kernels read with their
# strides, and for packed sequences their boundaries): every other tensor is contiguous or
# allocated here, so the launches' integer arguments follow from the key.
_plans: PlanCache[CallPlan] = PlanCache()
# Packed calls' plans apart: a training loop whose boundaries change at every step would
# otherwise fill and clear the dense calls' cache (the layers of one step share theirs).
_packed_plans: PlanCache[CallPlan] = PlanCache(limit=64)
_STRIDED = ("Q", "K", "V", "Z", "DT", "Trap", "ADT", "Angles", "dout")


class PlanKey(NamedTuple):
    """What a launch group's plan depends on besides its tensors' values."""
    group: str
    problem: Problem
    flags: tuple
    absent: tuple  # the names bound to None
    boundaries: Optional[tuple]  # packed sequences' cu_seqlens
    strides: tuple  # those of _STRIDED, None where absent


def plan_key(group: str, pb: Problem, x: dict, env: dict, *flags) -> Optional[PlanKey]:
    """The key of a launch group's plan (None: not cached, for a tensor given as two arguments,
    which a plan would bind from one name). Packed calls add their boundaries, which fix the
    layout's tables and sizes."""
    if x["aliased"]:
        return None
    # The absent tensors too: a plan built with an optional input present (MIMO_Z without Z,
    # say) binds its name, which a call without it could not fill.
    absent = tuple([name for name, value in env.items() if value is None])
    cu = None if x["cu"] is None else tuple(x["cu"])
    strides = tuple([None if env.get(n) is None else env[n].stride() for n in _STRIDED])
    return PlanKey(group, pb, flags, absent, cu, strides)


def launch_all(key: Optional[PlanKey], env: dict, build: Callable[[], list],
               device: torch.device) -> None:
    """Run the launches that build() describes, whose tensor arguments are env's (by name) or
    the device's placeholder, through the call plan kept under key (built from them when it is
    missing or key is None)."""
    plans = _plans if key is None or key.boundaries is None else _packed_plans
    plan = None if key is None else plans.get(key)
    if plan is None:
        plan = CallPlan.build(None, build(), env, placeholder(device))
        if key is not None:
            plans.put(key, plan)
    plan.launch(env)


def _previous_step(x: dict, pk: Optional[Packing]) -> Tuple[Tensor, Tensor, Tensor]:
    """(s, X [., H, N, P], PsiV_prev [., H, R, P]) of a call with an initial state, per batch
    entry or sequence: the previous step's shifted term enters step 0 as s X,
    s = DT[0] sigmoid(-Trap[0]) and X = sum_r k0[r] (x) PsiV_prev[r], PsiV_prev[r] =
    v0 MIMO_V[h, r] (SPEC section 7)."""
    s = _first_steps(x["DT"], pk) * torch.sigmoid(-_first_steps(x["Trap"], pk).float())
    return (s, *shifted_term(x["k0"], x["v0"], x["MIMO_V"]))


def shifted_term(k0: Tensor, v0: Tensor, MIMO_V: Tensor) -> Tuple[Tensor, Tensor]:
    """(X [., H, N, P], PsiV_prev [., H, R, P]) of a previous step's k0 [., R, H, N] (rotated)
    and v0 [., H, P]: X = sum_r k0[r] (x) v0 MIMO_V[h, r], the term a state continued from that
    step takes at its next step, weighted by DT sigmoid(-Trap) (SPEC section 7)."""
    psiv = v0.float()[:, :, None, :] * MIMO_V[None]
    return torch.einsum("brhn,bhrp->bhnp", k0, psiv), psiv


def _entering_state(x: dict, pk: Optional[Packing]) -> Optional[Tensor]:
    """The state entering each sequence's first chunk [B or n_seq, H, N, P] fp32: the given
    state (read as [N, P]) plus the previous step's shifted term, before step 0's decay; None
    without initial_state (the state pass starts from zero)."""
    if x["state0"] is None:
        return None
    s, X, _ = _previous_step(x, pk)
    return (x["state0"].transpose(-1, -2) + s[..., None, None] * X).contiguous()


def _initial_state_grads(x: dict, pk: Optional[Packing], d_entering: Tensor, d_angle0: Tensor,
                         grads: dict) -> None:
    """The gradients of the four initial-state tensors into grads, and their shares of d DT,
    d Trap (at each sequence's first step, in the kernels' layout) and d MIMO_V added there,
    from d_entering [., H, N, P] (the reverse scan's gradient of the state entering each
    sequence's first chunk) and d_angle0 [., H, RD]."""
    s, X, psiv = _previous_step(x, pk)
    d_s = (d_entering * X).sum((-1, -2))
    sig = torch.sigmoid(-_first_steps(x["Trap"], pk).float())  # sigmoid(-Trap[0])
    d_dt0 = sig * d_s
    d_trap0 = -_first_steps(x["DT"], pk) * sig * (1 - sig) * d_s
    for name, val in (("DT", d_dt0), ("Trap", d_trap0)):
        if pk is None:
            grads[name][..., 0] += val
        else:
            grads[name][0].index_add_(1, pk.firsts, val.T)
    d_x = s[..., None, None] * d_entering  # of X
    d_psiv = torch.einsum("brhn,bhnp->bhrp", x["k0"], d_x)
    grads["MIMO_V"] += (d_psiv * x["v0"].float()[:, :, None, :]).sum(0)
    grads.update(angle0=d_angle0, state0=d_entering.transpose(-1, -2),
                 k0=torch.einsum("bhnp,bhrp->brhn", d_x, psiv),
                 v0=(d_psiv * x["MIMO_V"][None]).sum(2))


def tiled_output(x: dict) -> bool:
    """Whether the output stage runs on chunk_output's tiles (MIMO_Out given, no fused norm)
    rather than chunk_forward's (which also has the per-rank output and the norm)."""
    return x["MIMO_Out"] is not None and not x["fuse_norm"]


# the output stage's outputs that both of its kernels take (chunk_forward's dy and part_w are
# passed apart); those a mode does not write are the placeholder
_OUTPUT_STAGE = ("out", "dout", "dz", "part_o", "part_z")


def output_launch(pb: Problem, x: dict, env: dict, tiled: bool, grad: bool) -> Launch:
    """The output stage's launch on a prepared call: without `grad` the forward (out), with it
    the gradient (dz, the partial sums part_o, part_z, part_w, given dout; and on chunk_forward
    dy = d raw_y, which phase 2 recomputes from dout and z after chunk_output's tiles); on
    chunk_output's tiles with `tiled` (in the config its shared-memory probe picks), else on
    chunk_forward."""
    m, stand = env["m"], placeholder(pb.device)
    opt = lambda name: stand if env.get(name) is None else env[name]  # noqa: E731
    common = dict(q=env["Q"], k=env["K"], v=env["V"], z=opt("Z"), q_bias=env["Q_bias"],
                  k_bias=env["K_bias"], mimo_v=env["MIMO_V"], mimo_o=opt("MIMO_Out"),
                  mimo_z=opt("MIMO_Z"), d=opt("D"), terms=env["terms"], cos=env["cos"],
                  sin=env["sin"], segsum=env["segsum"], states=env["states"], consts=m,
                  **{name: opt(name) for name in _OUTPUT_STAGE})
    if not tiled:
        return chunk_forward.launch(**common, dy=opt("dy"), norm_w=opt("norm_w"),
                                    part_w=opt("part_w"),
                                    eps=x["eps"], has_z=pb.has_z, has_d=pb.has_d,
                                    has_out=x["MIMO_Out"] is not None, norm=x["fuse_norm"],
                                    grad=grad)
    kpb = dataclasses.replace(pb, C=m.C)
    key = ("operator_output", grad, pb.N, pb.P, pb.R, m.C, m.U, m.RD, pb.dtype, pb.has_z,
           pb.has_d)
    cfg = resources.choose(key, configs.output_candidates(kpb),
                           lambda cfg: chunk_output.operator_launch(**common, grad=grad, cfg=cfg),
                           pb.device)
    return chunk_output.operator_launch(**common, grad=grad, cfg=cfg)


def _norm_weight(pb: Problem, x: dict) -> Optional[Tensor]:
    """chunk_forward's norm weight [H*P] fp32 of a call with the fused norm (ones for None),
    else None."""
    if not x["fuse_norm"]:
        return None
    w = x["norm_weight"]
    if w is None:
        return torch.ones(pb.H * pb.P, device=pb.device, dtype=torch.float32)
    return w.reshape(pb.H * pb.P).contiguous()


def _rotate(x: Tensor, angle: Tensor, inverse: bool = False) -> Tensor:
    """x [B, R, H, N] rotated on its first RD pairs (n, N/2 + n) by angle [B, H, RD] (rotate-half,
    SPEC section 2), or by -angle with `inverse` (the transpose: a gradient rotated back)."""
    half, RD = x.shape[-1] // 2, angle.shape[-1]
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]  # [B, 1, H, RD]
    if inverse:
        sin = -sin
    out = x.clone()
    x1, x2 = x[..., :RD], x[..., half:half + RD]
    out[..., :RD] = cos * x1 - sin * x2
    out[..., half:half + RD] = sin * x1 + cos * x2
    return out


def _final_k(pb: Problem, k_last: Tensor, k_bias: Tensor, angle: Tensor) -> Tensor:
    """kr of the last step [., R, H, N] fp32 from K's last step k_last [., R, G, N]: K + K_bias
    of each value head, rotated by the last angle [., H, RD]."""
    kb = k_last.float().repeat_interleave(pb.H // pb.G, dim=2) + k_bias.transpose(0, 1)
    return _rotate(kb, angle)


TENSOR_ARGS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
               "MIMO_Out", "Angles", "D", "Z", "norm_weight", "angle0", "state0", "k0", "v0")


def _forward(pb: Problem, x: dict, with_states: bool = True,
             with_out: bool = True) -> Tuple[Tensor, ...]:
    """(out, final_angle, final_state, final_k, final_v) of a validated call, the final states
    per batch entry or per sequence when packed; (out,) alone without `with_states` (the final
    states' few small ops are a visible share of a small shape's host time); the four final
    states alone without `with_out` (no output stage: a slice's summary, context_parallel)."""
    pk, lpb, xl = layout(pb, x, x["cu"], final_states=with_states)
    tiled = tiled_output(x)
    # chunk_output's tiles alone read the states of a forward without final states: in 16 bits
    env = prepare(lpb, xl, pk, rounded=tiled and not with_states)
    m = env["m"]
    if with_out:
        ranks = () if x["MIMO_Out"] is not None else (pb.R,)
        env["out"] = torch.empty(lpb.B, m.S_pad, *ranks, pb.H, pb.P, device=pb.device,
                                 dtype=x["Q"].dtype)
        if not tiled:
            env["norm_w"] = _norm_weight(pb, x)
        launch_all(plan_key("forward", lpb, x, env, tiled, x["fuse_norm"], x["eps"],
                            env["rounded"]), env,
                   lambda: prepare_launches(lpb, env) + [output_launch(lpb, x, env, tiled,
                                                                       False)],
                   pb.device)
        out = env["out"]
        out = out[:, :pb.S] if pk is None else packed.unpack(out, 1, pk)
        if not with_states:
            return (out.contiguous(),)
    else:
        launch_all(plan_key("states", lpb, x, env), env, lambda: prepare_launches(lpb, env),
                   pb.device)
    angle = _last_rows(env["angles"], pk, pb.S).clone()  # [., H, RD]
    # the final states enter the pad chunks (layout): [., H, N, P] -> [., H, P, N]
    final_state = (env["states"][:, :, -1] if pk is None else
                   env["states"][0].index_select(1, pk.pad_chunks).transpose(0, 1))
    k_last = _last_rows(xl["K"], pk, pb.S)
    states = (angle, final_state.transpose(-1, -2).contiguous(),
              _final_k(pb, k_last, x["K_bias"], angle), _last_rows(xl["V"], pk, pb.S).clone())
    return (out.contiguous(), *states) if with_out else states


def call_inputs(opts: dict, tensors: tuple) -> dict:
    """A call's arguments by name: opts, the tensors by TENSOR_ARGS' names, and "aliased": True
    when one tensor is given as two arguments."""
    given = [id(t) for t in tensors if t is not None]
    return dict(opts, **dict(zip(TENSOR_ARGS, tensors)), aliased=len(set(given)) < len(given))


class Mamba3Mimo(torch.autograd.Function):
    """out (and the final states) from the raw inputs; the backward recomputes what it needs
    from the inputs, which is all that is saved. opts["with_out"] False: the four final states
    alone (a slice's summary in context_parallel), with no output stage in the forward and no
    output gradient in the backward, whose second phase then drops dy's terms (chunk_grads'
    NO_DY)."""

    @staticmethod
    def forward(ctx, pb: Problem, opts: dict, *tensors):
        x = call_inputs(opts, tensors)
        outs = _forward(pb, x, opts["return_state"], opts["with_out"])
        ctx.pb, ctx.opts = pb, opts
        ctx.save_for_backward(*tensors)
        return outs if opts["return_state"] else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        x = call_inputs(ctx.opts, ctx.saved_tensors)
        d_out, d_states = (grads[0], grads[1:]) if ctx.opts["with_out"] else (None, grads)
        with on_device(ctx.pb.device):
            return (None, None) + _backward(ctx.pb, x, d_out, d_states)


# ---------------------------------------------------------------------------- torch.compile
# Under torch.compile the operator is a pair of torch.library custom ops with fake (meta)
# implementations and a registered autograd formula, so that Dynamo keeps it in the graph. The
# ops always return the four final states (cheap next to the output); an absent gradient is an
# empty tensor in the backward op's outputs (an op's outputs cannot be None).

def _problem(t: dict, cu_seqlens, chunk_size: int, rotary_dim_divisor: int, fuse_norm: bool):
    init = None if t["state0"] is None else (t["angle0"], t["state0"], t["k0"], t["v0"])
    return validate(t["Q"], t["K"], t["V"], t["ADT"], t["DT"], t["Trap"], t["Q_bias"],
                    t["K_bias"], t["MIMO_V"], t["MIMO_Z"], t["MIMO_Out"], t["Angles"], t["D"],
                    t["Z"], chunk_size, rotary_dim_divisor, None, cu_seqlens, fuse_norm,
                    t["norm_weight"], init)


@torch.library.custom_op("mamba3_mimo::operator_fwd", mutates_args=())
def _fwd_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor,
            Q_bias: Tensor, K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor],
            MIMO_Out: Optional[Tensor], Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
            norm_weight: Optional[Tensor], angle0: Optional[Tensor], state0: Optional[Tensor],
            k0: Optional[Tensor], v0: Optional[Tensor], cu_seqlens: Optional[Tensor],
            chunk_size: int, rotary_dim_divisor: int, fuse_norm: bool,
            eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    t = call_inputs(dict(fuse_norm=fuse_norm, eps=eps),
                    (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D,
                     Z, norm_weight, angle0, state0, k0, v0))
    pb, t["cu"] = _problem(t, cu_seqlens, chunk_size, rotary_dim_divisor, fuse_norm)
    with on_device(pb.device):
        return _forward(pb, t)


@_fwd_op.register_fake
def _fwd_fake(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
              norm_weight, angle0, state0, k0, v0, cu_seqlens, chunk_size, rotary_dim_divisor,
              fuse_norm, eps):
    B, S, R, _, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # the states' rows
    ranks = () if MIMO_Out is not None else (R,)
    f32 = torch.float32
    return (Q.new_empty(B, S, *ranks, H, P), Q.new_empty(n, H, Angles.shape[-1], dtype=f32),
            Q.new_empty(n, H, P, N, dtype=f32), Q.new_empty(n, R, H, N, dtype=f32),
            V.new_empty(n, H, P))


@torch.library.custom_op("mamba3_mimo::operator_bwd", mutates_args=())
def _bwd_op(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor,
            Q_bias: Tensor, K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor],
            MIMO_Out: Optional[Tensor], Angles: Tensor, D: Optional[Tensor], Z: Optional[Tensor],
            norm_weight: Optional[Tensor], angle0: Optional[Tensor], state0: Optional[Tensor],
            k0: Optional[Tensor], v0: Optional[Tensor], d_out: Tensor, d_angle: Optional[Tensor],
            d_state: Optional[Tensor], d_k: Optional[Tensor], d_v: Optional[Tensor],
            cu_seqlens: Optional[Tensor], chunk_size: int, rotary_dim_divisor: int,
            fuse_norm: bool, eps: float) -> List[Tensor]:
    t = call_inputs(dict(fuse_norm=fuse_norm, eps=eps),
                    (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D,
                     Z, norm_weight, angle0, state0, k0, v0))
    pb, t["cu"] = _problem(t, cu_seqlens, chunk_size, rotary_dim_divisor, fuse_norm)
    with on_device(pb.device):
        grads = _backward(pb, t, d_out,
                          (d_angle, d_state, d_k, d_v))
    return [Q.new_empty(0) if g is None else g.contiguous() for g in grads]


@_bwd_op.register_fake
def _bwd_fake(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
              norm_weight, angle0, state0, k0, v0, d_out, d_angle, d_state, d_k, d_v,
              cu_seqlens, chunk_size, rotary_dim_divisor, fuse_norm, eps):
    inputs = (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
              norm_weight, angle0, state0, k0, v0)
    return [Q.new_empty(0) if x is None else x.new_empty(x.shape) for x in inputs]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:len(TENSOR_ARGS)])
    ctx.scalars = inputs[len(TENSOR_ARGS):]


def _op_backward(ctx, d_out, d_angle, d_state, d_k, d_v):
    grads = _bwd_op(*ctx.saved_tensors, d_out, d_angle, d_state, d_k, d_v, *ctx.scalars)
    tensors = ctx.saved_tensors
    return tuple(None if x is None or not ctx.needs_input_grad[i] else g
                 for i, (x, g) in enumerate(zip(tensors, grads))) + (None,) * len(ctx.scalars)


_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _sum_in_order(parts: List[dict]) -> dict:
    """The sums of the groups' partial sums, name by name, added in the groups' order (the same
    order at every call: deterministic)."""
    total = dict(parts[0])
    for part in parts[1:]:
        for name, val in part.items():
            total[name] = total[name] + val
    return total


def _backward(pb: Problem, x: dict, d_out: Optional[Tensor], d_states: tuple) -> tuple:
    """The gradients of the tensor inputs, TENSOR_ARGS' order (None for an absent one). The
    output stage's gradient and phase 2 run per group of batch entries (configs.backward_group),
    on buffers of one group's size that the groups reuse; the rest runs once. d_out None: a call
    without its output (Mamba3Mimo's with_out), the gradients from the final states' alone: no
    output stage, phase 2 without dy's terms, None for the inputs that reach the output only."""
    pk, lpb, xl = layout(pb, x, x["cu"])
    # a plan built with dout as one of the inputs would bind them from one name
    x = dict(x, no_dy=d_out is None, aliased=x["aliased"] or (
        d_out is not None and any(d_out is xl[n] for n in SEQ_DIM if xl[n] is not None)))
    m = kernel_constants(lpb)
    B, L, H, G, N, P, R = lpb.B, lpb.S, pb.H, pb.G, pb.N, pb.P, pb.R  # L: the layout's steps
    S_pad, dev = m.S_pad, pb.device
    f32 = dict(device=dev, dtype=torch.float32)
    # the gradients of the final angle, state, k and v (None where unused)
    d_angle_end, d_state, d_k, d_v = (d_states + (None,) * 4)[:4]
    if pk is None:
        dout = None if d_out is None else _pad_steps(d_out.contiguous(), 1, S_pad)
        d_final, d_ends = None if d_state is None else d_state.transpose(-1, -2), None
    else:
        dout = None if d_out is None else packed.pack(d_out, 1, pk)
        d_ends = (torch.zeros(pk.n_seq, H, N, P, **f32) if d_state is None
                  else d_state.transpose(-1, -2).contiguous())
        d_final = d_ends[-1:]  # the last sequence's, where the reverse scan starts
    # The gradients with a step axis, written group by group. dQ, dK, dV and dZ in their inputs'
    # dtype: the kernels round each element once, as a cast would, and the fp32 buffers never
    # exist; but dK and dV in fp32 where the final k's (v's) gradient joins them at the last step.
    x16 = x["Q"].dtype
    steps = chunk_grads.step_buffers(m, dev, dq_dtype=x16,
                                     dk_dtype=x16 if d_k is None else torch.float32,
                                     dv_dtype=x16 if d_v is None else torch.float32)
    if pb.has_z and not x["no_dy"]:
        steps["dz"] = torch.empty(B, S_pad, H, P, device=dev, dtype=x["Z"].dtype)
    inputs = kernel_inputs(lpb, xl, pk)
    # per batch entry: the states entering each chunk and their gradients, and dy where
    # chunk_forward writes it (fp32)
    entry_bytes = 4 * H * N * P * (2 * m.nc + 1)
    if not tiled_output(x) and not x["no_dy"]:
        entry_bytes += 4 * S_pad * R * H * P
    group = configs.backward_group(B, entry_bytes)
    # every group's rows of the tensors with a batch axis, one split each (split_with_sizes:
    # half the host time of split)
    sizes = [group] * (B // group) + ([B % group] if B % group else [])
    rows = {name: (t,) if len(sizes) == 1 else t.split_with_sizes(sizes)
            for name, t in dict(inputs, **steps, dout=dout, d_final=d_final).items()
            if t is not None and (name not in inputs or name in _BATCH_INPUTS)}
    gpb, buffers, key, sums, angle, d_entering = None, None, None, [], [], []
    for i, n in enumerate(sizes):
        if gpb is None or gpb.B != n:  # the first group, or a last, smaller one
            if buffers is not None:  # the larger groups' sums first
                sums.append(_parameter_sums(x, buffers))
            buffers = key = None  # released before the next group's are allocated
            gpb = dataclasses.replace(lpb, B=n)
            buffers = _group_buffers(gpb, x, pk)
        env = dict(buffers, **inputs)
        env.update({name: t[i] for name, t in rows.items()})
        part, key = _group_grads(gpb, x, pk, env, env.pop("d_final", None), d_ends,
                                 d_k is not None, key)
        angle.append(part["angle"])
        d_entering.append(part["d_entering"])
    sums.append(_parameter_sums(x, buffers))
    del buffers, env
    grads = _sum_in_order(sums)
    angle = None if d_k is None else torch.cat(angle)
    d_entering = None if x["state0"] is None else torch.cat(d_entering)
    # the angles' backward writes d Angles with the strides it reads Angles with
    angle_in = dict(angles_raw=inputs["Angles"].contiguous(), dt=inputs["DT"],
                    trap=inputs["Trap"], bounds=inputs["step_bounds"])
    del inputs
    dK, d_angles = steps["dk"][:, :L], steps["d_angles"][:, :L]
    if d_k is not None:
        # final_k = rot(K + K_bias) at the last step, per value head: its gradient rotated back
        # joins dK (summed over a group's heads) and K_bias's; the angle's share as in
        # chunk_grads
        kr, d_k = _final_k(pb, _last_rows(xl["K"], pk, L), x["K_bias"], angle), d_k.float()
        back = _rotate(d_k, angle, inverse=True)
        _add_last_rows(dK, back.view(-1, R, G, H // G, N).sum(3), pk, L)
        grads["K_bias"] = grads["K_bias"] + back.sum(0).transpose(0, 1)
        RD, half = angle.shape[-1], N // 2
        _add_last_rows(d_angles, (d_k[..., half:half + RD] * kr[..., :RD]
                                  - d_k[..., :RD] * kr[..., half:half + RD]).sum(1), pk, L)
    if d_angle_end is not None:
        _add_last_rows(d_angles, d_angle_end, pk, L)
    # the angles' backward, which also takes DT's and Trap's gradients through gamma and
    # trap_scale, reads d_angles with the strides of the [B, S_pad, H, RD] buffer and the
    # per-step terms with those of the padded DT
    angle_env = dict(angle_in, d_angles=d_angles, d_raw=torch.empty(B, L, H, m.RD, **f32),
                     d_dt=torch.empty(B, H, S_pad, **f32),
                     d_angle0=torch.empty(B if pk is None else pk.n_seq, H, m.RD, **f32),
                     d_gamma=steps["d_gamma"], d_trap_scale=steps["d_trap_scale"],
                     d_trap=torch.empty(B, H, S_pad, **f32))
    launch_all(plan_key("angles_grad", lpb, x, angle_env), angle_env,
               lambda: [preprocess.angle_sum_backward_launch(**angle_env)], dev)
    d_raw_angles, d_angle0 = angle_env["d_raw"], angle_env["d_angle0"]
    d_dt, d_trap = angle_env["d_dt"][..., :L], angle_env["d_trap"][..., :L]
    dV = steps["dv"][:, :L]
    if d_v is not None:
        _add_last_rows(dV, d_v, pk, L)
    grads.update(Q=steps["dq"][:, :L], K=dK, V=dV, ADT=steps["d_adt"][..., :L], DT=d_dt,
                 Trap=d_trap, Angles=d_raw_angles)
    if "dz" in steps:
        grads["Z"] = steps["dz"][:, :L]
    elif x["MIMO_Z"] is not None and not pb.has_z:  # given without Z: unused
        grads["MIMO_Z"] = torch.zeros_like(x["MIMO_Z"])
    if d_entering is not None:
        # the reverse scan's gradient of the state entering each sequence's first chunk
        _initial_state_grads(xl, pk, d_entering, d_angle0, grads)
    if pk is not None:  # back from the packed layout to the given steps
        for name, dim in SEQ_DIM.items():
            if name in grads:
                grads[name] = packed.unpack(grads[name], dim, pk)
    out = []
    for name in TENSOR_ARGS:
        t = x[name]
        g = grads.get(name) if t is not None else None
        out.append(g if g is None or g.dtype == t.dtype else g.to(t.dtype))
    return tuple(out)


def _group_buffers(pb: Problem, x: dict, pk: Optional[Packing]) -> dict:
    """The buffers of the output stage's gradient and phase 2 for a group of pb.B batch entries
    (prepared_buffers', chunk_grads.chunk_buffers' with a zero final-state gradient, the output
    stage's partial sums, and dy where chunk_forward runs the output stage), which every group
    of that size reuses, the per-chunk partial sums accumulating over the groups."""
    env = prepared_buffers(pb, pk)
    m = env["m"]
    B, H, P, R, nc = pb.B, pb.H, pb.P, pb.R, m.nc
    f32 = dict(device=pb.device, dtype=torch.float32)
    if not x["no_dy"]:  # the output stage's gradient's (none without an output gradient)
        if not tiled_output(x):  # after chunk_output's tiles, phase 2 recomputes dy
            env["dy"] = torch.empty(B, m.S_pad, R, H, P, **f32)
            env["norm_w"] = _norm_weight(pb, x)
        # the output stage's per-chunk partial sums of the norm weight's, MIMO_Z's and
        # MIMO_Out's gradients, zero: the groups add theirs
        if x["fuse_norm"]:
            env["part_w"] = torch.zeros(B * H, nc, P, **f32)
        if pb.has_z:
            env["part_z"] = torch.zeros(B * H, nc, R, P, **f32)
        if x["MIMO_Out"] is not None:
            env["part_o"] = torch.zeros(B * H, nc, R, P, **f32)
    env.update(chunk_grads.chunk_buffers(m, pb.device))
    seg = env["segments"]
    env["d_ends"] = None if seg is None else torch.zeros(seg.n_segs, B, H, pb.N, P, **f32)
    return env


def _group_grads(pb: Problem, x: dict, pk: Optional[Packing], env: dict,
                 d_final: Optional[Tensor], d_ends: Optional[Tensor], with_angle: bool,
                 key: Optional[PlanKey] = None) -> Tuple[dict, Optional[PlanKey]]:
    """The output stage's gradient and phase 2 for one group of batch entries, as one launch
    group (pb: its Problem in the kernels' layout; x: the call's flags; env: _group_buffers',
    the group's rows of kernel_inputs', of dout and of the gradients with a step axis, which it
    writes; d_final: its rows of the final states' gradient, d_ends: a packed call's per
    sequence); the kernels add its share to the parameters' per-chunk partial sums. Returns its
    rows of the last step's running angle ("angle", with_angle) and of the gradient of the
    state entering the first chunk ("d_entering", with an initial state), with the key of its
    launch group's plan, which the groups of the same size share (given as `key`: not built
    again)."""
    B, H, N, P, nc = pb.B, pb.H, pb.N, pb.P, env["m"].nc
    # the reverse scan starts from the final states' gradient (zero in the buffers as made);
    # over segments, from each sequence's in its last segment
    if d_final is not None:
        env["dstates"][:, :, nc] = d_final
    seg = env["segments"]
    if seg is None:
        env["d_ends"] = d_ends  # a packed call's, per sequence (None for a dense call)
    elif pk is not None or d_final is not None:
        src = d_ends if pk is not None else d_final.reshape(1, B, H, N, P)
        env["d_ends"].view(seg.n_segs, -1).index_copy_(0, seg.ends, src.reshape(len(src), -1))
    tiled = tiled_output(x)
    if key is None:
        key = plan_key("backward", pb, x, env, tiled, x["fuse_norm"], x["eps"], x["no_dy"])
    launch_all(key, env, lambda: _group_launches(pb, x, env, tiled), pb.device)
    # of the running angles only the last step's is read below (the kernels read cos and sin)
    out = dict(angle=_last_rows(env["angles"], pk, pb.S).clone() if with_angle else None,
               d_entering=None)
    # of the states' gradients only those entering each sequence's first chunk are kept
    if x["state0"] is not None:
        dstates = env["dstates"]
        out["d_entering"] = (dstates[:, :, 0].clone() if pk is None else
                             dstates[0].index_select(1, pk.firsts // pk.C).transpose(0, 1))
    return out, key


def _parameter_sums(x: dict, env: dict) -> dict:
    """The parameters' gradients from the per-chunk partial sums that the groups on env's
    buffers accumulated, by input name: summed over the entries of a group and the chunks."""
    m = env["m"]
    B, H, R, P, nc = m.B, m.H, m.R, m.P, m.nc
    sums = dict(Q_bias=env["part_qb"].sum((0, 1)), K_bias=env["part_kb"].sum((0, 1)),
                MIMO_V=env["part_psi"].view(B, H, nc, R, P).sum((0, 2)))
    for name, part in (("MIMO_Z", "part_z"), ("MIMO_Out", "part_o")):
        if part in env:
            sums[name] = env[part].view(B, H, nc, R, P).sum((0, 2))
    if "part_w" in env and x["norm_weight"] is not None:
        sums["norm_weight"] = env["part_w"].view(B, H, nc, P).sum((0, 2)).reshape(
            x["norm_weight"].shape)
    if m.HAS_D:
        sums["D"] = env["part_d"].view(B, H, nc).sum((0, 2))
    return sums


def _group_launches(pb: Problem, x: dict, env: dict, tiled: bool) -> list:
    """A group's launches: the preparation (prepare_launches), the output stage's gradient and
    phase 2 (chunk_grads.launches, dy recomputed after chunk_output's tiles); without an output
    gradient (no_dy) no output stage, phase 2 without dy."""
    stand = placeholder(pb.device)
    gate = None
    if tiled and not x["no_dy"]:
        gate = (env["dout"], env["Z"], env["MIMO_Out"], env["MIMO_Z"] if pb.has_z else None)
    output = [] if x["no_dy"] else [output_launch(pb, x, env, tiled, True)]
    return prepare_launches(pb, env) + output + \
        chunk_grads.launches(
            q=env["Q"], k=env["K"], v=env["V"], q_bias=env["Q_bias"], k_bias=env["K_bias"],
            mimo_v=env["MIMO_V"], d=stand if env["D"] is None else env["D"],
            terms=env["terms"], cos=env["cos"], sin=env["sin"], da_cs=env["da_cs"],
            da_cs_rev=env["da_cs_rev"], segsum=env["segsum"], dy=env.get("dy"),
            states=env["states"], consts=env["m"], precision=env["m"].PREC,
            bounds=env["chunk_bounds"], d_ends=env["d_ends"], segments=env["segments"],
            finals=env.get("finals"), gate=gate, no_dy=x["no_dy"],
            **{name: env[name] for name in _PHASE_2_BUFFERS})


# the buffers that phase 2 writes (chunk_grads.launches' outputs and scratch)
_PHASE_2_BUFFERS = ("dq", "dk", "dv", "d_angles", "d_gamma", "d_trap_scale", "d_adt", "part_qb",
                    "part_kb", "part_psi", "part_d", "dstates", "part_cs", "part_carried")


def mamba3_mimo(Q: Tensor, K: Tensor, V: Tensor, ADT: Tensor, DT: Tensor, Trap: Tensor,
                Q_bias: Tensor, K_bias: Tensor, MIMO_V: Tensor, MIMO_Z: Optional[Tensor],
                MIMO_Out: Optional[Tensor], Angles: Tensor, D: Optional[Tensor],
                Z: Optional[Tensor], chunk_size: int, rotary_dim_divisor: int,
                dtype: torch.dtype, return_state: bool = False,
                cu_seqlens: Optional[Tensor] = None,
                fuse_pregate_headwise_rms_norm: bool = False,
                outproj_norm_weight: Optional[Tensor] = None,
                outproj_norm_eps: float = 1e-5,
                initial_state: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None,
                context_parallel_group=None):
    """The Mamba-3 MIMO operator (SPEC section 6), upstream's signature and argument order, plus
    `initial_state` (SPEC section 7) and `context_parallel_group`.

    Shapes: Q, K [B, S, R, G, N]; V, Z [B, S, H, P]; ADT, DT, Trap [B, H, S]; Q_bias, K_bias
    [H, R, N]; MIMO_V, MIMO_Z, MIMO_Out [H, R, P]; Angles [B, S, H, N // rotary_dim_divisor];
    D [H]; outproj_norm_weight [H, P] or [H * P]. Returns out [B, S, H, P] in Q's dtype
    ([B, S, R, H, P] without MIMO_Out), and with return_state=True also final_angle [B, H, RD],
    final_state [B, H, P, N], final_k [B, R, H, N] (fp32) and final_v [B, H, P]; every output
    is differentiable. initial_state: None (a zero state) or what return_state=True returns,
    (angle [B, H, RD], state [B, H, P, N], k [B, R, H, N] fp32, v [B, H, P] in V's dtype or
    fp32): the call continues the sequence that state ended. Gradients come for every tensor
    input that requires grad (the initial state's too), in its dtype. Raises ValueError /
    TypeError naming a bad argument, NotImplementedError for an unsupported device. Under
    torch.compile it is the custom ops `mamba3_mimo::operator_fwd` and `operator_bwd` (no graph
    break).

    context_parallel_group: a torch.distributed process group whose ranks each pass a
    contiguous slice of the same sequences (rank order = sequence order, any lengths); each
    receives its slice's output, and the gradients equal those of one call over the whole
    sequence (phases/context_parallel.py). initial_state is read on the group's first rank only;
    with return_state each rank gets its slice's final state (the last rank: the sequence's).
    Every rank must run the backward (its all-gather's backward is a collective)."""
    if context_parallel_group is not None:
        return _context_parallel(locals())
    init = (None,) * 4 if initial_state is None else tuple(initial_state)
    fuse_norm = bool(fuse_pregate_headwise_rms_norm)
    if torch.compiler.is_compiling():
        # traced as the custom op; the checks run at trace time, but for packed sequences,
        # whose boundaries the op's implementation reads and checks
        if cu_seqlens is None:
            validate(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
                     D, Z, chunk_size, rotary_dim_divisor, dtype, None, fuse_norm,
                     outproj_norm_weight, initial_state)
        else:
            _check_dtype(dtype, Q)
        outs = _fwd_op(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
                       D, Z, outproj_norm_weight, *init, cu_seqlens, chunk_size,
                       rotary_dim_divisor, fuse_norm, float(outproj_norm_eps))
        return outs if return_state else outs[0]
    return _apply((Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
                   outproj_norm_weight), initial_state, chunk_size, rotary_dim_divisor, dtype,
                  cu_seqlens, fuse_norm, outproj_norm_eps, bool(return_state), True)


def _context_parallel(args: dict):
    """mamba3_mimo(...) with a context_parallel_group (its docstring): each call of this rank's
    slice is a plain call with return_state and an initial state."""
    from . import context_parallel  # here: it imports this module
    group = args.pop("context_parallel_group")
    if args["cu_seqlens"] is not None:
        raise NotImplementedError("cu_seqlens with context_parallel_group is not supported: "
                                  "pass one of them")
    if torch.compiler.is_compiling():
        raise NotImplementedError("context_parallel_group under torch.compile is not supported: "
                                  "its collectives run eagerly")
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise ValueError("context_parallel_group needs an initialized torch.distributed "
                         "process group")
    return_state = args.pop("return_state")
    plain = {n: v for n, v in args.items() if n != "initial_state"}
    if torch.distributed.get_world_size(group) == 1:
        return mamba3_mimo(**plain, return_state=return_state,
                           initial_state=args["initial_state"])
    return context_parallel.context_parallel(
        lambda init: mamba3_mimo(**plain, return_state=True, initial_state=init),
        lambda: final_states(**plain), args, group, return_state)


# mamba3_mimo's tensor arguments, in TENSOR_ARGS' order but the initial state's
_CALL_TENSORS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
                 "MIMO_Out", "Angles", "D", "Z", "outproj_norm_weight")


def _apply(tensors: tuple, initial_state, chunk_size: int, rotary_dim_divisor: int, dtype,
           cu_seqlens, fuse_norm: bool, eps: float, return_state: bool, with_out: bool):
    """An eager, checked (validate) call of the autograd Function: mamba3_mimo's tensor
    arguments in _CALL_TENSORS' order, then its other arguments."""
    pb, cu = validate(*tensors[:14], chunk_size, rotary_dim_divisor, dtype, cu_seqlens,
                      fuse_norm, tensors[14], initial_state)
    init = (None,) * 4 if initial_state is None else tuple(initial_state)
    opts = dict(return_state=return_state, with_out=with_out, fuse_norm=fuse_norm,
                eps=float(eps), cu=cu)
    with on_device(pb.device):
        return Mamba3Mimo.apply(pb, opts, *tensors, *init)


def final_states(**kwargs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four final states of mamba3_mimo(**kwargs, return_state=True) without its output
    (eager; no context_parallel_group): the forward runs no output stage and the backward no
    output gradient (Mamba3Mimo's with_out)."""
    bound = inspect.signature(mamba3_mimo).bind(**kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return _apply(tuple(a[n] for n in _CALL_TENSORS), a["initial_state"], a["chunk_size"],
                  a["rotary_dim_divisor"], a["dtype"], a["cu_seqlens"],
                  bool(a["fuse_pregate_headwise_rms_norm"]), a["outproj_norm_eps"], True, False)
