#!/usr/bin/env bash
# The one script run on the H200 through the device tool: GPU tests and/or the benchmark.
# Usage: OUT=/existing/dir bash scripts/gpu_check.sh [tests|bench|all|sanitize|validate|operator]
#   [bench options]
# operator: the whole operator's tests (printing each official shape's errors) and its
# benchmark (python -m mamba3_mimo.bench_operator, options passed on) into $OUT/operator.log
# and $OUT/operator/results.{json,md,png}.
# sequences: the tests of initial states, packed sequences and the decode step (full-size GPU
# cases included, printing their errors) and their benchmark (python -m
# mamba3_mimo.bench_sequences) into $OUT/sequences.log and $OUT/sequences/results.*.
# clients: flash-linear-attention's Mamba3 layer on this package (tests/test_fla_layer.py,
# tests/test_upstream_decode.py, printing the full-size errors) and python -m
# mamba3_mimo.bench_clients into $OUT/clients.log and $OUT/clients/results.*; where fla is not
# importable it is installed first from the wheels in .whl/ (carried: the GPU box has no network;
# `pip download -d .whl flash-linear-attention==0.6.0` here, torch excluded).
# context_parallel: on a machine of several GPUs (the device tool's nvidia-h200-x2 or -x4),
# tests/test_context_parallel.py and the benchmark's harness test, then python -m
# mamba3_mimo.bench_context_parallel (one sequence across 1, 2, 4 GPUs) into
# $OUT/context_parallel.log and $OUT/context_parallel/results.*.
# validate: tests and sanitize side by side (about 4 minutes on the H200), sanitize's logs in
# $OUT/san.
# measure: the operator's open measurements in one call (docs/performance-operator.md, "What
# comes next", items 3 and 6): scripts/host_overhead.py on six shapes (the backward's groups of
# one entry, two and the whole batch: times and peaks), scripts/ab.py
# (AB_TARGET=operator, one round, MEASURE_SHAPES) over its variants, and ncu's stall reasons of
# chunk_grads_qk where ncu is found (with its per-instruction counters, qk_source.csv), into
# $OUT/measure/ (host_overhead.json, ab.json, *.log).
# MEASURE_PATCHES: patch files (git apply, from the repository root), each one more ab.py
# variant named after its file, e.g. a commit reverted: git diff C C~1 -- mamba3_mimo > x.patch.
# Writes at most 7 files: $OUT/env.txt, tests.log, demo.log, bench.log and
# $OUT/bench/results.{json,md,png} (sanitize: $OUT/sanitize_{bf16,fp16,fp32,operator}.log). Nothing is
# installed: the package runs from the tree (PYTHONPATH), with the machine's python3, torch and
# triton. The device machine's copy of .git
# can be stale: pass the commit, MAMBA3_GIT_COMMIT=<hash>, for the benchmark's records.
set -o pipefail

part="${1:-all}"
[ $# -gt 0 ] && shift
case "$part" in
  tests|bench|all|sanitize|validate|operator|sequences|clients|context_parallel|measure) ;;
  *) echo "usage: OUT=DIR $0 [tests|bench|all|sanitize|validate|operator|sequences|clients" \
          "|context_parallel|measure]" \
          "[bench options]" >&2
     exit 2 ;;
esac
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
  echo "OUT must name an existing folder (got '${OUT:-}')" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
# tests_then_bench NAME PATTERN BENCH_TIMEOUT TEST_FILES... -- BENCH_OPTIONS...: the test files
# into $OUT/NAME.log (the lines matching PATTERN shown), then python -m mamba3_mimo.bench_NAME
# into $OUT/NAME/results.*
tests_then_bench() {
  local name="$1" pattern="$2" bench_timeout="$3" files=() status=0
  shift 3
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do files+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  timeout "${TEST_TIMEOUT:-600}" "${PYTHON:-python3}" -m pytest -q -s -p no:cacheprovider \
    "${files[@]}" > "$OUT/$name.log" 2>&1 || status=$?
  grep -E "$pattern|passed|failed|error" "$OUT/$name.log"
  TRITON_CACHE_DIR="$(mktemp -d)" timeout "${BENCH_TIMEOUT:-$bench_timeout}" \
    "${PYTHON:-python3}" -m "mamba3_mimo.bench_$name" --out "$OUT/$name" "$@" 2>&1 \
    | tail -40 || status=$?
  return "$status"
}
if [ "$part" = operator ]; then
  tests_then_bench operator "^N[0-9]+_" 1500 tests/test_operator.py tests/test_operator_plans.py \
    tests/test_chunk_grads.py tests/test_preprocess.py -- "$@"
  exit $?
fi
if [ "$part" = sequences ]; then
  tests_then_bench sequences "^(packed|split|decode) " 900 tests/test_initial_state.py \
    tests/test_packed.py tests/test_decode.py -- "$@"
  exit $?
fi
if [ "$part" = clients ]; then
  if ! "${PYTHON:-python3}" -c "import fla" 2>/dev/null; then
    "${PYTHON:-python3}" -m pip install -q --no-index --find-links .whl \
      flash-linear-attention==0.6.0 || exit 2
  fi
  tests_then_bench clients "^fla " 600 tests/test_fla_layer.py tests/test_upstream_decode.py \
    -- "$@"
  exit $?
fi
if [ "$part" = context_parallel ]; then
  # NVLink multicast stays off (the device machines' rule; NCCL would otherwise use it)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  tests_then_bench context_parallel "^(cp|test_)" 1500 tests/test_context_parallel.py \
    "tests/test_bench.py::test_context_parallel_harness" -- "$@"
  exit $?
