"""Pretraining pipeline on a tiny synthetic corpus: data module, tokenizer, Lightning steps, export."""
from __future__ import annotations

import numpy as np
import torch

from tests.helpers import TINY_ARCH
from treedec.data.corpus import corpus_files, split_of
from treedec.data.datamodules import StdlibCodeDataModule
from treedec.data.prompts import heldout_prompts
from treedec.data.token_cache import open_tokens, tokenize_corpus
from treedec.data.tokenizer_train import EOS
from treedec.models.config import LlamaConfig
from treedec.models.llama import Transformer


def test_corpus_listing_and_split(corpus):
    files = corpus_files(corpus)
    assert len(files) == 41 and files == sorted(files)
    assert not any(part in f.split("/") for f in files for part in ("test", "tests", "site-packages", "idle_test"))
    splits = [split_of(f, 0.2) for f in files]
    assert {"train", "validation"} == set(splits)
    assert splits == [split_of(f, 0.2) for f in files]  # deterministic


def test_tokenizer_and_cache(corpus, tokenizer, tmp_path):
    path, tok = tokenizer
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() <= 384
    enc = tok.encode("def f(x):\n    return x\n")
    assert enc.ids[0] == 0 and tok.decode(enc.ids[1:]) == "def f(x):\n    return x\n"
    d1 = tokenize_corpus(tok, corpus, 0.2, tmp_path)
    mtime = (d1 / "train.bin").stat().st_mtime_ns
    d2 = tokenize_corpus(tok, corpus, 0.2, tmp_path)  # cached: not rewritten
    assert d1 == d2 and (d2 / "train.bin").stat().st_mtime_ns == mtime
    train = open_tokens(d1, "train")
    assert train.dtype == np.uint16 and train[0] == 0 and train[-1] == 0
    assert int((np.asarray(train) == 0).sum()) == len([f for f in corpus_files(corpus) if split_of(f, 0.2) == "train"]) + 1


def test_datamodule_windows(corpus, tokenizer, tmp_path):
    path, _ = tokenizer
    dm = StdlibCodeDataModule(str(path), root=str(corpus), seq_len=32, batch_size=4, val_fraction=0.2,
                              cache_dir=str(tmp_path), seed=3, max_val_windows=4)
    dm.prepare_data()
    dm.setup("fit")
    b1 = next(iter(dm.train_dataloader()))
    b2 = next(iter(dm.train_dataloader()))
    assert b1.shape == (4, 33) and b1.dtype == torch.long and torch.equal(b1, b2)  # seeded
    val = list(dm.val_dataloader())
    flat = torch.cat([v for v in val])
    assert flat.shape[1] == 33 and torch.equal(flat[1, :1], flat[0, 32:33])  # contiguous windows
    prompts = heldout_prompts(3, 16, root=corpus, val_fraction=0.2, tokenizer=dm_tokenizer(path))
    assert prompts and all(p.rstrip().endswith(":") and "def " in p.splitlines()[-1] for p in prompts)


def dm_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def test_forward_train_matches_cached_forward():
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(**TINY_ARCH), attn_backend="sdpa").eval()
    ids = torch.randint(0, 384, (2, 20))
    with torch.no_grad():
        ref = model(ids, model.new_cache(2, 20)).logits
        out = model.forward_train(ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_lightning_steps_checkpoint_and_export(corpus, tokenizer, tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from treedec.training.lm import CausalLMModule

    path, _ = tokenizer
    L.seed_everything(0)
    dm = StdlibCodeDataModule(str(path), root=str(corpus), seq_len=32, batch_size=8, val_fraction=0.2,
                              cache_dir=str(tmp_path / "cache"), seed=0, max_val_windows=2)
    module = CausalLMModule(TINY_ARCH, lr=1e-2, warmup_steps=2, max_steps=30)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=30, gradient_clip_val=1.0,
                        logger=False, callbacks=[ckpt, Record()], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 0.5

    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["hyper_parameters"]["arch"] == TINY_ARCH and state["global_step"] == 30
    again = CausalLMModule.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    ids = torch.randint(0, 384, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(again.model.forward_train(ids), module.model.forward_train(ids))

    from treedec.models.checkpoint import load_model
    from treedec.training.pretrain_job import export_hf

    out = export_hf(module, path, tmp_path / "hf", dtype="float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    loaded = load_model(out, dtype=torch.float32)
    module.model.eval()
    with torch.no_grad():
        ref = module.model(ids, module.model.new_cache(1, 16)).logits
        got = loaded(ids, loaded.new_cache(1, 16)).logits
    assert torch.equal(got, ref)
