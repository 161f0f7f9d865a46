"""Offline compilation of one bwd_fwd call: the production kernels compiled for an NVIDIA target by
the ptxas that comes with Triton, on a machine without a GPU, with each kernel's registers, local
memory (stack) per thread and shared memory (cuobjdump's resource usage). Used by
test_portability.py; also a tool for studying register pressure without device time:

    PYTHONPATH=.:tests python -m offline [--arch 89] [--no-z] [--out-f32] [--ptx-dir DIR]
        [--override JSON] [--json] B S H G N P R C

--arch: the compute capability compiled for (90 unless given, e.g. 89 or 120); the configs are
those the rules pick on a GPU of that capability (configs.measured_arch). --no-z: the Z gate
off; --out-f32: float32 outputs instead of bfloat16; --ptx-dir: also write each kernel's PTX and
TTGIR there; --override: fields of configs.override as JSON, candidate lists as lists of dicts,
e.g. '{"output": [{"BJ": 32, "BP": 64, "maxnreg": 128}], "tile_chunks": 1}'; --json: a last
line "RESOURCES {json}" with {kernel: {registers, stack, shared, num_warps, rounds}} (rounds: the
times its code waits for global memory, load_rounds).

It must run in a process of its own without TRITON_INTERPRET: Triton picks the interpreter when
the kernels are decorated, and interpreted kernels compile nothing. Nothing is launched: the call
plan is built on CPU tensors (bwd_fwd.new_call_plan, the configs' shared-memory probe takes the
first candidate off a GPU) and each of its launches compiled for the target.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mamba3_mimo import configs
from mamba3_mimo.bench import problem_of
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo.phases import bwd_fwd
from mamba3_mimo.runtime.device import interpreter_active

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUOBJDUMP = os.path.join(BIN, "cuobjdump")
_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
       torch.int64: "i64"}
DIMS = ("B", "S", "H", "G", "N", "P", "R", "C")


def tools_present() -> bool:
    """Whether Triton's NVIDIA backend brought ptxas and cuobjdump."""
    return all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump"))


def overrides_of(spec: dict) -> dict:
    """configs.override's keyword arguments from their JSON form: "state" and "output" as lists
    of dicts of StateConfig / OutputConfig fields, the other fields as they are."""
    out = dict(spec)
    for key, cls in (("state", configs.StateConfig), ("output", configs.OutputConfig)):
        if out.get(key) is not None:
            out[key] = [cls(**c) for c in out[key]]
    return out


def call_launches(shape: Shape, arch: int, z_gate: bool = True,
                  output_dtype: torch.dtype = torch.bfloat16,
                  overrides: Optional[dict] = None) -> List[tuple]:
    """(fn, grid, args, options) of every launch of a production call on this shape (bf16
    inputs, D on), in the configs chosen on a GPU of compute capability `arch`, with the host
    rewrites of the public entry (tail padding, sub-chunks) and without launching anything."""
    if interpreter_active():
        raise RuntimeError("TRITON_INTERPRET is set: the interpreter compiles nothing (run this "
                           "in a process without it)")
    a = make_inputs(shape, torch.bfloat16, z_gate, seed=0)
    a.pop("adt")
    a["output_dtype"] = output_dtype
    measured = arch // 10 in configs.MEASURED_MAJORS
    with configs.override(**dict(overrides or {}, measured_arch=measured)):
        args = {name: a[name] for name in bwd_fwd.ARG_NAMES}
        pb, kernel_args, _ = bwd_fwd.kernel_problem(problem_of(a), args)
        prepared = bwd_fwd.prepare(kernel_args, pb)
        plan, out = bwd_fwd.new_call_plan(pb, prepared)
    env = dict(prepared, **out)
    launches = []
    for bound, template, slots in zip(plan.group.bounds, plan.templates, plan.slots):
        args = list(template)
        for i, name in slots:
            args[i] = env[name]
        launches.append((bound.fn, bound.grid, tuple(args), dict(bound.options)))
    return launches