fi
if [ "$part" = measure ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PY="${PYTHON:-python3}" M="$OUT/measure" status=0
  mkdir -p "$M"
  OUT="$M" timeout 180 "$PY" scripts/host_overhead.py \
    N16_P64_R4_C8,N128_P64_R1_C64,N128_P64_R2_C32,N64_P64_R4_C16,N128_P32_R4_C16,N128_P64_R4_C16 \
    8 z operator || status=$?
  # no error sweeps (the GPU test suites check each path's numerics): timing only, so that
  # the whole mode fits one device call (267 s on an H100, 2026-12-05, with host_overhead.py
  # on three shapes and two groupings and four more ab.py variants, since decided: no PDL,
  # STATE_BJ 32, the angle walk in one part, launches with tensors; performance-operator.md,
  # item 6); the kernels' times of main, and one variant per patch
  variants='[{"name": "base", "check": false}'
  for patch in ${MEASURE_PATCHES:-}; do
    variants="$variants, {\"name\": \"$(basename "$patch" .patch)\", \"patch\": \"$patch\",
      \"check\": false}"
  done
  OUT="$M" AB_TARGET=operator timeout 300 "$PY" scripts/ab.py "$variants]" \
    "${MEASURE_SHAPES:-N16_P64_R4_C8,N128_P64_R4_C16,N128_P64_R1_C64}" 1 \
    > "$M/ab.log" 2>&1 || status=$?
  tail -30 "$M/ab.log"
  if command -v ncu > /dev/null; then
    # one report: the summary into ncu_qk.log, and per instruction (with its source line where
    # the kernel carries line information, as Triton's do by default) into qk_source.csv:
    # stall samples and shared-memory wavefronts, excess ones (bank conflicts) among them
    timeout 100 ncu --clock-control none -k regex:chunk_grads_qk --launch-skip 4 \
      --launch-count 1 --section WarpStateStats --section SpeedOfLight \
      --section SourceCounters --section MemoryWorkloadAnalysis_Tables --import-source yes \
      -o "$M/qk" "$PY" scripts/ncu_driver.py N128_P64_R4_C16 operator > "$M/ncu_qk.log" 2>&1 \
      || status=$?
    ncu -i "$M/qk.ncu-rep" >> "$M/ncu_qk.log" 2>&1
    ncu -i "$M/qk.ncu-rep" --page source --csv --print-source cuda,sass > "$M/qk_source.csv" \
      2>&1 || ncu -i "$M/qk.ncu-rep" --page source --csv --print-source sass \
      > "$M/qk_source.csv" 2>&1
    rm -f "$M/qk.ncu-rep"
    grep -E "Stall|Warp Cycles|Duration|Issued|Bank" "$M/ncu_qk.log" | head -30
  fi
  exit "$status"
fi
if [ "$part" = validate ]; then
  # the sanitizer's time is mostly compilation on the CPU, so the two share the machine well
  mkdir -p "$OUT/san"
  OUT="$OUT/san" bash scripts/gpu_check.sh sanitize > "$OUT/san/stdout.txt" 2>&1 &
  san=$!
  bash scripts/gpu_check.sh tests
  status=$?
  wait "$san" || status=$?
  rm -f "$OUT/san/env.txt"
  tail -4 "$OUT/san/stdout.txt"
  exit "$status"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

{
  nvidia-smi -L
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0]);
print("torch", torch.__version__, "cuda", torch.version.cuda); print("triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"

status=0
if [ "$part" = sanitize ]; then
  # compute-sanitizer memcheck over the production path on small shapes, one process per input
  # dtype and one for the whole operator (scripts/sanitize.py operator), side by side (bwd_fwd's
  # three took about 4 minutes on the H200, mostly compilation; the operator's not yet run);
  # SANITIZE_RUNS picks some of them, e.g. SANITIZE_RUNS=operator
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  pids=()
  for d in ${SANITIZE_RUNS:-bf16 fp16 fp32 operator}; do
    "$cs" --tool memcheck --print-limit 5 "$PY" scripts/sanitize.py "$d" \
      > "$OUT/sanitize_$d.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  grep -H "ERROR SUMMARY" "$OUT"/sanitize_*.log
  exit "$status"
fi
if [ "$part" != bench ]; then
  # One process per test file: a CUDA fault poisons its process's context, and would otherwise
  # fail every later test of the run with the same error. The files run side by side (their
  # time is mostly compilation, on the CPU); the logs are joined in file order afterwards.
  pids=()
  for f in tests/test_*.py; do
    MAMBA3_FULL_GRID=1 timeout "${TEST_TIMEOUT:-900}" "$PY" -m pytest -q "$f" -p no:cacheprovider \
      > "$OUT/tests.$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  for f in tests/test_*.py; do
    log="$OUT/tests.$(basename "$f" .py).log"
    { echo "=== $f"; cat "$log"; } >> "$OUT/tests.log" && rm -f "$log"
  done
  grep -E "^=== |passed|failed|error" "$OUT/tests.log"
  # The README's main job, on its GPU branch (an official shape, compiled kernels).
  "$PY" -m mamba3_mimo demo 2>&1 | tee "$OUT/demo.log" || status=$?
fi
if [ "$part" != tests ]; then
  # A fresh Triton cache, so that the first-call times include compilation.
  TRITON_CACHE_DIR="$(mktemp -d)" timeout "${BENCH_TIMEOUT:-3000}" "$PY" -m mamba3_mimo.bench --out "$OUT/bench" "$@" 2>&1 \
    | tee "$OUT/bench.log" || status=$?
fi
exit "$status"
