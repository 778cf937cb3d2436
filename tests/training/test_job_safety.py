"""Job safety: one live job per run dir, resumable loaders and RNG state, atomic exports that
follow the umask, start-up config checks with one-line errors."""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import compose_config
from treedec.atomic import atomic_dir
from treedec.config import ConfigError
from treedec.data.datamodules import EpochSampler, ResumableLoader
from treedec.models.paths import export_path
from treedec.training.preemption import ResumeState, rng_states, set_rng_states
from treedec.training.run_dir import JobError, RunDirLock, finished_metrics

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- lock
HOLD = """
import sys, time
from treedec.training.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_second_live_job_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JobError, match=rf"run dir {tmp_path} is in use by another job \(pid {holder.pid} on "):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # killed: its lock file stays behind, naming a pid that is not running
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="treedec.training"):
        with RunDirLock(tmp_path):
            assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {holder.pid}" in caplog.text
    assert not (tmp_path / ".lock").exists()  # released


def test_lock_without_flock_checks_the_recorded_pid(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from treedec.training.run_dir import _proc_stat

        start = _proc_stat(live.pid)[19]
        (tmp_path / ".lock").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "start": start}))
        with pytest.raises(JobError, match="in use by another job"):
            RunDirLock(tmp_path).acquire()
        # the same pid number but another process start time: a recycled pid, the lock is stale
        (tmp_path / ".lock").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "start": "1"}))
        with caplog.at_level(logging.WARNING, logger="treedec.training"):
            RunDirLock(tmp_path).acquire().release()
        assert "stale lock" in caplog.text
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------------------- resumable loading
def test_resumable_loader_continues_mid_epoch_and_only_in_that_epoch():
    data = torch.arange(100)

    def loader():
        return ResumableLoader(data, batch_size=4, sampler=EpochSampler(100, 40, seed=1), drop_last=True,
                               generator=torch.Generator().manual_seed(0))

    ref = loader()
    ref.sampler.set_epoch(2)
    full = [b.tolist() for b in ref]
    first = loader()
    first.sampler.set_epoch(2)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches": 3} and seen == full[:3]

    again = loader()
    again.load_state_dict(state)
    again.sampler.set_epoch(2)
    assert [b.tolist() for b in again] == full[3:]  # the rest of the epoch, nothing twice
    assert again.state_dict() == {"epoch": 2, "batches": 10}
    again.sampler.set_epoch(3)
    assert len(list(again)) == 10  # the next epoch is whole

    other = loader()
    other.load_state_dict({"epoch": 1, "batches": 3})  # a state of another epoch does not skip
    other.sampler.set_epoch(2)
    assert [b.tolist() for b in other] == full
    # creating its iterator draws nothing from torch's global RNG
    before = torch.get_rng_state()
    iter(loader())
    assert torch.equal(before, torch.get_rng_state())


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    cb = ResumeState()
    torch.save(cb.state_dict(), tmp_path / "s.pt")
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # a different state now
    restored = ResumeState()
    restored.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    restored.on_train_start(None, None)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    set_rng_states(rng_states())  # idempotent


# ------------------------------------------------------------------------------------------ export
def test_atomic_dir_keeps_the_old_directory_when_writing_fails(tmp_path):
    dest = tmp_path / "asset"
    atomic_dir(dest, lambda d: (d / "w.bin").write_bytes(b"old"))

    def crash(d: Path):
        (d / "w.bin").write_bytes(b"half")
        raise KeyboardInterrupt  # a kill in the middle of the save

    with pytest.raises(KeyboardInterrupt):
        atomic_dir(dest, crash)
    assert (dest / "w.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["asset"]  # no temporary left behind
    atomic_dir(dest, lambda d: (d / "new.bin").write_bytes(b"new"))
    assert [p.name for p in dest.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["asset"]


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_exports_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    from treedec.heads import DraftConfig, build_head
    from treedec.models.config import LlamaConfig
    from treedec.models.llama import Transformer

    target = Transformer(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=32), "sdpa")
    head = build_head(DraftConfig.for_target(target.config)).bind(target)
    old = os.umask(umask)
    try:
        out = atomic_dir(tmp_path / "head", head.save)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {"draft_config.json": file_mode, "draft.safetensors": file_mode}
    assert out.stat().st_mode & 0o777 == dir_mode


def test_export_paths_inside_the_assets_need_export_dir_bundled(tmp_path):
    from treedec.models.paths import ASSETS

    bundled = ASSETS / "tiny-code-eagle"
    assert export_path("bundled", bundled) == bundled
    assert export_path(None, bundled) is None
    assert export_path(str(tmp_path / "x"), bundled) == tmp_path / "x"
    with pytest.raises(ValueError, match="inside the package's assets.*export_dir=bundled"):
        export_path(str(ASSETS / "tiny-code"), bundled)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export_path(str(tmp_path / "f"), bundled)


def test_finished_metrics_decides_by_steps_and_time_cap(tmp_path):
    from omegaconf import OmegaConf

    trainer = OmegaConf.create({"max_steps": 20, "max_time": None})
    assert finished_metrics(tmp_path, trainer) is None  # no metrics.json: a fresh or interrupted run
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 20, "stopped_by": "max_steps"}))
    assert finished_metrics(tmp_path, trainer)["steps"] == 20
    assert finished_metrics(tmp_path, OmegaConf.create({"max_steps": 30, "max_time": None})) is None
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 12, "stopped_by": "max_time", "max_time_s": 60}))
    assert finished_metrics(tmp_path, OmegaConf.create({"max_steps": 30, "max_time": "00:00:01:00"}))
    assert finished_metrics(tmp_path, OmegaConf.create({"max_steps": 30, "max_time": "00:00:02:00"})) is None


# ------------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize("name, override, message", [
    ("train", "+eval.n_prompt=3", r"unknown key eval\.n_prompt; .*eval\.n_prompts.*n_prompts, prompt_tokens, "
                                  r"max_new_tokens, every_n_steps"),
    ("train", "+trainer.max_step=3", r"unknown key trainer\.max_step; .*trainer\.max_steps"),
    ("train", "+data.seqlen=3", r"unknown key data\.seqlen; .*seq_len"),
    ("train", "+draft_arch.intermediate_siz=64", r"unknown key draft_arch\.intermediate_siz; .*intermediate_size"),
    ("train", "+callbacks.lr={_target_:lightning.pytorch.callbacks.LearningRateMonitor,interval:step}",
     r"unknown key callbacks\.lr\.interval; .*logging_interval"),
    ("train", "+optim.learning_rate=1", r"unknown key optim\.learning_rate; .*lr"),
    ("train", "+exportdir=x", r"unknown key exportdir; .*export_dir"),
    ("train", "eval.n_prompts=many", r"eval\.n_prompts: Value 'many' of type 'str' could not be converted to Integer"),
    ("train", "export_dtype=bogus", r"invalid export_dtype: unknown dtype 'bogus'"),
    ("train", "model.dtype=fp8", r"invalid model\.dtype: unknown dtype 'fp8'"),
    ("train", "requeue=slurm", r"requeue='slurm'; choose one of auto, submitit, lightning, none"),
    ("train", "num_threads=0", r"num_threads=0 must be a number >= 1"),
    ("train", "trainer.max_time=soon", r"trainer\.max_time='soon' is not a positive duration"),
    ("train", "model.path=/nonexistent/model", r"model\.path=/nonexistent/model: no model directory"),
    ("train", "+target=tiny-code", r"target is now model\.path"),  # the old names fail, naming the new key
    ("train", "+target_dtype=float32", r"target_dtype is now model\.dtype"),
    ("train", "+draft.kind=eagle3", r"draft is now draft_arch"),
    ("train", "export_dir=treedec/assets/tiny-code-eagle", r"inside the package's assets"),
    # the head to train against init_from's head and the target (issue 46): one kind, a block that fits, real layers
    ("train", "init_from=tiny-code-parallel", r"init_from=tiny-code-parallel is a one-pass \(P-EAGLE, kind parallel\) "
                                              r"head, but draft_arch\.kind=eagle trains an EAGLE-1/2 head: pass "
                                              r"draft_arch=parallel"),
    ("train", "init_from=tiny-code-eagle3", r"is an EAGLE-3 head, but draft_arch\.kind=eagle .*draft_arch=eagle3"),
    ("train", "draft_arch=eagle3 init_from=tiny-code-parallel", r"one-pass .* draft_arch\.kind=eagle3 .*"
                                                                r"draft_arch=parallel"),
    ("train", "draft_arch=parallel init_from=tiny-code-eagle", r"is an EAGLE-1/2 head, but draft_arch\.kind=parallel .*"
                                                               r"from an EAGLE-3 head"),
    ("train", "draft_arch=parallel draft_arch.block_size=100000", r"draft_arch\.block_size=100000: .* more than "
                                                                  r"model\.path=tiny-code's 1024; lower draft_arch\."
                                                                  r"block_size"),
    ("train", "draft_arch=parallel init_from=tiny-code-parallel draft_arch.block_size=1024", r"draft_arch\.block_size=1024"),
    ("train", "draft_arch=parallel draft_arch.feature_layers=[2,6,40]", r"draft_arch\.feature_layers=\[2, 6, 40\]: a "
                                                                        r"one-pass .* model\.path=tiny-code has 12 "
                                                                        r"\(ids 0\.\.11\)"),
    ("train", "draft_arch=eagle3 draft_arch.feature_layers=[2,6,12]", r"draft_arch\.feature_layers=\[2, 6, 12\]: an "
                                                                      r"EAGLE-3 head"),
    ("train", "draft_arch=parallel init_from={deep}", r"init_from=\S+ is a one-pass \(P-EAGLE, kind parallel\) head "
                                                      r"reading target layers \[2, 6, 30\], but model\.path=tiny-code "
                                                      r"has 12 layers"),
    ("pretrain", "+model_arch.num_layers=2", r"unknown key model_arch\.num_layers; .*num_hidden_layers"),
    ("pretrain", "model_arch.num_key_value_heads=3", r"invalid model_arch: num_attention_heads \(8\) must be a "
                                                     r"multiple of num_key_value_heads \(3\)"),
    ("pretrain", "export_dtype=bogus", r"invalid export_dtype: unknown dtype 'bogus'"),
    ("pretrain", "data.seq_len=4096", r"data\.seq_len=4096 exceeds model_arch\.max_position_embeddings=1024"),
    ("pretrain", "paths.tokenizer=/nonexistent/dir/", r"paths.tokenizer"),
])
def test_bad_options_are_refused_before_anything_runs(name, override, message, tmp_path):
    from treedec.pretrain import run as pretrain
    from treedec.train import run as train

    if "paths.tokenizer" in override:  # a directory that holds no tokenizer.json
        override = f"paths.tokenizer={tmp_path}"
    if "{deep}" in override:  # a one-pass head's config (no weights: refused before they load) for a deeper target
        from treedec.heads.config import BUNDLED_DRAFTS, DRAFT_CONFIG

        head = json.loads((BUNDLED_DRAFTS["tiny-code-parallel"] / DRAFT_CONFIG).read_text())
        (tmp_path / "deep").mkdir()
        (tmp_path / "deep" / DRAFT_CONFIG).write_text(json.dumps({**head, "feature_layers": [2, 6, 30]}))
        override = override.replace("{deep}", str(tmp_path / "deep"))
    cfg = compose_config(name, [*override.split(" "), f"paths.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=message):
        (train if name == "train" else pretrain)(cfg)
    assert not (tmp_path / "run").exists()  # refused before the job made its run dir, data or model


def test_defaults_and_documented_overrides_pass(tmp_path):
    from treedec.config import validate

    run = f"paths.run_dir={tmp_path}"
    for name, ovr in [("train", []), ("pretrain", []), ("train", ["export_dtype=bf16", "trainer=ddp", "trainer.accelerator=cpu"]),
                      ("train", ["logger=[csv,tensorboard]", "trainer=fsdp", "trainer.accelerator=cpu", "+draft_arch.intermediate_size=128"]),
                      ("train", ["data=jsonl", "data.path=x.jsonl", "export_dir=null",
                                 "+callbacks.lr={_target_:lightning.pytorch.callbacks.LearningRateMonitor}"]),
                      ("pretrain", ["model_arch=tiny_code_assistant", "paths.tokenizer=tiny-code"]),
                      ("pretrain", ["export_dir=bundled", "+trainer.limit_test_batches=2"])]:
        cfg = compose_config(name, ovr + [run])
        before = OmegaConf.to_yaml(cfg)
        validate(cfg, name)  # raises ConfigError on any refusal
        assert OmegaConf.to_yaml(cfg) == before and cfg.paths.run_dir == str(tmp_path), (name, ovr)  # only read
