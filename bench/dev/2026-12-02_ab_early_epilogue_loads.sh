#!/usr/bin/env bash
# Session 21: chunk_output's dout and z (the gate epilogue's inputs) loaded before the pair-block
# dots rather than after them (bench/dev/2026-12-02_early_epilogue_loads.patch; P blocks of one
# program only, PB = 1, so P = 64 shapes), against main, Z on, N = 16..256 at P = 64, R = 4, two
# rounds, no error sweep (timing only).
# Usage on the GPU machine, from a tree without the patch: OUT=dir bash bench/dev/2026-12-02_ab_early_epilogue_loads.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "early", "check": false, "patch": "bench/dev/2026-12-02_early_epilogue_loads.patch"}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "P64_R4" 2 2>&1 | tail -20
