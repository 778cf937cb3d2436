"""Preemptible jobs: `kill -9` then re-running the same command resumes and ends bit-identical to an
uninterrupted run (the loader's position in its epoch and every RNG state are in the checkpoint);
re-running a finished job leaves it alone; checkpoints are weights_only-loadable; a truncated
last.ckpt falls back to the newest intact one."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARCH, compose_config
from tests.training.jobs import train_cfg
from treedec.training.run_dir import JobError, find_resume_checkpoint

REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def overrides(corpus, tok_path, cache, steps=STEPS):
    arch = [f"model_arch.{k}={v}" for k, v in TINY_ARCH.items()] + ["model_arch.head_dim=8"]
    return arch + [
        "export_dir=null", "num_threads=1", "ckpt_every_n_steps=2", "log_every=2", f"data.root={corpus}",
        "data.seq_len=32", "data.batch_size=8", "data.val_fraction=0.2", f"data.cache_dir={cache}",
        "data.max_val_windows=2", f"paths.tokenizer={tok_path}", f"trainer.max_steps={steps}", "trainer.max_time=null",
        "trainer.val_check_interval=6", "trainer.precision=32-true", "trainer.enable_model_summary=false",
        "optim.time_budget_s=null", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def killed_and_resumed(corpus, tokenizer, tmp_path_factory):
    """`python -m treedec.pretrain ...` SIGKILLed after its first checkpoints, then the same command again."""
    tmp = tmp_path_factory.mktemp("resume")
    run, marker = tmp / "run", tmp / "paused"
    cmd = [sys.executable, "-m", "treedec.pretrain", f"hydra.run.dir={run}",
           *overrides(corpus, tokenizer[0], tmp / "cache"),
           f"+callbacks.pause={{_target_:tests.training._pause.PauseOnce,at:5,marker:'{marker}'}}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp / "first.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while not marker.exists():
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                tail = (tmp / "first.log").read_text()[-3000:]
                pytest.fail(f"the first run never paused (rc {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    killed = {p.name: torch.load(p, weights_only=True)["global_step"] for p in (run / "checkpoints").glob("*.ckpt")}
    assert not (run / "metrics.json").exists()
    assert json.loads((run / ".lock").read_text())["pid"] == proc.pid  # the dead job's lock is left behind
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"taking over the stale lock of pid {proc.pid}" in again.stdout + again.stderr
    assert "not resumable" not in again.stdout + again.stderr  # Lightning sees a stateful loader
    return run, killed, json.loads((run / "metrics.json").read_text())


def weights(path):
    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


def test_kill9_then_rerun_ends_bit_identical_to_an_uninterrupted_run(killed_and_resumed, corpus, tokenizer, tmp_path):
    from treedec.pretrain import run as pretrain

    run, killed, metrics = killed_and_resumed
    assert killed["last.ckpt"] == 4 and killed == {"last.ckpt": 4, "step4.ckpt": 4}  # the kill came at step 5
    assert metrics["resumed_from"] == str(run / "checkpoints" / "last.ckpt")
    # an uninterrupted run of the same config ends at the same global step
    ovr = overrides(corpus, tokenizer[0], tmp_path / "cache") + [f"paths.run_dir={tmp_path / 'ref'}"]
    ref = pretrain(compose_config("pretrain", ovr))
    assert ref["resumed_from"] is None and metrics["steps"] == ref["steps"] == STEPS
    got, want = weights(run / "checkpoints" / "final.ckpt"), weights(tmp_path / "ref" / "checkpoints" / "final.ckpt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert metrics["val_loss"] == ref["val_loss"] and metrics["train_loss"] == ref["train_loss"]
    for name in ("last.ckpt", f"step{STEPS}.ckpt", "final.ckpt"):  # plain data only: weights_only loads everything
        state = torch.load(run / "checkpoints" / name, weights_only=True)
        assert state["global_step"] == STEPS and state["hyper_parameters"]["arch"]["num_hidden_layers"] == 2
    rows = (run / "csv" / "metrics.csv").read_text().splitlines()
    assert len(rows) > 2  # the CSV log continues in the same file


def test_rerunning_a_finished_job_leaves_it_alone(killed_and_resumed, corpus, tokenizer, caplog):
    from treedec.pretrain import run as pretrain

    run, _, metrics = killed_and_resumed
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in [run / "metrics.json", *(run / "checkpoints").iterdir()]}
    with caplog.at_level(logging.WARNING, logger="treedec.pretrain"):
        again = pretrain(compose_config("pretrain", overrides(corpus, tokenizer[0], run.parent / "cache")
                                        + [f"paths.run_dir={run}"]))
    assert again == metrics and "already finished (step 12" in caplog.text
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == files


def test_truncated_last_ckpt_falls_back_to_an_intact_one(killed_and_resumed, corpus, tokenizer,
                                                         tmp_path, caplog):
    from treedec.pretrain import run as pretrain

    src, _, _ = killed_and_resumed
    run = tmp_path / "run"
    shutil.copytree(src / "checkpoints", run / "checkpoints")
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short by a kill
    with pytest.raises(Exception, match="central directory|zip|unexpected EOF"):
        torch.load(last, weights_only=True)  # what Lightning would have choked on
    with caplog.at_level(logging.WARNING, logger="treedec.training"):
        got = find_resume_checkpoint(run)
    assert got == str(run / "checkpoints" / f"step{STEPS}.ckpt")
    assert "last.ckpt is unusable" in caplog.text and "newest intact" in caplog.text
    # the weights-only final.ckpt is never a resume candidate; the job itself resumes and goes on
    m = pretrain(compose_config("pretrain", overrides(corpus, tokenizer[0], tmp_path / "cache", steps=STEPS + 2)
                                + [f"paths.run_dir={run}"]))
    assert m["resumed_from"] == got and m["steps"] == STEPS + 2
    assert torch.load(find_resume_checkpoint(run), weights_only=True)["global_step"] == STEPS + 2


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    (ckpts / "step8.ckpt").write_bytes(b"")
    with pytest.raises(JobError, match="no checkpoint there is readable.*last.ckpt.*truncated or corrupt"):
        find_resume_checkpoint(tmp_path)
    assert find_resume_checkpoint(tmp_path / "fresh") is None


def test_requeue_has_exactly_one_owner(monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from omegaconf import OmegaConf

    from treedec.training.preemption import requeue_plugins

    cfg = OmegaConf.create({"requeue": "auto"})
    for var in ("SLURM_NTASKS", "SLURM_JOB_NAME", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(var, raising=False)
    assert requeue_plugins(cfg) == []  # not on SLURM: nothing to own
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "pretrain")
    assert requeue_plugins(cfg) == []  # plain sbatch: Lightning's SIGUSR1 auto-requeue stays on
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # launched by hydra/launcher=slurm: submitit owns it
    (env,) = requeue_plugins(cfg)
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False
    assert requeue_plugins(cfg, [SLURMEnvironment()]) == []  # the user's own environment is left alone
    assert requeue_plugins(OmegaConf.create({"requeue": "lightning"})) == []
    with pytest.raises(ValueError, match="requeue must be"):
        requeue_plugins(OmegaConf.create({"requeue": "slurm"}))


def test_slurm_launcher_config_keys_run_dirs_by_job_name():
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401  (the slurm extra is a test dependency: no skip)
    from omegaconf import OmegaConf
    cfg = compose_config("train", ["hydra/launcher=slurm", "hydra.job.name=my-head", "trainer=ddp"], hydra=True,
                         job_name="train")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.max_num_timeout > 0 and launcher.timeout_min > 0
    sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
    assert cfg.hydra.sweep.dir == "outputs/slurm/my-head" and sweep["subdir"] == "${hydra.job.num}"  # no timestamps
    assert launcher.submitit_folder.startswith("outputs/slurm/my-head/") and launcher.name == "my-head"
    assert cfg.trainer.strategy == "ddp" and cfg.trainer.precision == "bf16-mixed" and cfg.requeue == "auto"


def test_resuming_with_another_head_shape_names_the_setting(target_dir, corpus, tmp_path, monkeypatch):
    """Issue 46 item 2: re-running a run dir with another head kind (or block size) is one ``Error:`` line naming
    the setting that differs from the run it would resume and the fix, not a state-dict traceback; the checkpoint
    is kept."""
    import re

    from treedec.cli import entry
    from treedec.train import run

    same = ("draft_arch.draft_vocab_size=48", "eval.every_n_steps=0", "export_dir=null")
    run(train_cfg(target_dir, corpus, tmp_path, 2, "draft_arch=parallel", "draft_arch.block_size=3", *same))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    kept = ckpt.read_bytes()
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for change, now, then, fix in [
        (("draft_arch=eagle3",), "draft_arch.kind=eagle3", "draft_arch.kind=parallel", "draft_arch=parallel"),
        (("draft_arch=parallel", "draft_arch.block_size=4"), "draft_arch.block_size=4", "draft_arch.block_size=3",
         "draft_arch.block_size=3")]:
        with pytest.raises(SystemExit) as e:
            entry(run)(train_cfg(target_dir, corpus, tmp_path, 4, *change, *same))
        assert re.fullmatch(rf"Error: this job has {now}, but the run in {re.escape(str(tmp_path / 'run'))} that it "
                            rf"would resume has {then} \(the settings its checkpoint last\.ckpt was trained "
                            rf"with\): pass {fix} to resume that run, or a new hydra\.run\.dir to start another; "
                            r"the checkpoints there are kept", str(e.value.code)), e.value.code
        assert ckpt.read_bytes() == kept
