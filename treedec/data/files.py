"""Files the data layer writes and keys caches by: one atomic write-then-rename, one content hash."""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds, remove it when not.

    The idea of :func:`treedec.cli.write_text_atomic`: a reader (another DDP rank, a resumed job) never sees
    half a file, and concurrent builders each write their own temporary (the name holds the pid).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_fingerprint(path: str | os.PathLike) -> str:
    """SHA-1 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


__all__ = ["atomic_file", "file_fingerprint"]
