"""Speculative generation: ``python -m treedec.generate [hydra overrides]``.

Loads the target (``model``), its EAGLE head (``draft``) and a tree policy (``tree``), streams
the continuation of ``prompt``, prints a one-line summary (tokens, tokens/s, τ and, with
``compare=true``, the speedup over vanilla decoding on the same prompt), and writes
``metrics.json`` and the resolved config into the run dir.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.atomic import write_text_atomic
from treedec.cli import entry, launch, load_stack

log = logging.getLogger(__name__)


def _warm_up(dec, ids: list[int], max_new_tokens: int) -> float:
    """Seconds of one untimed run: with compile=true it compiles the graphs the timed run replays."""
    import time

    t0 = time.perf_counter()
    dec.generate(ids, max_new_tokens)
    return time.perf_counter() - t0


def read_prompt(cfg: DictConfig) -> str:
    """``prompt``, or the text of ``prompt_file`` (``-``: stdin), both read up to the prompt-size cap."""
    if cfg.prompt_file:
        from treedec.data.prompts import read_stdin, read_text

        return read_stdin("prompt_file") if cfg.prompt_file == "-" else read_text(cfg.prompt_file, "prompt_file")
    return str(cfg.prompt)


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


class TextStream:
    """Prints decoded text as tokens arrive (decoding the whole suffix keeps multi-byte pieces intact)."""

    def __init__(self, tok, enabled: bool):
        self.tok, self.enabled, self.ids, self.shown = tok, enabled, [], ""

    def __call__(self, row: int, new: list[int]) -> None:
        self.ids += new
        text = self.tok.decode(self.ids)
        if self.enabled and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def run(cfg: DictConfig) -> dict:
    """Generate from the configured prompt; every option is checked before the model loads."""
    from treedec.config_checks import ConfigError, instantiate_checked, validate

    validate(cfg, "generate")
    policy = instantiate_checked(cfg.tree, "tree")
    sampling = instantiate_checked(cfg.sampling, "sampling")
    text = read_prompt(cfg)

    import torch

    from treedec.data.chat import chat_prompt_ids
    from treedec.decoding import vanilla
    from treedec.decoding.speculative import SpeculativeDecoder

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    torch.manual_seed(int(cfg.seed))
    target, tok, draft = load_stack(cfg)
    ids = chat_prompt_ids(tok, text, "pass chat=false") if cfg.chat else tok.encode(text)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens; pass a non-empty prompt= or prompt_file=")
    eos, n_new = tok.eos_ids or None, int(cfg.max_new_tokens)
    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=eos, compile=bool(cfg.compile))
    van_dec = vanilla.VanillaDecoder(target, sampling, eos, compile=bool(cfg.compile))
    compile_s = {"speculative": _warm_up(dec, ids, n_new), "vanilla": _warm_up(van_dec, ids, n_new) if cfg.compare
                 else None} if cfg.compile else None  # compilation is paid here, never in tok/s
    gen = torch.Generator(device=target.device).manual_seed(int(cfg.seed))
    stream = TextStream(tok, bool(cfg.stream))
    if cfg.stream:
        sys.stdout.write(text)
    res = dec.generate(ids, n_new, generator=gen, stream=stream, timing=True)  # time_split in metrics.json
    if cfg.stream:
        sys.stdout.write("\n")
    stats = res.stats.as_dict()
    metrics = {"prompt_tokens": len(ids), "text": tok.decode(res.tokens[0]), **stats, "compile_s": compile_s}
    tps = stats["tokens_per_s"]
    summary = f"{stats['new_tokens']} tokens, {_fmt(tps, '.1f')} tok/s, tau {_fmt(stats['tau'], '.2f')}"
    if stats["prepare_s"] >= 0.005:  # tree=auto's first run here: the step-cost profile, never in tok/s
        summary += f" (+ {stats['prepare_s']:.2f} s profiling this machine's step costs, once)"
    if cfg.compare:
        gen = torch.Generator(device=target.device).manual_seed(int(cfg.seed))
        van = van_dec.generate(ids, n_new, generator=gen)
        v_tps = van.stats.tokens_per_s
        metrics["vanilla"] = {"tokens_per_s": v_tps, "new_tokens": len(van.tokens[0])}
        metrics["speedup"] = tps / v_tps if v_tps and tps is not None else None  # no tokens: no speedup
        summary += f", vanilla {_fmt(v_tps, '.1f')} tok/s, speedup {_fmt(metrics['speedup'], '.2f')}x"
        if sampling.greedy:
            metrics["identical_to_vanilla"] = van.tokens[0] == res.tokens[0]
            summary += f", identical: {metrics['identical_to_vanilla']}"
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
