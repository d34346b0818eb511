#!/usr/bin/env bash
# Rehearse the device check here (issue 42 item 5): build an environment like the lent GPU machine's
# image, copy the working tree as the device receives it, and run the dry check in it exactly as the
# device runs the real one (scripts/gpu_check.sh unpacking the carried wheels itself).
#
#   bash scripts/gpu_wheels.sh && bash scripts/gpu_rehearse.sh     # ends "every section ok"
#
# What is like the device, and what is not:
#   - Python 3.11, not the image's 3.12: no CPU torch wheel for 3.12 is at hand here (the image has
#     torch 2.11 + CUDA 13; this machine has only /opt/wheels/torch-2.13.0+cpu for cp311, and pyenv's
#     3.12.1 has no torch). So the carried wheels are rebuilt for 3.11 (gpu_wheels.sh with
#     GPU_WHEELS_PYTHON=3.11) into .rehearse/whl-3.11; the device's 3.12 .whl/ is left alone.
#   - the image's packages from PyPI: triton 3.6.0, transformers 5.17.0 (which drops cache=: the
#     carried transformers must win over it), numpy 2.5.x where the index has it, else the newest
#     2.4.x (triton 3.6's interpreter needs kvbench's numpy >= 2.4 shim either way), pandas, scipy,
#     safetensors, tokenizers, pytest; torch from the local CPU wheel. Not omegaconf, hydra-core or
#     antlr4-python3-runtime: the image lacks them (the script fails if one got in).
#   - the tree: tracked and untracked-but-not-ignored files of this checkout (what the device tool
#     copies), in .rehearse/tree, with the 3.11 wheels as its .whl/; no .venv; OUT=.rehearse/out.
#
# Idempotent: the venv and the wheels are rebuilt only when their recipe changed (stamps); the tree
# is re-copied every run. Everything lives in .rehearse/ (ignored by git); remove it to start over.
# Environment: GPU_REHEARSE_DIR (default .rehearse), GPU_REHEARSE_BASE_PYTHON (a python3.11),
# GPU_REHEARSE_TORCH_WHEEL, GPU_REHEARSE_TRANSFORMERS (the carried version; default: the one in .whl/,
# else the lower end of pyproject's pin). Arguments go to scripts/gpu_check.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${GPU_REHEARSE_DIR:-$ROOT/.rehearse}"
VENV="$DIR/venv"
WHEELS="$DIR/whl-3.11"
TREE="$DIR/tree"
OUTDIR="$DIR/out"
TORCH_WHEEL="${GPU_REHEARSE_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
# numpy: the image has 2.5; the nearest release the index has, at least 2.4
IMAGE=(triton==3.6.0 transformers==5.17.0 "numpy>=2.4,<2.6" pandas scipy safetensors tokenizers pytest)
ABSENT=(omegaconf hydra-core antlr4-python3-runtime)
T0=$SECONDS

mkdir -p "$DIR"
[[ -f "$DIR/.gitignore" ]] || echo '*' >"$DIR/.gitignore"

# -- the interpreter: Python 3.11 ------------------------------------------------------------------
base="${GPU_REHEARSE_BASE_PYTHON:-}"
if [[ -z "$base" ]]; then
    for c in python3.11 "$HOME"/.pyenv/versions/3.11*/bin/python3.11 /usr/bin/python3.11 python3; do
        if command -v "$c" >/dev/null 2>&1 &&
            [[ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == 3.11 ]]; then
            base="$c"
            break
        fi
    done
fi
[[ -n "$base" ]] || { echo "gpu_rehearse: no Python 3.11 found (set GPU_REHEARSE_BASE_PYTHON)" >&2; exit 2; }
[[ -f "$TORCH_WHEEL" ]] || { echo "gpu_rehearse: no torch wheel at $TORCH_WHEEL (set GPU_REHEARSE_TORCH_WHEEL)" >&2; exit 2; }

# -- the image-like venv ---------------------------------------------------------------------------
recipe="$("$base" -VV) | $(basename "$TORCH_WHEEL") | ${IMAGE[*]}"
if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.rehearse-recipe" 2>/dev/null)" != "$recipe" ]]; then
    echo "== gpu_rehearse: building $VENV ($("$base" -V))"
    rm -rf "$VENV"
    "$base" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "$TORCH_WHEEL" "${IMAGE[@]}" 2> >(grep -v 'is ignored: it is neither' >&2)
    echo "$recipe" >"$VENV/.rehearse-recipe"
else
    echo "== gpu_rehearse: $VENV is up to date"
fi
PY="$VENV/bin/python3"
for pkg in "${ABSENT[@]}"; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        echo "gpu_rehearse: $pkg is installed in $VENV; the image lacks it (remove $VENV)" >&2
        exit 2
    fi
