"""End-to-end benchmark: ``python -m treedec.bench [hydra overrides]`` (see conf/bench.yaml, docs/benchmarks.md).

Writes metrics.json, results.md, outputs.jsonl and plots into the run dir. Exits 1 when a
treedec greedy method's output differs from vanilla decoding (after writing metrics.json), and
with one ``Error: ...`` line when an option is wrong (before any model loads).

The harness (torch and the models, seconds to import) is imported inside :func:`main`, after Hydra has composed
and checked the config, so ``--help`` and a wrong option answer at once.
"""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

import treedec.config.schema  # noqa: F401  (registers schema/bench before Hydra composes)
from treedec.cli import entry, launch

log = logging.getLogger("treedec.bench")


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="bench")
@entry
def main(cfg: DictConfig) -> None:
    from treedec.bench.harness import OutputMismatch, run

    try:
        run(cfg)
    except OutputMismatch as exc:
        log.error("greedy output differs from vanilla decoding: %s", exc)
        sys.exit(1)


if __name__ == "__main__":
    launch("bench", main)
