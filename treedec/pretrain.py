"""Pretrain the bundled target model: ``python -m treedec.pretrain [hydra overrides]``.

1. trains the byte-level BPE tokenizer on the corpus's train split (unless ``paths.tokenizer`` exists);
2. trains :class:`treedec.training.lm.CausalLMModule` with a Lightning Trainer, checkpointing
   ``last.ckpt`` into the run dir and resuming from it automatically when it is there;
3. exports the weights in Hugging Face format (config.json, model.safetensors, tokenizer.json,
   generation_config.json) to ``export_dir``;
4. writes ``metrics.json`` (losses, steps, tokens, wall time, params) into the run dir.
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


def _progress_callback(every: int):
    import lightning as L

    class LogProgress(L.Callback):
        """Log step, loss, lr and tokens/s every ``every`` steps to the job log (the progress bar is off)."""

        def __init__(self):
            self.t = time.time()
            self.step0 = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if self.step0 is None:
                self.step0, self.t = step, time.time()
            if step % every == 0 and step != self.step0:
                dt = time.time() - self.t
                tok_s = (step - self.step0) * batch.numel() * (batch.shape[1] - 1) / batch.shape[1] / max(dt, 1e-9)
                lr = trainer.optimizers[0].param_groups[0]["lr"]
                log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s", step, trainer.max_steps,
                         float(outputs["loss"]), lr, tok_s)
                self.step0, self.t = step, time.time()

        def on_validation_epoch_end(self, trainer, pl_module):
            if "val/loss" in trainer.callback_metrics and not trainer.sanity_checking:
                log.info("step %d  val/loss %.4f", trainer.global_step, float(trainer.callback_metrics["val/loss"]))

    return LogProgress()


def _seconds(max_time) -> float:
    """Lightning's max_time "DD:HH:MM:SS" (or a dict of timedelta kwargs) in seconds."""
    if isinstance(max_time, str):
        d, h, m, sec = (int(x) for x in max_time.split(":"))
        return float(((d * 24 + h) * 60 + m) * 60 + sec)
    import datetime

    return datetime.timedelta(**dict(max_time)).total_seconds()


def resolve_export_dir(export_dir: str | None) -> Path | None:
    if not export_dir:
        return None
    if export_dir == "bundled":
        from treedec.models.checkpoint import BUNDLED

        return BUNDLED["tiny-code"]
    return Path(export_dir)


def run(cfg: DictConfig) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from treedec.training.lm import CausalLMModule

    t0 = time.time()
    torch.set_num_threads(int(cfg.num_threads))
    L.seed_everything(int(cfg.seed), workers=True)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

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
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    if optim.get("time_budget_s") == "auto":  # the LR reaches its floor just before trainer.max_time stops the run
        optim["time_budget_s"] = max(60.0, _seconds(cfg.trainer.get("max_time")) - 60.0) if cfg.trainer.get("max_time") else None
    module = CausalLMModule(arch, max_steps=max_steps, seed=int(cfg.seed), **optim)
    log.info("model: %.2fM parameters", module.n_params / 1e6)

    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step}", save_last=True,
                           every_n_train_steps=int(cfg.ckpt_every_n_steps), save_top_k=1,
                           auto_insert_metric_name=False)
    trainer = hydra.utils.instantiate(cfg.trainer, default_root_dir=str(run_dir),
                                      callbacks=[ckpt, _progress_callback(int(cfg.log_every))],
                                      logger=CSVLogger(str(run_dir), name="csv", version="",
                                                       flush_logs_every_n_steps=int(cfg.log_every)))
    last = run_dir / "checkpoints" / "last.ckpt"
    resume = str(last) if last.is_file() else None
    start_step = 0
    if resume:
        log.info("resuming from %s", resume)
        start_step = int(torch.load(resume, map_location="cpu", weights_only=True)["global_step"])
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    fit_end = time.time()

    m = trainer.callback_metrics
    train_loss = float(m["train/loss"]) if "train/loss" in m else None
    val = trainer.validate(module, datamodule=dm, verbose=False)
    val_loss = float(val[0]["val/loss"]) if val else None
    steps = int(trainer.global_step)
    tokens = steps * dm.batch_size * dm.seq_len
    ckpt_path = run_dir / "checkpoints" / "final.ckpt"
    trainer.save_checkpoint(str(ckpt_path), weights_only=True)

    export = resolve_export_dir(cfg.export_dir)
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
        "tokens_per_s": (steps - start_step) * dm.batch_size * dm.seq_len / max(1e-9, fit_end - t0),
        "resumed_from": resume,
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
