"""What a training job's run dir holds, read before the job starts: its lock (one live job per run dir,
:class:`RunDirLock`), the ``metrics.json`` of a job that already finished (:func:`finished_metrics`), and the
newest *readable* checkpoint to resume from (:func:`find_resume_checkpoint`), which must have been written with
this job's head kind and sizes (:class:`SameShapeAsResumed`). A run dir that cannot be used as asked is a
:class:`JobError`.

Lightning writes a checkpoint to a temporary file and then moves it into place; the move is an atomic rename
only when the temporary directory (``$TMPDIR``, /tmp) is on the run dir's file system, otherwise it is a copy
that a kill can cut short. So every candidate is opened before resuming, and a truncated ``last.ckpt`` is
skipped with a warning in favour of the newest intact one (an error when none is intact).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from treedec.training.schedule import seconds

log = logging.getLogger("treedec.training")
LOCK_NAME = ".lock"


class JobError(ValueError):
    """A job that cannot run as asked (run dir in use, unreadable checkpoints, bad export target).

    A ValueError, so ``treedec.cli.entry`` prints it as one ``Error: ...`` line."""



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


# The hyperparameters a checkpoint's weights are shaped by, and the train/pretrain keys that set them.
SHAPE_SETTINGS = {"draft": "draft_arch", "arch": "model_arch", "target_path": "model.path", "init_from": "init_from"}


def _show(value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def _settings(hparams: dict) -> dict[str, object]:
    """The shape settings of a module's hyperparameters, by the key a user sets (``draft_arch.kind`` ...)."""
    out: dict[str, object] = {}
    for name, key in SHAPE_SETTINGS.items():
        if name not in hparams:
            continue
        value = hparams[name]
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def check_same_shape(checkpoint: str | os.PathLike, hparams: dict) -> None:
    """Raise :class:`JobError` naming each setting that differs between this job (its module's ``hparams``) and
    the run whose ``checkpoint`` it would resume (the head kind and sizes, the model's architecture, the target,
    the start head): that checkpoint's weights do not fit this job's module."""
    path = Path(checkpoint)
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters") or {}
    before, now = _settings(saved), _settings(dict(hparams))
    differ = [k for k in dict.fromkeys([*now, *before]) if k in now and before.get(k) != now.get(k)
              and (k in before or now[k] is not None)]
    if not differ:
        return
    if "draft_arch.kind" in differ:  # another kind of head: its sizes differ as a consequence
        differ = ["draft_arch.kind"]
    here = ", ".join(f"{k}={_show(now.get(k))}" for k in differ)
    then = ", ".join(f"{k}={_show(before.get(k))}" for k in differ)
    fix = " ".join(f"draft_arch={_show(before.get(k))}" if k == "draft_arch.kind" else f"{k}={_show(before.get(k))}"
                   for k in differ)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    raise JobError(f"this job has {here}, but the run in {run_dir} that it would resume has {then} (the settings "
                   f"its checkpoint {path.name} was trained with): pass {fix} to resume that run, or a new "
                   f"hydra.run.dir to start another; the checkpoints there are kept")


class SameShapeAsResumed(L.Callback):
    """Before Lightning loads the checkpoint to resume (at ``setup``): :func:`check_same_shape`, so a changed head
    kind or size is one line naming the setting, not a state-dict traceback."""

    def __init__(self, checkpoint: str | os.PathLike | None):
        self.checkpoint = checkpoint

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.checkpoint is not None and stage == "fit":
            check_same_shape(self.checkpoint, dict(pl_module.hparams))
