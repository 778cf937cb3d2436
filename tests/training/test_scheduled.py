"""A scheduled training job, end to end: ``python -m treedec.train -m hydra/launcher=submitit_local`` takes the path
of a SLURM job (the launcher pickles the job, a submitit process runs it and owns the requeue signal) without the
scheduler. Preempted as SLURM preempts a submitit job (SIGTERM, then submitit's USR2), the job is requeued by
submitit and resumes from its newest checkpoint, ending with the weights of a run that was never interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.training.jobs import head_weights, train_cfg, train_overrides

REPO = Path(__file__).resolve().parents[2]


def submitit_tasks(folder: Path) -> list[int]:
    """The pids of the job processes submitit runs for ``folder`` (``python -m submitit.core._submit <folder>``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if b"submitit.core._submit" in argv and str(folder).encode() in argv:
            pids.append(int(proc.name))
    return pids


EXTRA = ("num_threads=1", "eval.every_n_steps=0")  # one thread: the same float sums in the job and the reference


@pytest.fixture(scope="module")
def uninterrupted(target_dir, corpus, tmp_path_factory):
    """The exported head and metrics of the same 12 steps, run through in this process."""
    from treedec.train import run

    out = tmp_path_factory.mktemp("uninterrupted")
    metrics = run(train_cfg(target_dir, corpus, out, 12, *EXTRA))
    assert metrics["resumed_from"] is None and metrics["steps"] == 12
    return head_weights(out / "draft"), metrics


def wait_for(check, what: str, proc: subprocess.Popen, logs, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while not check():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"{what} never happened (rc {proc.wait()}):\n{logs()[-4000:]}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["usr2_mid_step", "sigterm_then_usr2"])
def test_submitit_job_preempted_is_requeued_and_resumes_exactly(preemption, target_dir, corpus, tmp_path,
                                                                 uninterrupted):
    """``usr2_mid_step``: submitit's signal lands in a step (as before a time limit); the job resumes from step 5's
    checkpoint. ``sigterm_then_usr2``: SLURM's preemption of a submitit job, where the SIGTERM (which submitit
    ignores, and Lightning does not) stops training at step 7 with ``last.ckpt`` saved before the USR2 arrives:
    the job must still be alive to be requeued, and resumes from step 7."""
    outputs, folder, marker = tmp_path / "outputs", tmp_path / "submitit", tmp_path / "paused"
    pause = "PauseOnce" if preemption == "usr2_mid_step" else "WaitForSigterm"
    job = [o for o in train_overrides(target_dir, corpus, tmp_path, 12, *EXTRA) if not o.startswith("paths.run_dir=")]
    cmd = [sys.executable, "-m", "treedec.train", "-m", "hydra/launcher=submitit_local", f"paths.output_dir={outputs}",
           f"hydra.launcher.submitit_folder={folder}",
           "hydra.launcher.timeout_min=60",  # under 10 min, submitit counts any signal as a time-out
           f"+callbacks.pause={{_target_:tests.training._pause.{pause},at:7,marker:'{marker}'}}", *job]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HYDRA_FULL_ERROR", None)

    def logs() -> str:
        return "".join(p.read_text() for p in [tmp_path / "launcher.log", *sorted(folder.glob("*_log.*"))]
                       if p.exists())

    with open(tmp_path / "launcher.log", "wb") as out:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(marker.exists, "step 7", launcher, logs)  # after step 5's checkpoint
        (task,) = submitit_tasks(folder)
        if preemption == "sigterm_then_usr2":
            os.kill(task, signal.SIGTERM)
            wait_for(lambda: "stopped by SIGTERM before the end" in logs(), "the stop on SIGTERM", launcher, logs)
        try:
            os.kill(task, signal.SIGUSR2)
        except ProcessLookupError:  # it exited on the SIGTERM: nobody is left to requeue it
            pass
        rc = launcher.wait(timeout=300)
    text = logs()
    assert rc == 0, text[-4000:]
    assert "this job is preempted" in text and "Requeued job" in text and "Traceback" not in text, text[-4000:]
    assert submitit_tasks(folder) == []
    (run_dir,) = outputs.glob("train/multirun/*/*/0")  # the default sweep dir (a time): the requeued job's too
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 12 and Path(metrics["resumed_from"]).name == "last.ckpt"
    assert ("SIGTERM: saved step 7" in text) == (preemption == "sigterm_then_usr2")
    want, ref = uninterrupted
    got = head_weights(tmp_path / "draft")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert metrics["val"] == ref["val"]


def test_after_sigterm_a_submitit_job_waits_for_the_requeue_signal(monkeypatch):
    """Outside submitit a SIGTERM'd job exits at once; in a submitit job it waits for the requeue signal, which
    ends the wait (submitit's handler exits the process), and a SIGTERM alone (scancel) exits after the wait."""
    import threading

    from treedec.training.preemption import await_submitit_requeue

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    t0 = time.monotonic()
    await_submitit_requeue(5)
    assert time.monotonic() - t0 < 1
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    t0 = time.monotonic()
    await_submitit_requeue(0.3)
    assert time.monotonic() - t0 >= 0.3

    def requeue(signum, frame):
        raise SystemExit(144)  # as submitit's handler ends a requeued local job

    old = signal.signal(signal.SIGUSR2, requeue)
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        t0 = time.monotonic()
        with pytest.raises(SystemExit, match="144"):
            await_submitit_requeue(30)
        assert time.monotonic() - t0 < 10
    finally:
        signal.signal(signal.SIGUSR2, old)
