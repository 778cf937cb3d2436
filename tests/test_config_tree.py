"""The config tree (treedec/conf, lightning-hydra-template style): one run-dir pattern, debug/ and local/ groups,
and one source of truth for each default (the YAML, or the schema dataclass where the YAML leaves it out)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import MISSING, OmegaConf

import treedec.config_schema as schema
from treedec.models.paths import CONF
from treedec.training import schema as train_schema

REPO = Path(__file__).resolve().parents[1]
ENTRIES = ("generate", "calibrate", "bench", "regenerate", "export_head", "train", "pretrain")
SCHEMAS = {**schema.SCHEMAS, "train": train_schema.TrainSchema, "pretrain": train_schema.PretrainSchema}


def composed(name: str, overrides=(), hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=hydra)


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
        train_schema.check_job_config(cfg, name)
    assert composed(name, ["debug=fdr"], hydra=True).hydra.run.dir.startswith(f"./outputs/debug/{name}/")


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


def _defaults(cls: type, prefix: str = ""):
    """(dotted key, default) of every field of a schema dataclass with a plain default (nested dataclasses too)."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            yield from _defaults(f.type, f"{prefix}{f.name}.")
        elif f.default is not dataclasses.MISSING and f.default is not MISSING:
            yield f"{prefix}{f.name}", f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            if dataclasses.is_dataclass(value):
                yield from _defaults(type(value), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value


@pytest.mark.parametrize("name", ENTRIES)
def test_yaml_and_schema_defaults_agree(name):
    """A key with a default in both the YAML and the schema has the same one: the schema's only documents it."""
    yaml = OmegaConf.to_container(composed(name), resolve=False)
    differ = []
    for key, default in _defaults(SCHEMAS[name]):
        node = yaml
        for part in key.split("."):
            node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
        if node is not MISSING and node != "???" and node != default:
            differ.append(f"{key}: yaml {node!r}, schema {default!r}")
    assert not differ, f"{name}: " + "; ".join(differ)


@pytest.mark.parametrize("name, module", [("train", "DraftModule"), ("pretrain", "CausalLMModule")])
def test_the_training_module_is_a_group(name, module, tmp_path):
    from hydra.utils import instantiate

    cfg = composed(name, [f"paths.run_dir={tmp_path}"])
    assert instantiate(cfg.module).func.__name__ == module  # a partial: the job passes the target/architecture
    with pytest.raises(train_schema.ConfigError, match=r"module\._target_='no\.Such' cannot be imported"):
        train_schema.check_job_config(composed(name, ["module._target_=no.Such", f"paths.run_dir={tmp_path}"]), name)


def test_the_dynamic_tree_defaults_follow_total_tokens():
    """``tree=dynamic tree.total_tokens=auto`` alone is the tuned auto configuration (the pool 7 / 4, chains to depth
    10); a fixed T keeps 6 / 2 and no chain depth; explicit values win over either default."""
    from treedec.config_schema import instantiate_checked
    from treedec.tree.policies import DynamicPolicy

    def tree(*ov):
        t = OmegaConf.to_container(composed("generate", ["tree=dynamic", *ov]).tree, resolve=True)
        return {k: t[k] for k in ("total_tokens", "depth", "top_k", "chain_depth")}

    assert tree("tree.total_tokens=auto") == dict(total_tokens="auto", depth=7, top_k=4, chain_depth=10)
    assert tree() == dict(total_tokens=16, depth=6, top_k=2, chain_depth=None)
    assert tree("tree.total_tokens=auto", "tree.depth=5", "tree.chain_depth=8") == dict(
        total_tokens="auto", depth=5, top_k=4, chain_depth=8)
    assert tree("tree.total_tokens=24", "tree.top_k=3") == dict(total_tokens=24, depth=6, top_k=3, chain_depth=None)
    node = composed("generate", ["tree=dynamic", "tree.total_tokens=auto", "tree.calibration=null"]).tree
    pol = instantiate_checked(node, "tree")
    assert isinstance(pol, DynamicPolicy) and pol.max_depth == 10 and pol.top_k == 4
