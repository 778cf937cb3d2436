"""The learning-rate schedule both training modules share: linear warm-up, then cosine decay to a floor,
advanced by whichever is further along, the step count or the wall time.

A job capped by ``trainer.max_time`` (``time_budget_s: auto``, :func:`time_budget`) thus still ends on the
LR floor instead of being cut off mid-decay; the elapsed time is checkpointed, so a resumed job goes on
with the schedule where the killed one left it.
"""
from __future__ import annotations

import math
import time

import lightning as L

from treedec.config.jobs import seconds  # the max_time parser the config check uses too


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                       time_frac: float = 0.0) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``min_lr_ratio``.

    Decay progress is the larger of the step fraction ``(step - warmup) / (total - warmup)``
    and ``time_frac`` (elapsed / time budget), so a run capped by wall time still ends on the floor.
    """
    if step < warmup_steps:
        return (step + 1) / max(1, warmup_steps)
    t = max((step - warmup_steps) / max(1, total_steps - warmup_steps), time_frac)
    t = min(1.0, t)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def time_budget(optim: dict, trainer_cfg) -> dict:
    """Resolve ``time_budget_s: auto`` to ``trainer.max_time`` - 60 s, so the LR ends on its floor in time."""
    if optim.get("time_budget_s") == "auto":
        max_time = trainer_cfg.get("max_time")
        optim["time_budget_s"] = max(60.0, seconds(max_time) - 60.0) if max_time else None
    return optim


class WallTimeScheduled(L.LightningModule):
    """A LightningModule whose optimizer's LR is ``hparams.lr`` times :func:`cosine_with_warmup`, set before
    every step; reads ``hparams`` ``lr``, ``warmup_steps``, ``max_steps``, ``min_lr_ratio``, ``time_budget_s``."""

    _t_start: float | None = None  # when this job's training began
    _elapsed_base: float = 0.0  # training wall time of earlier jobs (restored from the checkpoint)

    @property
    def train_elapsed_s(self) -> float:
        return self._elapsed_base + (time.time() - self._t_start if self._t_start is not None else 0.0)

    def lr_multiplier(self, step: int | None = None) -> float:
        hp = self.hparams
        frac = self.train_elapsed_s / hp.time_budget_s if hp.time_budget_s else 0.0
        return cosine_with_warmup(self.global_step if step is None else step, hp.warmup_steps, hp.max_steps,
                                  hp.min_lr_ratio, frac)

    def on_train_start(self) -> None:
        self._t_start = time.time()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        lr = self.hparams.lr * self.lr_multiplier()
        for g in self.optimizers(use_pl_optimizer=False).param_groups:
            g["lr"] = lr

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["train_elapsed_s"] = float(self.train_elapsed_s)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._elapsed_base = float(checkpoint.get("train_elapsed_s", 0.0))


__all__ = ["WallTimeScheduled", "cosine_with_warmup", "seconds", "time_budget"]
