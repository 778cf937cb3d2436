"""What Hydra's composition leaves to treedec.cli.launch: HYDRA_FULL_ERROR=1 keeps Hydra's exception, an experiment
names the entry points it is for, and make run passes quoted overrides to Hydra (issue 46 item 12; the one-line
errors themselves are cases of tests/test_user_mistakes.py's table)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compose_config, entry_module

ROOT = Path(__file__).resolve().parents[1]


def test_hydra_full_error_keeps_a_composition_errors_traceback(monkeypatch):
    """``HYDRA_FULL_ERROR=1``: Hydra's own exception, as before (the one-line form is for users)."""
    from hydra.errors import MissingConfigException

    from treedec.cli import launch

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["treedec.generate", "tree=nonexistent"])
    with pytest.raises(MissingConfigException):
        launch("generate", entry_module("generate").main)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_names_its_entry_points_and_composes_there(experiment):
    """An experiment's header shows the command that runs it (``python -m treedec.<entry> ... experiment=NAME``):
    that is how an experiment used with another entry point names the one it belongs to (issue 46 item 12)."""
    from treedec.config.compose_errors import experiment_entries

    entries = experiment_entries(experiment)
    assert entries, f"conf/experiment/{experiment}.yaml shows no `python -m treedec.<entry> experiment={experiment}`"
    for name in entries:
        assert compose_config(name, [f"experiment={experiment}"], hydra=True).hydra.runtime.choices.experiment == experiment


def test_make_run_passes_quoted_overrides_to_hydra(tmp_path):
    """Issue 46 item 12: ``make run ARGS="prompt='def f(x):'"`` reaches Hydra with its quotes (the shell used to
    strip them: "mismatched input '('"); ``--cfg job`` prints the composed config without running the job."""
    from treedec.cli import split_args

    assert split_args(" prompt='def f(x):'  tree=auto 'a=b c' ") == ["prompt='def f(x):'", "tree=auto", "a=b c"]
    with pytest.raises(SystemExit, match=r"^Error: ARGS has an unclosed ' quote"):
        split_args("prompt='def f(x):")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MAKEFLAGS", "MFLAGS")}
    venv = tmp_path / "venv"  # not made: -o takes the environment as set up, PY is this interpreter
    done = subprocess.run(["make", "-s", "-o", f"{venv}/.installed", "run", f"VENV={venv}", f"PY={sys.executable}",
                           "ARGS=prompt='def f(x):' max_new_tokens=3 --cfg job"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prompt: 'def f(x):'" in done.stdout and "max_new_tokens: 3" in done.stdout, done.stdout[-2000:]

