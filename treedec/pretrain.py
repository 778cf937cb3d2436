"""Pretrain the bundled target model: ``python -m treedec.pretrain [hydra overrides]``.

1. trains the byte-level BPE tokenizer on the corpus's train split (unless ``paths.tokenizer`` exists);
2. trains :class:`treedec.training.lm.CausalLMModule` with a Lightning Trainer, checkpointing
   ``last.ckpt`` into the run dir and resuming from it automatically when it is there;
3. exports the weights in Hugging Face format (config.json, model.safetensors, tokenizer.json,
   generation_config.json) to ``export_dir``;
4. writes ``metrics.json`` (losses, steps, tokens, wall time, params) into the run dir.

Under DDP (``trainer=ddp``) every rank runs this script (Lightning re-launches it per rank with the
same run dir); the final checkpoint is a collective write by rank 0, and only rank 0 exports and
writes ``metrics.json``.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def export_hf(module, tokenizer_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``module.model`` as a Hugging Face directory with its tokenizer and generation config."""
    from treedec.models.checkpoint import save_pretrained

    model = module.model
    out = save_pretrained(model, out_dir, tokenizer=str(tokenizer_path), dtype=dtype)
    cfg = model.config
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False,
           "max_length": cfg.max_position_embeddings, "_from_model_config": True}
    (Path(out) / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Path(out)


def run(cfg: DictConfig) -> dict:
    import torch

    from treedec.models.checkpoint import BUNDLED
    from treedec.training.callbacks import build_trainer, export_path, start_job, time_budget
    from treedec.training.lm import CausalLMModule

    t0 = time.time()
    run_dir = start_job(cfg)

    dm = hydra.utils.instantiate(cfg.data)
    dm.prepare_data()  # trains the tokenizer if missing, tokenises (cached) the corpus
    dm.setup("fit")
    meta = dm.meta
    log.info("corpus: %s train tokens (%d files), %s validation tokens (%d files); token cache %s",
             meta["splits"]["train"]["tokens"], meta["splits"]["train"]["files"],
             meta["splits"]["validation"]["tokens"], meta["splits"]["validation"]["files"], dm.token_dir)
    arch = OmegaConf.to_container(cfg.model_arch, resolve=True)
    if arch["vocab_size"] < meta["vocab_size"]:
        raise ValueError(f"model_arch.vocab_size {arch['vocab_size']} < tokenizer vocab {meta['vocab_size']}")

    max_steps = int(cfg.trainer.max_steps)
    optim = time_budget(OmegaConf.to_container(cfg.optim, resolve=True), cfg.trainer)
    module = CausalLMModule(arch, max_steps=max_steps, seed=int(cfg.seed), **optim)
    log.info("model: %.2fM parameters", module.n_params / 1e6)

    trainer, resume = build_trainer(cfg, run_dir)
    start_step = int(torch.load(resume, map_location="cpu", weights_only=True)["global_step"]) if resume else 0
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    fit_end = time.time()

    m = trainer.callback_metrics
    train_loss = float(m["train/loss"]) if "train/loss" in m else None
    val = trainer.validate(module, datamodule=dm, verbose=False)
    val_loss = float(val[0]["val/loss"]) if val else None
    steps = int(trainer.global_step)
    world = int(trainer.world_size)  # under DDP data.batch_size is per process
    tokens = steps * dm.batch_size * dm.seq_len * world
    ckpt_path = run_dir / "checkpoints" / "final.ckpt"
    trainer.save_checkpoint(str(ckpt_path), weights_only=True)  # collective; rank 0 writes

    export = export_path(cfg.export_dir, BUNDLED["tiny-code"])
    if not trainer.is_global_zero:  # DDP: the other ranks leave the export and metrics.json to rank 0
        return {"steps": steps, "global_rank": int(trainer.global_rank)}
    if export is not None:
        module.model.config.bos_token_id = arch.get("bos_token_id", meta["eos_id"])
        module.model.config.eos_token_id = arch.get("eos_token_id", meta["eos_id"])
        export_hf(module, cfg.paths.tokenizer, export, dtype=cfg.export_dtype)
        log.info("exported Hugging Face model to %s", export)
    metrics = {
        "train_loss": train_loss, "val_loss": val_loss, "steps": steps, "tokens_seen": tokens,
        "epochs": tokens / max(1, dm.n_train_tokens), "train_tokens_corpus": dm.n_train_tokens,
        "val_tokens_corpus": meta["splits"]["validation"]["tokens"], "params": module.n_params,
        "wall_time_s": time.time() - t0, "fit_time_s": fit_end - t0,
        "tokens_per_s": (steps - start_step) * dm.batch_size * dm.seq_len * world / max(1e-9, fit_end - t0),
        "world_size": world, "resumed_from": resume,
        "export_dir": str(export) if export else None, "final_ckpt": str(ckpt_path),
        "arch": arch, "seq_len": dm.seq_len, "batch_size": dm.batch_size,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("metrics: %s", json.dumps({k: v for k, v in metrics.items() if k != "arch"}))
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
