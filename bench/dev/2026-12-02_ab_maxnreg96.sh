#!/usr/bin/env bash
# Session 22 (optimisation.md step 80): chunk_output at 96 registers (five programs per SM) at
# N <= 32, with main's statement order and with the scores-first order that keeps the q tiles
# (bench/dev/2026-12-02_scores_first_keep_q.patch), against main's 128. Z on and off, two
# rounds, timing only; the P = 64, R = 4 shapes (the rule would change N = 16 and 32 only).
# Usage on the GPU machine, from a tree without the patch: OUT=dir bash bench/dev/2026-12-02_ab_maxnreg96.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "main96", "check": false, "output_cfg": {"maxnreg": 96}},
    {"name": "kq96", "check": false, "patch": "bench/dev/2026-12-02_scores_first_keep_q.patch",
     "output_cfg": {"maxnreg": 96}}]'
for z in 1 0; do
  mkdir -p "$OUT/z$z"
  OUT=$OUT/z$z AB_Z=$z PYTHONPATH=. python3 scripts/ab.py "$V" "_P64_R4_C" 2 2>&1 | tail -16
done