def operator_launches(shape: Shape, arch: int, z_gate: bool = True, fused_norm: bool = False,
                      overrides: Optional[dict] = None) -> List[tuple]:
    """(fn, grid, args, options) of every launch of one forward and backward of the whole
    operator on this shape (bf16 inputs, D on), of a forward with the final states and of one
    decode step (mamba3_mimo_step), recorded on CPU tensors without launching anything (the
    recorded calls do nothing, so the values computed are meaningless). overrides: fields of
    configs.override, as call_launches takes them."""
    if interpreter_active():
        raise RuntimeError("TRITON_INTERPRET is set: the interpreter compiles nothing")
    from triton.runtime.jit import JITFunction
    from mamba3_mimo.inputs import operator_inputs
    from mamba3_mimo import upstream
    from mamba3_mimo.phases import operator, step
    from mamba3_mimo.runtime import launcher
    recorded = []

    def record(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
        values = dict(zip(names, args), **kwargs)
        recorded.append((self, grid, tuple(values[n] for n in names), options))

    args = operator_inputs(shape, torch.bfloat16, z_gate=z_gate, seed=0)
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.requires_grad_(True)
    if fused_norm:
        args["fuse_pregate_headwise_rms_norm"] = True
    measured = arch // 10 in configs.MEASURED_MAJORS
    saved = (JITFunction.run, launcher.DIRECT, operator.check_device, step.check_device,
             upstream.check_device)
    try:
        JITFunction.run = record
        launcher.DIRECT = False  # every launch through JITFunction.run
        # CPU tensors stand for the GPU's
        operator.check_device = step.check_device = upstream.check_device = lambda device: None
        with configs.override(**dict(overrides or {}, measured_arch=measured)):
            # as training calls it (without the norm: chunk_output's FORWARD and GRAD), then
            # with the final states (a zero chunk more)
            out = operator.mamba3_mimo(**args)
            out.float().sum().backward()
            operator.mamba3_mimo(**args, return_state=True)
            _decode_step(args, shape, step.mamba3_mimo_step)
            _upstream_step(args, shape)
    finally:
        (JITFunction.run, launcher.DIRECT, operator.check_device, step.check_device,
         upstream.check_device) = saved
    return recorded


def _decode_step(args: dict, shape: Shape, step_fn) -> None:
    """One decode step on the operator's arguments' first token, from a zero state."""
    B, H, P, N, R = shape.B, shape.H, shape.P, shape.N, shape.R
    RD = args["Angles"].shape[-1]
    from mamba3_mimo.phases.step import step_arguments
    token = {k: (v.detach() if isinstance(v, torch.Tensor) else v)
             for k, v in step_arguments(args, 0).items()}
    state = (torch.zeros(B, H, RD), torch.zeros(B, H, P, N), torch.zeros(B, R, H, N),
             torch.zeros(B, H, P, dtype=args["V"].dtype))
    step_fn(**token, state=state)


def _upstream_step(args: dict, shape: Shape) -> None:
    """One step of upstream's decode function (upstream.mamba3_step_fn, the kernel's PREPARED
    form) as flash-linear-attention calls it: bf16 q, k and k state, fp32 state."""
    from mamba3_mimo.upstream import mamba3_step_fn
    B, H, P, N, R = shape.B, shape.H, shape.P, shape.N, shape.R
    bf16 = dict(dtype=torch.bfloat16)
    qk = torch.zeros(B, R, H, N, **bf16)
    x = torch.zeros(B, H, P, **bf16)
    proj = torch.zeros(R, H, P)
    small = torch.zeros(B, H)
    mamba3_step_fn(torch.zeros(B, H, P, N), qk, x, small, qk, qk, torch.zeros(H), x, small,
                   small, proj, outproj=proj, out=torch.empty(B, H, P, **bf16), z=x, zproj=proj)


def compile_for(fn, args: tuple, options: dict, arch: int):
    """fn compiled for compute capability `arch` with these arguments, specialised as the JIT
    specialises them: an integer equal to 1 becomes a constant (e.g. a unit stride, which
    decides whether loads vectorise), one divisible by 16 is marked so, as are tensors (taken
    as 16-byte aligned); do_not_specialize integers are neither."""
    sig, const, attrs = {}, {}, {}
    dns = {p.name for p in fn.params if p.do_not_specialize}
    for i, (name, val) in enumerate(zip(fn.arg_names, args)):
        if i in fn.constexprs:
            sig[name] = "constexpr"
            const[name] = val
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + _TY[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            if val == 1 and name not in dns:
                sig[name] = "constexpr"
                const[name] = 1
                continue
            sig[name] = "i64" if abs(val) >= 2 ** 31 else "i32"
            if val % 16 == 0 and name not in dns:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(val).__name__}")
    opts = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "maxnreg")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options=opts)


