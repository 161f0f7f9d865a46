#!/usr/bin/env bash
# Is the fused state scan latency-bound at C = 16 (optimisation.md next steps, item 3: the
# segmented scan)? Nsight Compute's throughput, occupancy and warp-state sections for
# state_scan_kernel of the second call at N128_P64_R4_C16 (C = 16) and, for comparison,
# N128_P128_R4_C8 (C = 8, where step 50 found it bound by L1 and shared memory), as text.
# Usage on the GPU machine: OUT=dir bash bench/dev/2026-12-02_ncu_scan.sh   (about 2 minutes)
cd "$(dirname "$0")/../.." || exit 2
for shape in N128_P64_R4_C16 N128_P128_R4_C8; do
  PYTHONPATH=. ncu --clock-control none -k regex:state_scan --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats python3 scripts/ncu_driver.py "$shape" > "$OUT/ncu_scan_$shape.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Registers Per" \
    "$OUT/ncu_scan_$shape.txt" | sed "s/^/$shape /"
done
