#!/usr/bin/env bash
# Step 70 (session 20): step_terms' cos/sin tables in fp16 for bf16 inputs
# (bench/dev/2026-12-02_step70_fp16_tables.patch) against main, every official shape, Z on,
# two rounds, no error sweep (the CPU suite and the next gpu_check.sh validate check accuracy).
# Usage on the GPU machine, from a tree without the patch applied (main is the unpatched tree):
#   OUT=dir [AB_Z=0] bash bench/dev/2026-12-02_ab_step70_fp16_tables.sh
# Measured in session 20 (optimisation.md step 70): slower on 9 of 11 shapes; not landed.
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "f16tab", "check": false, "patch": "bench/dev/2026-12-02_step70_fp16_tables.patch"}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "" 2 2>&1 | tail -30
