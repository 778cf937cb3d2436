"""Pretrain the bundled target model: ``python -m treedec.pretrain [hydra overrides]``.

1. trains the byte-level BPE tokenizer on the corpus's train split (unless ``paths.tokenizer`` exists;
   ``paths.tokenizer=tiny-code`` reuses the bundled model's, e.g. for a small assistant model);
2. trains :class:`treedec.training.lm.CausalLMModule` with a Lightning Trainer, checkpointing
   ``last.ckpt`` into the run dir and resuming from it automatically when it is there;
3. exports the weights in Hugging Face format (config.json, model.safetensors, tokenizer.json,
   generation_config.json) to ``export_dir`` (default ``<run dir>/export``; ``export_dir=bundled``
   replaces ``treedec/assets/<model_arch.asset_name>``), atomically, and logs the
   ``model.path=`` override that uses it;
4. writes ``metrics.json`` (losses, steps, tokens, wall time, params) into the run dir.

Under DDP (``trainer=ddp``) every rank runs this script (Lightning re-launches it per rank with the
same run dir); the final checkpoint is a collective write by rank 0, and only rank 0 exports and
writes ``metrics.json``.

The job itself is :mod:`treedec.training.pretrain_job`, imported inside :func:`run`: torch and Lightning take
seconds to import, and a mistyped option must end in its one-line error before they load.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treedec.cli import entry, launch


def run(cfg: DictConfig) -> dict:
    """Pretrain (or resume, or, when the run dir holds a finished job, report) and return ``metrics.json``."""
    from treedec.training.pretrain_job import pretrain  # (after composition: see the module docstring)

    return pretrain(cfg)


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="pretrain")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("pretrain", main)
