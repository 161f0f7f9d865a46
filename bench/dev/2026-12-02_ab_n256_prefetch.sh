#!/usr/bin/env bash
# Step 64: chunk_output's L2 prefetch off at N256_P64_R4_C8 (offline its local memory drops
# from 88 to 8 bytes per thread with Z on), Z on and Z off, two rounds each.
# Usage on the GPU machine: OUT=dir bash bench/dev/2026-12-02_ab_n256_prefetch.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false}, {"name": "no_prefetch", "check": false, "meta": {"PREFETCH": 0}}]'
mkdir -p "$OUT/on" "$OUT/off"
OUT="$OUT/on" PYTHONPATH=. python3 scripts/ab.py "$V" N256 2 2>&1 | tail -12
OUT="$OUT/off" AB_Z=0 PYTHONPATH=. python3 scripts/ab.py "$V" N256 2 2>&1 | tail -12
