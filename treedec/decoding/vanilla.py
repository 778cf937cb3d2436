"""Vanilla autoregressive decoding: the baseline every speedup is measured against.

One prefill pass, then one target forward per token, over a static KV cache allocated
once. Token choice goes through :func:`treedec.decoding.sampling.next_token`, the same
distribution the speculative verifier uses, so "lossless" has one definition.

Conventions shared with the speculative loop:

* ``tokens[b]`` holds the new tokens of row b, at most ``max_new_tokens``; a row stops right
  after emitting one of ``eos_ids`` (the EOS is included) and emits nothing more.
* Rows may have prompts of different lengths (a list of lists): the batch is right-padded,
  prefilled once, and each row's cache length is then set to its own prompt length.
* ``stream(row, tokens)`` is called whenever row ``row`` emits tokens (here one at a time), the
  same callback the speculative decoder takes.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from treedec.decoding.sampling import SamplingParams, next_token
from treedec.models.cache import KVCache

GREEDY = SamplingParams()


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row (EOS included when a row stopped on it)
    stats: dict = field(default_factory=dict)


def normalize_prompts(prompt_ids) -> list[list[int]]:
    """LongTensor [B, L] | [L], list[int] or list[list[int]] -> list of non-empty rows."""
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be [B, L] or [L]; got shape {tuple(prompt_ids.shape)}")
        rows = prompt_ids.tolist()
    else:
        rows = list(prompt_ids)
        if rows and not isinstance(rows[0], (list, tuple)) and not torch.is_tensor(rows[0]):
            rows = [rows]
        rows = [r.tolist() if torch.is_tensor(r) else [int(t) for t in r] for r in rows]
    if not rows:
        raise ValueError("empty batch: pass at least one prompt")
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {b} is empty: a prompt needs at least one token (e.g. the BOS token)")
    return rows


def check_context(model, rows: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Raise a clear error, before any work, when the prompts or the generation cannot fit."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.config
    ctx = getattr(cfg, "context_length", cfg.max_position_embeddings)
    longest = max(len(r) for r in rows)
    if longest > ctx:
        raise ValueError(
            f"prompt of {longest} tokens is longer than the model's context of {ctx} tokens; shorten the prompt"
        )
    if longest + max_new_tokens > ctx:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {ctx} "
            f"tokens; lower max_new_tokens to at most {ctx - longest}"
        )
    V = cfg.vocab_size
    for b, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {b} holds token id {bad[0]}, outside the vocabulary [0, {V})")
    return longest


def _prefill(model, cache: KVCache, rows: list[list[int]], lens: torch.Tensor):
    B, L = len(rows), int(lens.max())
    device = model.device
    ids = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    ids = ids.to(device)
    cache.reset()
    if bool((lens == L).all()):
        logits = model(ids, cache, logits="last").logits[:, -1]
        cache.advance(L)
    else:
        # Right-padded: write all L slots, read each row's logits at its own last token, then
        # set the per-row lengths (the padding slots are overwritten by the next writes).
        last = (lens - 1).to(device)[:, None]
        logits = model(ids, cache, logits=last).logits[:, 0]
        cache.rollback(lens.to(cache.lengths.device))
    return logits


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_ids: Sequence[int] | int | None = None,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
    stream: Callable[[int, list[int]], None] | None = None,
    compile: bool = False,
) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per row, one target forward per token.

    ``eos_ids``: None uses the model config's EOS ids; pass ``[]`` to never stop early.
    ``cache``: an existing :class:`KVCache` to reuse (batch and length must fit; it is reset).
    ``compile``: experimental ``torch.compile`` of the decode step (falls back to eager).
    """
    rows = normalize_prompts(prompt_ids)
    longest = check_context(model, rows, max_new_tokens)
    B = len(rows)
    eos = model.config.eos_ids if eos_ids is None else ([eos_ids] if isinstance(eos_ids, int) else list(eos_ids))
    stats = {"n_forward": 0, "prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0, "batch": B,
             "prompt_tokens": sum(len(r) for r in rows)}
    out: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens == 0:
        stats.update(total_s=0.0, tokens_per_s=0.0, decode_tokens_per_s=0.0)
        return GenerateResult(out, stats)

    need = longest + max_new_tokens
    if cache is None:
        cache = model.new_cache(B, max_len=need)
    elif cache.batch != B or cache.max_len < need:
        raise ValueError(f"the cache given holds batch {cache.batch} x {cache.max_len} slots; "
                         f"this call needs batch {B} x {need}")
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    step = _decode_step(model, compile)
    eos_set = set(eos)
    done = [False] * B

    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = _prefill(model, cache, rows, lens)
        tok = next_token(logits, sampling, generator)  # [B]
        stats["n_forward"] = 1
        t1 = time.perf_counter()
        stats["prefill_s"] = t1 - t0
        while True:
            for b, t in enumerate(tok.tolist()):  # one host sync per step
                if done[b]:
                    continue
                out[b].append(t)
                if stream is not None:
                    stream(b, [t])
                if t in eos_set or len(out[b]) == max_new_tokens:
                    done[b] = True
            if all(done):
                break
            # Finished rows keep decoding (their tokens are dropped): the batch stays rectangular.
            logits = step(tok[:, None], cache)
            cache.advance(1)
            stats["n_forward"] += 1
            tok = next_token(logits, sampling, generator)
        stats["decode_s"] = time.perf_counter() - t1

    total = stats["prefill_s"] + stats["decode_s"]
    stats["new_tokens"] = sum(len(r) for r in out)
    stats["total_s"] = total
    stats["tokens_per_s"] = stats["new_tokens"] / total if total > 0 else 0.0
    stats["decode_tokens_per_s"] = (stats["n_forward"] - 1) * B / stats["decode_s"] if stats["decode_s"] > 0 else 0.0
    return GenerateResult(out, stats)


def _decode_step(model, compile: bool):
    def step(tok: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return model(tok, cache, logits="last").logits[:, -1]

    if not compile:
        return step
    try:
        compiled = torch.compile(step, dynamic=True)
    except Exception as exc:  # pragma: no cover - depends on the toolchain
        warnings.warn(f"torch.compile unavailable ({exc}); decoding eagerly", stacklevel=3)
        return step
    state = {"ok": True}

    def guarded(tok, cache):
        if state["ok"]:
            try:
                return compiled(tok, cache)
            except Exception as exc:  # pragma: no cover - compiler failures vary by platform
                state["ok"] = False
                warnings.warn(f"torch.compile of the decode step failed ({type(exc).__name__}: {exc}); "
                              "decoding eagerly", stacklevel=3)
        return step(tok, cache)

    return guarded


__all__ = ["GREEDY", "GenerateResult", "check_context", "generate", "normalize_prompts"]
