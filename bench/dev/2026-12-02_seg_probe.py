"""Session 22 probe for a segmented state scan (optimisation.md step 79): what would its pass
over 16-chunk segments cost? The fused scan over B*H*(nc/16) programs of 16 chunks each is the
scan at batch B*nc/16 and length 16*C; time it (and the split form at the official shape) per
kernel. Usage on the GPU: PYTHONPATH=. python3 bench/dev/2026-12-02_seg_probe.py > $OUT/seg.json"""
import json
import sys

import torch

from mamba3_mimo import api, dispatch
from mamba3_mimo.bench import kernel_ms
from mamba3_mimo.inputs import Shape, make_inputs

SCAN = dict(SCAN=True, BJ=16, BP=64, num_warps=4)
SPLIT = None  # the dispatcher's own choice
CASES = []
for N, P, C in ((16, 64, 8), (32, 64, 16), (64, 64, 16), (64, 128, 16)):
    nc = 2048 // C
    for seg in (None, 8, 16, 32):
        B = 4 if seg is None else 4 * nc // seg
        S = 2048 if seg is None else seg * C
        for cfg in ((SPLIT, SCAN) if seg is None else (SCAN,)):
            CASES.append((N, P, C, B, S, seg, cfg))
res = []
orig = dispatch._state_candidates
for N, P, C, B, S, seg, cfg in CASES:
    dispatch._state_candidates = (orig if cfg is None
                                  else lambda pb, m, cfg=cfg: [cfg] + orig(pb, m)[1:])
    dispatch.clear_caches()
    a = make_inputs(Shape(B, S, 16, 1, N, P, 4, C), torch.bfloat16, True, device="cuda", seed=1)
    a.pop("adt")
    fn = lambda: api.bwd_fwd(**a, output_dtype=torch.bfloat16, impl="chunked")
    ms = kernel_ms(fn)
    row = dict(N=N, P=P, C=C, B=B, S=S, seg=seg, scan=cfg is not None,
               kernels={k: round(v * 1e3, 1) for k, v in ms.items()})
    print(json.dumps(row), file=sys.stderr)
    res.append(row)
print(json.dumps(res, indent=1))
