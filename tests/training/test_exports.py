"""Where training writes: the README's commands export into their run dir and never touch the shipped
models; ``export_dir=bundled`` (the maintainer's action) replaces an asset atomically; export_dtype
names go through the one dtype resolver."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARCH, compose_config
from tests.training.jobs import tree_hashes


def tiny_pretrain(corpus, tok_path, run_dir, *extra):
    arch = [f"model_arch.{k}={v}" for k, v in TINY_ARCH.items()] + ["model_arch.head_dim=8"]
    return compose_config("pretrain", arch + [
        f"paths.run_dir={run_dir}", f"paths.tokenizer={tok_path}", "num_threads=1", f"data.root={corpus}",
        "data.seq_len=32", "data.batch_size=4", "data.val_fraction=0.2", f"data.cache_dir={run_dir.parent / 'cache'}",
        "data.max_val_windows=1", "trainer.max_steps=3", "trainer.max_time=null", "trainer.precision=32-true",
        "trainer.enable_model_summary=false", "optim.time_budget_s=null", "optim.warmup_steps=1", *extra])


def test_readme_commands_export_into_the_run_dir_and_leave_the_assets_alone(corpus, tokenizer, tmp_path,
                                                                            caplog):
    """`python -m treedec.pretrain` and `python -m treedec.train` with their defaults (tiny settings)."""
    from treedec.heads import load_head
    from treedec.models.paths import ASSETS
    from treedec.pretrain import run as pretrain
    from treedec.train import run as train

    before = tree_hashes(ASSETS)
    with caplog.at_level(logging.INFO):
        m = pretrain(tiny_pretrain(corpus, tokenizer[0], tmp_path / "pre"))
        export = tmp_path / "pre" / "export"
        assert m["export_dir"] == str(export) and (export / "model.safetensors").is_file()
        assert f"use it: python -m treedec.generate model=hf model.path={export} " in caplog.text

        cfg = compose_config("train", [  # the default target: the bundled tiny-code
            f"paths.run_dir={tmp_path / 'train'}", "num_threads=1", f"data.root={corpus}", "data.seq_len=16",
            "data.batch_size=2", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}",
            "data.max_val_windows=1", "trainer.max_steps=2", "trainer.max_time=null", "trainer.val_check_interval=2",
            "trainer.enable_model_summary=false", "optim.time_budget_s=null", "optim.warmup_steps=1",
            "eval.n_prompts=1", "eval.prompt_tokens=16", "eval.max_new_tokens=4", "eval.every_n_steps=0"])
        m = train(cfg)
        export = tmp_path / "train" / "export"
        assert m["export_dir"] == str(export) and (export / "draft.safetensors").is_file()
        assert f"use it: python -m treedec.generate draft=path draft.path={export}" in caplog.text
    assert load_head(export).config.target == "tiny-code"
    assert tree_hashes(ASSETS) == before  # the shipped model and head are untouched


def test_export_dir_bundled_replaces_the_asset_atomically(corpus, tokenizer, tmp_path, monkeypatch):
    import treedec.models.checkpoint as ckpt
    import treedec.models.paths as paths
    from treedec.models import load_model
    from treedec.pretrain import run as pretrain

    assets = tmp_path / "assets"
    assets.mkdir()
    monkeypatch.setattr(paths, "ASSETS", assets)
    old_umask = os.umask(0o022)
    try:
        m = pretrain(tiny_pretrain(corpus, tokenizer[0], tmp_path / "first", "export_dir=bundled"))
    finally:
        os.umask(old_umask)
    asset = assets / "tiny-code"
    assert m["export_dir"] == str(asset) and load_model(asset, dtype=torch.float32).config.num_hidden_layers == 2
    assert {p.name: p.stat().st_mode & 0o777 for p in asset.iterdir()} == dict.fromkeys(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"],
        0o644)  # safetensors alone would write 0600
    assert asset.stat().st_mode & 0o777 == 0o755
    good = tree_hashes(asset)

    real = ckpt.save_pretrained

    def dies_mid_save(model, path, **kw):
        real(model, path, **kw)
        weights = Path(path) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])  # half a file, then the process goes down
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("treedec.training.pretrain_job.save_pretrained", dies_mid_save)  # the name the export calls
    with pytest.raises(OSError, match="No space left"):
        pretrain(tiny_pretrain(corpus, tokenizer[0], tmp_path / "second", "export_dir=bundled", "seed=1"))
    assert tree_hashes(asset) == good and [p.name for p in assets.iterdir()] == ["tiny-code"]
    assert not (tmp_path / "second" / "metrics.json").exists()


def test_export_dtype_aliases_reach_the_files(corpus, tokenizer, tmp_path):
    """`export_dtype=bf16` used to train fully and then fail on `torch.bf16`."""
    from safetensors import safe_open

    from treedec.pretrain import run as pretrain

    m = pretrain(tiny_pretrain(corpus, tokenizer[0], tmp_path / "run", "export_dtype=bf16"))
    with safe_open(str(Path(m["export_dir"]) / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((Path(m["export_dir"]) / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_paths_tokenizer_names_a_model_to_reuse_its_tokenizer(tmp_path):
    from treedec.data.tokenizer_train import tokenizer_file
    from treedec.models.paths import ASSETS

    assert tokenizer_file("tiny-code") == ASSETS / "tiny-code" / "tokenizer.json"
    assert tokenizer_file(ASSETS / "tiny-code") == ASSETS / "tiny-code" / "tokenizer.json"
    assert tokenizer_file(tmp_path / "tok.json") == tmp_path / "tok.json"  # trained there
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        tokenizer_file(tmp_path)
