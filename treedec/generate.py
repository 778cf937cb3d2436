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

import treedec.config_schema  # noqa: F401  (registers the structured schema before Hydra composes)

log = logging.getLogger(__name__)


def read_prompt(cfg: DictConfig) -> str:
    if cfg.prompt_file:
        return sys.stdin.read() if cfg.prompt_file == "-" else Path(cfg.prompt_file).read_text()
    return str(cfg.prompt)


def load_stack(cfg: DictConfig):
    """(target, tokenizer, draft head, policy, sampling params) from a composed config."""
    import torch

    from treedec.models import load_model
    from treedec.models.draft import DraftHead
    from treedec.models.tokenizer import load_tokenizer

    target = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device, attn_backend=cfg.kernel.backend)
    target.eval()
    tok = load_tokenizer(cfg.model.path)
    draft = DraftHead.load(cfg.draft.path, target=target, dtype=target.dtype, device=target.device).eval()
    policy = hydra.utils.instantiate(cfg.tree)
    sampling = hydra.utils.instantiate(cfg.sampling)
    torch.manual_seed(int(cfg.seed))
    return target, tok, draft, policy, sampling


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
    import torch

    from treedec.decoding import vanilla
    from treedec.decoding.speculative import SpeculativeDecoder

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    target, tok, draft, policy, sampling = load_stack(cfg)
    text = read_prompt(cfg)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True) if cfg.chat else tok.encode(text)
    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=tok.eos_ids or None)
    gen = torch.Generator(device=target.device).manual_seed(int(cfg.seed))
    stream = TextStream(tok, bool(cfg.stream))
    if cfg.stream:
        sys.stdout.write(text)
    res = dec.generate(ids, int(cfg.max_new_tokens), generator=gen, stream=stream)
    if cfg.stream:
        sys.stdout.write("\n")
    stats = res.stats.as_dict()
    metrics = {"prompt_tokens": len(ids), "text": tok.decode(res.tokens[0]), **stats}
    summary = f"{stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, tau {stats['tau']:.2f}"
    if cfg.compare:
        gen = torch.Generator(device=target.device).manual_seed(int(cfg.seed))
        van = vanilla.generate(target, ids, int(cfg.max_new_tokens), sampling=sampling,
                               eos_ids=tok.eos_ids or None, generator=gen)
        v_tps = van.stats["tokens_per_s"]
        metrics["vanilla"] = {"tokens_per_s": v_tps, "new_tokens": len(van.tokens[0])}
        metrics["speedup"] = stats["tokens_per_s"] / v_tps if v_tps else None
        if sampling.greedy:
            metrics["identical_to_vanilla"] = van.tokens[0] == res.tokens[0]
        summary += f", vanilla {v_tps:.1f} tok/s, speedup {metrics['speedup']:.2f}x"
        if sampling.greedy:
            summary += f", identical: {metrics['identical_to_vanilla']}"
    print(summary)
    out_dir = Path(cfg.paths.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps({**metrics, "config": OmegaConf.to_container(cfg, resolve=True)}, indent=2) + "\n")
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> float | None:
    metrics = run(cfg)
    key = cfg.get("optimized_metric")  # an Optuna sweep maximises this metrics.json key
    return float(metrics[key]) if key else None


if __name__ == "__main__":
    main()
