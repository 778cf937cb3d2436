"""Job plumbing shared by ``treedec.pretrain`` and ``treedec.train``: progress logging, the checkpointing
trainer and the job around it (time budgets and the LR schedule: :mod:`treedec.training.schedule`; export
destinations: :mod:`treedec.models.paths`; the run dir's lock, finished metrics and resume checkpoint:
:mod:`treedec.training.run_dir`; exact resume, SIGTERM and requeue: :mod:`treedec.training.preemption`).

Preemptible jobs: ``checkpoints/last.ckpt`` (and ``step<N>.ckpt``) is written every
``ckpt_every_n_steps`` and a re-run of the same command in the same run dir continues from the
newest *readable* checkpoint (:func:`~treedec.training.run_dir.find_resume_checkpoint`), ending at the same
step count. A run dir whose job finished (``metrics.json``) is left alone when the command is re-run
(:func:`~treedec.training.run_dir.finished_metrics`); one live job per run dir
(:class:`~treedec.training.run_dir.RunDirLock`).

SIGTERM (a kill, ``scancel``, a preemption): the step being trained finishes, ``checkpoints/last.ckpt`` is
saved (:class:`~treedec.training.preemption.SaveOnSigterm`), and the job exits with status 143 (128 + SIGTERM,
as if the signal had killed it), without an export or ``metrics.json``, so ``train && bench`` and schedulers
see a job that did not finish; re-running the same command resumes. 143 always means neither was written: after
training ``train`` stops before its first write (:class:`~treedec.training.preemption.AfterFit`), and a SIGTERM
that lands once both are written finds the job complete (exit 0). Exit status 0 only when Lightning requeued
the SLURM job (its ``hpc_ckpt_*.ckpt`` was written during this job): the job goes on in its requeued run, and
SLURM ignores a requeued run's status. A job that submitit runs waits a while for submitit's requeue signal
before it exits; submitit's handler then requeues it and ends it.

Config keys read here: ``trainer`` (instantiated), ``ckpt_every_n_steps``, ``log_every``,
``logger`` (a mapping of logger configs, see ``conf/logger/``; absent: CSV in the run dir),
``callbacks`` (a mapping of extra callback configs), ``requeue`` (who requeues a SLURM job:
see :func:`~treedec.training.preemption.requeue_plugins`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, Timer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from treedec.config import validate
from treedec.data.datamodules import process_rank
from treedec.training.preemption import (
    ResumeState,
    SaveOnSigterm,
    await_submitit_requeue,
    ignore_sigterm_once_complete,
    preempted_status,
    requeue_plugins,
)
from treedec.training.run_dir import RunDirLock, SameShapeAsResumed, find_resume_checkpoint, finished_metrics

log = logging.getLogger("treedec.training")


def batch_ids(batch):
    """The token ids of a batch: the tensor itself, ``batch["input_ids"]`` or ``batch[0]``."""
    if isinstance(batch, dict):
        return batch["input_ids"] if "input_ids" in batch else batch["ids"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


class LogProgress(L.Callback):
    """Log step, loss, lr and tokens/s every ``every`` steps to the job log (the progress bar is off).

    Under DDP only rank 0 logs: its loss, and the tokens/s of all ranks together.
    """

    def __init__(self, every: int):
        self.every, self.t, self.step0 = every, time.time(), None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:  # DDP: one progress line per step, from rank 0
            return
        step = trainer.global_step
        if self.step0 is None:
            self.step0, self.t = step, time.time()
        if step % self.every == 0 and step != self.step0:
            dt = time.time() - self.t
            ids = batch_ids(batch)
            tok_s = (step - self.step0) * ids.numel() * (ids.shape[1] - 1) / ids.shape[1] / max(dt, 1e-9)
            tok_s *= trainer.world_size  # every rank trains on a batch like this one
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s", step, trainer.max_steps,
                     float(outputs["loss"]), lr, tok_s)
            self.step0, self.t = step, time.time()

    def on_validation_epoch_end(self, trainer, pl_module):
        if "val/loss" in trainer.callback_metrics and not trainer.sanity_checking and trainer.is_global_zero:
            log.info("step %d  val/loss %.4f", trainer.global_step, float(trainer.callback_metrics["val/loss"]))


def stop_reason(trainer: L.Trainer) -> str:
    """Why ``fit`` returned: ``max_steps``, ``max_time`` or ``other`` (max_epochs, early stopping, ...)."""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return "max_steps"
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None and (timer.time_remaining("train") or 0.0) <= 0:
        return "max_time"
    return "other"


def run_job(cfg: DictConfig, name: str, body: Callable[[DictConfig, Path], dict]) -> dict:
    """Check every option, hold the run dir, and run ``body(cfg, run_dir)`` unless the job there already finished."""
    validate(cfg, name)  # every key and value (and a GPU trainer without a GPU), before anything loads
    with job(cfg) as run_dir:
        done = finished_metrics(run_dir, cfg.trainer)
        if done is not None:
            log.warning("the job in %s already finished (step %s, %s): nothing to do; its metrics.json and export "
                        "stay as they are (raise trainer.max_steps to train on, or pick a new hydra.run.dir)",
                        run_dir, done.get("steps"), run_dir / "metrics.json")
            return done
        started = time.time()
        try:
            metrics = body(cfg, run_dir)
            ignore_sigterm_once_complete()  # (its export and metrics.json are written: nothing left to stop)
            return metrics
        except SIGTERMException:  # Lightning's, a SystemExit of status 0: a preempted job must not read as done
            status = preempted_status(run_dir, started)
            log.warning("stopped by SIGTERM before the end: no export and no metrics.json; the checkpoints in %s are "
                        "kept, and the same command (same hydra.run.dir) resumes. Exit status %d%s", run_dir,
                        status, " (Lightning requeued this SLURM job)" if status == 0 else " (128 + SIGTERM)")
            await_submitit_requeue()
            raise SystemExit(status) from None



def build_loggers(cfg: DictConfig, run_dir: Path):
    """``cfg.logger``: a mapping name -> logger config (``conf/logger/``); absent: a CSV log in the run dir."""
    if cfg.get("logger") is None:
        return CSVLogger(str(run_dir), name="csv", version="", flush_logs_every_n_steps=int(cfg.log_every))
    loggers = [hydra.utils.instantiate(c) for c in cfg.logger.values() if c is not None]
    return loggers or False


def build_trainer(cfg: DictConfig, run_dir: Path, *callbacks: L.Callback) -> tuple[L.Trainer, str | None]:
    """The configured Trainer with ``last.ckpt`` checkpointing, the configured loggers (CSV in the run
    dir by default) and extra callbacks, and the checkpoint to resume from (None on a fresh run)."""
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step}", save_last=True,
                           every_n_train_steps=int(cfg.ckpt_every_n_steps), save_top_k=1,
                           auto_insert_metric_name=False)
    every = int(cfg.log_every)
    extra = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if cfg.trainer.get("enable_progress_bar") and not any(isinstance(c, ProgressBar) for c in extra):
        if importlib.util.find_spec("rich") is not None:  # else Lightning's tqdm bar
            extra.append(RichProgressBar())
    kwargs = {}
    trainer_plugins = hydra.utils.instantiate(cfg.trainer.get("plugins"), _convert_="all") or []
    trainer_plugins = list(trainer_plugins) if isinstance(trainer_plugins, (list, tuple)) else [trainer_plugins]
    added = requeue_plugins(cfg, trainer_plugins)
    if added:
        kwargs["plugins"] = trainer_plugins + added
    on_sigterm = SaveOnSigterm(run_dir / "checkpoints" / "last.ckpt")  # last: after every other batch-end hook
    resume = find_resume_checkpoint(run_dir)
    trainer = hydra.utils.instantiate(
        cfg.trainer, default_root_dir=str(run_dir),
        callbacks=[ckpt, ResumeState(), SameShapeAsResumed(resume), *callbacks, *extra, LogProgress(every), on_sigterm],
        logger=build_loggers(cfg, run_dir), **kwargs)
    if resume:
        log.info("resuming from %s", resume)
    return trainer, resume


@contextlib.contextmanager
def job(cfg: DictConfig) -> Iterator[Path]:
    """Threads, seeds, the run dir and (on rank 0) its lock, for the duration of a training job."""
    torch.set_num_threads(int(cfg.num_threads))
    L.seed_everything(int(cfg.seed), workers=True)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir).acquire() if process_rank() == 0 else None  # DDP ranks > 0 run inside rank 0's job
    try:
        yield run_dir
    finally:
        if lock is not None:
            lock.release()


def use_hint(kind: str, path: Path, target: str | None = None) -> str:
    """The overrides that use an export: ``draft.path=...`` for a head, ``model.path=...`` for a model."""
    if kind == "draft":
        model = "" if target in (None, "tiny-code") else f"model=hf model.path={target} "
        return f"python -m treedec.generate {model}draft=path draft.path={path}"
    return (f"python -m treedec.generate model=hf model.path={path} draft=path draft.path=HEAD "
            f"(HEAD: a head trained for it by python -m treedec.train model.path={path})")
