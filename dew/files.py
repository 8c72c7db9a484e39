"""Writing files so that nothing is lost (a reader sees the old file or the new one, never a part), and
reading the JSON files Dew and other tools write, saying what is wrong with a damaged one."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_json(path: str | os.PathLike, object_only: bool = False) -> tuple[Any, str | None]:
    """(the value of JSON file `path`, None), or (None, what is wrong with it, to follow the path in the
    caller's message: "is not UTF-8 text ...", "is not valid JSON ...", and with `object_only` "holds a JSON
    array, not an object of fields")."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        return None, f"is not UTF-8 text ({error.reason} at byte {error.start})"
    except json.JSONDecodeError as error:
        return None, f"is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
    if object_only and not isinstance(value, dict):
        return None, f"holds a JSON {_JSON_KINDS.get(type(value), type(value).__name__)}, not an object of fields"
    return value, None


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
