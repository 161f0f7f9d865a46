"""The kernels on GPUs other than the H200, checked without one: ptxas, which comes with Triton,
compiles the kernels of a call for sm_89 and sm_120 in the configs the rules pick there
(offline.py, next to this file). Each fits those GPUs' 99 KB of shared memory per block, and
chunk_output's local memory per thread stays small: the H200's configs spill 136-2608 bytes per
thread on the official shapes there (sm_89; docs/performance.md, "Configuration rules").
"""
import json
import os
import subprocess
import sys

import pytest

import offline

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# the portable config spilled 0-104 bytes per thread on the official shapes
MAX_STACK = 128
SMEM_LIMIT = 99 * 1024  # per block, opt-in, on sm_86, sm_89 and sm_120

pytestmark = pytest.mark.skipif(
    not offline.tools_present(),
    reason="needs the ptxas and cuobjdump that come with Triton's NVIDIA backend")


def compiled_resources(arch: int, N: int, P: int, R: int, C: int, *flags: str) -> dict:
    """{kernel name: (registers, stack bytes per thread, shared bytes)} of one call's kernels
    (compiled_kernels)."""
    return {name: (r["registers"], r["stack"], r["shared"])
            for name, r in compiled_kernels(arch, N, P, R, C, *flags).items()}


