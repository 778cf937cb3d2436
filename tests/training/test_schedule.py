"""The one LR schedule of both training modules: warm-up, cosine to the floor, advanced by steps or wall time."""
from __future__ import annotations

import math

import pytest
import torch

from treedec.training.schedule import WallTimeScheduled, cosine_with_warmup, seconds, time_budget


def test_cosine_with_warmup_by_steps_and_by_time():
    assert cosine_with_warmup(0, 4, 104, 0.1) == pytest.approx(0.25)
    assert cosine_with_warmup(4, 4, 104, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(54, 4, 104, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # half way
    assert cosine_with_warmup(104, 4, 104, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(10, 4, 104, 0.1, time_frac=1.0) == pytest.approx(0.1)  # the time budget is spent
    assert cosine_with_warmup(54, 4, 104, 0.1, time_frac=0.2) == cosine_with_warmup(54, 4, 104, 0.1)  # steps lead


def test_time_budget_auto_is_max_time_less_a_minute():
    assert seconds("00:01:00:30") == 3630.0 and seconds({"minutes": 2}) == 120.0
    assert time_budget({"time_budget_s": "auto"}, {"max_time": "00:00:10:00"})["time_budget_s"] == 540.0
    assert time_budget({"time_budget_s": "auto"}, {"max_time": None})["time_budget_s"] is None


class Tiny(WallTimeScheduled):
    def __init__(self, **hp):
        super().__init__()
        self.save_hyperparameters(hp)


def test_a_module_checkpoints_its_elapsed_time_and_resumes_the_schedule(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("treedec.training.schedule.time.time", lambda: clock[0])
    m = Tiny(lr=1.0, warmup_steps=0, max_steps=10**6, min_lr_ratio=0.0, time_budget_s=100.0)
    m.on_train_start()
    clock[0] += 50.0
    assert m.lr_multiplier(step=1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    ckpt = {}
    m.on_save_checkpoint(ckpt)
    assert ckpt["train_elapsed_s"] == pytest.approx(50.0)
    again = Tiny(lr=1.0, warmup_steps=0, max_steps=10**6, min_lr_ratio=0.0, time_budget_s=100.0)
    again.on_load_checkpoint(ckpt)
    again.on_train_start()
    clock[0] += 50.0  # a second job of 50 s: the budget is spent, the LR is on the floor
    assert again.train_elapsed_s == pytest.approx(100.0) and again.lr_multiplier(step=1) == pytest.approx(0.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=9.0)
    monkeypatch.setattr(again, "optimizers", lambda use_pl_optimizer=False: opt)
    monkeypatch.setattr(type(again), "global_step", property(lambda self: 1))
    again.on_train_batch_start(None, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)
