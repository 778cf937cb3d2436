"""Job plumbing shared by ``treedec.pretrain`` and ``treedec.train``: progress logging, the
checkpointing trainer, exact resume, the run-dir lock and atomic exports (time budgets and the LR
schedule: :mod:`treedec.training.schedule`; export destinations: :mod:`treedec.models.paths`).

Preemptible jobs: ``checkpoints/last.ckpt`` (and ``step<N>.ckpt``) is written every
``ckpt_every_n_steps`` and a re-run of the same command in the same run dir continues from the
newest *readable* checkpoint (:func:`find_resume_checkpoint`), ending at the same step count.
Lightning writes a checkpoint to a temporary file and then moves it into place; the move is an
atomic rename only when the temporary directory (``$TMPDIR``, /tmp) is on the run dir's file
system, otherwise it is a copy that a kill can cut short. So every candidate is opened before
resuming, and a truncated ``last.ckpt`` is skipped with a warning in favour of the newest intact
one (an error when none is intact).

Exact resume: the checkpoint also holds every RNG state (:class:`ResumeState`) and the position of
the training loader within its epoch (:class:`treedec.data.datamodules.ResumableLoader`), so a job
killed and resumed ends with the same weights, bit for bit, as one that ran through (CPU, one
process). A run dir whose job finished (``metrics.json``) is left alone when the command is re-run
(:func:`finished_metrics`); one live job per run dir (:class:`RunDirLock`).

SIGTERM (a kill, ``scancel``, a preemption): the step being trained finishes, ``checkpoints/last.ckpt`` is
saved (:class:`SaveOnSigterm`), and the job exits with status 143 (128 + SIGTERM, as if the signal had
killed it), without an export or ``metrics.json``, so ``train && bench`` and schedulers see a job that did
not finish; re-running the same command resumes. Exit status 0 only when Lightning requeued the SLURM job
(its ``hpc_ckpt_*.ckpt`` was written during this job): the job goes on in its requeued run, and SLURM
ignores a requeued run's status (:func:`preempted_status`). A job that submitit requeues is ended by
submitit's own handler.

Config keys read here: ``trainer`` (instantiated), ``ckpt_every_n_steps``, ``log_every``,
``logger`` (a mapping of logger configs, see ``conf/logger/``; absent: CSV in the run dir),
``callbacks`` (a mapping of extra callback configs), ``requeue`` (who requeues a SLURM job:
see :func:`requeue_plugins`).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

from treedec.training.schedule import seconds

log = logging.getLogger("treedec.training")
LOCK_NAME = ".lock"


class JobError(ValueError):
    """A job that cannot run as asked (run dir in use, unreadable checkpoints, bad export target).

    A ValueError, so ``treedec.cli.entry`` prints it as one ``Error: ...`` line."""


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


# ------------------------------------------------------------------------------------ run-dir lock
def _proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state field on (Linux), None where unavailable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _holder_alive(holder: dict) -> bool:
    """Whether the job recorded in a lock file still runs (a dead pid, a zombie or a recycled pid: no),
    for file systems without ``flock``. A holder on another host cannot be checked: taken as alive."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    return stat[0] != "Z" and str(holder.get("start", stat[19])) == stat[19]


class RunDirLock:
    """``<run dir>/.lock``: at most one live job per run dir.

    Held with ``flock`` for the job's lifetime (the kernel drops it when the process dies; where
    the file system has no ``flock``, the recorded pid is checked instead); the file holds the
    job's pid, host, start time and command, for the messages. A second job into
    the same run dir refuses to start while the first runs; a lock left by a dead job (``kill -9``)
    is taken over with a warning. Removed when the job ends.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None

    def _read(self, fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunDirLock":
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked, flocked = True, True
            except BlockingIOError:
                locked, flocked = False, True
            except OSError:  # no flock on this file system: the recorded pid alone decides
                locked, flocked = True, False
            holder = self._read(fd)
            mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
            # With flock the kernel answers (a dead holder, here or on another node, holds nothing).
            if not locked or (not flocked and holder and not mine and _holder_alive(holder)):
                os.close(fd)
                who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
                       f"{holder.get('cmd')}") if holder else "a process that is still writing its lock"
                raise JobError(f"run dir {self.path.parent} is in use by another job ({who}); wait for it to end "
                               f"or give this job its own hydra.run.dir (a lock left by a job that is not running "
                               f"is taken over by itself)")
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder ended and removed the file between our open and flock: again
        if holder and not mine:
            log.warning("run dir %s: taking over the stale lock of pid %s (host %s, started %s), which is not "
                        "running any more", self.path.parent, holder.get("pid"), holder.get("host"),
                        holder.get("started"))
        stat = _proc_stat(os.getpid())
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": stat[19] if stat else None,
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "cmd": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------ exact resume
def rng_states() -> dict:
    """Every global RNG state as plain data (torch, CUDA, numpy, python ``random``): weights_only-loadable."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": random.getstate()}


def set_rng_states(state: dict) -> None:
    import numpy as np
    import torch

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
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException):
            self._save(trainer)


