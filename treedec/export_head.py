"""Export a treedec draft head for other engines: ``python -m treedec.export_head draft.path=<name|dir> format=eagle|eagle3 out=DIR``.

Writes ``config.json`` + ``model.safetensors`` in the layout the public EAGLE-1/2 or EAGLE-3
(SpecForge / SGLang, which vLLM also reads) heads use (treedec/models/head_formats.py), so
a head trained here serves there, and ``DraftHead.load(DIR)`` reads it back unchanged.
config.json's ``"treedec"`` key records the target's fingerprint (a warning when the head
meets another target). A new directory appears whole or not at all (written beside it,
then renamed); an existing non-empty directory is never written into, unless an earlier
export made it (a ``.treedec-export`` marker): then only the files an export writes are
replaced, each by a rename, and whatever else is there (a README, a tokenizer) is kept.
The files are written in a hidden work directory beside ``out``
(``.<out>.treedec-export-tmp.<random>``); one that a killed export left is removed by the
next export to the same ``out``.
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

import hydra
import torch
from omegaconf import DictConfig

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.cli import entry, launch

log = logging.getLogger(__name__)
MARKER = ".treedec-export"
WORK = ".treedec-export-tmp."  # the work directory beside out: f".{out.name}{WORK}{mkdtemp's 8 random characters}"
OWNER = ".owner"  # in the work directory while it is written: "<host> <pid>" of the export writing it
STALE_S = 24 * 3600  # a work directory this old is abandoned whoever made it (another host's, or its owner unknown)


def _check_out(out: Path) -> None:
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
    """Write ``head`` (a :class:`~treedec.heads.head.DraftHead`) to ``out`` in layout ``fmt`` (eagle | eagle3)."""
    from safetensors.torch import save_file

    from treedec.atomic import follow_umask
    from treedec.models.checkpoint import WEIGHTS
    from treedec.heads.formats.published import to_published

    out = Path(out).expanduser()
    _check_out(out)
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


def _check_kind(path, fmt: str) -> None:
    """A head whose kind has no layout ``fmt`` is refused from its config, before its weights load."""
    from treedec.heads.checkpoint import head_summary
    from treedec.heads.formats.published import kind_mismatch

    if path is None:
        return
    kind = head_summary(path)["kind"]
    if kind != fmt:
        raise ValueError(kind_mismatch(kind, fmt, path))


def run(cfg: DictConfig) -> Path:
    from treedec.config import instantiate_checked, validate
    from treedec.models.checkpoint import resolve_dtype

    validate(cfg, "export_head")
    _check_out(Path(cfg.out).expanduser())  # before loading anything
    _check_kind(cfg.draft.get("path"), cfg.format)
    # the file's own dtype and weights: export writes what was trained
    head = instantiate_checked(cfg.draft, dtype=None, quantize=None)
    out = export_head(head, cfg.out, cfg.format, resolve_dtype(cfg.dtype) if cfg.dtype else None)
    log.info("wrote the %s head %s as format=%s to %s (load it with draft.path=%s)",
             head.config.kind, cfg.draft.path, cfg.format, out, out)
    return out


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="export_head")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("export_head", main)
