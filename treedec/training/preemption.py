"""Surviving a kill: exact resume, SIGTERM, SLURM requeue.

Exact resume: the checkpoint also holds every RNG state (:class:`ResumeState`) and the position of the training
loader within its epoch (:class:`treedec.data.datamodules.ResumableLoader`), so a job killed and resumed ends
with the same weights, bit for bit, as one that ran through (CPU, one process).

SIGTERM: the step being trained finishes, ``checkpoints/last.ckpt`` is saved (:class:`SaveOnSigterm`), and the
job exits with status 143 (:data:`PREEMPTED`), or 0 when Lightning requeued the SLURM job
(:func:`preempted_status`); a job that submitit runs first waits for submitit's requeue signal
(:func:`await_submitit_requeue`). Who requeues a SLURM job: :func:`requeue_plugins`.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

log = logging.getLogger("treedec.training")


def rng_states() -> dict:
    """Every global RNG state as plain data (torch, CUDA, numpy, python ``random``): weights_only-loadable."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": random.getstate()}


def set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))


class ResumeState(L.Callback):
    """Saves every RNG state with each checkpoint and restores it when a resumed run starts training,
    so the resumed steps draw exactly what the uninterrupted run drew after that checkpoint."""

    def __init__(self):
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        return {"rng": rng_states()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict.get("rng")

    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None


PREEMPTED = 128 + signal.SIGTERM  # 143: the status a shell reports for a process that SIGTERM ended


class SaveOnSigterm(L.Callback):
    """On SIGTERM, ``checkpoints/last.ckpt`` of the step just trained, so the re-run resumes from it rather than
    from the last periodic checkpoint (up to ``ckpt_every_n_steps`` earlier).

    Saved at the end of the training batch, where ModelCheckpoint saves, so the resume is as exact as from any
    checkpoint (Lightning then stops the fit with its SIGTERMException); a SIGTERM during validation saves when
    that exception stops it. One process only: DDP ranks do not see the signal at the same step, and a save is
    a collective, so there the periodic checkpoints (and Lightning's requeue checkpoint) stay the resume point.
    """

    def __init__(self, path: str | os.PathLike):
        self.path, self.saved_step = Path(path), None

    def _save(self, trainer: L.Trainer) -> None:
        if self.saved_step is None and trainer.world_size == 1:
            trainer.save_checkpoint(self.path)
            self.saved_step = trainer.global_step
            log.warning("SIGTERM: saved step %d to %s (re-run the same command to resume from it)",
                        trainer.global_step, self.path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.received_sigterm:
            self._save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self._save(trainer)


SUBMITIT_GRACE_S = 30.0  # SLURM's default KillWait: how long after a SIGTERM a job is killed anyway


def await_submitit_requeue(seconds: float = SUBMITIT_GRACE_S) -> None:
    """In a job that submitit runs, wait (at most ``seconds``) for its requeue signal before the job exits.

    SLURM preempts a submitit job with SIGTERM and submitit's USR2, one right after the other, in either order.
    SIGTERM alone stops the training here (after saving ``last.ckpt``); exiting at once could beat the USR2,
    and a job that is gone when it arrives is never requeued. submitit's USR2 handler requeues the job and ends
    this process; a plain ``scancel`` (SIGTERM only) exits after the wait. Outside submitit this returns at once."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    log.warning("submitit runs this job: waiting up to %.0f s for its requeue signal (%s)", seconds,
                os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # submitit's handler raises SystemExit in here
        time.sleep(0.05)


class AfterFit:
    """From the end of ``fit`` to the job's last write, where Lightning no longer stops the job on SIGTERM: a SIGTERM
    is noted, not fatal. :meth:`commit`, just before the first write, stops a job that received one with Lightning's
    SIGTERMException (exit 143: checkpoints kept, no export and no metrics.json); from there on the writes finish and
    the job is complete (exit 0). A command-line job (Hydra's single run, which only exits after this) then ignores
    SIGTERM, so a signal that lands after its writes cannot turn a finished job into a 143; elsewhere (a sweep,
    a Python caller) the previous handler comes back."""

    def __enter__(self) -> "AfterFit":
        self.received, self._committed = False, False
        self._main = threading.current_thread() is threading.main_thread()
        self._prev = signal.getsignal(signal.SIGTERM)
        if self._main:  # (Lightning's own handler, inside validate(), calls this one too)
            signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = True

    def commit(self) -> None:
        """Stop here if a SIGTERM came since ``fit`` (nothing is written yet); else the job will complete."""
        if self.received:
            log.warning("SIGTERM after training, before the export and metrics.json: stopping without them")
            raise SIGTERMException
        self._committed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._main:
            signal.signal(signal.SIGTERM, self._prev)
            if exc_type is None and self._committed:
                ignore_sigterm_once_complete()


def ignore_sigterm_once_complete() -> None:
    """A job whose export and metrics.json are written is complete: in a command-line job of one run (``python -m
    treedec.train ...``, not a ``-m`` sweep, whose next job must stop on SIGTERM), which only exits from here, a
    SIGTERM is ignored, so it cannot end a finished job with 143."""
    if threading.current_thread() is threading.main_thread() and HydraConfig.initialized() and \
            HydraConfig.get().mode == RunMode.RUN:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def preempted_status(run_dir: str | os.PathLike, since: float) -> int:
    """The exit status of a job that SIGTERM stopped: 0 when Lightning requeued it (on SLURM's requeue signal it
    writes ``hpc_ckpt_<n>.ckpt`` into the run dir, then runs ``scontrol requeue``): the job goes on in its
    requeued run, and SLURM ignores the status of a run it requeued. Else 143 (128 + SIGTERM), so that
    ``train && bench`` and schedulers see a job that did not finish."""
    requeued = any(p.stat().st_mtime >= since for p in Path(run_dir).glob("hpc_ckpt_*.ckpt"))
    return 0 if requeued else PREEMPTED


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
    owner = str(cfg.get("requeue", "auto") or "none")
    if owner not in ("auto", "submitit", "lightning", "none"):
        raise ValueError(f"requeue must be auto, submitit, lightning or none, not {owner!r}")
    if not SLURMEnvironment.detect() or any(isinstance(p, SLURMEnvironment) for p in trainer_plugins):
        return []
    if owner == "auto":
        owner = "submitit" if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" else "lightning"
    log.info("SLURM job: the requeue signal is handled by %s", owner)
    return [] if owner == "lightning" else [SLURMEnvironment(auto_requeue=False)]

