"""Compile the kernels of one bwd_fwd call for sm_90 (or another target) on a machine without a
GPU and print each kernel's registers, spills and shared memory (ptxas through cuobjdump), to
study register pressure without device time. Integer arguments are specialised as the JIT does
(1 becomes a constant, multiples of 16 are marked), so that the layouts match a GPU build.
Usage: [PTX_DIR=dir] [VARIANT=json] [NO_Z=1] [OUT_F32=1] [ARCH=89]
  python scripts/offline_resources.py B S H G N P R C [impl]
(PTX_DIR: also write each kernel's PTX and TTGIR there; VARIANT: one variant in scripts/ab.py's
form, e.g. '{"output_cfg": {"maxnreg": 128}, "meta": {"PREFETCH": 0}}', applied as ab.py applies
it; NO_Z=1: the Z gate off; OUT_F32=1: float32 outputs instead of bfloat16; ARCH: the compute
capability to compile for, 90 unless given, e.g. 89 or 120; the configs are those the
dispatcher picks on a GPU of that capability, dispatch.measured_arch.)"""
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from mamba3_mimo import api, dispatch
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo.kernels import launcher

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
ARCH = int(os.environ.get("ARCH", "90"))  # the compute capability compiled for


def _compile(self, *args, grid, warmup, **kwargs):
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    sig, const, attrs = {}, {}, {}
    dns = set(self.do_not_specialize) | {self.arg_names[i] for i in self.do_not_specialize
                                         if isinstance(i, int)}
    for i, (name, val) in enumerate(bound.arguments.items()):
        if i in self.constexprs:
            sig[name] = "constexpr"
            const[name] = val
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + _TY[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the JIT does for 16-byte aligned data
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            # as the JIT specialises: an integer equal to 1 becomes a constant (e.g. a unit
            # stride, which decides whether loads vectorise), one divisible by 16 says so
            if val == 1 and name not in dns:
                sig[name] = "constexpr"
                const[name] = 1
                continue
            sig[name] = "i64" if abs(val) >= 2 ** 31 else "i32"
            if val % 16 == 0 and name not in dns:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    k = triton.compile(ASTSource(self, sig, const, attrs), target=GPUTarget("cuda", ARCH, 32),
                       options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    if os.environ.get("PTX_DIR"):  # for reading load widths, layouts and conversions
        for ext in ("ptx", "ttgir"):
            with open(os.path.join(os.environ["PTX_DIR"], f"{self.fn.__name__}.{ext}"), "w") as f:
                f.write(k.asm[ext])
    line = [x for x in res.splitlines() if "REG:" in x][0].strip()
    print(f"{self.fn.__name__:28s} warps={opts.get('num_warps')} {line} "
          f"shared(meta)={k.metadata.shared}")
    return k


def _patch() -> None:
    """Compile instead of launching, on any device. The production launcher goes through
    Triton's path (JITFunction.run, patched here) rather than launching directly, which needs a
    GPU driver."""
    JITFunction.run = _compile
    dispatch.check_device = lambda device: None
    launcher.DIRECT = False
    # the configs the dispatcher picks on a GPU of the target's compute capability
    dispatch.measured_arch = lambda device: ARCH // 10 in dispatch.MEASURED_MAJORS


def main():
    dims = [int(x) for x in sys.argv[1:9]]
    impl = sys.argv[9] if len(sys.argv) > 9 else "chunked"
    _patch()
    if os.environ.get("VARIANT"):
        import ab  # this script's folder is on sys.path
        ab.apply(dict(json.loads(os.environ["VARIANT"]), name="VARIANT"))
    s = Shape(*dims)
    a = make_inputs(s, torch.bfloat16, os.environ.get("NO_Z") != "1", seed=0)
    a.pop("adt")
    out = torch.float32 if os.environ.get("OUT_F32") == "1" else torch.bfloat16
    api.bwd_fwd(**a, output_dtype=out, impl=impl)


def sweep(dims, state_cfgs, output_cfgs):
    """Print resources for each (state, output) config pair on one shape."""
    _patch()
    s = Shape(*dims)
    a = make_inputs(s, torch.bfloat16, seed=0)
    a.pop("adt")
    for sc, oc in zip(state_cfgs, output_cfgs):
        print("state", sc, "output", oc)
        dispatch._state_candidates = lambda pb, m, sc=sc: [sc]
        dispatch._output_candidates = lambda pb, m, oc=oc: [oc]
        api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked")


if __name__ == "__main__":
    main()
