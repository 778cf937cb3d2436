"""The checks ``Decoder.generate`` runs once per call, before any forward pass: prompts (token rows of whole
numbers), the budget, the context the rows need against the model's cache, EOS ids, slots; and the padding of
the rows into one tensor."""
from __future__ import annotations

import numbers
from typing import Sequence

import torch


def _token_row(r, b: int) -> list[int]:
    if torch.is_tensor(r):
        if r.is_floating_point() or r.is_complex():
            raise ValueError(f"prompt {b} holds {r.dtype} token ids; token ids must be integers")
        return r.tolist()
    out = []
    for t in r:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt {b} holds token id {t!r} ({type(t).__name__}); token ids must be integers")
        out.append(int(t))
    return out


def normalize_prompts(prompt_ids) -> list[list[int]]:
    """LongTensor [B, L] | [L], list[int] or list[list[int]] -> list of non-empty integer rows."""
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be [B, L] or [L]; got shape {tuple(prompt_ids.shape)}")
        rows = [_token_row(r, b) for b, r in enumerate(prompt_ids)]
    else:
        rows = list(prompt_ids)
        if rows and not isinstance(rows[0], (list, tuple)) and not torch.is_tensor(rows[0]):
            rows = [rows]
        elif rows and torch.is_tensor(rows[0]) and rows[0].dim() == 0:
            rows = [rows]
        rows = [_token_row(r, b) for b, r in enumerate(rows)]
    if not rows:
        raise ValueError("empty batch: pass at least one prompt")
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {b} is empty: a prompt needs at least one token (e.g. the BOS token)")
    return rows


def check_budget(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise ValueError(f"max_new_tokens must be a whole number, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return int(max_new_tokens)


def check_context(model, rows: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Raise a clear error, before any work, when the prompts or the generation cannot fit."""
    max_new_tokens = check_budget(max_new_tokens)
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


def normalize_eos(eos_ids, default: Sequence[int]) -> set[int]:
    """None -> the model's EOS ids; an int or a sequence of ints -> that set; [] never stops early."""
    if eos_ids is None:
        return set(default)
    if isinstance(eos_ids, numbers.Integral) and not isinstance(eos_ids, bool):
        return {int(eos_ids)}
    ids = list(eos_ids)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise ValueError(f"eos_ids must be an int or a list of ints, got {eos_ids!r}")
    return {int(t) for t in ids}


def check_slots(slots) -> int | None:
    """``serve``'s ``slots``: None (every prompt at once) or a whole number >= 1."""
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1):
        raise ValueError(f"slots must be a whole number >= 1 (batch rows decoding at once) or None, got {slots!r}")
    return None if slots is None else int(slots)


def static_room(need: int, cap: int) -> int:
    """Cache length for a compiled decoder: a power-of-two bucket (at least 256, at most ``cap``).

    A compiled static-shape pass attends over the whole cache and compiles once per cache shape,
    so buckets keep both the graphs few and the attention little longer than the generation.
    """
    size = 256
    while size < need:
        size *= 2
    return max(need, min(size, cap))


def pad_prompts(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated prompt rows -> right-padded ids [B, L] and lengths [B] on ``device``."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return ids.to(device), torch.tensor([len(r) for r in rows], device=device)
