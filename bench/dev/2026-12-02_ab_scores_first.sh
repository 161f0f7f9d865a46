#!/usr/bin/env bash
# Session 21: chunk_output computes the scores and their weights before the inter dot, in two
# passes over the pair blocks, so that the scores and inter accumulators are never live together
# (optimisation.md step 77). Variants: main, the patch, the patch at 96 registers (five programs
# per SM; meaningful at N <= 32 only). P = 64, R = 4 shapes (N = 16..256), Z on unless AB_Z=0,
# ROUNDS rounds (default 1), timing only.
#   default:  bench/dev/2026-12-02_scores_first.patch, q loaded and rotated again in the second
#             pass (measured in session 21: slower, step 77);
#   KEEP_Q=1: bench/dev/2026-12-02_scores_first_keep_q.patch, the first pass's q tiles kept for
#             the second (Triton holds them as the inter dot's shared-memory operand); measured
#             in session 22 (step 78: 2-3 % of the call at N = 16 and 32 at 96 registers).
# Usage on the GPU machine, from a tree without the patch:
#   OUT=dir [KEEP_Q=1] [AB_Z=0] [ROUNDS=2] bash bench/dev/2026-12-02_ab_scores_first.sh
cd "$(dirname "$0")/../.." || exit 2
patch=bench/dev/2026-12-02_scores_first.patch
[ "${KEEP_Q:-0}" = 1 ] && patch=bench/dev/2026-12-02_scores_first_keep_q.patch
V="[{\"name\": \"main\", \"check\": false},
    {\"name\": \"sfirst\", \"check\": false, \"patch\": \"$patch\"},
    {\"name\": \"sfirst96\", \"check\": false, \"patch\": \"$patch\", \"output_cfg\": {\"maxnreg\": 96}}]"
PYTHONPATH=. python3 scripts/ab.py "$V" "P64_R4" "${ROUNDS:-1}" 2>&1 | tail -16
