"""The job ``python -m treedec.pretrain`` runs: the bundled target trained from scratch, exported in Hugging Face
format with its metrics.

:func:`pretrain` checks the options and holds the run dir (:func:`~treedec.training.trainer.run_job`), then builds
the data (training the tokenizer if it is missing) and the model from the config, fits, saves the final checkpoint
and (rank 0) exports the model and writes ``metrics.json``. The config is only read: the tokenizer file it derives
is passed to the data module as an argument.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from treedec.atomic import atomic_dir, write_json
from treedec.data.tokenizer_train import tokenizer_file
from treedec.models.checkpoint import save_pretrained
from treedec.models.paths import bundled_dir, export_path
from treedec.training.schedule import seconds, time_budget
from treedec.training.trainer import build_trainer, run_job, stop_reason, use_hint

log = logging.getLogger(__name__)


def pretrain(cfg: DictConfig) -> dict:
    """Pretrain (or resume, or, when the run dir holds a finished job, report) and return ``metrics.json``."""
    return run_job(cfg, "pretrain", _pretrain)


def export_hf(module, tokenizer_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``module.model`` as a Hugging Face directory with its tokenizer and generation config.

    Atomic (:func:`treedec.atomic.atomic_dir`): ``out_dir`` is the old directory or the
    complete new one, never a half-written one; the files follow the umask."""
    model = module.model
    cfg = model.config
    # no max_length: every caller passes max_new_tokens, and transformers warns on each generate() given both
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False,
           "_from_model_config": True}

    def write(d: Path) -> None:
        save_pretrained(model, d, tokenizer=str(tokenizer_path), dtype=dtype)
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    return atomic_dir(out_dir, write)


def _pretrain(cfg: DictConfig, run_dir: Path) -> dict:
    t0 = time.time()
    arch = OmegaConf.to_container(cfg.model_arch, resolve=True)
    asset = arch.pop("asset_name", None)  # where export_dir=bundled writes; not a model setting
    export = export_path(cfg.export_dir, bundled_dir(asset or "tiny-code"))
    tok_path = tokenizer_file(cfg.paths.tokenizer)

    dm = hydra.utils.instantiate(cfg.data, tokenizer_path=str(tok_path))
    dm.prepare_data()  # trains the tokenizer if missing, tokenises (cached) the corpus
    dm.setup("fit")
    meta = dm.meta
    log.info("corpus: %s train tokens (%d files), %s validation tokens (%d files); token cache %s",
             meta["splits"]["train"]["tokens"], meta["splits"]["train"]["files"],
             meta["splits"]["validation"]["tokens"], meta["splits"]["validation"]["files"], dm.token_dir)
    if arch["vocab_size"] < meta["vocab_size"]:
        raise ValueError(f"model_arch.vocab_size {arch['vocab_size']} < tokenizer vocab {meta['vocab_size']}")

    max_steps = int(cfg.trainer.max_steps)
    optim = time_budget(OmegaConf.to_container(cfg.optim, resolve=True), cfg.trainer)
    module = hydra.utils.instantiate(cfg.module)(arch, max_steps=max_steps, seed=int(cfg.seed), **optim)
    log.info("model: %.2fM parameters", module.n_params / 1e6)

    trainer, resume = build_trainer(cfg, run_dir)
    start_step = int(torch.load(resume, map_location="cpu", weights_only=True)["global_step"]) if resume else 0
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    fit_end = time.time()
    stopped_by = stop_reason(trainer)

    m = trainer.callback_metrics
    train_loss = float(m["train/loss"]) if "train/loss" in m else None
    val = trainer.validate(module, datamodule=dm, verbose=False)
    val_loss = float(val[0]["val/loss"]) if val else None
    steps = int(trainer.global_step)
    world = int(trainer.world_size)  # under DDP data.batch_size is per process
    tokens = steps * dm.batch_size * dm.seq_len * world
    ckpt_path = run_dir / "checkpoints" / "final.ckpt"
    trainer.save_checkpoint(str(ckpt_path), weights_only=True)  # collective; rank 0 writes

    if not trainer.is_global_zero:  # DDP: the other ranks leave the export and metrics.json to rank 0
        return {"steps": steps, "global_rank": int(trainer.global_rank)}
    if export is not None:
        module.model.config.bos_token_id = arch.get("bos_token_id", meta["eos_id"])
        module.model.config.eos_token_id = arch.get("eos_token_id", meta["eos_id"])
        export_hf(module, tok_path, export, dtype=cfg.export_dtype)
        log.info("exported the Hugging Face model to %s; use it: %s", export, use_hint("model", export))
    max_time = cfg.trainer.get("max_time")
    metrics = {
        "train_loss": train_loss, "val_loss": val_loss, "steps": steps, "tokens_seen": tokens,
        "epochs": tokens / max(1, dm.n_train_tokens), "train_tokens_corpus": dm.n_train_tokens,
        "val_tokens_corpus": meta["splits"]["validation"]["tokens"], "params": module.n_params,
        "wall_time_s": time.time() - t0, "fit_time_s": fit_end - t0,
        "tokens_per_s": (steps - start_step) * dm.batch_size * dm.seq_len * world / max(1e-9, fit_end - t0),
        "world_size": world, "resumed_from": resume, "stopped_by": stopped_by, "max_steps": max_steps,
        "max_time_s": seconds(max_time) if max_time else None,
        "export_dir": str(export) if export else None, "final_ckpt": str(ckpt_path),
        "arch": arch, "seq_len": dm.seq_len, "batch_size": dm.batch_size, "tokenizer": str(tok_path),
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info("metrics: %s", json.dumps({k: v for k, v in metrics.items() if k != "arch"}))
    return metrics
