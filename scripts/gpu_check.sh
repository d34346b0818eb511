#!/usr/bin/env bash
# The prepared device check (issue 24): kernel parity, kernel bandwidth against a plain copy, and the
# decode step of every method against FP16 SDPA on a random Llama-3.1-8B shape; writes
# benchmarks/gpu_parity.csv, gpu_bandwidth.csv and gpu_decode.csv (see scripts/gpu_check.py).
#
#   bash scripts/gpu_check.sh                      # on a CUDA machine, under 8 minutes on an H200
#   bash scripts/gpu_check.sh --dry                # CPU, TRITON_INTERPRET=1, tiny sizes (seconds)
#   KVBENCH_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh --out-dir /tmp/gc
#
# Other arguments go to scripts/gpu_check.py (--out-dir, --sections, --only, --budget-s).
# On CUDA the kernels' own full-size tests run first (pytest -m cuda). Every step prints its outcome
# and the script exits non-zero when any of them failed or timed out.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY=python
fi

DRY=0
[[ "${KVBENCH_GPU_CHECK_DRY:-0}" != "0" && -n "${KVBENCH_GPU_CHECK_DRY:-}" ]] && DRY=1
for arg in "$@"; do
    [[ "$arg" == "--dry" ]] && DRY=1
done
ARGS=("$@")
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    [[ " $* " == *" --dry "* ]] || ARGS+=(--dry)
fi

# seconds for the kernels' pytest and for the check itself (the H200 session has 8 minutes)
PYTEST_TIMEOUT="${GPU_CHECK_PYTEST_TIMEOUT:-90}"
CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT:-360}"
status=()
failed=0

# run_pytest LABEL ARGS...: one pytest on the device, its outcome added to the summary
run_pytest() {
    local label="$1"
    shift
    echo "== pytest: ${label} (timeout ${PYTEST_TIMEOUT}s)"
    timeout "$PYTEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -n 15
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) status+=("pytest (${label}): ok") ;;
        124) status+=("pytest (${label}): TIMED OUT after ${PYTEST_TIMEOUT}s"); failed=1 ;;
        *) status+=("pytest (${label}): FAILED (exit $rc)"); failed=1 ;;
    esac
}

if [[ $DRY == 0 ]]; then
    run_pytest "full-size kernel tests on CUDA, -m cuda" -m cuda \
        tests/kernels/test_quant_pack.py tests/kernels/test_decode_attention.py \
        tests/kernels/test_triton_planes.py tests/cache/test_static_step.py
    # every stored part read by TritonReader against its torch reference, on the device (the
    # interpreter-only method tests in the file skip themselves)
    run_pytest "TritonReader part parity on CUDA" tests/kernels/test_triton_parts.py
fi

echo "== scripts/gpu_check.py ${ARGS[*]} (timeout ${CHECK_TIMEOUT}s)"
timeout "$CHECK_TIMEOUT" "$PY" scripts/gpu_check.py "${ARGS[@]}"
rc=$?
case $rc in
    0) status+=("gpu_check.py: ok") ;;
    124) status+=("gpu_check.py: TIMED OUT after ${CHECK_TIMEOUT}s (the CSVs hold the rows measured so far)"); failed=1 ;;
    *) status+=("gpu_check.py: FAILED (exit $rc; rows not ok are marked in the CSVs)"); failed=1 ;;
esac

echo "== gpu_check.sh summary ($([[ $DRY == 1 ]] && echo dry || echo full))"
for line in "${status[@]}"; do
    echo "  $line"
done
exit $failed
