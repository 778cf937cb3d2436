"""Job plumbing shared by ``treedec.pretrain`` and ``treedec.train``: progress logging, the
checkpointing trainer, automatic resume, time budgets and export paths.

Preemptible jobs: ``checkpoints/last.ckpt`` (and ``step<N>.ckpt``) is written every
``ckpt_every_n_steps`` and a re-run of the same command in the same run dir continues from the
newest *readable* checkpoint (:func:`find_resume_checkpoint`), ending at the same step count.
Lightning writes a checkpoint to a temporary file and then moves it into place; the move is an
atomic rename only when the temporary directory (``$TMPDIR``, /tmp) is on the run dir's file
system, otherwise it is a copy that a kill can cut short. So every candidate is opened before
resuming, and a truncated ``last.ckpt`` is skipped with a warning in favour of the newest intact
one (an error when none is intact).

Config keys read here: ``trainer`` (instantiated), ``ckpt_every_n_steps``, ``log_every``,
``logger`` (a mapping of logger configs, see ``conf/logger/``; absent: CSV in the run dir),
``callbacks`` (a mapping of extra callback configs), ``requeue`` (who requeues a SLURM job:
see :func:`requeue_plugins`).
"""
from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import time
from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

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


def find_resume_checkpoint(run_dir: str | os.PathLike) -> str | None:
    """The newest resumable checkpoint of a run dir, or None on a fresh run.

    Candidates: ``checkpoints/last*.ckpt``, ``checkpoints/step*.ckpt`` and Lightning's SLURM
    ``hpc_ckpt_*.ckpt`` (written when Lightning owns the requeue signal). Each is opened with
    ``torch.load(weights_only=True, mmap=True)`` (cheap: tensors are mapped, not read), which
    fails on a truncated file; unreadable or weights-only ones are skipped with a warning. The
    highest ``global_step`` wins (``last.ckpt`` on a tie). Raises when checkpoints exist but
    none is usable, rather than silently starting over and overwriting them.
    """
    import torch

    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    cands = sorted({*ckpt_dir.glob("last*.ckpt"), *ckpt_dir.glob("step*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")})
    good, bad = [], []
    for p in cands:
        if not p.is_file():
            continue
        try:
            state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            if "optimizer_states" not in state or "global_step" not in state:
                raise ValueError("not a resumable Lightning checkpoint (weights only?)")
            good.append((int(state["global_step"]), p.name == "last.ckpt", p.stat().st_mtime_ns, p))
            del state
        except Exception as exc:  # truncated / corrupt / foreign file
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            bad.append((p, msg))
            log.warning("checkpoint %s is unusable (%s): ignoring it", p, msg)
    if not good:
        if bad:
            listing = "; ".join(f"{p.name}: {m}" for p, m in bad)
            raise RuntimeError(f"cannot resume the run in {run_dir}: no checkpoint there is readable ({listing}). "
                               f"They are truncated or corrupt (an interrupted copy?); move them away to start over.")
        return None
    step, _, _, best = max(good)
    if bad:
        log.warning("resuming from %s (step %d), the newest intact checkpoint", best, step)
    return str(best)


def requeue_plugins(cfg: DictConfig, trainer_plugins=()) -> list:
    """Trainer plugins so that exactly one party requeues a preempted / timed-out SLURM job.

    ``cfg.requeue``: ``auto`` (default) = ``submitit`` when launched by submitit (the Hydra
    ``hydra/launcher=slurm`` launcher: ``$SUBMITIT_EXECUTOR`` is ``slurm``), else ``lightning``;
    ``submitit``: submitit handles its signal (USR2 ``signal_delay_s`` before the limit), checkpoints
    the launcher and requeues, so Lightning's SLURM auto-requeue is switched off
    (``SLURMEnvironment(auto_requeue=False)``); ``lightning``: Lightning's default on SLURM
    (SIGUSR1 -> ``hpc_ckpt_<n>.ckpt`` + ``scontrol requeue``; sbatch needs ``--signal=SIGUSR1@90``);
    ``none``: nobody requeues. Off SLURM nothing is added.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    owner = str(cfg.get("requeue", "auto") or "none")
    if owner not in ("auto", "submitit", "lightning", "none"):
        raise ValueError(f"requeue must be auto, submitit, lightning or none, not {owner!r}")
    if not SLURMEnvironment.detect() or any(isinstance(p, SLURMEnvironment) for p in trainer_plugins):
        return []
    if owner == "auto":
        owner = "submitit" if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" else "lightning"
    log.info("SLURM job: the requeue signal is handled by %s", owner)
    return [] if owner == "lightning" else [SLURMEnvironment(auto_requeue=False)]


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
    trainer = hydra.utils.instantiate(
        cfg.trainer, default_root_dir=str(run_dir), callbacks=[ckpt, *callbacks, *extra, LogProgress(every)],
        logger=build_loggers(cfg, run_dir), **kwargs)
    resume = find_resume_checkpoint(run_dir)
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
