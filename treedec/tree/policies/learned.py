"""Learned trees: a static shape chosen by ``python -m treedec.calibrate`` (Sequoia DP, see tree/sequoia.py).

The shape file is an ordinary tree-shape YAML (``name`` + ``choices``, so ``tree=static
tree.shape=<file>`` reads it too) with the calibration's metadata: the acceptance table, the
expected τ, the budget and depth, the hardware timings, and under ``trees`` the DP's optimal tree
for every other budget at the same depth limit, so ``tree.total_tokens=16`` picks a smaller
learned tree without recalibrating.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from treedec.conf_defaults import shipped_defaults
from treedec.tree.policies.static import StaticPolicy
from treedec.tree.tree import TreeError
from treedec.tree.yaml_files import Dumper, read_yaml

_D = shipped_defaults("tree/learned")  # the defaults of tree=learned, written once there

HEADER = "# Learned tree shape written by `python -m treedec.calibrate` (Sequoia DP on measured acceptance).\n"


def load_learned(path: str | Path) -> dict[str, Any]:
    """The parsed shape file (a dict with at least ``choices``); clear errors for missing/malformed files."""
    p, data = read_yaml(path, "learned tree file", "run `python -m treedec.calibrate` and pass the "
                        "learned_tree.yaml it writes (tree=learned tree.path=...)")
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise TreeError(f"learned tree file {p} has no 'choices' list (a list of paths like [[0], [0, 0]])")
    return data


def save_learned(path: str | Path, choices: Sequence[Sequence[int]], meta: Mapping[str, Any],
                 trees: Mapping[int, Sequence[Sequence[int]]] | None = None) -> Path:
    """Write a shape file: ``meta`` (name, budget, depth, acceptance, timing, ...) then ``choices`` and ``trees``.

    Paths are written as one JSON flow list per tree (valid YAML) to keep the file readable.
    """
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.dump(dict(meta), Dumper=Dumper, sort_keys=False, width=120)
    lines = [HEADER, body, f"choices: {json.dumps([list(map(int, c)) for c in choices])}\n"]
    if trees:
        lines.append("trees:  # the DP's optimal tree for each budget T (root included) at the same depth limit\n")
        lines += [f"  {int(n)}: {json.dumps([list(map(int, c)) for c in t])}\n" for n, t in sorted(trees.items())]
    p.write_text("".join(lines))
    return p


class LearnedPolicy(StaticPolicy):
    """A static tree read from a calibrated shape file (``tree=learned tree.path=...``).

    ``total_tokens`` (T, root included) selects another budget from the file's ``trees``; null
    uses the calibrated choice.
    """

    def __init__(self, path: str, total_tokens: int | None = _D["total_tokens"], sample_drafts: bool = _D["sample_drafts"]):
        data = load_learned(path)
        choices = data["choices"]
        if total_tokens is not None and int(total_tokens) != len(choices) + 1:
            trees = data.get("trees") or {}
            trees = {int(k): v for k, v in trees.items()}
            if int(total_tokens) not in trees:
                avail = f"{min(trees)}..{max(trees)}" if trees else f"only {len(choices) + 1}"
                raise TreeError(f"learned tree file {path} has no tree of total_tokens={total_tokens} "
                                f"(available: {avail}); recalibrate with a larger dp.max_budget")
            choices = trees[int(total_tokens)]
        super().__init__(choices=choices, sample_drafts=sample_drafts)
        self.path = str(path)
        self.meta = {k: v for k, v in data.items() if k not in ("choices", "trees")}
