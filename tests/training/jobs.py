"""What the training tests run: a short draft job's overrides and config on the tiny target (``target_dir``,
tests/training/conftest.py), its exported weights, a directory's file hashes, and the jsonl records of a chat corpus."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.helpers import compose_config


def train_overrides(target_dir, corpus, tmp_path, steps, *extra) -> list[str]:
    """The overrides of a short draft job on the tiny target (``extra`` replaces a key or adds one)."""
    overrides = [f"model.path={target_dir}", "model.dtype=float32", f"export_dir={tmp_path / 'draft'}",
                 f"paths.run_dir={tmp_path / 'run'}", f"data.root={corpus}", "data.seq_len=32", "data.batch_size=8",
                 "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "data.max_val_windows=2",
                 f"trainer.max_steps={steps}", "trainer.max_time=null", "trainer.val_check_interval=10",
                 "trainer.precision=32-true", "optim.time_budget_s=null", "optim.lr=3e-3", "optim.warmup_steps=2",
                 "eval.n_prompts=2", "eval.prompt_tokens=24", "eval.max_new_tokens=8", "eval.every_n_steps=10",
                 "ckpt_every_n_steps=5", "log_every=5", "export_dtype=float32"]
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + list(extra)


def train_cfg(target_dir, corpus, tmp_path, steps, *extra):
    return compose_config("train", train_overrides(target_dir, corpus, tmp_path, steps, *extra))


def tree_hashes(root: Path) -> dict[str, str]:
    """Each file under ``root`` (relative path) -> its sha256: what a test compares to show nothing was touched."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def head_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "draft.safetensors"))


def conversation(i: int) -> dict:
    return {"conversations": [
        {"from": "system", "value": "Code only."},
        {"from": "human", "value": f"QUERY{i} please"},
        {"from": "gpt", "value": f"def reply_{i}(x):\n    return x + {i}\n"},
        {"role": "user", "content": "and again"},
        {"role": "assistant", "content": f"return {i}"}]}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
