#!/usr/bin/env bash
# Wheels of what the lent GPU machine's image lacks, for its Python (3.12, manylinux x86_64), into
# .whl/ (ignored by git: .whl/.gitignore); the device run carries them with `carry: [".whl"]` and
# scripts/gpu_check.sh unpacks them into .whl/site, first on PYTHONPATH. Run here, with network:
#
#   bash scripts/gpu_wheels.sh          # then: carry ".whl" to the device, bash scripts/gpu_check.sh
#
# GPU_WHEELS_PYTHON (default 3.12) picks the interpreter the wheels are for, GPU_WHEELS_DEST another
# folder than .whl/ (scripts/gpu_rehearse.sh builds 3.11 ones in .rehearse/ and leaves the device's
# .whl/ alone), GPU_WHEELS_TRANSFORMERS the transformers version.
#
# What travels (docs/gpu_check.md says why):
#   - omegaconf (kvbench imports it at top level) and antlr4-python3-runtime 4.9.3, its dependency,
#     which exists only as a source distribution: built into a wheel here;
#   - transformers at the version kvbench is tested with (the image's 5.17 ignores cache=, which
#     kvbench refuses), with the dependencies that version needs (huggingface-hub and the rest);
#     numpy and torch stay the image's.
# The working tree and the wheels travel together within 64 MiB; this script fails above
# GPU_WHEELS_MAX_MB (default 48).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DEST:-$ROOT/.whl}"
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
MAX_MB="${GPU_WHEELS_MAX_MB:-48}"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY=python3
fi
# transformers: the version installed here (the one the tests ran), else the lower end of the pin
TRANSFORMERS="${GPU_WHEELS_TRANSFORMERS:-$("$PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo 5.24.0)}"

mkdir -p "$DEST"
echo '*' >"$DEST/.gitignore"
rm -rf "$DEST"/*.whl "$DEST/site"

binary=(--only-binary=:all: --python-version "$PYVER" --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

echo "== antlr4-python3-runtime 4.9.3: a wheel built from its source distribution"
"$PY" -m pip wheel -q --no-deps --no-binary antlr4-python3-runtime -w "$DEST" antlr4-python3-runtime==4.9.3
echo "== omegaconf 2.3.0"
"$PY" -m pip download -q --no-deps "${binary[@]}" -d "$DEST" omegaconf==2.3.0
echo "== transformers ${TRANSFORMERS} and its dependencies (numpy excepted)"
"$PY" -m pip download -q "${binary[@]}" -d "$DEST" "transformers==${TRANSFORMERS}"
# the image's own: numpy 2.5 (transformers accepts it), and anything torch brings
rm -f "$DEST"/numpy-*.whl "$DEST"/torch-*.whl "$DEST"/nvidia_*.whl "$DEST"/triton-*.whl

shopt -s nullglob
wheels=("$DEST"/*.whl)
ls -l "${wheels[@]}" | awk '{printf "  %8.1f KB  %s\n", $5 / 1024, $NF}'
bytes=$(cat "${wheels[@]}" | wc -c)
mb=$((bytes / 1024 / 1024))
tree_mb=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && du -cb --files0-from=- 2>/dev/null) | tail -1 | awk '{print int($1 / 1048576)}')
echo "gpu_wheels: ${#wheels[@]} wheels, ${mb} MiB in ${DEST#"$ROOT"/} (tracked tree ${tree_mb} MiB; 64 MiB travel in all)"
if ((mb > MAX_MB)); then
    echo "gpu_wheels: ${mb} MiB of wheels > GPU_WHEELS_MAX_MB=${MAX_MB}" >&2
    exit 1
fi
