#!/usr/bin/env bash
# The fused state scan with more warps in flight (session 20; optimisation.md step 69): at
# N128_P64_R4_C16 its 256 programs of 4 warps fill one wave at two per SM (181 registers), 5.1
# cycles per issued instruction, 12 % occupancy (bench/dev/2026-12-02_ncu_scan_*.txt). Variants:
# 8 warps capped at 128 registers (two programs of 8 warps per SM; needs
# bench/dev/2026-12-02_scan_maxnreg.patch), and 8-pair N blocks at 4 warps (128 registers, twice
# the programs). Every official shape, Z on. Below N = 64 state_cfg overrides chunk_increment's
# first config instead (the split form): not a control.
# Usage on the GPU machine: OUT=dir bash bench/dev/2026-12-02_ab_scan_warps.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false},
    {"name": "w8r128", "check": false, "patch": "bench/dev/2026-12-02_scan_maxnreg.patch",
     "state_cfg": {"num_warps": 8, "maxnreg": 128}},
    {"name": "bj8", "check": false, "state_cfg": {"BJ": 8}}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "" 2 2>&1 | tail -30