done
"$PY" - <<'EOF'
import importlib.metadata as md, sys
print("   the image:", f"python {sys.version.split()[0]},",
      ", ".join(f"{p} {md.version(p)}" for p in ("torch", "triton", "transformers", "numpy", "pandas", "scipy")))
EOF

# -- the carried wheels, for 3.11 ------------------------------------------------------------------
tv="${GPU_REHEARSE_TRANSFORMERS:-}"
if [[ -z "$tv" ]]; then
    shopt -s nullglob
    carried=("$ROOT"/.whl/transformers-*.whl)
    shopt -u nullglob
    if ((${#carried[@]})); then
        tv="$(basename "${carried[0]}" | cut -d- -f2)"
    else
        tv="$(sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' "$ROOT/pyproject.toml" | head -1)"
    fi
fi
wrecipe="3.11 | transformers $tv | $(md5sum "$ROOT/scripts/gpu_wheels.sh" | cut -c1-32)"
if [[ "$(cat "$WHEELS/.rehearse-recipe" 2>/dev/null)" != "$wrecipe" ]]; then
    echo "== gpu_rehearse: 3.11 wheels (transformers $tv) into $WHEELS"
    GPU_WHEELS_DEST="$WHEELS" GPU_WHEELS_PYTHON=3.11 GPU_WHEELS_TRANSFORMERS="$tv" PYTHON="$PY" \
        bash "$ROOT/scripts/gpu_wheels.sh"
    echo "$wrecipe" >"$WHEELS/.rehearse-recipe"
else
    echo "== gpu_rehearse: $WHEELS is up to date (transformers $tv)"
fi

# -- the tree as the device receives it ------------------------------------------------------------
mkdir -p "$TREE"
find "$TREE" -mindepth 1 -maxdepth 1 ! -name .whl -exec rm -rf {} +
git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    (cd "$ROOT" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$TREE"
mkdir -p "$TREE/.whl"
if ! diff -q <(cd "$WHEELS" && ls -l --time-style=+%s ./*.whl) <(cd "$TREE/.whl" && ls -l --time-style=+%s ./*.whl 2>/dev/null) >/dev/null; then
    rm -rf "$TREE/.whl"/*.whl "$TREE/.whl/site"
    cp -p "$WHEELS"/*.whl "$TREE/.whl/"
fi
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"

# -- the dry check, as the device runs the real one -------------------------------------------------
echo "== gpu_rehearse: KVBENCH_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh in $TREE (PYTHON=$PY)"
set +e
(
    cd "$TREE" &&
        env -u TRITON_INTERPRET -u PYTHONPATH -u VIRTUAL_ENV PATH="$VENV/bin:$PATH" PYTHON="$PY" \
            OUT="$OUTDIR" GPU_CHECK_WHEELS=1 KVBENCH_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh "$@"
) 2>&1 | tee "$DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e

# what the check imported: the carried transformers over the image's, omegaconf from the wheels
(cd "$TREE" && env -u PYTHONPATH PYTHONPATH="$TREE/.whl/site:$TREE" "$PY" -c '
import omegaconf, transformers, kvbench
where = "the carried wheels" if "/.whl/site/" in transformers.__file__ else "the image (NOT carried)"
print(f"   imported: transformers {transformers.__version__} from {where}, omegaconf {omegaconf.__version__}")
')

# every section ok: gpu_check.py's summary rows and gpu_check.sh's steps
bad="$(awk '/^gpu_check summary:/{s=1; next} s && /^  [a-z]/ && !/ rows, ok, /{print} /^== gpu_check.sh summary/{s=0; t=1; next} t && /^  / && !/: ok$/{print}' "$DIR/gpu_check.log")"
sections="$(grep -c ' rows, ok, ' "$DIR/gpu_check.log" || true)"
wheel_kb="$(du -sk --exclude=site "$WHEELS" | cut -f1)"
dev_kb="$(du -sk --exclude=site "$ROOT/.whl" 2>/dev/null | cut -f1 || echo 0)"
tree_kb="$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && du -ck --files0-from=- 2>/dev/null) | tail -1 | cut -f1)"
awk -v w="$wheel_kb" -v d="${dev_kb:-0}" -v t="$tree_kb" 'BEGIN {
    printf "   sizes: rehearsal wheels %.1f MiB, device .whl %.1f MiB, tracked tree %.1f MiB\n", w / 1024, d / 1024, t / 1024 }'
if ((rc != 0)) || [[ -n "$bad" ]] || ((sections == 0)); then
    echo "gpu_rehearse: FAILED (gpu_check.sh exit $rc) in $((SECONDS - T0)) s; not ok:" >&2
    echo "${bad:-  (no section summary)}" >&2
    exit 1
fi
echo "gpu_rehearse: every section ok ($sections sections, gpu_check.sh exit 0) in $((SECONDS - T0)) s; log $DIR/gpu_check.log"
