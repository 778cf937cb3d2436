"""What the data layer keys its caches by: one content hash (atomic writes: :mod:`treedec.atomic`)."""
from __future__ import annotations

import hashlib
import os


def file_fingerprint(path: str | os.PathLike) -> str:
    """SHA-1 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


__all__ = ["file_fingerprint"]
