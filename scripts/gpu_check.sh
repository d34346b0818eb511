#!/usr/bin/env bash
# The prepared device check (issue 24): kernel parity, the decode step of every method against FP16
# SDPA on a random Llama-3.1-8B shape, and kernel bandwidth against a plain copy; writes
# gpu_parity.csv, gpu_decode.csv and gpu_bandwidth.csv (see scripts/gpu_check.py) row by row to
# $OUT/gpu_check when OUT is set (the lent machine returns only $OUT), else to benchmarks/.
#
# On the lent machine (a bare image: python3, its own torch/triton/transformers, no network) the
# packages it lacks travel as wheels in .whl/ (built here by scripts/gpu_wheels.sh; carry ".whl"):
# they are unpacked into .whl/site, which goes first on PYTHONPATH with the repository after it.
# See docs/gpu_check.md.
#
#   bash scripts/gpu_check.sh                      # on a CUDA machine, under 8 minutes on an H200
#   bash scripts/gpu_check.sh --dry                # CPU, TRITON_INTERPRET=1, tiny sizes (seconds)
#   KVBENCH_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh --out-dir /tmp/gc
#
# Other arguments go to scripts/gpu_check.py (--out-dir, --sections, --only, --budget-s).
# On CUDA the kernels' own full-size tests run after the check (pytest -m cuda), within what is left
# of GPU_CHECK_TOTAL seconds (default 480: the lent machine's 15 minutes include its start). Every
# step prints its outcome and the script exits non-zero when any of them failed or timed out.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
    PY=python3 # the lent machine's image has python3, not python
else
    PY=python
fi

# Carried wheels (scripts/gpu_wheels.sh): unpacked once into .whl/site, first on the path, so that
# they win over the image's own versions (transformers) and fill in what it lacks (omegaconf). Not
# for the repository's own .venv, which has everything (GPU_CHECK_WHEELS=1 forces them, 0 skips).
WHEELS="$ROOT/.whl"
SITE="$WHEELS/site"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
use_wheels="${GPU_CHECK_WHEELS:-auto}"
if [[ "$use_wheels" == auto ]]; then
    prefix="$("$PY" -c 'import sys; print(sys.prefix)' 2>/dev/null || true)"
    [[ "$prefix" -ef "$ROOT/.venv" ]] && use_wheels=0 || use_wheels=1
fi
if ((${#wheels[@]})) && [[ "$use_wheels" != 0 ]]; then
    stamp="$SITE/.installed"
    want="$(ls -l "${wheels[@]}" | md5sum | cut -c1-32)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        echo "== installing ${#wheels[@]} carried wheels into .whl/site"
        rm -rf "$SITE" && mkdir -p "$SITE"
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" || exit 2
        else # a wheel is a zip laid out as site-packages
            for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$SITE" || exit 2; done
        fi
        echo "$want" >"$stamp"
    fi
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
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

# seconds for the kernels' pytest and for the check itself, all within TOTAL (the H200 session has
# 15 minutes with its start and the transfers)
PYTEST_TIMEOUT="${GPU_CHECK_PYTEST_TIMEOUT:-90}"
CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT:-360}"
TOTAL="${GPU_CHECK_TOTAL:-480}"
status=()
failed=0
LOGS=""
if [[ -n "${OUT:-}" ]]; then
    LOGS="$OUT/gpu_check"
    mkdir -p "$LOGS"
fi

# left SECONDS_WANTED: the smaller of it and what remains of TOTAL
left() {
    local rest=$((TOTAL - SECONDS))
    ((rest < $1)) && echo "$rest" || echo "$1"
}

# run_pytest LABEL LOG ARGS...: one pytest (its output also to $OUT/gpu_check/LOG) on the device, its outcome added to the summary
run_pytest() {
    local label="$1" log="$2"
    shift 2
    local limit
    limit="$(left "$PYTEST_TIMEOUT")"
    if ((limit < 10)); then
        status+=("pytest (${label}): SKIPPED, ${TOTAL}s (GPU_CHECK_TOTAL) spent"); failed=1
        return
    fi
    echo "== pytest: ${label} (timeout ${limit}s)"
    timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee ${LOGS:+"$LOGS/$log"} | tail -n 15
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) status+=("pytest (${label}): ok") ;;
        124) status+=("pytest (${label}): TIMED OUT after ${limit}s"); failed=1 ;;
        *) status+=("pytest (${label}): FAILED (exit $rc)"); failed=1 ;;
    esac
}

limit="$(left "$CHECK_TIMEOUT")"
echo "== scripts/gpu_check.py ${ARGS[*]} (timeout ${limit}s, $PY)"
timeout "$limit" "$PY" scripts/gpu_check.py "${ARGS[@]}" 2>&1 | tee ${LOGS:+"$LOGS/gpu_check.log"}
rc=${PIPESTATUS[0]}
case $rc in
    0) status+=("gpu_check.py: ok") ;;
    124) status+=("gpu_check.py: TIMED OUT after ${limit}s (the CSVs hold the rows measured so far)"); failed=1 ;;
    *) status+=("gpu_check.py: FAILED (exit $rc; rows not ok are marked in the CSVs)"); failed=1 ;;
esac

if [[ $DRY == 0 ]]; then
    run_pytest "full-size kernel tests on CUDA, -m cuda" pytest_cuda.log -m cuda \
        tests/kernels/test_quant_pack.py tests/kernels/test_decode_attention.py \
        tests/kernels/test_triton_planes.py tests/cache/test_static_step.py
    # every stored part read by TritonReader against its torch reference, on the device (the
    # interpreter-only method tests in the file skip themselves)
    run_pytest "TritonReader part parity on CUDA" pytest_parts.log tests/kernels/test_triton_parts.py
fi

{
    echo "== gpu_check.sh summary ($([[ $DRY == 1 ]] && echo dry || echo full)) in ${SECONDS}s"
    for line in "${status[@]}"; do
        echo "  $line"
    done
} | tee ${LOGS:+"$LOGS/summary.txt"}
exit $failed
