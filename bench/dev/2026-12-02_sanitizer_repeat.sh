#!/usr/bin/env bash
# Session 18's open compute-sanitizer report (docs/validation.md, open items; runs 32 and 33):
# the fp32 sanitizer process (scripts/sanitize.py fp32) N times alone and N times while
# tests/test_gpu.py runs in a loop beside it, on the repository's package ("main") and on a
# copy with bench/dev/2026-12-02_step_terms_bs16.patch ("bs16").
# Usage on the GPU machine: OUT=dir [N=4] [MAMBA3_DIRECT=0] bash bench/dev/2026-12-02_sanitizer_repeat.sh
# Writes $OUT/summary.txt (one line per process: variant, company, errors, shapes done) and the
# first failing log of each variant, $OUT/fail_<variant>.log: at most three files.
set -u
cd "$(dirname "$0")/../.." || exit 2
N=${N:-4}
CS=${CS:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
bs16=$(mktemp -d)
cp -r mamba3_mimo scripts tests bench "$bs16"/
(cd "$bs16" && git apply bench/dev/2026-12-02_step_terms_bs16.patch) || exit 2

one() {  # variant root company i
  local log="$OUT/run_$1_$3_$4.log" errs
  (cd "$2" && PYTHONPATH="$2" timeout 300 "$CS" --tool memcheck --print-limit 5 \
      python3 scripts/sanitize.py fp32) > "$log" 2>&1
  errs=$(grep -o "ERROR SUMMARY: [0-9]*" "$log" | grep -o "[0-9]*$")
  echo "$1 $3 run $4: errors=${errs:-none} shapes_done=$(grep -c ' done$' "$log")" \
    | tee -a "$OUT/summary.txt"
  if [ "${errs:-1}" != 0 ] && [ ! -e "$OUT/fail_$1.log" ]; then
    mv "$log" "$OUT/fail_$1.log"
  else
    rm -f "$log"
  fi
}

for v in main bs16; do
  root=$PWD
  [ "$v" = bs16 ] && root=$bs16
  for i in $(seq "$N"); do one "$v" "$root" alone "$i"; done
  (while :; do
     PYTHONPATH="$PWD" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > /dev/null 2>&1
   done) &
  loop=$!
  sleep 5  # the tests' first kernels on the GPU
  for i in $(seq "$N"); do one "$v" "$root" beside_tests "$i"; done
  kill "$loop" 2> /dev/null
  pkill -f "pytest -q -p no:cacheprovider tests/test_gpu.py"
  wait 2> /dev/null
done
rm -rf "$bs16"
grep -c "errors=0 " "$OUT/summary.txt" | sed 's/^/processes with 0 errors: /'
