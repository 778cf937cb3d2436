"""Export a treedec draft head for other engines: ``python -m treedec.export_head draft.path=<name|dir> format=eagle|eagle3 out=DIR``.

Writes ``config.json`` + ``model.safetensors`` in the layout the public EAGLE-1/2 or EAGLE-3
(SpecForge / SGLang, which vLLM also reads) heads use (treedec/models/head_formats.py), so
a head trained here serves there, and ``DraftHead.load(DIR)`` reads it back unchanged. The
directory appears whole or not at all (written beside it, then renamed); an existing
non-empty directory is never written into, unless an earlier export made it (a
``.treedec-export`` marker), which is then replaced.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

import treedec.config_schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.cli import entry, load, refuse_renamed

log = logging.getLogger(__name__)
MARKER = ".treedec-export"


def _check_out(out: Path) -> None:
    if out.is_file():
        raise ValueError(f"out={str(out)!r} is a file; pass a directory to create")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"out={str(out)!r} exists and is not empty, and export_head did not make it: "
                              "pass a new directory (nothing was written)")


def export_head(head, out: str | os.PathLike, fmt: str, dtype: torch.dtype | None = None) -> Path:
    """Write ``head`` (a :class:`~treedec.models.draft.DraftHead`) to ``out`` in layout ``fmt`` (eagle | eagle3)."""
    from safetensors.torch import save_file

    from treedec.models.checkpoint import WEIGHTS, follow_umask
    from treedec.models.head_formats import to_published

    out = Path(out).expanduser()
    _check_out(out)
    cfg, tensors = to_published(head, fmt)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / MARKER).write_text(json.dumps({"format": fmt, "source": head.config.target}) + "\n")
        follow_umask(tmp)
        if out.exists():  # empty, or an earlier export: replaced by a rename, never left half-written
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run(cfg: DictConfig) -> Path:
    from treedec.config_schema import validate
    from treedec.models.checkpoint import resolve_dtype

    validate(cfg, "export_head")
    _check_out(Path(cfg.out).expanduser())  # before loading anything
    head = load(cfg.draft, dtype=None, quantize=None)  # the file's own dtype and weights: export writes what was trained
    out = export_head(head, cfg.out, cfg.format, resolve_dtype(cfg.dtype) if cfg.dtype else None)
    log.info("wrote the %s head %s as format=%s to %s (load it with draft.path=%s)",
             head.config.kind, cfg.draft.path, cfg.format, out, out)
    return out


@hydra.main(version_base="1.3", config_path="conf", config_name="export_head")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    refuse_renamed("export_head")
    main()
