"""Every tree-shape sweep the README and docs show (``python -m treedec.generate -m ...``) composes, validates and
builds its tree for every job of the sweep, as written (issue 39.5: the README's own sweep once stopped at its
first job). Keys of launchers and sweepers (``hydra/launcher=``, ``hparams_search=``) are plugins' and are left
to them; a ``tree.path`` of a learned tree is the shipped one."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.helpers import compose_config
from treedec.config import instantiate_checked, validate
from treedec.models.paths import ASSETS

ROOT = Path(__file__).resolve().parents[1]
LEARNED = ASSETS / "tiny-code-eagle" / "learned_tree.yaml"


def sweeps() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every ``python -m treedec.generate -m`` line in README.md and docs/."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            m = re.search(r"python -m treedec\.generate -m (.*?)(?:\s+#.*)?$", line)
            if m and not m.group(1).rstrip().endswith("\\"):
                args = [a for a in shlex.split(m.group(1))
                        if not a.startswith(("hydra/", "hydra.", "hparams_search"))]
                out.append((f"{path.name}:{n}", [f"tree.path={LEARNED}" if a.startswith("tree.path=") else a
                                                 for a in args]))
    return out


def test_the_docs_show_tree_sweeps():
    assert any("tree.total_tokens=16,32" in " ".join(args) for _, args in sweeps())


@pytest.mark.parametrize("where,args", sweeps(), ids=[w for w, _ in sweeps()])
def test_every_job_of_a_documented_sweep_builds_its_tree(where, args):
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)[0]
    assert jobs, where
    for job in jobs:
        cfg = compose_config("generate", job)
        validate(cfg, "generate")
        assert instantiate_checked(cfg.tree, "tree").max_size >= 2, (where, job)
