"""bench.draft_heads: several draft heads in one run, every method crossed with every head (``METHOD@HEAD``)."""
from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from treedec.config import instantiate_checked
from treedec.config.bench import draft_head_entry
from treedec.errors import ConfigError
from treedec.models.paths import CONF
from treedec.tree.tree import TreeError

log = logging.getLogger("treedec.bench")


def head_configs(cfg: DictConfig) -> dict[str, DictConfig] | None:
    """``bench.draft_heads`` as {short name: draft config}; None when it is null (the ``draft`` group's head alone).

    An entry is a draft config name (``conf/draft/NAME.yaml``: short name NAME) or a head directory or bundled head
    name (``conf/draft/path.yaml`` with that path: short name the directory's name). The ``draft`` group's
    ``dtype`` and ``quantize`` apply to every head.
    """
    heads = cfg.bench.get("draft_heads")
    if heads is None:
        return None
    out = {}
    for entry in heads:
        short, file = draft_head_entry(str(entry))
        node = OmegaConf.load(file or CONF / "draft" / "path.yaml")
        if file is None:
            node.path = str(entry)
        for key in ("dtype", "quantize"):
            if key in cfg.draft:
                node[key] = cfg.draft[key]
        out[short] = node
    return out


def load_heads(cfg: DictConfig, target, draft) -> dict[str, object] | None:
    """The heads of ``bench.draft_heads`` bound to ``target`` (None when it is null); ``draft``, the head load_stack
    loaded from the first entry, is reused."""
    nodes = head_configs(cfg)
    if nodes is None:
        return None
    heads = {}
    for i, (short, node) in enumerate(nodes.items()):
        heads[short] = draft if i == 0 else instantiate_checked(
            node, target=target, dtype=node.get("dtype") or target.dtype, device=target.device).eval()
        log.info("draft head %s: %s (%s%s)", short, node.path, heads[short].config.kind,
                 f", block_size {heads[short].block_size}" if getattr(heads[short], "one_pass", False) else "")
    return heads


def head_info(heads: dict[str, object], nodes: dict[str, DictConfig]) -> dict[str, dict]:
    """metrics.json's ``heads``: per short name its path, kind, dtype and (one-pass heads) block size."""
    return {short: {"path": str(nodes[short].path), "kind": h.config.kind, "one_pass": bool(getattr(h, "one_pass", False)),
                    "block_size": getattr(h, "block_size", None) if getattr(h, "one_pass", False) else None,
                    "dtype": str(h.dtype).removeprefix("torch.")}
            for short, h in heads.items()}


def rejects(policy, head) -> str | None:
    """Why ``policy`` cannot draft from ``head`` (its ``check_head``'s TreeError), or None."""
    try:
        policy.check_head(head)
    except TreeError as exc:
        return str(exc)
    return None


def check_compared(cfg: DictConfig, names: list[str], methods: list, skipped: dict[str, str],
                   heads: dict[str, object]) -> None:
    """A bench whose every requested tree method (of ``names``) was skipped compares nothing but vanilla with itself:
    one error, before any timing, naming each skipped pair and why, and the methods of ``bench.trees`` each head can
    draft."""
    if all(n == "vanilla" for n in names) or any(m.policy is not None for m in methods):
        return
    why = "; ".join(f"{row} ({reason.split(': use ')[0]})" for row, reason in skipped.items())
    fits = "; ".join(f"{short}: {', '.join(usable_methods(cfg, head)) or 'none'}" for short, head in heads.items())
    raise ConfigError(f"bench.methods={list(cfg.bench.methods)}: every tree method was skipped, so the bench would "
                      f"compare nothing: {why}; choose methods these heads can draft (bench.methods=[vanilla,...] "
                      f"from {fits})")


def usable_methods(cfg: DictConfig, head) -> list[str]:
    """The methods of ``bench.trees`` whose tree ``head`` can feed (those that do not build here are left out)."""
    out = []
    for name in cfg.bench.trees:
        try:
            policy = instantiate_checked(cfg.bench.trees[name], f"bench.trees.{name}")
        except Exception:  # e.g. learned without a shape file: not a method to offer
            continue
        if rejects(policy, head) is None:
            out.append(name)
    return out


def head_name(name: str, head: str | None) -> str:
    """A row's name: ``chain``, or with bench.draft_heads ``chain@tiny_code`` (a sampled row adds ``@T`` after)."""
    return name if head is None else f"{name}@{head}"
