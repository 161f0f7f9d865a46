#!/usr/bin/env bash
# Session 21: chunk_output computes the scores and their weights before the inter dot, in two
# passes over the pair blocks (q loaded and rotated twice), so that the scores and inter
# accumulators are never live together (bench/dev/2026-12-02_scores_first.patch). Offline
# (sm_90, Z on): spill 64 -> 0 bytes at N128_P64_R4_C16, 88 -> 0 at N = 256, 8 -> 0 at N128_P128,
# 0 -> 16 at N128_P32 and N128_P64_R1_C64; at 96 registers (five programs per SM) 48 bytes at
# N = 16 and 32 (main: 88 and 56). Variants: main, the patch, the patch at 96 registers
# (meaningful at N <= 32 only). P = 64, R = 4 shapes, Z on, one round, timing only.
# Usage on the GPU machine, from a tree without the patch: OUT=dir bash bench/dev/2026-12-02_ab_scores_first.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "sfirst", "check": false, "patch": "bench/dev/2026-12-02_scores_first.patch"},
    {"name": "sfirst96", "check": false, "patch": "bench/dev/2026-12-02_scores_first.patch",
     "output_cfg": {"maxnreg": 96}}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "P64_R4" "${ROUNDS:-1}" 2>&1 | tail -16
