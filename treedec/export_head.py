"""Export a treedec draft head for other engines: ``python -m treedec.export_head draft.path=<name|dir> format=eagle|eagle3|peagle out=DIR``.

Writes ``config.json`` + ``model.safetensors`` in the layout the public EAGLE-1/2, EAGLE-3
(SpecForge / SGLang / vLLM) or P-EAGLE (vLLM's parallel drafting) heads use (treedec/heads/formats/),
so a head trained here serves there, and ``load_head(DIR)`` reads it back unchanged.
config.json's ``"treedec"`` key records the target's fingerprint (a warning when the head
meets another target). A new directory appears whole or not at all (written beside it,
then renamed); an existing non-empty directory is never written into, unless an earlier
export made it (a ``.treedec-export`` marker): then only the files an export writes are
replaced, each by a rename, and whatever else is there (a README, a tokenizer) is kept.
The files are written in a hidden work directory beside ``out``
(``.<out>.treedec-export-tmp.<random>``); one that a killed export left is removed by the
next export to the same ``out`` (the writing: :mod:`treedec.heads.export`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.cli import entry, launch
from treedec.config import instantiate_checked, validate
from treedec.heads.export import check_kind, check_out, export_head
from treedec.models.checkpoint import load_model, resolve_dtype

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> Path:
    """Export ``draft`` as ``format`` to ``out``; ``out`` and the head's kind are checked before its weights load."""

    validate(cfg, "export_head")
    check_out(Path(cfg.out).expanduser())  # before loading anything
    check_kind(cfg.draft.get("path"), cfg.format)
    # the file's own dtype and weights: export writes what was trained
    head = instantiate_checked(cfg.draft, dtype=None, quantize=None)
    if cfg.format == "peagle":  # the export carries the target's embedding table
        head.bind(_target(cfg.get("target") or head.config.target))
    out = export_head(head, cfg.out, cfg.format, resolve_dtype(cfg.dtype) if cfg.dtype else None)
    log.info("wrote the %s head %s as format=%s to %s (load it with draft.path=%s)",
             head.config.kind, cfg.draft.path, cfg.format, out, out)
    return out


def _target(name: str):
    try:
        return load_model(name, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"format=peagle carries the target's embedding table, and the target {name!r} does not load "
                         f"({str(e).splitlines()[0]}): pass target=<the target model's directory>") from None


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="export_head")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("export_head", main)
