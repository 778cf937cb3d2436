"""`Trainer(fast_dev_run=True)` for both Lightning modules on tiny random models: one training and
one validation batch from the real data modules on the tiny corpus, through the Trainer's hooks."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from tests.helpers import TINY_ARCH
from treedec.data.datamodules import JsonlDataModule, StdlibCodeDataModule


def fast_dev_trainer(tmp_path, precision="bf16-mixed", callbacks=()):
    return L.Trainer(fast_dev_run=True, accelerator="cpu", devices=1, precision=precision, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=list(callbacks))


def stdlib_dm(corpus, tokenizer, tmp_path):
    return StdlibCodeDataModule(str(tokenizer[0]), root=str(corpus), seq_len=32, batch_size=4, val_fraction=0.2,
                                cache_dir=str(tmp_path / "cache"), max_val_windows=2)


def finite(metrics, *keys) -> bool:
    return all(k in metrics and math.isfinite(float(metrics[k])) for k in keys)


def test_causal_lm_fast_dev_run(corpus, tokenizer, tmp_path):
    from treedec.training.lm import CausalLMModule

    module = CausalLMModule(TINY_ARCH, warmup_steps=1, max_steps=1)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = fast_dev_trainer(tmp_path)
    trainer.fit(module, datamodule=stdlib_dm(corpus, tokenizer, tmp_path))
    assert trainer.global_step == 1 and trainer.state.finished
    assert finite(trainer.callback_metrics, "train/loss", "val/loss")
    assert any(not torch.equal(before[k], v) for k, v in module.model.state_dict().items())  # one real step
    assert not list(tmp_path.rglob("*.ckpt"))  # fast_dev_run writes nothing


@pytest.mark.parametrize("data", ["stdlib", "chat"])
def test_draft_fast_dev_run(data, target_dir, corpus, tokenizer, chat_file, tmp_path):
    from treedec.training.draft import DraftModule, SpeculativeEvalCallback

    if data == "stdlib":
        dm = stdlib_dm(corpus, tokenizer, tmp_path)
    else:  # dict batches with the assistant-turn loss mask
        dm = JsonlDataModule(str(chat_file), str(tokenizer[0]), seq_len=60, batch_size=4, val_fraction=0.25,
                             cache_dir=str(tmp_path / "cache"))
    module = DraftModule(str(target_dir), target_dtype="float32", warmup_steps=1, max_steps=1)
    head0 = {k: v.clone() for k, v in module.head.state_dict().items()}
    target0 = {k: v.clone() for k, v in module.target.state_dict().items()}
    tau = SpeculativeEvalCallback([[0, 5, 7, 9, 11, 13]], every_n_steps=1, max_new_tokens=4)
    trainer = fast_dev_trainer(tmp_path, callbacks=[tau])
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 1 and trainer.state.finished
    assert finite(trainer.callback_metrics, "train/loss", "train/feat_loss", "train/ce", "val/loss", "val/top1_acc")
    assert any(not torch.equal(head0[k], v) for k, v in module.head.state_dict().items())
    assert all(torch.equal(target0[k], v) for k, v in module.target.state_dict().items())  # frozen
    assert [s for s, _ in tau.history] == [1]  # measured once, not again at the end
    assert 1.0 <= tau.history[0][1] < 1.5  # a one-step head is an untrained one: at most 1 of 4 tokens drafted
