"""One prompt decoded speculatively, streamed as it arrives and, on request, beside vanilla decoding: what
``python -m treedec.generate`` shows (:func:`decode_prompt`: its metrics and its one-line summary)."""
from __future__ import annotations

import sys
import time

import torch

from treedec.decoding.loop import Decoder


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


def warm_up(dec: Decoder, ids: list[int], max_new_tokens: int) -> float:
    """Seconds of one untimed run: with compile=true it compiles the graphs the timed run replays."""
    t0 = time.perf_counter()
    dec.generate(ids, max_new_tokens)
    return time.perf_counter() - t0


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def decode_prompt(dec: Decoder, vanilla: Decoder, tok, text: str, ids: list[int], max_new_tokens: int, seed: int, *,
                  stream: bool, compare: bool, compile: bool) -> tuple[dict, str]:
    """Decode ``ids`` (the prompt ``text``) with ``dec``, streaming the text when ``stream``, and, with ``compare``,
    with ``vanilla`` too (speedup; greedy: identical?) -> (metrics, summary line). Both runs are seeded by ``seed``;
    with ``compile`` each decoder runs once untimed first, so compilation is never in tok/s."""
    compile_s = {"speculative": warm_up(dec, ids, max_new_tokens),
                 "vanilla": warm_up(vanilla, ids, max_new_tokens) if compare else None} if compile else None
    device = dec.target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    if stream:
        sys.stdout.write(text)
    res = dec.generate(ids, max_new_tokens, generator=gen, stream=TextStream(tok, stream),
                       timing=True)  # time_split in metrics.json
    if stream:
        sys.stdout.write("\n")
    stats = res.stats.as_dict()
    metrics = {"prompt_tokens": len(ids), "text": tok.decode(res.tokens[0]), **stats, "compile_s": compile_s}
    tps = stats["tokens_per_s"]
    summary = f"{stats['new_tokens']} tokens, {_fmt(tps, '.1f')} tok/s, tau {_fmt(stats['tau'], '.2f')}"
    if stats["prepare_s"] >= 0.005:  # tree=auto's first run here: the step-cost profile, never in tok/s
        summary += f" (+ {stats['prepare_s']:.2f} s profiling this machine's step costs, once)"
    if compare:
        gen = torch.Generator(device=device).manual_seed(seed)
        van = vanilla.generate(ids, max_new_tokens, generator=gen)
        v_tps = van.stats.tokens_per_s
        metrics["vanilla"] = {"tokens_per_s": v_tps, "new_tokens": len(van.tokens[0])}
        metrics["speedup"] = tps / v_tps if v_tps and tps is not None else None  # no tokens: no speedup
        summary += f", vanilla {_fmt(v_tps, '.1f')} tok/s, speedup {_fmt(metrics['speedup'], '.2f')}x"
        if dec.sampling.greedy:
            metrics["identical_to_vanilla"] = van.tokens[0] == res.tokens[0]
            summary += f", identical: {metrics['identical_to_vanilla']}"
    return metrics, summary
