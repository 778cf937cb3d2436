"""Shipped static tree shapes (``conf/tree/shape/*.yaml``) and a loader for user shape files.

A shape file is YAML (or JSON, which is YAML) with a ``choices`` key holding an EAGLE/Medusa
path list (root implicit), e.g. ``choices: [[0], [1], [0, 0]]``; an optional ``name`` is
informational. ``load_shape`` accepts either a shipped name (``"eagle_mc_sim_7b_63"``) or a
path to such a file, and returns the path list, ready for :meth:`Tree.from_choices`.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from treedec.models.paths import CONF
from treedec.tree.tree import TreeError

SHAPE_DIR = CONF / "tree" / "shape"
_SUFFIXES = (".yaml", ".yml", ".json")


def list_shapes() -> list[str]:
    """Names of the shipped shapes, sorted."""
    if not SHAPE_DIR.is_dir():
        return []
    return sorted(p.stem for p in SHAPE_DIR.iterdir() if p.suffix in _SUFFIXES and p.is_file())


def _resolve(name_or_path: str | Path) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    s = str(name_or_path)
    if "/" not in s and "\\" not in s:
        for candidate in [SHAPE_DIR / s] + [SHAPE_DIR / f"{s}{suffix}" for suffix in _SUFFIXES]:
            if candidate.suffix in _SUFFIXES and candidate.is_file():
                return candidate
    shipped = ", ".join(list_shapes()) or "(none found in " + str(SHAPE_DIR) + ")"
    raise TreeError(
        f"unknown tree shape {s!r}: not a file and not a shipped shape; "
        f"shipped shapes: {shipped}; or pass a path to a YAML/JSON file with a 'choices' key"
    )


def load_shape(name_or_path: str | Path) -> list[list[int]]:
    """The ``choices`` path list of a shipped shape name or of a YAML/JSON file."""
    path = _resolve(name_or_path)
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # parse errors from yaml/omegaconf
        raise TreeError(f"cannot parse tree shape file {path}: {e}") from e
    if not isinstance(cfg, DictConfig) or "choices" not in cfg:
        raise TreeError(f"tree shape file {path} has no 'choices' key (a list of paths like [[0], [0, 0]])")
    raw = cfg.choices
    if not isinstance(raw, ListConfig):
        raise TreeError(f"'choices' in {path} must be a list of paths, got {type(raw).__name__}")
    choices = OmegaConf.to_container(raw, resolve=True)
    out: list[list[int]] = []
    for c in choices:
        if not isinstance(c, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in c):
            raise TreeError(f"'choices' in {path} must hold lists of integer ranks, got {c!r}")
        out.append([int(x) for x in c])
    return out
