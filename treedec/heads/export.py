"""A draft head written to a directory in a published layout (``python -m treedec.export_head``): the layout is
:func:`treedec.heads.formats.write.to_published`'s; here, how the directory is written.

A new directory appears whole or not at all (written beside it, then renamed); an existing non-empty directory is
never written into, unless an earlier export made it (a ``.treedec-export`` marker): then only the files an export
writes are replaced, each by a rename, and whatever else is there (a README, a tokenizer) is kept. The files are
written in a hidden work directory beside ``out`` (``.<out>.treedec-export-tmp.<random>``); one that a killed export
left is removed by the next export to the same ``out``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from treedec.atomic import follow_umask
from treedec.heads.checkpoint import head_summary
from treedec.heads.formats.write import FORMAT_OF_KIND, kind_mismatch, to_published
from treedec.models.checkpoint import WEIGHTS

log = logging.getLogger("treedec.export_head")  # the command's own name, as in its other messages
MARKER = ".treedec-export"
WORK = ".treedec-export-tmp."  # the work directory beside out: f".{out.name}{WORK}{mkdtemp's 8 random characters}"
OWNER = ".owner"  # in the work directory while it is written: "<host> <pid>" of the export writing it
STALE_S = 24 * 3600  # a work directory this old is abandoned whoever made it (another host's, or its owner unknown)


def check_out(out: Path) -> None:
    """``out`` is new, empty, or an earlier export's: anything else is refused before a file is read."""
    if out.is_file():
        raise ValueError(f"out={str(out)!r} is a file; pass a directory to create")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"out={str(out)!r} exists and is not empty, and export_head did not make it: "
                              "pass a new directory (nothing was written)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process (or a pid no process can have)
        return True
    return True


def _abandoned(work: Path) -> bool:
    """Whether no export is writing ``work``: its owner, a process of this host, is gone; or it is a day old."""
    if time.time() - work.stat().st_mtime > STALE_S:
        return True
    try:
        host, pid = (work / OWNER).read_text().split()
        return host == socket.gethostname() and not _alive(int(pid))
    except (OSError, ValueError):  # no owner yet (just made) or none any more (being renamed): in use
        return False


def clean_stale(out: Path, written: tuple[str, ...]) -> list[Path]:
    """Remove the work directories that killed exports to ``out`` left beside it -> those removed.

    Only a directory named as this tool names them, that holds nothing but files an export writes, and whose
    export is not running (:func:`_abandoned`); its files are unlinked one by one, never a tree, so nothing else
    is ever deleted."""
    pattern = re.compile(re.escape(f".{out.name}{WORK}") + r"[a-z0-9_]{8}")
    removed = []
    for work in out.parent.iterdir():
        if not pattern.fullmatch(work.name) or work.is_symlink() or not work.is_dir():
            continue
        files = list(work.iterdir())
        if any(f.name not in (*written, OWNER) or f.is_symlink() or not f.is_file() for f in files):
            continue
        if not _abandoned(work):
            continue
        try:
            for f in files:
                f.unlink()
            work.rmdir()
        except OSError as e:
            log.warning("could not remove %s, left by an interrupted export (%s)", work, e)
            continue
        removed.append(work)
    if removed:
        log.info("removed %s, left by an interrupted export", ", ".join(str(w) for w in removed))
    return removed


def export_head(head, out: str | os.PathLike, fmt: str, dtype: torch.dtype | None = None) -> Path:
    """Write ``head`` (a :class:`~treedec.heads.head.DraftHead`) to ``out`` in layout ``fmt`` (eagle | eagle3 | peagle)."""
    out = Path(out).expanduser()
    check_out(out)
    cfg, tensors = to_published(head, fmt)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    dest = out.resolve()  # (a link to a directory: the work directory goes beside what it names, one file system)
    dest.parent.mkdir(parents=True, exist_ok=True)
    written = (WEIGHTS, "config.json", MARKER)  # what an export owns in out: all it ever replaces
    clean_stale(dest, written)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}{WORK}", dir=dest.parent))
    try:
        (work / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        save_file(tensors, str(work / WEIGHTS), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (work / MARKER).write_text(json.dumps({"format": fmt, "source": head.config.target, "files": written}) + "\n")
        follow_umask(work)
        if not dest.exists():
            (work / OWNER).unlink()
            os.replace(work, dest)  # the directory appears whole
        else:  # empty, or an earlier export: its files replaced one rename each, anything else kept
            kept = sorted(p.name for p in dest.iterdir() if p.name not in written)
            for name in written:
                os.replace(work / name, dest / name)
            (work / OWNER).unlink()
            work.rmdir()
            log.info("replaced %s in %s%s", ", ".join(written), out,
                     f"; kept {', '.join(kept)} (not written by export_head)" if kept else "")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def check_kind(path, fmt: str) -> None:
    """A head whose kind has no layout ``fmt`` is refused from its config, before its weights load."""
    if path is None:
        return
    kind = head_summary(path)["kind"]
    if FORMAT_OF_KIND.get(kind) != fmt:
        raise ValueError(kind_mismatch(kind, fmt, path))
