#!/usr/bin/env bash
# Prepared in session 21, not yet run (optimisation.md step 77, next steps item 0): step 77's
# scores-first order with the first pass's q tiles kept for the inter pass
# (bench/dev/2026-12-02_scores_first_keep_q.patch; Triton keeps them as the inter dot's
# shared-memory operand, so the second pass loads nothing), at 96 registers: five chunk_output
# programs per SM at N <= 32. Offline (sm_90, Z on): at 96 registers 40 bytes of spill at N = 16,
# 48 at N = 32 (Z off 32 and 32; main at 96: 88 and 56), 28 KB of shared memory; at 128 registers
# no spill on any official shape with Z on, but 49-98 KB of shared memory from N = 64 (65 KB at
# N = 128: three programs per SM by shared memory). Variants: main, the patch at 128 and 96
# registers. N = 16 and 32 decide ("2_P64" and "16_P64" would each take one shape; P64_R4 takes
# the five P = 64, R = 4 shapes), Z on and (AB_Z=0) off, two rounds, timing only.
# Usage on the GPU machine, from a tree without the patch:
#   OUT=dir bash bench/dev/2026-12-02_ab_scores_first_keep_q.sh; OUT=dir AB_Z=0 bash ...
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "keepq", "check": false, "patch": "bench/dev/2026-12-02_scores_first_keep_q.patch"},
    {"name": "keepq96", "check": false, "patch": "bench/dev/2026-12-02_scores_first_keep_q.patch",
     "output_cfg": {"maxnreg": 96}}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "P64_R4" "${ROUNDS:-2}" 2>&1 | tail -16
