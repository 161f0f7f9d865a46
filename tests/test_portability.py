"""The kernels on GPUs other than the H200, checked without one: ptxas, which comes with Triton,
compiles the kernels of a call for sm_89 and sm_120 in the configs the dispatcher picks there
(scripts/offline_resources.py). Each fits those GPUs' 99 KB of shared memory per block, and
chunk_output's local memory per thread stays small: the H200's configs spill 136-2608 bytes per
thread on the official shapes there (sm_89; docs/optimisation.md, step 66).
"""
import os
import re
import subprocess
import sys

import pytest
import triton

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the portable config spills 0-104 bytes per thread on the official shapes (step 66)
MAX_STACK = 128
SMEM_LIMIT = 99 * 1024  # per block, opt-in, on sm_86, sm_89 and sm_120

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(BIN, t)) for t in ("ptxas", "cuobjdump")),
    reason="needs the ptxas and cuobjdump that come with Triton's NVIDIA backend")


def compiled_resources(arch: int, N: int, P: int, R: int, C: int) -> dict:
    """{kernel name: (registers, stack bytes per thread, shared bytes)} of one call's kernels
    compiled for compute capability `arch` (B=4, S=2048, H=16, G=1, bf16, Z and D on), in a
    process of its own: it needs Triton's compiler rather than the interpreter the CPU tests
    run under."""
    env = dict(os.environ, ARCH=str(arch), PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "offline_resources.py"),
           "4", "2048", "16", "1", str(N), str(P), str(R), str(C)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"^(\w+_kernel)\s.*?REG:(\d+) STACK:(\d+).*?shared\(meta\)=(\d+)",
                       done.stdout, re.M)
    return {name: tuple(map(int, v)) for name, *v in found}


@pytest.mark.parametrize("arch, dims", [(89, (16, 64, 4, 8)), (89, (128, 64, 4, 16)),
                                        (120, (256, 64, 4, 8))],
                         ids=["sm89_N16_P64_R4_C8", "sm89_N128_P64_R4_C16",
                              "sm120_N256_P64_R4_C8"])
def test_kernels_off_hopper(arch, dims):
    """chunk_output compiled for a GPU whose dots run on mma.sync, in the config the dispatcher
    picks there (32-column P blocks), spills at most MAX_STACK bytes per thread and keeps the
    168-register cap; every other kernel of the call spills nothing beyond a small stack
    frame (step_terms: 32-40 bytes, the 28-byte array of libdevice's sin/cos range reduction);
    each fits SMEM_LIMIT."""
    res = compiled_resources(arch, *dims)
    assert "chunk_output_kernel" in res and len(res) >= 4, res
    assert all(shared <= SMEM_LIMIT for _, _, shared in res.values()), res
    reg, stack, _ = res.pop("chunk_output_kernel")
    assert reg <= 168 and stack <= MAX_STACK, (reg, stack)
    assert all(stack <= 40 for _, stack, _ in res.values()), res
