"""`python -m treedec.generate` end to end on a tiny random model (in-process and as a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from treedec.models.checkpoint import save_pretrained
from treedec.models.config import LlamaConfig
from treedec.models.draft import DraftConfig, DraftHead
from treedec.models.llama import Transformer
from treedec.tree.shapes import SHAPE_DIR

from .training.test_pretrain import TINY_ARCH, corpus, tokenizer  # noqa: F401  (fixtures)

CONF = str(SHAPE_DIR.parents[1])


@pytest.fixture(scope="module")
def stack(tokenizer, tmp_path_factory):  # noqa: F811
    torch.manual_seed(0)
    target = Transformer(LlamaConfig(**{**TINY_ARCH, "max_position_embeddings": 256}), "sdpa")
    root = tmp_path_factory.mktemp("stack")
    save_pretrained(target, root / "target", tokenizer=str(tokenizer[0]))
    DraftHead(DraftConfig.for_target(target.config)).save(root / "draft")
    return root


def overrides(stack, tmp_path, *extra):
    return [f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}",
            "max_new_tokens=24", f"paths.run_dir={tmp_path}", "prompt='def add(a, b):'", *extra]


@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
def test_generate_matches_vanilla_and_writes_metrics(stack, tmp_path, tree, capsys):
    from treedec.generate import run

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides(stack, tmp_path, f"tree={tree}", "compare=true"))
    m = run(cfg)
    assert m["identical_to_vanilla"] is True and m["new_tokens"] > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["tau"] >= 1.0 and saved["config"]["tree"]["_target_"].endswith("Policy")
    out = capsys.readouterr().out
    assert "def add(a, b):" in out and "tau" in out and "speedup" in out


def test_cli_subprocess_and_typo(stack, tmp_path):
    cmd = [sys.executable, "-m", "treedec.generate", *overrides(stack, tmp_path)[:-2], f"hydra.run.dir={tmp_path}",
           "prompt='class Thing:'", "sampling=sample"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "metrics.json").is_file() and "tok/s" in done.stdout
    bad = subprocess.run(cmd + ["tree.totl_tokens=8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "totl_tokens" in bad.stderr
