"""A training job reads its composed config and changes nothing in it: what it derives (the tokenizer file the data
module reads) goes to the piece that needs it as an argument."""
from __future__ import annotations

from omegaconf import OmegaConf

from tests.training.jobs import train_cfg


def test_train_leaves_its_config_as_composed(target_dir, corpus, tmp_path):
    from treedec.train import run

    cfg = train_cfg(target_dir, corpus, tmp_path, 2, "eval.every_n_steps=0")
    composed = OmegaConf.to_yaml(cfg)
    assert run(cfg)["steps"] == 2
    assert OmegaConf.to_yaml(cfg) == composed and OmegaConf.is_struct(cfg)
