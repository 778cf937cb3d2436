"""Speculative generation: ``python -m treedec.generate [hydra overrides]``.

Loads the target (``model``), its EAGLE head (``draft``) and a tree policy (``tree``), streams
the continuation of ``prompt``, prints a one-line summary (tokens, tokens/s, τ and, with
``compare=true``, the speedup over vanilla decoding on the same prompt), and writes
``metrics.json`` and the resolved config into the run dir.

The decoding is :mod:`treedec.decoding`'s (the prompt's run and its summary: :mod:`treedec.decoding.one_prompt`),
imported inside :func:`run` once the options are checked: torch and the models take seconds to import, and a
mistyped option must end in its one-line error before they load.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.atomic import write_text_atomic
from treedec.cli import entry, launch, load_stack
from treedec.data.prompts import read_stdin, read_text

log = logging.getLogger(__name__)


def read_prompt(cfg: DictConfig) -> str:
    """``prompt``, or the text of ``prompt_file`` (``-``: stdin), both read up to the prompt-size cap."""
    if cfg.prompt_file:
        return read_stdin("prompt_file") if cfg.prompt_file == "-" else read_text(cfg.prompt_file, "prompt_file")
    return str(cfg.prompt)


def run(cfg: DictConfig) -> dict:
    """Generate from the configured prompt; every option is checked before the model loads."""
    from treedec.config import ConfigError, instantiate_checked, validate

    validate(cfg, "generate")
    policy = instantiate_checked(cfg.tree, "tree")
    sampling = instantiate_checked(cfg.sampling, "sampling")
    text = read_prompt(cfg)

    import torch  # (after the checks: see the module docstring)

    from treedec.data.chat import chat_prompt_ids
    from treedec.decoding.one_prompt import decode_prompt
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.decoding.vanilla import VanillaDecoder

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    torch.manual_seed(int(cfg.seed))
    target, tok, draft = load_stack(cfg)
    ids = chat_prompt_ids(tok, text, "pass chat=false") if cfg.chat else tok.encode(text)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens; pass a non-empty prompt= or prompt_file=")
    eos = tok.eos_ids or None
    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=eos, compile=bool(cfg.compile))
    vanilla = VanillaDecoder(target, sampling, eos, compile=bool(cfg.compile))
    metrics, summary = decode_prompt(dec, vanilla, tok, text, ids, int(cfg.max_new_tokens), int(cfg.seed),
                                     stream=bool(cfg.stream), compare=bool(cfg.compare), compile=bool(cfg.compile))
    print(summary)
    record = {**metrics, "config": OmegaConf.to_container(cfg, resolve=True)}
    write_text_atomic(Path(cfg.paths.run_dir) / "metrics.json", json.dumps(record, indent=2) + "\n")
    return metrics


def objective(metrics: dict, key: str | None) -> float | None:
    """The value an Optuna sweep maximises: ``metrics[key]``; NaN (a failed trial) where this run has none."""
    if not key:
        return None
    value = metrics.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        log.warning("optimized_metric %r has no numeric value in this run (%r): returning NaN", key, value)
        return float("nan")
    return float(value)


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="generate")
@entry
def main(cfg: DictConfig) -> float | None:
    return objective(run(cfg), cfg.get("optimized_metric"))


if __name__ == "__main__":
    launch("generate", main)