def resource_usage(kernel) -> Tuple[int, int]:
    """(registers, stack bytes per thread) of a compiled kernel, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{text}")
    return int(found.group(1)), int(found.group(2))


_REG = re.compile(r"%[a-z]+\d+")


def load_rounds(ptx: str) -> int:
    """How many times a kernel's code waits for global memory, each basic block (a loop's body)
    counted once, read from its PTX: loads issued with no wait between them form a burst, and a
    round is a wait for a pending burst, either the first read of a pending load's register in a
    stretch between two barriers (ptxas may hoist loads to the stretch's start, not across a
    barrier) or a wgmma's proxy fence with loads in flight (it waits for every access in
    flight). A wait completes the burst it reads and every earlier one; copies wait for
    nothing. An estimate of latency exposed, not a timing: fewer rounds at the same work is
    what a program that issues its loads together shows."""
    rounds, pending, burst, waited = 0, [], 0, False
    for line in ptx.splitlines():
        s = line.split("//")[0].strip()
        if re.match(r"^\$L__BB\d+_\d+:", s):
            pending, waited = [], False
            continue
        if not s or s[0] in ".{}":
            continue
        body = re.sub(r"^@!?%p\d+\s+", "", s)
        op = body.split()[0]
        regs = _REG.findall(body)
        if op.startswith("ld.global"):
            pending.append((set(_REG.findall(body[:body.index("[")])), burst))
            continue
        if op.startswith("fence.proxy.async"):
            hit, waited = list(pending), False
        elif op.startswith("bar.sync") or op.startswith("barrier"):
            waited = False
            continue
        else:
            srcs = set(regs) if op.startswith("st.") else set(regs[1:])
            hit = [(d, b) for d, b in pending if d & srcs]
            if hit and op.startswith("mov"):
                for d, _ in hit:
                    d.add(regs[0])
                continue
        if hit:
            rounds += 0 if waited else 1
            waited = True
            last = max(b for _, b in hit)
            pending = [(d, b) for d, b in pending if b > last]
            burst += 1
    return rounds


def compiled_resources(shape: Shape, arch: int = 90, z_gate: bool = True,
                       output_dtype: torch.dtype = torch.bfloat16,
                       overrides: Optional[dict] = None, ptx_dir: Optional[str] = None,
                       echo: bool = False, operator: bool = False,
                       fused_norm: bool = False) -> Dict[str, dict]:
    """{kernel name: dict(registers, stack, shared, num_warps, rounds)} of one call's kernels
    compiled for compute capability `arch` (call_launches; rounds: load_rounds); echo prints a
    line per kernel as it comes."""
    res = {}
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
    launches = (operator_launches(shape, arch, z_gate, fused_norm, overrides) if operator
                else call_launches(shape, arch, z_gate, output_dtype, overrides))
    for fn, _, args, options in launches:
        kernel = compile_for(fn, args, options, arch)
        regs, stack = resource_usage(kernel)
        name = fn.__name__
        if "CAREFUL" in fn.arg_names and args[fn.arg_names.index("CAREFUL")]:
            name += ".rerun"  # chunk_output's rerun of tiles that met a non-finite value
        for flag in ("GRAD", "REVERSE", "PREPARED"):  # the backward's forms, upstream's step
            if flag in fn.arg_names and args[fn.arg_names.index(flag)]:
                name += "." + flag.lower()
        if "MODE" in fn.arg_names:  # chunk_output's forms: bwd_fwd's, the operator's two
            name += ("", ".forward", ".grad")[args[fn.arg_names.index("MODE")]]
        res[name] = dict(registers=regs, stack=stack, shared=kernel.metadata.shared,
                         num_warps=options.get("num_warps"), rounds=load_rounds(kernel.asm["ptx"]))
        if ptx_dir:  # for reading load widths, layouts and conversions
            for ext in ("ptx", "ttgir"):
                with open(os.path.join(ptx_dir, f"{name}.{ext}"), "w") as f:
                    f.write(kernel.asm[ext])
        if echo:
            print(f"{name:28s} warps={options.get('num_warps')} REG:{regs} STACK:{stack} "
                  f"shared={kernel.metadata.shared} rounds={res[name]['rounds']}", flush=True)
    return res


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m offline", description=__doc__.split("\n\n")[0])
    for dim in DIMS:
        p.add_argument(dim, type=int)
    p.add_argument("--arch", type=int, default=90, help="compute capability (default 90)")
    p.add_argument("--no-z", action="store_true", help="the Z gate off")
    p.add_argument("--out-f32", action="store_true", help="float32 outputs (default bf16)")
    p.add_argument("--ptx-dir", help="also write each kernel's PTX and TTGIR there")
    p.add_argument("--override", type=json.loads, default=None,
                   help="configs.override fields as JSON")
    p.add_argument("--json", action="store_true", help="a last line RESOURCES {json}")
    p.add_argument("--operator", action="store_true",
                   help="the whole operator's kernels (forward and backward) instead of bwd_fwd's")
    p.add_argument("--norm", action="store_true", help="with --operator: the fused norm on")
    opts = p.parse_args(argv)
    res = compiled_resources(Shape(*[getattr(opts, d) for d in DIMS]), opts.arch, not opts.no_z,
                             torch.float32 if opts.out_f32 else torch.bfloat16,
                             overrides_of(opts.override or {}), opts.ptx_dir, echo=True,
                             operator=opts.operator, fused_norm=opts.norm)
    if opts.json:
        print("RESOURCES " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
