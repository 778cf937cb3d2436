"""`trainer=ddp` on two CPU processes (gloo): `python -m treedec.pretrain` and `python -m treedec.train`
in a subprocess, each rank a process that Lightning launches; one model trained on different data per
rank; exactly one metrics.json / export / final checkpoint, written by rank 0; τ measured on rank 0 only."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARCH

REPO = Path(__file__).resolve().parents[2]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=bf16-mixed",
       "trainer.enable_model_summary=false", "num_threads=1", "optim.time_budget_s=null"]
TIMEOUT = 300


def ddp_env() -> dict:
    """The environment of a fresh job: no inherited ranks, no SLURM (Lightning would take its ranks from it)."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def run_ddp(module: str, args: list[str], log_path) -> str:
    cmd = [sys.executable, "-m", module, *DDP, *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:  # a hung collective: show what each rank got to
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        pytest.fail(f"{module} under DDP did not finish in {TIMEOUT} s:\n{out[-4000:]}")
    out = proc.stdout + proc.stderr
    log_path.write_text(out)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("All distributed processes registered. Starting with 2 processes") == 2, out[-4000:]
    return out


def files_named(root, name: str) -> list:
    return sorted(root.rglob(name))


def assert_one_model_two_data_streams(sync_path) -> None:
    sync = json.loads(sync_path.read_text())
    (p0, b0), (p1, b1) = sync["ranks"]
    assert sync["world_size"] == 2
    assert p0 == p1  # gradients were all-reduced: both ranks end with the same weights
    assert b0 != b1  # the distributed sampler gave each rank its own batches


@pytest.fixture(scope="module")
def pretrained_ddp(corpus, tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_pretrain")
    arch = [f"model_arch.{k}={v}" for k, v in TINY_ARCH.items()] + ["model_arch.head_dim=8"]
    out = run_ddp("treedec.pretrain", arch + [
        f"hydra.run.dir={tmp / 'run'}", f"export_dir={tmp / 'export'}", f"paths.tokenizer={tokenizer[0]}",
        f"data.root={corpus}", "data.seq_len=32", "data.batch_size=4", "data.val_fraction=0.2",
        f"data.cache_dir={tmp / 'cache'}", "data.max_val_windows=4", "trainer.max_steps=6",
        "trainer.val_check_interval=3", "ckpt_every_n_steps=3", "log_every=2", "optim.warmup_steps=2",
        f"+callbacks.sync={{_target_:tests.training._ddp_check.RankSync,out:'{tmp / 'sync.json'}'}}"],
        tmp / "ddp.log")
    return tmp, out


@pytest.mark.slow  # ~10 s per run: two interpreters start and import torch + Lightning
def test_pretrain_ddp_two_cpu_processes(pretrained_ddp):
    tmp, out = pretrained_ddp
    run = tmp / "run"
    assert (run / "train_ddp_process_1.log").is_file()  # rank 1 ran in the same run dir (Hydra re-launch)
    assert_one_model_two_data_streams(tmp / "sync.json")

    # rank 0 alone writes: one metrics.json, one export, one final checkpoint, each logged once
    assert files_named(tmp, "metrics.json") == [run / "metrics.json"]
    assert files_named(tmp, "model.safetensors") == [tmp / "export" / "model.safetensors"]
    assert files_named(tmp, "final.ckpt") == [run / "checkpoints" / "final.ckpt"]
    assert out.count("exported the Hugging Face model") == 1 and out.count("- metrics: {") == 1
    m = json.loads((run / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["steps"] == 6 and m["tokens_seen"] == 6 * 4 * 32 * 2
    assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert m["val_loss"] < math.log(TINY_ARCH["vocab_size"]) + 1.0
    state = torch.load(run / "checkpoints" / "final.ckpt", weights_only=True)
    assert state["global_step"] == 6
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    # one progress line per logged step (rank 0's), not one per rank
    assert out.count("step 2/6  loss") == 1


@pytest.mark.slow
def test_train_draft_ddp_two_cpu_processes(pretrained_ddp, corpus):
    """The draft module holds its frozen target outside its parameters: DDP wraps the head alone."""
    ptmp, _ = pretrained_ddp
    tmp = ptmp.parent / (ptmp.name + "_draft")
    tmp.mkdir()
    out = run_ddp("treedec.train", [
        f"model.path={ptmp / 'export'}", "model.dtype=float32", f"hydra.run.dir={tmp / 'run'}",
        f"export_dir={tmp / 'draft'}", "export_dtype=float32", f"data.root={corpus}", "data.seq_len=32",
        "data.batch_size=4", "data.val_fraction=0.2", f"data.cache_dir={tmp / 'cache'}", "data.max_val_windows=4",
        "trainer.max_steps=4", "trainer.val_check_interval=2", "ckpt_every_n_steps=2", "log_every=2",
        "optim.warmup_steps=1", "eval.n_prompts=2", "eval.prompt_tokens=24", "eval.max_new_tokens=8",
        "eval.every_n_steps=2",
        f"+callbacks.sync={{_target_:tests.training._ddp_check.RankSync,out:'{tmp / 'sync.json'}'}}"],
        tmp / "ddp.log")
    run = tmp / "run"
    assert (run / "train_ddp_process_1.log").is_file()
    assert_one_model_two_data_streams(tmp / "sync.json")
    m = json.loads((run / "metrics.json").read_text())
    assert files_named(tmp, "metrics.json") == [run / "metrics.json"]
    assert files_named(tmp, "draft.safetensors") == [tmp / "draft" / "draft.safetensors"]
    assert m["world_size"] == 2 and m["steps"] == 4
    assert all(math.isfinite(v) for v in m["val"].values()) and "val/loss" in m["val"]
    # τ: measured by rank 0 only, at steps 2 and 4 (not again at the end), once per measurement in the log
    assert [s for s, _ in m["tau_history"]] == [2, 4]
    # before training the head drafts about as well as chance; two steps on this repetitive corpus already help
    assert 1.0 <= m["tau_before"] < 1.3 and m["tau"] > m["tau_before"]
    assert out.count("speculative tau") == 2 and out.count("exported the draft head") == 1
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 4
    assert not any(k.startswith(("target", "_target")) or "embed_tokens" in k or "lm_head" in k
                   for k in state["state_dict"])


def test_ranks_above_zero_wait_for_rank_zeros_tokenizer(corpus, tokenizer, tmp_path, monkeypatch):
    """srun/torchrun start every rank at once: rank 1 must not train a tokenizer of its own."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from treedec.data.datamodules import StdlibCodeDataModule, wait_for_rank_zero

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    tok_path = tmp_path / "tok" / "tokenizer.json"
    dm = StdlibCodeDataModule(str(tok_path), root=str(corpus), seq_len=32, batch_size=4, val_fraction=0.2,
                              cache_dir=str(tmp_path / "cache"), vocab_size=384)

    def rank0():  # writes its tokenizer a moment later, atomically as train_bpe does
        time.sleep(0.5)
        tok_path.parent.mkdir()
        shutil.copy(tokenizer[0], tmp_path / "tok.tmp")
        os.replace(tmp_path / "tok.tmp", tok_path)

    writer = threading.Thread(target=rank0)
    t0 = time.time()
    writer.start()
    dm.prepare_data()
    writer.join()
    assert time.time() - t0 >= 0.45 and dm.token_dir is not None
    assert tok_path.read_bytes() == Path(tokenizer[0]).read_bytes()  # rank 0's file, not one of its own
    with pytest.raises(TimeoutError, match="rank 1: waited .* for rank 0 to write the tokenizer .*share"):
        wait_for_rank_zero(tmp_path / "never.json", "tokenizer", timeout_s=0.1)
