#!/usr/bin/env bash
# Step 65 (prepared in session 19, not yet measured): chunk_output's gate epilogue with
# dout * raw shared and Phi applied after dmimo_z's sum over time
# (bench/dev/2026-12-02_step65_gate_phi_after_sum.patch; 90 fewer fp32 multiplies in the PTX
# of one program at N16 and N128), against main, every official shape, Z on (the patch does
# not change the Z-off kernel), two rounds, with the patched variant's error sweep.
# Usage on the GPU machine: OUT=dir bash bench/dev/2026-12-02_ab_step65_gate.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false}, {"name": "gate", "patch": "bench/dev/2026-12-02_step65_gate_phi_after_sum.patch"}]'
PYTHONPATH=. python3 scripts/ab.py "$V" "" 2 2>&1 | tail -30
