#!/usr/bin/env bash
# Session 21: chunk_output's inter dot (Qr states) on the bf16 states as read, with Qr split into
# bf16 hi + lo (bench/dev/2026-12-02_st16_inter.patch), against main, every official shape, Z on,
# two rounds, timing only (the error sweep of ab.py runs fp32 outputs, where the patch is off; the
# GPU suite checks its accuracy).
# Usage on the GPU machine, from a tree without the patch: OUT=dir bash bench/dev/2026-12-02_ab_st16_inter.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "st16", "check": false, "patch": "bench/dev/2026-12-02_st16_inter.patch"}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "" 2 2>&1 | tail -30
