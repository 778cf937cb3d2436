"""Job plumbing shared by ``treedec.pretrain`` and ``treedec.train``: progress logging, the
checkpointing trainer, automatic resume, time budgets and export paths.

Preemptible jobs: ``checkpoints/last.ckpt`` is written every ``ckpt_every_n_steps`` (Lightning
writes it atomically: a temporary file, then a rename) and a re-run of the same command in the
same run dir continues from it, ending at the same step count.
"""
from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

log = logging.getLogger("treedec.training")


class LogProgress(L.Callback):
    """Log step, loss, lr and tokens/s every ``every`` steps to the job log (the progress bar is off)."""

    def __init__(self, every: int):
        self.every, self.t, self.step0 = every, time.time(), None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.step0 is None:
            self.step0, self.t = step, time.time()
        if step % self.every == 0 and step != self.step0:
            dt = time.time() - self.t
            tok_s = (step - self.step0) * batch.numel() * (batch.shape[1] - 1) / batch.shape[1] / max(dt, 1e-9)
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s", step, trainer.max_steps,
                     float(outputs["loss"]), lr, tok_s)
            self.step0, self.t = step, time.time()

    def on_validation_epoch_end(self, trainer, pl_module):
        if "val/loss" in trainer.callback_metrics and not trainer.sanity_checking:
            log.info("step %d  val/loss %.4f", trainer.global_step, float(trainer.callback_metrics["val/loss"]))


def seconds(max_time) -> float:
    """Lightning's max_time "DD:HH:MM:SS" (or a dict of timedelta kwargs) in seconds."""
    if isinstance(max_time, str):
        d, h, m, sec = (int(x) for x in max_time.split(":"))
        return float(((d * 24 + h) * 60 + m) * 60 + sec)
    return datetime.timedelta(**dict(max_time)).total_seconds()


def time_budget(optim: dict, trainer_cfg: DictConfig) -> dict:
    """Resolve ``time_budget_s: auto`` to ``trainer.max_time`` - 60 s, so the LR ends on its floor in time."""
    if optim.get("time_budget_s") == "auto":
        max_time = trainer_cfg.get("max_time")
        optim["time_budget_s"] = max(60.0, seconds(max_time) - 60.0) if max_time else None
    return optim


def export_path(export_dir: str | None, bundled: Path) -> Path | None:
    """``null`` -> no export; ``bundled`` -> the asset directory shipped with treedec; else the path."""
    if not export_dir:
        return None
    return bundled if export_dir == "bundled" else Path(export_dir)


def build_trainer(cfg: DictConfig, run_dir: Path, *callbacks: L.Callback) -> tuple[L.Trainer, str | None]:
    """The configured Trainer with ``last.ckpt`` checkpointing and a CSV log in the run dir, and the
    checkpoint to resume from (None on a fresh run)."""
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step}", save_last=True,
                           every_n_train_steps=int(cfg.ckpt_every_n_steps), save_top_k=1,
                           auto_insert_metric_name=False)
    every = int(cfg.log_every)
    trainer = hydra.utils.instantiate(
        cfg.trainer, default_root_dir=str(run_dir), callbacks=[ckpt, *callbacks, LogProgress(every)],
        logger=CSVLogger(str(run_dir), name="csv", version="", flush_logs_every_n_steps=every))
    last = run_dir / "checkpoints" / "last.ckpt"
    resume = str(last) if last.is_file() else None
    if resume:
        log.info("resuming from %s", resume)
    return trainer, resume


def start_job(cfg: DictConfig) -> Path:
    """Threads, seeds and the run dir: the first lines of every training job."""
    import torch

    torch.set_num_threads(int(cfg.num_threads))
    L.seed_everything(int(cfg.seed), workers=True)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
