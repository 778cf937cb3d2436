"""The calibration prompts: ``prompts.source`` (held-out stdlib code, third-party packages, or a prompt file),
encoded as the probe decodes them."""
from __future__ import annotations

from omegaconf import DictConfig

from treedec.data.chat import chat_prompt_ids
from treedec.data.prompts import load_prompt_set, read_prompt_file


def prompt_set(cfg: DictConfig, tok) -> list:
    """The calibration prompts (:class:`treedec.data.prompts.PromptText`) of ``prompts.source``."""
    p = cfg.prompts
    if p.source == "file":
        return read_prompt_file(p.file, "prompts.file")[: int(p.n)]
    source = "stdlib" if p.source == "heldout" else p.source
    return load_prompt_set(source, int(p.n), int(p.prompt_tokens), tok, seed=int(cfg.seed), root=p.root,
                           val_fraction=float(p.val_fraction), packages=p.packages,
                           hint="pass prompts.source=file prompts.file=<prompts.jsonl>")


def encode_prompts(cfg: DictConfig, tok, texts: list[str]) -> list[list[int]]:
    out = []
    for t in texts:
        ids = chat_prompt_ids(tok, t, "pass chat=false") if cfg.chat else tok.encode(t)
        ids = ids[-int(cfg.prompts.prompt_tokens):]
        if ids:
            out.append(ids)
    if not out:
        raise ValueError("every calibration prompt encoded to zero tokens")
    return out
