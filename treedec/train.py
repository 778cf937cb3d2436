"""Train an EAGLE draft head: ``python -m treedec.train [hydra overrides]`` (``draft_arch=eagle3``: an EAGLE-3 head).

The target is loaded frozen (``model.path=tiny-code`` or a local HF directory); the head trains on
token windows of ``data`` (or, with ``data=jsonl`` on chat data, on the assistant turns of each
conversation) with the EAGLE loss (EAGLE-3: its training-time test), checkpoints ``last.ckpt`` into the run dir and
resumes from it when re-run with the same ``hydra.run.dir``; a callback runs the real
speculative loop on held-out prompts and logs τ. The head is exported to ``export_dir`` (default
``<run dir>/export``; ``export_dir=bundled`` replaces the shipped ``tiny-code-eagle``, atomically)
and ``metrics.json`` is written into the run dir; the log names the ``draft.path=`` override that
uses the head. Every option is checked before anything loads (``treedec.config``); a
second job into a live run dir is refused, and re-running a finished job leaves it alone.

Under DDP (``trainer=ddp``) every rank runs this script with its own copy of the frozen target;
τ is measured, and the head exported and ``metrics.json`` written, on rank 0 only.

The job itself is :mod:`treedec.training.train_job`, imported inside :func:`run`: torch and Lightning take
seconds to import, and a mistyped option must end in its one-line error before they load.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treedec.cli import entry, launch


def run(cfg: DictConfig) -> dict:
    """Train (or resume, or, when the run dir holds a finished job, report) and return ``metrics.json``."""
    from treedec.training.train_job import train_head  # (after composition: see the module docstring)

    return train_head(cfg)


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="train")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("train", main)
