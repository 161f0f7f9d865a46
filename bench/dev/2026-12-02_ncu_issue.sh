#!/usr/bin/env bash
# Session 22 (optimisation.md step 81): are the production kernels bound by their instruction
# issue? Nsight Compute's scheduler and instruction statistics for the second call's kernels
# at N16_P64_R4_C8 (split form: 5 launches per call) and N128_P64_R4_C16 (fused scan: 4 per
# call), with the Z gate on and off, as text.
# Usage on the GPU machine: OUT=dir bash bench/dev/2026-12-02_ncu_issue.sh   (about 2 minutes)
cd "$(dirname "$0")/../.." || exit 2
for spec in N16_P64_R4_C8:5 N128_P64_R4_C16:4; do for z in "" noz; do
  shape=${spec%:*} n=${spec#*:}
  PYTHONPATH=. ncu --clock-control none -k 'regex:step_terms|chunk_increment|state_passing|state_scan|chunk_output|rank_sums' \
    --launch-skip "$n" --launch-count "$n" --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section LaunchStats python3 scripts/ncu_driver.py "$shape" $z > "$OUT/ncu_issue_$shape$z.txt" 2>&1
  grep -E "^  [a-z_]+_kernel|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Registers Per|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Executed Instructions  |Issue Slots Busy|Executed Ipc Active" \
    "$OUT/ncu_issue_$shape$z.txt" | sed "s/^/$shape$z /"
done; done
