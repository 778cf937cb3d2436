"""Atomic file I/O, the one implementation every layer uses: a reader (another DDP rank, a resumed job, a sweep
summary) never sees half a file or half a directory, and a crash or a kill leaves the old one or the new one.
Files follow the umask (``mkstemp``/``mkdtemp``/safetensors make owner-only files, unreadable on a shared cluster),
and a write that finds the disk full raises an ``OSError`` naming the output, not the temporary file."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

# errno of a write that found no room: no space left, a file over the size limit, a quota exceeded.
DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def naming(exc: OSError, path: str | os.PathLike) -> OSError | None:
    """A full disk's error naming the output ``path`` (a failed ``write()`` names no file, an ``open()`` the temp
    file); None for any other error."""
    return OSError(exc.errno, exc.strerror, str(path)) if exc.errno in DISK_FULL else None


def current_umask() -> int:
    """The process umask (read without changing it where /proc tells it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
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
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds, remove it when not
    (concurrent writers each write their own temporary: the name holds the pid)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        follow_umask(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if (full := naming(exc, path)) is not None:
            raise full from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a uniquely named temp file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        follow_umask(tmp)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and (full := naming(exc, path)) is not None:
            raise full from exc
        raise
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def atomic_dir(dest: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Build directory ``dest`` by ``write(tmp)`` in a temporary sibling, then swap it in.

    A reader or a kill sees the old directory or the complete new one, never a half-written
    one: a failing ``write`` leaves ``dest`` as it was. Files follow the umask.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        try:
            write(tmp)
        except OSError as exc:
            if (full := naming(exc, dest)) is None:
                raise
            raise full from exc
        follow_umask(tmp)
        if not dest.exists():
            os.rename(tmp, dest)
        elif _exchange(tmp, dest):
            shutil.rmtree(tmp)  # now the old directory
        else:  # no atomic exchange here: two renames, the old copy kept until the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.rename(dest, old / dest.name)
            os.rename(tmp, dest)
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """``json.dumps(data)`` to ``path`` through a temporary file and a rename (never half written; a full disk
    names the file)."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


__all__ = ["DISK_FULL", "atomic_dir", "atomic_file", "current_umask", "follow_umask", "naming", "write_json",
           "write_text_atomic"]
