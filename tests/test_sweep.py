"""Multirun sweeps: the SweepSummary callback writes summary.csv and plots into the sweep dir."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_multirun_2x2_writes_summary_and_plots(stack, tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "treedec.generate", "-m", "tree=dynamic", "tree.total_tokens=6,10", "tree.depth=2,3", "tree.top_k=4",
           f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}",
           "max_new_tokens=8", "stream=false", "compare=true", "num_threads=1", "prompt='def f(x):'",
           f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    grid = {(r["tree.total_tokens"], r["tree.depth"]) for r in rows}
    assert grid == {("6", "2"), ("6", "3"), ("10", "2"), ("10", "3")}
    for r in rows:
        assert r["policy"] == "dynamic" and r["tree_size"] == r["tree.total_tokens"]
        assert float(r["tau"]) >= 1.0 and float(r["tokens_per_s"]) > 0 and float(r["speedup"]) > 0
        assert r["identical_to_vanilla"] == "True" and int(r["new_tokens"]) > 0
        assert "accept_rank_0" in r and "time_verify" in r
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    for png in ("tree_size.png", "acceptance.png"):
        assert (sweep / png).stat().st_size > 5000

    # rebuilt by hand (e.g. after a failed job): same rows
    (sweep / "summary.csv").unlink()
    from treedec.sweep import main

    assert main([str(sweep)]) == 0
    with open(sweep / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 4


@pytest.mark.slow
def test_sweep_with_zero_new_tokens_completes(stack, tmp_path):
    """A sweep containing max_new_tokens=0 (compare=true) used to abort in the summary line: every job now writes
    metrics.json and the summary has both rows (no speedup where nothing was generated)."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "treedec.generate", "-m", "max_new_tokens=0,3", "compare=true", "stream=false",
           f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}", "num_threads=1",
           "prompt='def f(x):'", f"hydra.sweep.dir={sweep}", "+hydra.callbacks.sweep_summary.plots=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(sweep / "summary.csv") as f:
        rows = {r["max_new_tokens"]: r for r in csv.DictReader(f)}
    assert rows["0"]["new_tokens"] == "0" and rows["0"]["speedup"] == "" and rows["3"]["new_tokens"] == "3"
    assert "0 tokens, " in done.stdout