def compiled_kernels(arch: int, N: int, P: int, R: int, C: int, *flags: str) -> dict:
    """{kernel name: offline.py's dict (registers, stack, shared, num_warps, rounds)} of one
    call's kernels compiled for compute capability `arch` (B=4, S=2048, H=16, G=1, bf16, Z and
    D on), by offline.py in a process of its own: it needs Triton's compiler, and Triton picks
    the interpreter that the CPU tests run under when the kernels are decorated."""
    path = [ROOT, TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "offline", "--arch", str(arch), "--json", *flags,
           "4", "2048", "16", "1", str(N), str(P), str(R), str(C)]
    done = subprocess.run(cmd, env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESOURCES ")]
    assert len(line) == 1, done.stdout[-3000:]
    return json.loads(line[0][len("RESOURCES "):])


@pytest.mark.parametrize("arch, dims", [(89, (16, 64, 4, 8)), (89, (128, 64, 4, 16)),
                                        (120, (256, 64, 4, 8))],
                         ids=["sm89_N16_P64_R4_C8", "sm89_N128_P64_R4_C16",
                              "sm120_N256_P64_R4_C8"])
def test_kernels_off_hopper(arch, dims):
    """chunk_output compiled for a GPU whose dots run on mma.sync, in the config the rules pick
    there (32-column P blocks), spills at most MAX_STACK bytes per thread and keeps the
    168-register cap; every other kernel of the call spills nothing beyond a small stack
    frame (step_terms: 32-40 bytes, the 28-byte array of libdevice's sin/cos range reduction);
    each fits SMEM_LIMIT."""
    res = compiled_resources(arch, *dims)
    assert "chunk_output_kernel" in res and len(res) >= 4, res
    assert all(shared <= SMEM_LIMIT for _, _, shared in res.values()), res
    reg, stack, _ = res.pop("chunk_output_kernel")
    assert reg <= 168 and stack <= MAX_STACK, (reg, stack)
    # the rerun of tiles that met a non-finite value: only its shared memory matters (above);
    # clean tiles load their partial sums and exit
    assert "chunk_output_kernel.rerun" in res, res
    res.pop("chunk_output_kernel.rerun")
    assert all(stack <= 40 for _, stack, _ in res.values()), res


# the whole operator's whole-chunk kernels spill at most this on the official shapes (sm_90:
# 0-2,056 bytes, chunk_grads the most: at 4 warps it spills and still ran faster on the H200
# than at 8 warps with 664 bytes, docs/performance.md; tests/offline.py --operator)
OPERATOR_MAX_STACK = 2304


# offline.load_rounds of the kernels whose loads are issued per step, on sm_90 at
# N128_P64_R4_C16 and N256_P64_R4_C8 with the fused norm (2026-12-05; before: state_grad 8,
# chunk_grads_qk 15, chunk_grads_v 26-27, state_scan 2, chunk_forward 14 / 17, chunk_output's
# forward / grad 12 / 13, the decode step 14 / 5, the segment join 5 / 6)
MAX_ROUNDS = {"state_grad_kernel": 2, "chunk_grads_qk_kernel": 2, "chunk_grads_v_kernel": 2,
              "state_scan_kernel": 1, "chunk_forward_kernel": 4, "chunk_forward_kernel.grad": 4,
              "chunk_output_kernel.forward": 10, "chunk_output_kernel.grad": 11,
              "decode_step_kernel": 11, "decode_step_kernel.prepared": 3,
              "segment_join_kernel": 4, "segment_join_kernel.reverse": 5}


@pytest.mark.parametrize("arch, dims, norm", [(90, (128, 64, 4, 16), False),
                                              (90, (256, 64, 4, 8), True),
                                              (89, (128, 128, 4, 8), False)],
                         ids=["sm90_N128_P64_R4_C16", "sm90_N256_P64_R4_C8_norm",
                              "sm89_N128_P128_R4_C8"])
def test_operator_kernels_fit(arch, dims, norm):
    """Every kernel of the whole operator's forward and backward (the output stage on
    chunk_output's tiles, or with the norm chunk_forward with and without GRAD; state_grad,
    chunk_grads_qk and _v, the preprocessing, the state pass), of a forward with the final
    states and of its decode steps (ours, and upstream's form) fits SMEM_LIMIT of shared
    memory and spills at most OPERATOR_MAX_STACK bytes per thread. On sm_90 the kernels that
    issue each step's loads together wait for memory no more often than when that landed
    (MAX_ROUNDS, offline.load_rounds): an edit that puts a use, or a layout conversion, between
    two of their loads shows here."""
    kernels = compiled_kernels(arch, *dims, "--operator", *(["--norm"] if norm else []))
    if arch == 90:
        for name, bound in MAX_ROUNDS.items():
            if name in kernels:
                assert kernels[name]["rounds"] <= bound, (name, kernels[name])
    res = {name: (r["registers"], r["stack"], r["shared"]) for name, r in kernels.items()}
    stage = (("chunk_forward_kernel", "chunk_forward_kernel.grad") if norm else
             ("chunk_output_kernel.forward", "chunk_output_kernel.grad"))
    for name in (*stage, "state_grad_kernel", "chunk_grads_qk_kernel", "chunk_grads_v_kernel",
                 "angle_sum_kernel", "angle_sum_kernel.reverse", "decay_pieces_kernel",
                 "decode_step_kernel", "decode_step_kernel.prepared"):
        assert name in res, res
    assert all(shared <= SMEM_LIMIT for _, _, shared in res.values()), res
    assert all(stack <= OPERATOR_MAX_STACK for _, stack, _ in res.values()), res


def test_dependent_launches(tmp_path):
    """Compiled as programmatic dependent launches (sm_90), every kernel of a bwd_fwd call waits
    for its predecessor's results before touching memory (griddepcontrol.wait), and each but
    step_terms lets its successor start early (griddepcontrol.launch_dependents): the state
    pass's programs resident beside step_terms's slowed N128_P64_R8_C8 by 6 % on the H200
    (docs/performance.md, "The hardening's cost")."""
    res = compiled_resources(90, 16, 64, 4, 8, "--override", '{"dependent_launches": true}',
                             "--ptx-dir", str(tmp_path))
    assert "step_terms_kernel" in res and len(res) >= 4, res
    for name in res:
        ptx = (tmp_path / f"{name}.ptx").read_text()
        assert "griddepcontrol.wait" in ptx, name
        assert ("griddepcontrol.launch_dependents" in ptx) == (name != "step_terms_kernel"), name


# load_rounds reads PTX text only: these cases need no ptxas
_LOAD = "ld.global.v2.b32 {{%r{0}, %r{1}}}, [%rd{0}];"


def test_load_rounds_counts_waits_for_memory():
    """Loads whose first reads share a stretch between barriers cost one round; a read after a
    barrier of a load issued after the first wait costs another; a copy of a pending register
    waits for nothing, its first real read does; a wgmma's fence waits for loads in flight; each
    basic block starts with nothing pending."""
    together = [_LOAD.format(1, 2), _LOAD.format(3, 4), "add.f32 %r9, %r1, %r3;",
                "bar.sync 0;", "add.f32 %r10, %r2, %r4;"]
    assert offline.load_rounds("\n".join(together)) == 1
    apart = [_LOAD.format(1, 2), "add.f32 %r9, %r1, %r1;", "bar.sync 0;", _LOAD.format(3, 4),
             "mov.b32 %r11, %r3;", "bar.sync 0;", "add.f32 %r10, %r11, %r4;"]
    assert offline.load_rounds("\n".join(apart)) == 2
    fenced = [_LOAD.format(1, 2), "fence.proxy.async.shared::cta;", "add.f32 %r9, %r1, %r2;"]
    assert offline.load_rounds("\n".join(fenced)) == 1
    blocks = [_LOAD.format(1, 2), "$L__BB0_1:", "add.f32 %r9, %r1, %r2;"]
    assert offline.load_rounds("\n".join(blocks)) == 0
