"""Files written whole or not at all, for the job store and its checkpoints."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_file_atomically(path: Path, write: Callable[[Any], object]) -> None:
    """Writes ``path`` under a temporary name, fsynced, then renames it into place: a
    reader never opens a half-written file, and a failed write leaves none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_synced(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it (the caller makes it visible)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsyncs a folder, so the names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
