#!/usr/bin/env bash
# Where does chunk_output's time go? Timing-only ablations (session 21): each variant removes one
# part of the kernel (its results are wrong, so no error sweep) and the A/B reports the kernels'
# device time per call against main, Z on, at N = 16, 32, 64, 128, 256 (P = 64, R = 4), one round.
#   inter:  no state tiles loaded, no Qr states dot
#   scores: no k loaded or rotated, no Qr Kr^T dot (scores stay zero; qk_dot written as zeros)
#   intra:  no causal weights and no (scores * w) psi_v dot
#   epi:    no gate epilogue (no dout / z loads, no gate terms, no dz store; the per-rank sums of
#           raw over the steps remain)
# Usage on the GPU machine, from a tree without any of the patches applied:
#   OUT=dir bash bench/dev/2026-12-02_ab_output_ablation.sh
cd "$(dirname "$0")/../.." || exit 2
V='[{"name": "main", "check": false}'
for v in inter scores intra epi; do
  V="$V, {\"name\": \"no_$v\", \"check\": false, \"patch\": \"bench/dev/2026-12-02_ablation_$v.patch\"}"
done
V="$V]"
PYTHONPATH=. python3 scripts/ab.py "$V" "P64_R4" 1 2>&1 | tail -40
