"""Atomic file writes, the one implementation every layer uses: a reader (another DDP rank, a resumed job, a sweep
summary) never sees half a file, and a crash or a kill leaves the old file or the new one, never a mix."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give a file, or a directory and everything in it, the modes a plain ``open``/``mkdir`` would have.

    safetensors, ``mkstemp`` and ``mkdtemp`` create owner-only files, unreadable on a shared cluster.
    """
    mask, path = current_umask(), Path(path)
    if not path.is_dir():
        os.chmod(path, 0o666 & ~mask)
        return
    for d, _, files in os.walk(path):
        os.chmod(d, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds, remove it when not.

    Concurrent writers each write their own temporary (the name holds the pid).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temp file in the same folder and a rename (readable as umask allows)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        follow_umask(tmp)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


__all__ = ["atomic_file", "current_umask", "follow_umask", "write_text_atomic"]
