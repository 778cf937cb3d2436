"""The config tree (conf/, shipped as treedec.conf; lightning-hydra-template style): one run-dir pattern, debug/,
local/ and experiment/ groups (that each default is written once, in the YAML: tests/test_config_defaults.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compose_config
from treedec.config import ConfigError, validate

REPO = Path(__file__).resolve().parents[1]
ENTRIES = ("generate", "calibrate", "bench", "regenerate", "export_head", "train", "pretrain")


def composed(name: str, overrides=(), hydra: bool = False):
    return compose_config(name, overrides, hydra=hydra)


def test_one_run_dir_pattern_and_a_sweep_dir_per_entry():
    sweeps = set()
    for name in ENTRIES:
        h = composed(name, hydra=True).hydra
        assert h.run.dir.startswith(f"./outputs/{name}/") and not h.job.chdir
        assert h.sweep.dir.startswith(f"./outputs/{name}/multirun/")
        sweeps.add(h.sweep.dir.split("/multirun/")[0])
    assert len(sweeps) == len(ENTRIES)  # generate and calibrate never share a sweep dir


@pytest.mark.parametrize("name", ["train", "pretrain"])
def test_debug_configs_compose_and_validate(name, tmp_path):
    base = [f"paths.run_dir={tmp_path}"]
    fdr = composed(name, ["debug=fdr", *base])
    assert fdr.trainer.fast_dev_run is True and fdr.trainer.accelerator == "cpu" and fdr.export_dir is None
    over = composed(name, ["debug=overfit", *base])
    assert over.trainer.overfit_batches == 2 and "fast_dev_run" not in over.trainer
    for cfg in (fdr, over):
        validate(cfg, name)
    assert composed(name, ["debug=fdr"], hydra=True).hydra.run.dir.startswith(f"./outputs/debug/{name}/")


@pytest.mark.slow
def test_local_overrides_from_a_config_dir(tmp_path):
    """``optional local: default``: absent, nothing changes; in a --config-dir, it overrides every entry."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text("# @package _global_\npaths:\n  data_dir: /my/data\n")
    cmd = [sys.executable, "-m", "treedec.generate", "--cfg", "job", "--resolve"]
    plain = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=120, cwd=REPO)
    local = subprocess.run(cmd[:-1] + ["--config-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                           cwd=REPO)
    assert plain.returncode == 0 and local.returncode == 0, plain.stderr + local.stderr
    assert "data_dir: ${paths.root_dir}/data" in plain.stdout and "data_dir: /my/data" in local.stdout


@pytest.mark.parametrize("name, module", [("train", "DraftModule"), ("pretrain", "CausalLMModule")])
def test_the_training_module_is_a_group(name, module, tmp_path):
    from hydra.utils import instantiate

    cfg = composed(name, [f"paths.run_dir={tmp_path}"])
    assert instantiate(cfg.module).func.__name__ == module  # a partial: the job passes the target/architecture
    with pytest.raises(ConfigError, match=r"module\._target_='no\.Such' cannot be imported"):
        validate(composed(name, ["module._target_=no.Such", f"paths.run_dir={tmp_path}"]), name)


def test_tree_auto_and_the_dynamic_trees_top_k_auto():
    """``tree=auto`` is its own policy; ``tree=dynamic`` is EAGLE-2 at a fixed T whose default top_k (auto) holds
    any (total_tokens, depth) a tree of that depth can hold; ``total_tokens=auto`` names the new policy."""
    from treedec.config import instantiate_checked
    from treedec.tree.policies import AutoPolicy, DynamicPolicy

    def tree(*ov):
        calibration = ["tree.calibration=null"] if "tree=dynamic" in ov else []
        return instantiate_checked(composed("generate", [*ov, *calibration]).tree, "tree")

    auto = tree("tree=auto")
    assert isinstance(auto, AutoPolicy) and (auto.max_depth, auto.top_k, auto.max_size) == (10, 4, 64)
    for T, depth, k in [(16, 6, 2), (16, 4, 3), (32, 4, 4), (16, 3, 3), (32, 5, 3), (4, 6, 1)]:
        pol = tree("tree=dynamic", f"tree.total_tokens={T}", f"tree.depth={depth}")
        assert isinstance(pol, DynamicPolicy) and pol.top_k == k, (T, depth)
    assert tree("tree=dynamic", "tree.total_tokens=24", "tree.top_k=3").top_k == 3
    with pytest.raises(ConfigError, match="tree.total_tokens=auto is now its own policy: pass tree=auto"):
        tree("tree=dynamic", "tree.total_tokens=auto")
    with pytest.raises(ConfigError, match=r"total_tokens=16 must be in \[2, 15\]"):  # an explicit top_k keeps its check
        tree("tree=dynamic", "tree.total_tokens=16", "tree.depth=4", "tree.top_k=2")


@pytest.mark.parametrize("name, experiment", [("bench", "which_tree"), ("generate", "tree_sweep")])
def test_experiments_compose_and_validate(name, experiment):
    """conf/experiment/ (lightning-hydra-template style, ``# @package _global_``): the README's long commands by name."""

    cfg = composed(name, [f"experiment={experiment}"], hydra=True)
    validate(cfg, name)
    if experiment == "which_tree":
        b = cfg.bench
        assert list(b.batch_sizes) == [1, 4, 16] and b.n_prompts == 16 and b.max_new_tokens == 96
        assert list(b.methods) == ["vanilla", "chain", "dynamic", "auto", "lookup"] and list(b.peers) == []
        assert b.num_threads == 2 and b.learned_path is None and b.vanilla_fp32 is False
        assert composed(name, [f"experiment={experiment}", "bench.n_prompts=4"]).bench.n_prompts == 4  # CLI wins
    else:
        assert dict(cfg.hydra.sweeper.params) == {"tree.total_tokens": "16,32", "tree.depth": "4,6"}
    assert "experiment" not in composed(name)  # the default (null) adds nothing
