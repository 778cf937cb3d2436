"""EAGLE / EAGLE-3 draft-head training: loss falls, τ is measured, the head exports and resumes, target stays out."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import TINY_ARCH
from tests.training.jobs import head_weights, train_cfg, train_overrides


def test_train_resume_and_export(target_dir, corpus, tmp_path):
    from treedec.heads import load_head
    from treedec.train import run

    m = run(train_cfg(target_dir, corpus, tmp_path, 20))
    assert m["steps"] == 20 and m["tau"] >= 1.0 and len(m["tau_history"]) >= 2
    rows = (tmp_path / "run" / "csv" / "metrics.csv").read_text().splitlines()
    assert len(rows) > 2
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any(k.startswith(("target", "_target")) or "embed_tokens" in k or "lm_head" in k for k in state["state_dict"])
    # re-running the same command continues from last.ckpt and ends at the new step count
    m2 = run(train_cfg(target_dir, corpus, tmp_path, 30))
    assert m2["resumed_from"] and m2["steps"] == 30
    head = load_head(tmp_path / "draft")
    assert head.config.target == str(target_dir)
    # the same command once more: the job is finished, its results stay as they are
    files = {p: p.read_bytes() for p in [tmp_path / "run" / "metrics.json", *(tmp_path / "draft").iterdir()]}
    assert run(train_cfg(target_dir, corpus, tmp_path, 30)) == m2
    assert {p: p.read_bytes() for p in files} == files and json.loads(files[tmp_path / "run" / "metrics.json"])["tau"]


def test_crash_then_rerun_is_bit_identical(target_dir, corpus, tmp_path):
    """A crash after the end-of-epoch checkpoint (8 batches an epoch here), then the same command again:
    the loader, the feature noise's generator and the RNGs go on from the checkpoint."""
    from treedec.train import run

    crash = f"+callbacks.crash={{_target_:tests.training._pause.CrashOnce,at:10,marker:'{tmp_path / 'crashed'}'}}"
    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(RuntimeError, match="simulated crash at step 10"):
        run(train_cfg(target_dir, corpus, a, 14, "ckpt_every_n_steps=4", crash))
    assert torch.load(a / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    resumed = run(train_cfg(target_dir, corpus, a, 14, "ckpt_every_n_steps=4", crash))
    ref = run(train_cfg(target_dir, corpus, b, 14, "ckpt_every_n_steps=4"))
    assert resumed["resumed_from"] and ref["resumed_from"] is None and resumed["steps"] == ref["steps"] == 14
    got, want = head_weights(a / "draft"), head_weights(b / "draft")
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert resumed["val"] == ref["val"] and resumed["tau_history"] == ref["tau_history"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_143_and_the_rerun_resumes(target_dir, corpus, tmp_path):
    """A SIGTERM'd job (kill, scancel, a preemption) must not exit 0 as a finished one does: it saves
    last.ckpt of the step it was on, writes no export or metrics.json, exits 143; the same command resumes."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from treedec.training.preemption import PREEMPTED

    repo, marker = Path(__file__).resolve().parents[2], tmp_path / "waiting"
    wait = f"+callbacks.wait={{_target_:tests.training._pause.WaitForSigterm,at:7,marker:'{marker}'}}"
    cmd = [sys.executable, "-m", "treedec.train", f"hydra.run.dir={tmp_path / 'run'}", "num_threads=1",
           *[o for o in train_overrides(target_dir, corpus, tmp_path, 12, wait, "eval.every_n_steps=0")
             if not o.startswith("paths.run_dir=")]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HYDRA_FULL_ERROR", None)
    with open(tmp_path / "first.log", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while not marker.exists():
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                tail = (tmp_path / "first.log").read_text()[-3000:]
                pytest.fail(f"the job never reached step 7 (rc {proc.wait()}):\n{tail}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    log = (tmp_path / "first.log").read_text()
    assert rc == PREEMPTED == 143, log[-3000:]
    run = tmp_path / "run"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 7  # not step 5's
    assert not (run / "metrics.json").exists() and not (tmp_path / "draft").exists() and not (run / ".lock").exists()
    assert "SIGTERM: saved step 7" in log and "Traceback" not in log
    again = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["resumed_from"].endswith("last.ckpt")


def test_draft_loss_decreases(target_dir):
    from treedec.training.draft import DraftModule

    torch.manual_seed(0)
    module = DraftModule(str(target_dir), lr=3e-3, target_dtype="float32", feature_noise=0.0)
    opt = torch.optim.AdamW(module.head.parameters(), lr=3e-3)
    ids = torch.randint(0, TINY_ARCH["vocab_size"], (4, 33))
    first = None
    for _ in range(40):
        out = module.losses(ids, 0.0)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        first = first if first is not None else float(out["loss"])
    assert float(out["loss"]) < 0.5 * first
    assert all(p.grad is None for p in module.target.parameters())  # the target stays frozen


def fit(module, ids: torch.Tensor, steps: int = 40) -> tuple[dict, dict]:
    """AdamW steps of ``module``'s head on one batch: (the first step's loss terms, the last step's)."""
    opt = torch.optim.AdamW(module.head.parameters(), lr=3e-3)
    hist = []
    for _ in range(steps):
        out = module.losses(ids, 0.0)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        hist.append({k: float(v) for k, v in out.items()})
    return hist[0], hist[-1]


def test_eagle3_training_time_test_loss_decreases(target_dir):
    from treedec.training.draft import DraftModule

    torch.manual_seed(0)
    module = DraftModule(str(target_dir), draft={"kind": "eagle3", "draft_vocab_size": 64}, target_dtype="float32",
                         feature_noise=0.0)
    module.set_draft_vocab(torch.randperm(TINY_ARCH["vocab_size"])[:64])
    assert torch.equal(module.head.lm_head.weight, module.target.lm_head.weight[module.head.vocab_ids])  # its start
    first, last = fit(module, torch.randint(0, TINY_ARCH["vocab_size"], (4, 33)))
    assert first["loss"] == pytest.approx(first["ce"] + 0.8 * first["ce_1"] + 0.64 * first["ce_2"], rel=1e-5)
    for i in ("", "_1", "_2"):  # every unrolled step learns
        assert last[f"ce{i}"] < first[f"ce{i}"] - 0.2 and last[f"top1_acc{i}"] > first[f"top1_acc{i}"]
    assert "feat_loss" not in last and all(p.grad is None for p in module.target.parameters())
    with pytest.raises(ValueError, match="unroll at least 1"):
        DraftModule(str(target_dir), target_dtype="float32", unroll=0)


def test_eagle_training_time_test_weights_the_steps_and_every_step_learns(target_dir):
    """An EAGLE-1/2 head with unroll=3: loss = sum 0.8^i (feat + w_ce ce) of each step; each step's CE falls."""
    from treedec.training.draft import DraftModule

    torch.manual_seed(0)
    module = DraftModule(str(target_dir), target_dtype="float32", feature_noise=0.0, unroll=3, w_ce=1.0)
    one = DraftModule(str(target_dir), target_dtype="float32", feature_noise=0.0)
    one.head.load_state_dict(module.head.state_dict())
    ids = torch.randint(0, TINY_ARCH["vocab_size"], (4, 33))
    step0 = one.losses(ids, 0.0)  # unroll 1: the one-step loss, equal to step 0 of the unrolled one
    first, last = fit(module, ids)
    assert first["ce"] == pytest.approx(float(step0["ce"]), rel=1e-5) and "ce_1" not in step0
    want = sum(0.8 ** i * (first[f"feat_loss{s}"] + first[f"ce{s}"]) for i, s in enumerate(("", "_1", "_2")))
    assert first["loss"] == pytest.approx(want, rel=1e-5)
    for i in ("", "_1", "_2"):
        assert last[f"ce{i}"] < first[f"ce{i}"] - 0.2


@pytest.mark.slow
def test_eagle3_train_resume_and_export(target_dir, corpus, tmp_path):
    from treedec.heads import load_head
    from treedec.heads.eagle3 import Eagle3Head
    from treedec.train import run

    extra = ("draft_arch=eagle3", "draft_arch.draft_vocab_size=48", "optim.unroll=2", "eval.every_n_steps=0")
    m = run(train_cfg(target_dir, corpus, tmp_path, 6, *extra))
    assert m["steps"] == 6 and "val/ce_1" in m["val"] and "val/ce_2" not in m["val"]
    m2 = run(train_cfg(target_dir, corpus, tmp_path, 10, *extra))  # resumed from last.ckpt
    assert m2["resumed_from"] and m2["steps"] == 10
    head = load_head(tmp_path / "draft")
    assert isinstance(head, Eagle3Head) and head.config.feature_layers == [1, 1, 0]
    assert head.lm_head.out_features == 48 and head.vocab_ids.unique().numel() == 48


def test_debug_fdr_runs_one_batch(target_dir, corpus, tmp_path):
    """``debug=fdr`` (conf/debug/fdr.yaml): Lightning's fast_dev_run through the real job: one step, then it ends."""
    from treedec.train import run

    m = run(train_cfg(target_dir, corpus, tmp_path, 20, "debug=fdr", "export_dir=null"))
    assert m["steps"] == 1 and m["export_dir"] is None and m["max_steps"] == 20


def test_init_from_accepts_an_exported_head(target_dir, corpus, tmp_path):
    """init_from= takes what draft.path takes (one loader): here a head exported in EAGLE's layout."""
    from treedec.config import ConfigError, validate
    from treedec.heads import DraftConfig, build_head
    from treedec.heads.export import export_head
    from treedec.models import load_model
    from treedec.training.draft import DraftModule

    target = load_model(target_dir)
    head = build_head(DraftConfig.for_target(target.config)).bind(target)
    out = export_head(head, tmp_path / "exported", "eagle")
    validate(train_cfg(target_dir, corpus, tmp_path, 1, f"init_from={out}"), "train")
    module = DraftModule(str(target_dir), init_from=str(out), target_dtype="float32")
    got = module.head.state_dict()
    assert all(torch.equal(got[k], v) for k, v in head.state_dict().items())
    assert module.head.config.target == str(target_dir)
    with pytest.raises(ConfigError, match=r"init_from=.*nowhere: no draft head at"):
        validate(train_cfg(target_dir, corpus, tmp_path, 1, f"init_from={tmp_path / 'nowhere'}"), "train")


def test_init_from_a_one_pass_head_takes_draft_arch_block_size():
    """draft_arch.block_size is honoured when fine-tuning a one-pass head (its mask positions share one input pair,
    so K is the config's alone): the head trains, measures and exports at the block the saved config names."""
    from treedec.training.draft import DraftModule

    module = DraftModule("tiny-code", draft={"kind": "parallel", "block_size": 4, "feature_layers": None,
                                             "draft_vocab_size": 2048}, init_from="tiny-code-parallel",
                         target_dtype="float32")
    assert module.head.block_size == module.head.config.block_size == 4


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after_the_writes", "before_the_writes"])
def test_exit_143_means_no_export_and_no_metrics(when, target_dir, corpus, tmp_path):
    """README's promise, at the edges of training: a SIGTERM that lands after the last step but before the writes
    stops the job with 143 and writes nothing; one that lands once the export and metrics.json are written finds
    the job complete: exit 0."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    extra = ("+callbacks.term={_target_:tests.training._pause.SigtermOnFinalValidation}",) \
        if when == "before_the_writes" else ()
    module = "tests.training._late_sigterm" if when == "after_the_writes" else "treedec.train"
    cmd = [sys.executable, "-m", module, f"hydra.run.dir={tmp_path / 'run'}", "num_threads=1",
           *[o for o in train_overrides(target_dir, corpus, tmp_path, 4, "eval.every_n_steps=0", *extra)
             if not o.startswith("paths.run_dir=")]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    written = [(tmp_path / "run" / "metrics.json").exists(), (tmp_path / "draft" / "draft_config.json").exists()]
    if when == "after_the_writes":
        assert done.returncode == 0 and written == [True, True], (done.returncode, log)
    else:
        assert done.returncode == 143 == 128 + signal.SIGTERM and written == [False, False], (done.returncode, log)
        assert "before the export and metrics.json" in log and "Traceback" not in log, log


@pytest.mark.parametrize("kind", ["parallel", "dflash"])
def test_one_pass_training_loss_falls_at_every_depth(kind, target_dir):
    """A one-pass head (P-EAGLE's or DFlash's) trains in one pass: every depth's CE falls and its top-1 rises, the
    loss is its documented mix of the depths, and the target stays frozen."""
    from treedec.training.draft import DraftModule

    torch.manual_seed(0)
    draft = {"kind": kind, "block_size": 4, "draft_vocab_size": 64, "feature_layers": None,
             **({"draft_layers": 2} if kind == "dflash" else {})}
    module = DraftModule(str(target_dir), draft=draft, target_dtype="float32", feature_noise=0.0, block_anchors=8)
    module.set_draft_vocab(torch.randperm(TINY_ARCH["vocab_size"])[:64])
    ids = torch.randint(0, TINY_ARCH["vocab_size"], (4, 33))
    first, last = fit(module, ids, steps=60)
    for i in ("", "_1", "_2", "_3"):  # depths 1..4
        assert last[f"ce{i}"] < first[f"ce{i}"] - 0.2 and last[f"top1_acc{i}"] > first[f"top1_acc{i}"], (i, first, last)
    if kind == "dflash":  # the decay weights depth j by exp(-(j-1)/gamma), gamma = half the block: 2
        w = [math.exp(-j / 2) for j in range(4)]
        ce = [first[f"ce{s}"] for s in ("", "_1", "_2", "_3")]
        assert first["loss"] == pytest.approx(sum(a * b for a, b in zip(w, ce)) / sum(w), rel=0.05)
    assert all(p.grad is None for p in module.target.parameters())


@pytest.mark.slow
def test_dflash_train_resume_and_export(target_dir, corpus, tmp_path):
    """draft_arch=dflash through the real job: trains, resumes from last.ckpt, exports a head that loads as one."""
    from treedec.heads import DFlashHead, load_head
    from treedec.train import run

    extra = ("draft_arch=dflash", "draft_arch.draft_vocab_size=48", "draft_arch.block_size=4",
             "draft_arch.draft_layers=2", "optim.block_anchors=8", "eval.every_n_steps=0")
    m = run(train_cfg(target_dir, corpus, tmp_path, 6, *extra))
    assert m["steps"] == 6 and "val/ce_3" in m["val"] and "val/ce_4" not in m["val"]
    m2 = run(train_cfg(target_dir, corpus, tmp_path, 10, *extra))  # resumed from last.ckpt
    assert m2["resumed_from"] and m2["steps"] == 10
    head = load_head(tmp_path / "draft")
    assert isinstance(head, DFlashHead) and head.block_size == 4 and head.config.draft_layers == 2
    assert head.lm_head.out_features == 48 and head.vocab_ids.unique().numel() == 48
