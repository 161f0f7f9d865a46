#!/usr/bin/env bash
# Why did fp16 rotary tables make chunk_output 1-11 % slower (optimisation.md step 70), with
# vector loads as wide as before and a smaller stack frame? Nsight Compute on the second call's
# chunk_output at N128_P32_R4_C16 (the largest loss, 213.9 -> 241.0 us), on main and on a copy
# with bench/dev/2026-12-02_step70_fp16_tables.patch: throughput, memory, occupancy, warp states
# and per-line source counters, as text (about 3 minutes).
# Usage on the GPU machine, from a tree without the patch: OUT=dir bash bench/dev/2026-12-02_ncu_fp16_tables.sh
cd "$(dirname "$0")/../.." || exit 2
tree=$(mktemp -d)
cp -r mamba3_mimo scripts bench "$tree"/
(cd "$tree" && patch -s -p1 < bench/dev/2026-12-02_step70_fp16_tables.patch) || exit 2
shape=N128_P32_R4_C16
for v in main f16tab; do
  root=$PWD
  [ "$v" = f16tab ] && root=$tree
  (cd "$root" && PYTHONPATH="$root" ncu --clock-control none -k regex:chunk_output_kernel \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
    --section SourceCounters -o "$OUT/$v" python3 scripts/ncu_driver.py "$shape") > /dev/null 2>&1
  ncu -i "$OUT/$v.ncu-rep" --page details > "$OUT/details_$v.txt" 2>&1
  ncu -i "$OUT/$v.ncu-rep" --page source --csv --print-source cuda,sass > "$OUT/source_$v.csv" 2>&1
  gzip -f "$OUT/source_$v.csv"
  rm -f "$OUT/$v.ncu-rep"
  grep -E "Duration|Memory Throughput|L1/TEX Cache Throughput|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Local Memory" \
    "$OUT/details_$v.txt" | sed "s/^/$v /"
done
