"""Writing files so that nothing is lost: a reader sees the old file or the new one, never a part."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def staged_path(path: Path, token: str) -> Path:
    """The hidden name `path` is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.{token}.tmp")


def write_atomically(path: str | os.PathLike, content: str | bytes) -> Path:
    """Replace `path` with `content` (text as UTF-8) in one rename, flushed to the disk first."""
    path = Path(path)
    staged = staged_path(path, secrets.token_hex(4))
    try:
        staged.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        fsync(staged)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
    return path


def fsync(path: str | os.PathLike) -> None:
    """Flush `path`'s bytes to the disk, so a rename that follows never publishes a partly written file."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