def preempted_status(run_dir: str | os.PathLike, since: float) -> int:
    """The exit status of a job that SIGTERM stopped: 0 when Lightning requeued it (on SLURM's requeue signal it
    writes ``hpc_ckpt_<n>.ckpt`` into the run dir, then runs ``scontrol requeue``): the job goes on in its
    requeued run, and SLURM ignores the status of a run it requeued. Else 143 (128 + SIGTERM), so that
    ``train && bench`` and schedulers see a job that did not finish."""
    requeued = any(p.stat().st_mtime >= since for p in Path(run_dir).glob("hpc_ckpt_*.ckpt"))
    return 0 if requeued else PREEMPTED


def check_accelerator(trainer_cfg: DictConfig) -> None:
    """A GPU trainer (``trainer=gpu | ddp | fsdp``) on a machine without one is one clear error before any data or
    model loads (Lightning would say "No supported gpu backend found!" with a traceback, after both)."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    acc = str(trainer_cfg.get("accelerator") or "auto")
    needs = {"gpu": (CUDAAccelerator, MPSAccelerator), "cuda": (CUDAAccelerator,), "mps": (MPSAccelerator,)}
    if acc in needs and not any(a.is_available() for a in needs[acc]):
        raise JobError(f"trainer.accelerator={acc} needs a GPU, and this machine has none that Lightning can use "
                       f"(no {acc if acc != 'gpu' else 'CUDA or MPS'} device): run on the CPU with "
                       f"trainer.accelerator=cpu (trainer=cpu for one process; trainer=ddp trainer.accelerator=cpu "
                       f"trainer.devices=2 for DDP over CPU processes)")


def stop_reason(trainer: L.Trainer) -> str:
    """Why ``fit`` returned: ``max_steps``, ``max_time`` or ``other`` (max_epochs, early stopping, ...)."""
    from lightning.pytorch.callbacks import Timer

    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return "max_steps"
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None and (timer.time_remaining("train") or 0.0) <= 0:
        return "max_time"
    return "other"


def run_job(cfg: DictConfig, name: str, body: Callable[[DictConfig, Path], dict]) -> dict:
    """Check every option, hold the run dir, and run ``body(cfg, run_dir)`` unless the job there already finished."""
    from treedec.training.schema import check_job_config

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    check_job_config(cfg, name)  # every key and value, before anything loads
    check_accelerator(cfg.trainer)
    with job(cfg) as run_dir:
        done = finished_metrics(run_dir, cfg.trainer)
        if done is not None:
            log.warning("the job in %s already finished (step %s, %s): nothing to do; its metrics.json and export "
                        "stay as they are (raise trainer.max_steps to train on, or pick a new hydra.run.dir)",
                        run_dir, done.get("steps"), run_dir / "metrics.json")
            return done
        started = time.time()
        try:
            return body(cfg, run_dir)
        except SIGTERMException:  # Lightning's, a SystemExit of status 0: a preempted job must not read as done
            status = preempted_status(run_dir, started)
            log.warning("stopped by SIGTERM before the end: no export and no metrics.json; the checkpoints in %s are "
                        "kept, and the same command (same hydra.run.dir) resumes. Exit status %d%s", run_dir,
                        status, " (Lightning requeued this SLURM job)" if status == 0 else " (128 + SIGTERM)")
            raise SystemExit(status) from None


def finished_metrics(run_dir: str | os.PathLike, trainer_cfg: DictConfig) -> dict | None:
    """The ``metrics.json`` of a run dir whose job already ended where this config would end it, else None.

    Re-running a finished job then does nothing (it neither retrains nor rewrites its results);
    raising ``trainer.max_steps`` (and, for a run the time cap stopped, ``trainer.max_time``) trains on.
    """
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
        steps = int(m["steps"])
    except (ValueError, KeyError, TypeError):
        return None  # not a result of ours: let the job run (and rewrite it)
    max_steps = trainer_cfg.get("max_steps")
    more_steps = max_steps in (None, -1) or int(max_steps) > steps
    max_time = trainer_cfg.get("max_time")
    if m.get("stopped_by") == "max_time":
        done_time = m.get("max_time_s")
        more_time = not max_time or done_time is None or seconds(max_time) > float(done_time)
    else:
        more_time = True
    return None if (more_steps and more_time) else m


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
            raise JobError(f"cannot resume the run in {run_dir}: no checkpoint there is readable ({listing}). "
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
    on_sigterm = SaveOnSigterm(run_dir / "checkpoints" / "last.ckpt")  # last: after every other batch-end hook
    trainer = hydra.utils.instantiate(
        cfg.trainer, default_root_dir=str(run_dir),
        callbacks=[ckpt, ResumeState(), *callbacks, *extra, LogProgress(every), on_sigterm],
        logger=build_loggers(cfg, run_dir), **kwargs)
    resume = find_resume_checkpoint(run_dir)
    if resume:
        log.info("resuming from %s", resume)
    return trainer, resume


@contextlib.contextmanager
def job(cfg: DictConfig) -> Iterator[Path]:
    """Threads, seeds, the run dir and (on rank 0) its lock, for the duration of a training job."""
    import torch

    from treedec.data.datamodules import process_rank

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
