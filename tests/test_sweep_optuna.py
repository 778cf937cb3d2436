"""The Optuna search over tree shapes (``hparams_search=optuna_tree``, the ``optuna`` extra), end to end: each trial
is a generate job on a tree the sampler chose, and the sweep's ``optimization_results.yaml`` names the best one."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import yaml

SEARCHED = ("tree.total_tokens", "tree.depth", "tree.top_k")


@pytest.mark.slow
def test_two_trial_optuna_sweep_over_tree_shapes_names_the_best(stack, tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "treedec.generate", "-m", "hparams_search=optuna_tree", "hydra.sweeper.n_trials=2",
           f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}",
           "max_new_tokens=8", "num_threads=1", "prompt='def f(x):'", f"hydra.sweep.dir={sweep}",
           "+hydra.callbacks.sweep_summary.plots=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    trials = []
    for job in ("0", "1"):  # both trials ran, each on the tree shape the sampler gave it
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        chosen = {k: int(v) for k, _, v in (o.partition("=") for o in overrides) if k in SEARCHED}
        assert set(chosen) == set(SEARCHED), overrides
        tree = metrics["config"]["tree"]
        assert tree["_target_"].endswith("DynamicPolicy")
        assert {k: tree[k.split(".")[1]] for k in SEARCHED} == {k: chosen[k] for k in SEARCHED}
        assert metrics["tokens_per_s"] > 0 and metrics["new_tokens"] == 8
        trials.append(({k: chosen[k] for k in SEARCHED}, metrics["tokens_per_s"]))
    assert not (sweep / "2").exists()

    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best_params, best_value = max(trials, key=lambda t: t[1])
    assert result["name"] == "optuna" and result["best_params"] == best_params
    assert result["best_value"] == pytest.approx(best_value)
    with open(sweep / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
